"""The benchmark registry on the CPU: every op's module imports, its case grid is what the issues ask for,
and every case has a roofline (bytes, FLOPs) — the timing itself needs a GPU."""

import importlib
import json
import sys
import time
import types

import pytest
import torch

from tilela import bench


@pytest.mark.parametrize("op", sorted(bench.OPS))
def test_every_case_has_a_floor(op):
    spec = importlib.import_module(bench.OPS[op]).BENCH
    full, quick = spec.cases(False), spec.cases(True)
    assert quick and len(quick) < len(full)
    assert {c.name for c in quick} <= {c.name for c in full}
    for case in full + spec.check_cases:
        cost = spec.cost(case)
        assert cost["bytes"] > 0 and cost["flops"] >= 0  # a cumsum has no matrix FLOPs
    assert len({c.name for c in full}) == len(full)


def test_gdn_grid_is_the_issue_grid():
    from tilela.bench import gdn

    names = {c.name for c in gdn.cases(False)}
    # head configs x layouts x gate regimes, the 12 layouts beyond it, and the 4 model calls (q/k l2norm in the op)
    assert len(names) == 6 * 6 * 2 + 12 * 2 + 4
    assert {"8192x4_h16-64_mixed_l2norm", "1x512_h2-8_mixed_l2norm"} <= names
    assert "28672+4096_h16-64_decay" in names and "1024x8_h2-8_mixed" in names
    assert {"1x131072_h4-16_decay", "skew16384+63x128_h16-32_mixed", "serving40_h4-16_mixed",
            "1x512_h2-8_decay"} <= names
    serving = next(c for c in gdn.cases(False) if c.name == "serving40_h4-16_mixed").params["lengths"]
    assert len(serving) == 40 and 50 <= min(serving) and max(serving) <= 2000


def test_kda_grid_is_the_issue_grid():
    from tilela.bench import kda

    full = {c.name: c.params for c in kda.cases(False)}
    # HV x T, then varlen, the long few-head case, FlashKDA's B = 2, the tensor-parallel shard, three small calls;
    # two gates
    assert len(full) == (3 * 2 + 4 + 3) * 2
    assert {"1x32768_h8-8_softplus", "1024x8_h32-32_bounded", "1x65536_h4-16_softplus",
            "1x65536_h4-4_bounded", "serving40_h4-4_bounded", "1x512_h32-32_softplus"} <= set(full)
    assert full["2x8192_h64-64_bounded"]["B"] == 2 and full["1x8192_h64-64_softplus"]["B"] == 1


def test_kda_bench_times_every_dv_block_of_the_pass():
    """One implementation per DV block the KDA pass is built for (their profiles are the cost model's periods)."""
    from tilela.bench import kda
    from tilela.kernels.hopper.plan import dv_blocks

    blocks = dv_blocks(kda.DIM, "channel", True)
    assert sorted(blocks) == list(kda.DV_BLOCKS)
    assert {f"tilela_dv{block}" for block in blocks} <= set(kda.BENCH.impls)


@pytest.mark.parametrize("gate", ["none", "weak"])
def test_kkt_solve_bench_runs_ours_on_its_inputs(gate):
    """The kkt_solve bench's own implementation on a check case's inputs (the PyTorch path on the CPU) against its
    reference: the harness calls the public op with the case's chunk and method."""
    from tilela.bench import kkt_solve

    case = kkt_solve._case(128, 4, gate=gate)
    gen = torch.Generator().manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(1, 128, 2, 128, generator=gen), dim=-1).to(torch.bfloat16)
    x = {"k": k, "beta": torch.rand(1, 128, 4, generator=gen)}
    if gate == "weak":
        g = torch.nn.functional.logsigmoid(torch.randn(1, 128, 4, generator=gen)) / 16
        x["gc"] = g.view(1, 2, 64, 4).cumsum(2).view(1, 128, 4)
    got = kkt_solve.BENCH.impls["tilela"](case, x).double()
    ref = kkt_solve.BENCH.reference(case, x).double()
    assert (got - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("channels", [None, 16])
def test_cumsum_bench_runs_ours_on_its_inputs(channels):
    """The chunk_local_cumsum bench's own implementation on a check case's inputs (the CPU path) against its
    reference."""
    from tilela.bench import cumsum

    case = cumsum._case(200, 4, channels)
    gen = torch.Generator().manual_seed(0)
    x = {"g": torch.nn.functional.logsigmoid(torch.randn((1, 200, 4) + ((channels,) if channels else ()),
                                                        generator=gen))}
    got = cumsum.BENCH.impls["tilela"](case, x).double()
    ref = cumsum.BENCH.reference(case, x).double()
    assert (got - ref).norm() / ref.norm() < 1e-6


def test_markdown_ratios_and_floor():
    rec = dict(op="x", case="c", params={}, rel_err=None, floor_ms=0.5)
    table = bench.markdown([dict(rec, impl="ours", ms=1.0), dict(rec, impl="theirs", ms=2.0)])
    assert "| c | 1.0000 | 2.0000 (2.00) | 0.5000 | 2.00 |" in table


class FakeDevice:
    """The host's clock (time.perf_counter) and a device queue in simulated ms: a call takes `host` ms of the host
    and then queues `device` ms of work; torch.cuda's events record when the queue reaches them, and synchronising
    waits for it."""

    def __init__(self, monkeypatch):
        self.now = self.busy = 0.0
        device = self

        class Event:
            def __init__(self, enable_timing):
                self.at = None

            def record(self):
                self.at = max(device.now, device.busy)

            def synchronize(self):
                device.now = max(device.now, self.at)

            def elapsed_time(self, end):
                return end.at - self.at

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
        monkeypatch.setattr(time, "perf_counter", lambda: self.now / 1e3)

    def call(self, host: float, device: float) -> None:
        self.now += host
        self.busy = max(self.busy, self.now) + device


def test_time_eager_host_time_per_call(monkeypatch):
    """time_eager: the device's ms per call (from the first launch to the queue's end) and the host's, each divided
    over the input sets; the host's counts the calls alone (no device wait after them)."""
    device = FakeDevice(monkeypatch)
    calls = []

    def fn(x):
        calls.append(x)
        device.call(host=4.0, device=6.0)

    times, errors = bench.time_eager({"a": fn}, [1, 2, 3], replays=3, warmup=1)
    assert calls == [1, 2, 3] * 4 and errors == {}
    assert times["a"].ms == pytest.approx(22.0 / 3)  # the device: 4 ms to the first launch, then 3 x 6 queued
    assert times["a"].host_ms == pytest.approx(4.0)


def test_time_eager_takes_the_implementations_in_turn(monkeypatch):
    """time_eager with several fns: within every replay each fn runs its input sets once, from an idle device, in an
    order rotated from replay to replay and reversed on every other one; a slow spell of the host (the second replay)
    falls on every fn, and the medians leave it out. A fn that raises in its warm-up is left out with its error."""
    device = FakeDevice(monkeypatch)
    turns = []

    def fn(name, host):
        def call(x):
            if x == 0:
                turns.append(name)
            device.call(host=host * (5 if 7 <= len(turns) <= 9 else 1), device=1.0)  # the second replay slow
        return call

    def broken(x):
        raise RuntimeError("no kernel for this case")

    times, errors = bench.time_eager({"a": fn("a", 2.0), "b": fn("b", 6.0), "broken": broken, "c": fn("c", 4.0)},
                                     [0, 1], replays=3, warmup=1)
    assert turns == ["a", "b", "c"] + ["a", "b", "c", "a", "c", "b", "c", "a", "b"]  # the warm-up, then the replays
    assert {name: t.host_ms for name, t in times.items()} == pytest.approx({"a": 2.0, "b": 6.0, "c": 4.0})
    assert {name: t.ms for name, t in times.items()} == pytest.approx({"a": 2.5, "b": 6.5, "c": 4.5})
    assert errors == {"broken": "RuntimeError: no kernel for this case"}


def fake_bench(monkeypatch, impls):
    """bench.run("fake") over one case with these impls, graph and eager timing replaced: time_graph gives 2.0 ms
    but raises for impls["graphless"] (told apart by the tensor it returns, the same every call); time_eager gives
    every fn 10.0 ms, raises where an impl named "flaky" is among them, and records the names it got."""
    case = bench.Case("c", {})
    fake = types.SimpleNamespace(BENCH=bench.Bench(
        op="fake", cases=lambda quick: [case], check_cases=[],
        make_inputs=lambda case, seed: {"x": torch.full((4,), float(seed + 1))}, impls=impls,
        reference=lambda case, x: x["x"] * 2, cost=lambda case: {"bytes": 4.3e9, "flops": 0.0}))
    monkeypatch.setitem(sys.modules, "tilela_fake_bench", fake)
    monkeypatch.setitem(bench.OPS, "fake", "tilela_fake_bench")
    monkeypatch.setattr(bench, "device_info", lambda: {"name": "fake", "l2_bytes": 1})
    monkeypatch.setattr(bench, "peak_bytes", lambda fn, x: 0)
    eager_calls = []

    def time_graph(fn, input_sets, replays):
        if fn({"x": torch.ones(4)}) is impls["graphless"](None, {"x": torch.ones(4)}):
            raise RuntimeError("capture: the call synchronises")
        return 2.0

    def time_eager(fns, input_sets, replays):
        eager_calls.append(sorted(fns))
        if "flaky" in fns:
            raise RuntimeError("eager: flaky")
        return {name: bench.EagerTime(10.0, 0.1) for name in fns}, {}

    monkeypatch.setattr(bench, "time_graph", time_graph)
    monkeypatch.setattr(bench, "time_eager", time_eager)
    return bench.run("fake", replays=2), eager_calls


def test_run_times_every_implementation_eagerly_in_one_interleaved_run(monkeypatch):
    """bench.run: every implementation that ran is graph-timed alone and eager-timed in one time_eager call with the
    others; one whose capture fails takes its eager time as its time; one that raises on its first call is recorded
    failed; one that does not cover the case has no record."""
    graphless_out = torch.zeros(4)

    def raiser(case, x):
        raise ValueError("q: expected bf16")

    impls = {"ours": lambda case, x: x["x"] * 2, "graphless": lambda case, x: graphless_out, "raiser": raiser,
             "absent": lambda case, x: None}
    records, eager_calls = fake_bench(monkeypatch, impls)
    assert eager_calls == [["graphless", "ours"]]
    assert [(r["impl"], r["ms"], r.get("eager_ms"), r.get("timing"), r["error"] is not None if "error" in r else False)
            for r in records] == [("raiser", None, None, None, True), ("ours", 2.0, 10.0, "cuda_graph", False),
                                  ("graphless", 10.0, 10.0, "eager", False)]
    assert records[2]["rel_err_vs"]["ours"] == 1.0


def test_run_keeps_graph_times_when_the_eager_run_fails(monkeypatch):
    """bench.run: where the joint eager run raises, every implementation keeps its graph time without an eager one,
    and one without a graph time is recorded failed with the eager run's error."""
    graphless = torch.zeros(4)
    impls = {"ours": lambda case, x: x["x"] * 2, "flaky": lambda case, x: x["x"] * 3,
             "graphless": lambda case, x: graphless, "absent": lambda case, x: None}
    records, eager_calls = fake_bench(monkeypatch, impls)
    assert eager_calls == [["flaky", "graphless", "ours"]]
    by_impl = {r["impl"]: r for r in records}
    assert len(records) == 3
    assert (by_impl["ours"]["ms"], by_impl["ours"]["eager_ms"]) == (2.0, None)
    assert (by_impl["flaky"]["ms"], by_impl["flaky"]["eager_ms"]) == (2.0, None)
    assert by_impl["graphless"]["ms"] is None and by_impl["graphless"]["error"] == "RuntimeError: eager: flaky"


def test_markdown_eager_columns_and_geometric_means():
    """--report --eager: each implementation's eager and host ms beside its graph ms; below the table the geometric
    mean of each ratio to the first implementation over the cases both timed (a case without the other's time is left out),
    its range and the cases where the first is at least as fast."""
    rec = dict(op="x", params={}, rel_err=None, floor_ms=0.5)
    records = [dict(rec, case="a", impl="ours", ms=1.0, eager_ms=2.0, host_ms=0.1),
               dict(rec, case="a", impl="theirs", ms=2.0, eager_ms=1.0, host_ms=0.4),
               dict(rec, case="b", impl="ours", ms=1.0, eager_ms=1.0, host_ms=0.2),
               dict(rec, case="b", impl="theirs", ms=0.5, eager_ms=4.0, host_ms=0.2),
               dict(rec, case="c", impl="ours", ms=1.0)]
    table = bench.markdown(records, eager=True)
    assert ("| case | ours ms (/ ours) | ours eager ms (/ ours) | ours host ms (/ ours) | theirs ms (/ ours) | "
            "theirs eager ms (/ ours) | theirs host ms (/ ours) |") in table
    assert "| a | 1.0000 | 2.0000 | 0.1000 | 2.0000 (2.00) | 1.0000 (0.50) | 0.4000 (4.00) | 0.5000 | 2.00 |" in table
    assert "| c | 1.0000 | - | - | - | - | - | 0.5000 | 2.00 |" in table
    assert "- theirs / ours: geometric mean 1.000 over 2 cases (0.50-2.00); ours at least as fast on 1" in table
    assert "- theirs eager / ours: geometric mean 1.414 over 2 cases (0.50-4.00); ours at least as fast on 1" in table
    assert "- theirs host / ours: geometric mean 2.000 over 2 cases (1.00-4.00); ours at least as fast on 2" in table
    assert "eager" not in bench.markdown(records) and "host" not in bench.markdown(records)


def test_report_merges_result_files_later_first(tmp_path):
    """`tilela bench --report`: a later file's records of a case replace every earlier record of it (a failure too,
    and an implementation the later run did not time drops out: each row is one run); eager timings drop out;
    untimed rows first, then the op's grid order."""
    def rec(case, impl, ms, timing="cuda_graph"):
        return {"op": "gdn", "case": case, "impl": impl, "ms": ms, "timing": timing, "floor_ms": 0.1}

    first = {"op": "gdn", "records": [rec("1x8192_h2-8_mixed", "tilela", 2.0), rec("1x8192_h2-8_mixed", "fla", 3.0),
                                      rec("1x8192_h2-8_mixed", "tilela_unsplit", 4.0),
                                      rec("1x32768_h2-8_mixed", "fla", 1.0),
                                      rec("1x32768_h2-8_mixed", "tilela", 9.0, "eager"),
                                      rec("1x2048_h2-8_mixed", "tilela", 0.1)]}
    second = {"op": "gdn", "records": [rec("1x8192_h2-8_mixed", "tilela", 0.5), rec("1x8192_h2-8_mixed", "fla", 0.6),
                                       dict(rec("1x32768_h2-8_mixed", "tilela", None), error="RuntimeError: x")]}
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, data in zip(paths, (first, second)):
        path.write_text(json.dumps(data))
    records = bench.merged(paths)
    assert [(r["case"], r["impl"], r["ms"]) for r in records] == [("1x32768_h2-8_mixed", "tilela", None),
                                                                  ("1x8192_h2-8_mixed", "tilela", 0.5),
                                                                  ("1x8192_h2-8_mixed", "fla", 0.6),
                                                                  ("1x2048_h2-8_mixed", "tilela", 0.1)]
    assert bench.main(["--report", *map(str, paths)]) == 0
    with pytest.raises(ValueError, match="expected results of op 'ladder', got 'gdn'"):
        bench.merged(paths, "ladder")


def test_cases_run_in_the_order_asked_and_unknown_names_fail():
    from tilela.bench import gdn

    grid = gdn.cases(False)
    names = ["1x2048_h2-8_mixed", "1x32768_h16-32_decay"]
    assert [c.name for c in bench.selected(grid, names)] == names
    assert bench.selected(grid, None) == grid
    with pytest.raises(ValueError, match=r"--cases: unknown case names \['1x5_h1-1_mixed'\]"):
        bench.selected(grid, ["1x5_h1-1_mixed"])


def test_compare_two_runs_side_by_side(tmp_path, capsys):
    """`tilela bench --compare BASE HEAD`: per case and implementation timed in both runs, head / base; the other
    implementations' ratio to the first in each run (the anchor); the first's kernels in both; geometric means."""
    def rec(case, impl, ms, kernels=None):
        return {"op": "gdn", "case": case, "impl": impl, "ms": ms, "floor_ms": 0.1, "kernels": kernels}

    base = {"op": "gdn", "records": [rec("1x8192_h2-8_mixed", "tilela", 2.0, {"kkt": 50.0, "pass": 150.0}),
                                     rec("1x8192_h2-8_mixed", "flash_qla", 2.2),
                                     rec("1x2048_h2-8_mixed", "tilela", 1.0),
                                     rec("1x512_h2-8_mixed", "tilela", 0.5)]}
    copy = "void at::native::unrolled_elementwise_kernel<" + "TrivialOffsetCalculator<1, unsigned int>, " * 6 + ">"
    head = {"op": "gdn", "records": [rec("1x8192_h2-8_mixed", "tilela", 1.5, {"kkt": 40.0, "warmup": 5.0, copy: 2.0}),
                                     rec("1x8192_h2-8_mixed", "flash_qla", 2.4),
                                     rec("1x2048_h2-8_mixed", "tilela", 1.0)]}
    paths = [tmp_path / "base.json", tmp_path / "head.json"]
    for path, data in zip(paths, (base, head)):
        path.write_text(json.dumps(data))
    assert bench.main(["--compare", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert "| 1x8192_h2-8_mixed | tilela | 2.0000 | 1.5000 | 0.750 | - | - |" in out
    assert "| 1x8192_h2-8_mixed | flash_qla | 2.2000 | 2.4000 | 1.091 | 1.100 | 1.600 |" in out
    assert "| 1x2048_h2-8_mixed | tilela | 1.0000 | 1.0000 | 1.000 | - | - |" in out
    assert "1x512" not in out  # timed in one run only
    for row in ("| 1x8192_h2-8_mixed | kkt | 50.0 | 40.0 |", "| 1x8192_h2-8_mixed | pass | 150.0 | - |",
                "| 1x8192_h2-8_mixed | warmup | - | 5.0 |", f"| 1x8192_h2-8_mixed | {copy[:90]} | - | 2.0 |"):
        assert row in out
    assert "- tilela: head / base geometric mean 0.866 over 2 cases (0.750-1.000)" in out
    assert "- flash_qla / tilela: geometric mean 1.100 in base, 1.600 in head" in out
    (tmp_path / "kda.json").write_text(json.dumps({"op": "kda", "records": []}))
    assert bench.main(["--compare", str(paths[0]), str(tmp_path / "kda.json")]) == 2
    assert "expected results of one op, got 'gdn' and 'kda'" in capsys.readouterr().err
