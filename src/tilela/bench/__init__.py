"""Benchmark harness: ours against FLA and FlashQLA on the same inputs, in one process (`tilela bench`).

An op registers a `Bench` (see `OPS`): its cases, an input maker, the implementations, a float64 reference and
the roofline counts of a case. For every case the harness
  - builds `rotations` independent input sets, enough that one pass over them exceeds twice the L2 cache,
  - runs every implementation once eagerly (JIT compile / autotune, outside the timing), compares its output on
    input set 0 with the first implementation's (`rel_err_vs`), and times it as a CUDA graph replaying one call per
    input set: median over `replays` replays of (replay time / rotations), warm-up replays excluded;
and times every implementation eagerly too, the implementations in turn within each replay (`eager_ms`: one call
per input set from the host, launch gaps and host overhead included, as a serving engine runs prefill without a
graph; `host_ms`: the host's time to issue a call, which eager_ms hides while the device is the slower:
time_eager), and records each one's peak device memory (`peak_bytes`: one call's outputs and workspace beyond the
inputs); on the op's small check cases it compares every implementation with the float64 reference (`rel_err`).
Records (op, case, impl, ms, rel_err, rel_err_vs, floor, device, versions) go to a JSON file under
benchmarks/results/, and a markdown table with the ratios to the first implementation and the roofline floor
(bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s) is printed.

FLA dispatches to FlashQLA unless FLA_FLASH_QLA=0 (and KDA to FlashKDA unless FLA_FLASH_KDA=0), so the harness
sets both before anything imports fla.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

os.environ.setdefault("FLA_FLASH_QLA", "0")
os.environ.setdefault("FLA_FLASH_KDA", "0")

import torch  # noqa: E402

from .._progress import Progress  # noqa: E402

HBM_BYTES_PER_S = 4.3e12
TENSOR_FLOPS_PER_S = 790e12

# op name -> module defining BENCH
OPS = {
    "gdn": "tilela.bench.gdn",
    "kda": "tilela.bench.kda",
    "ladder": "tilela.bench.ladder",
    "kkt_solve": "tilela.bench.kkt_solve",
    "chunk_local_cumsum": "tilela.bench.cumsum",
    "state_pass": "tilela.bench.state_pass",
}


@dataclasses.dataclass
class Case:
    name: str
    params: dict[str, Any]


@dataclasses.dataclass
class Bench:
    """An op's benchmark. impls: name -> (inputs -> output, or None where the impl does not cover the case);
    the first impl is the one the others are compared with and the ratios are relative to."""

    op: str
    cases: Callable[[bool], list[Case]]  # quick -> cases
    check_cases: list[Case]  # small cases compared with the float64 reference
    make_inputs: Callable[[Case, int], dict[str, Any]]  # (case, seed) -> inputs on the GPU
    impls: dict[str, Callable[[Case, dict[str, Any]], torch.Tensor | None]]
    reference: Callable[[Case, dict[str, Any]], torch.Tensor]  # float64 on the CPU inputs
    cost: Callable[[Case], dict[str, float]]  # bytes, flops (and any accounting worth recording)


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    x = x.double()
    ref = ref.to(x.device).double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def versions() -> dict[str, str | None]:
    out = {}
    for name, dist in (("torch", "torch"), ("triton", "triton"), ("tilelang", "tilelang"),
                       ("fla", "flash-linear-attention"), ("flash_qla", "flash_qla")):
        try:
            out[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            module = _try_import(name)
            out[name] = getattr(module, "__version__", None) if module else None
    return out


def _try_import(name):
    try:
        return importlib.import_module(name)
    except Exception:  # an absent or broken optional backend only removes its column
        return None


def hopper_plan(x: dict[str, Any], lengths: list[int], K: int, gate: str, **options):
    """The Hopper plan the public op makes for these inputs (x: q, v, initial_state and optionally g, beta,
    cu_seqlens), with kernels.hopper.make_plan's options (kernel, block_DV, split, g_input, gate_form, outputs)."""
    from tilela.kernels import hopper

    return hopper.plan_call(x["q"], x["v"], x.get("g"), x.get("beta"), K**-0.5, gate=gate, lengths=lengths,
                            initial_state=x.get("initial_state") is not None, output_final_state=True,
                            varlen=x.get("cu_seqlens") is not None, **options)


def ours_variant(x: dict[str, Any], lengths: list[int], K: int, gate: str, **options) -> torch.Tensor | None:
    """o of our Hopper pipeline with make_plan's options (split=None: the sequence split off), or None where they
    leave the public op's plan (the row would repeat the op's)."""
    from tilela.kernels import hopper

    plan = hopper_plan(x, lengths, K, gate, **options)
    if plan == hopper_plan(x, lengths, K, gate):
        return None
    o, _ = hopper.forward(plan, x["q"], x["k"], x["v"], x.get("g"), x.get("beta"), x.get("initial_state"),
                          x.get("cu_seqlens"))
    return o


def _attempt(fn, *args):
    """(fn(*args), None), or (None, the error as text): one failing implementation must not end the run."""
    try:
        return fn(*args), None
    except Exception as exc:  # noqa: BLE001 - reported in the records and the table
        return None, _error_text(exc)


def _error_text(exc: Exception) -> str:
    """An error as the records and the table show it: its type and its first line (200 characters at most)."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def device_info() -> dict[str, Any]:
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
            "l2_bytes": getattr(p, "L2_cache_size", None)}


def input_bytes(inputs: dict[str, Any]) -> int:
    return sum(x.numel() * x.element_size() for x in inputs.values() if isinstance(x, torch.Tensor))


def time_graph(fn: Callable[[dict[str, Any]], Any], input_sets: list[dict[str, Any]], replays: int,
               warmup: int = 3) -> float:
    """Median ms per call of fn over CUDA-graph replays that call it once per input set."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # eager warm-up off the default stream, as graph capture requires
        for x in input_sets:
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x in input_sets:
            fn(x)
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(input_sets))
    del graph
    return statistics.median(times)


class EagerTime(NamedTuple):
    """time_eager's medians, ms per call: ms from the device's events (launch gaps and host overhead included) and
    host_ms, the host's time to return from the calls (perf_counter, the device idle at the start of each replay):
    the call's host overhead where the device keeps up with it, near ms where the call waits for the device (a
    synchronisation, or a launch queue full)."""

    ms: float
    host_ms: float


def time_eager(fns: dict[str, Callable[[dict[str, Any]], Any]], input_sets: list[dict[str, Any]], replays: int,
               warmup: int = 3) -> tuple[dict[str, EagerTime], dict[str, str]]:
    """Every fn called eagerly once per input set (for calls a CUDA graph cannot capture, e.g. ones that synchronise
    with the host, and as serving engines run prefill): medians over replays of the per-call time, by fn's name
    (EagerTime), and the errors (as text, by name) of the fns left out because they raised in their warm-up calls.
    Within a replay the fns run in turn, each from an idle device, in an order rotated from replay to replay and
    reversed on every other one (so no fn always follows the same one): a slow spell of the host (another process,
    a collection) falls on every fn alike instead of on whichever was timed during it, so their ratios hold within
    one run."""
    errors = {}
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                for x in input_sets:
                    fn(x)
        except Exception as exc:  # noqa: BLE001 - the others are timed; the caller records this one's error
            errors[name] = _error_text(exc)
    names = [name for name in fns if name not in errors]
    if not names:
        return {}, errors
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: dict[str, list[float]] = {name: [] for name in names}
    host: dict[str, list[float]] = {name: [] for name in names}
    torch.cuda.synchronize()  # each fn's turn then starts on an idle device (the one before it waited for its end)
    for replay in range(replays):
        turns = names[replay % len(names):] + names[:replay % len(names)]
        for name in turns[::-1] if replay % 2 else turns:
            start.record()
            began = time.perf_counter()
            for x in input_sets:
                fns[name](x)
            host[name].append((time.perf_counter() - began) * 1e3 / len(input_sets))
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / len(input_sets))
    return {name: EagerTime(statistics.median(times[name]), statistics.median(host[name])) for name in names}, errors


def peak_bytes(fn: Callable[[dict[str, Any]], Any], inputs: dict[str, Any]) -> int:
    """Device memory one eager call of fn takes at its peak beyond what was allocated before it (its outputs and
    workspace; the inputs excluded)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(inputs)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def kernel_times(fn: Callable[[dict[str, Any]], Any], inputs: dict[str, Any], calls: int = 5) -> dict[str, float]:
    """Microseconds per call of each GPU kernel fn launches (torch.profiler over `calls` eager calls, after one
    warm-up call), largest first: where an implementation's time goes."""
    from torch.profiler import ProfilerActivity, profile

    fn(inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(inputs)
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time_total / calls
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def kernel_label(name: str, width: int = 90) -> str:
    """A profiled kernel's name as the tables print it: its first `width` characters (a templated torch kernel's
    full signature runs to hundreds)."""
    return name[:width]


def selected(cases: list[Case], only: list[str] | None) -> list[Case]:
    """The cases named in only, in its order (so a device call can put the rows it needs most first), or all."""
    if only is None:
        return cases
    by_name = {case.name: case for case in cases}
    unknown = [name for name in only if name not in by_name]
    if unknown:
        raise ValueError(f"--cases: unknown case names {unknown} (known: {list(by_name)})")
    return [by_name[name] for name in only]


def run(op: str, quick: bool = False, replays: int = 30, impls: list[str] | None = None,
        save: Callable[[list[dict[str, Any]]], None] | None = None, only: list[str] | None = None,
        checks: bool = True, profile: bool = False) -> list[dict[str, Any]]:
    """Check and time every case; ``save(records)`` runs after each case, so an interrupted run keeps its data.
    profile: also record each timed implementation's kernels (kernel_times) as the record's "kernels"."""
    bench: Bench = importlib.import_module(OPS[op]).BENCH
    chosen = {name: fn for name, fn in bench.impls.items() if impls is None or name in impls}
    dev, vers = device_info(), versions()
    l2 = dev["l2_bytes"] or 64 << 20
    records = []

    def record(case, impl, **fields):
        cost = bench.cost(case)
        floor_ms = 1e3 * max(cost["bytes"] / HBM_BYTES_PER_S, cost["flops"] / TENSOR_FLOPS_PER_S)
        records.append({"op": op, "case": case.name, "params": case.params, "impl": impl, **fields,
                        "floor_ms": floor_ms, "cost": cost, "device": dev, "versions": vers})

    check_cases = bench.check_cases if checks else []
    cases = selected(bench.cases(quick), only)
    with Progress(f"bench {op}", total=len(check_cases) + len(cases)) as bar:
        for check in check_cases:
            bar.update(check.name)
            inputs = bench.make_inputs(check, 0)
            ref = bench.reference(check, {k: v.cpu() if isinstance(v, torch.Tensor) else v
                                          for k, v in inputs.items()})
            for impl, fn in chosen.items():
                out, error = _attempt(fn, check, inputs)
                if out is not None or error is not None:
                    record(check, impl, kind="check", ms=None, rel_err=None if error else rel_l2(out, ref),
                           rel_err_vs=None, error=error)
                    bar.echo(f"{check.name:40s} {impl:24s} rel err vs float64 {records[-1]['rel_err'] or error}")
            del inputs, ref
            bar.advance()

        for case in cases:
            bar.update(case.name)
            first = bench.make_inputs(case, 0)
            rotations = max(2, min(32, math.ceil(2 * l2 / max(input_bytes(first), 1))))
            input_sets = [first] + [bench.make_inputs(case, seed) for seed in range(1, rotations)]
            baseline = None
            timed = {}  # impl -> (its call, graph ms or None where capture failed, rel_err_vs)
            for impl, fn in chosen.items():
                out, error = _attempt(fn, case, first)
                if out is None and error is None:
                    continue  # the implementation does not cover this case
                if out is not None:
                    if baseline is None:
                        baseline, base_impl = out, impl
                    err = rel_l2(out, baseline)
                    del out
                    call = lambda x, fn=fn: fn(case, x)  # noqa: E731
                    ms, error = _attempt(time_graph, call, input_sets, replays)
                    if error is not None:
                        bar.echo(f"{case.name:40s} {impl:24s} graph capture failed ({error}); timing eagerly")
                        ms, error = None, None
                if error is not None:
                    record(case, impl, kind="time", ms=None, rel_err=None, rel_err_vs=None, error=error)
                    bar.echo(f"{case.name:40s} {impl:24s} failed: {error}")
                    continue
                timed[impl] = (call, ms, err)
            eager, error = _attempt(time_eager, {impl: call for impl, (call, _, _) in timed.items()}, input_sets,
                                    replays)
            eager, errors = eager or ({}, dict.fromkeys(timed, error))
            for impl, (call, ms, err) in timed.items():
                timing = "cuda_graph" if ms is not None else "eager"
                eager_ms, host_ms = eager.get(impl, (None, None))
                if ms is None and eager_ms is None:
                    record(case, impl, kind="time", ms=None, rel_err=None, rel_err_vs=None, error=errors[impl])
                    bar.echo(f"{case.name:40s} {impl:24s} failed: {errors[impl]}")
                    continue
                ms = eager_ms if ms is None else ms
                peak = _attempt(peak_bytes, call, first)[0]
                record(case, impl, kind="time", ms=ms, eager_ms=eager_ms, host_ms=host_ms, peak_bytes=peak,
                       rel_err=None, rel_err_vs={base_impl: err}, rotations=rotations, timing=timing)
                shown = "-" if eager_ms is None else f"{eager_ms:.4f}, host {host_ms:.4f}"
                bar.echo(f"{case.name:40s} {impl:24s} {ms:9.4f} ms (eager {shown})  vs {base_impl}: {err:.2e} "
                         f"({timing})")
                if profile:
                    kernels, error = _attempt(kernel_times, call, first)
                    records[-1].update(kernels=kernels, kernels_error=error)
                    for name, us in (kernels or {}).items():
                        bar.echo(f"{'':40s} {'':24s} {us:9.1f} us  {kernel_label(name)}")
            del input_sets, first, baseline
            torch.cuda.empty_cache()
            if save is not None:
                save(records)
            bar.advance()
    return records


LABELS = {"ms": "", "eager_ms": "eager ", "host_ms": "host "}  # a record's times, as the report heads them


def markdown(records: list[dict[str, Any]], eager: bool = False) -> str:
    """One row per case: each impl's ms, its ratio to the first impl, the floor and the first impl's distance; with
    eager, each impl's eager ms (host overhead and launch gaps included) and host ms (its time to issue a call:
    time_eager) and their ratios beside its graph ms. Below the
    table, per other impl, the geometric mean of those ratios over the cases both timed (above 1: the first impl is
    faster), their range and the cases where the first impl is at least as fast."""
    timed = [r for r in records if r.get("ms") is not None]
    impls = list(dict.fromkeys(r["impl"] for r in timed))
    lines = []
    checks = [r for r in records if r.get("rel_err") is not None]
    if checks:
        lines += ["| check case | impl | rel err vs float64 |", "|---|---|---|"]
        lines += [f"| {r['case']} | {r['impl']} | {r['rel_err']:.2e} |" for r in checks]
        lines.append("")
    failures = [r for r in records if r.get("error")]
    if failures:
        lines += [f"- {r['case']} {r['impl']}: {r['error']}" for r in failures] + [""]
    if not timed:
        return "\n".join(lines)
    base_impl = impls[0]
    columns = [(i, key) for i in impls for key in (("ms", "eager_ms", "host_ms") if eager else ("ms",))]
    head = " | ".join(f"{i} {LABELS[key]}ms (/ {base_impl})" for i, key in columns)
    lines += [f"| case | {head} | floor ms | {base_impl} / floor |", "|---" * (len(columns) + 3) + "|"]
    ratios: dict[tuple[str, str], list[float]] = {column: [] for column in columns}
    for case in dict.fromkeys(r["case"] for r in timed):
        rows = {r["impl"]: r for r in timed if r["case"] == case}
        base = rows.get(base_impl)
        cells = []
        for i, key in columns:
            value = rows.get(i, {}).get(key)
            if value is None:
                cells.append("-")
            elif base is None or base.get(key) is None or i == base_impl:
                cells.append(f"{value:.4f}")
            else:
                ratios[i, key].append(value / base[key])
                cells.append(f"{value:.4f} ({value / base[key]:.2f})")
        floor = next(iter(rows.values()))["floor_ms"]
        dist = f"{base['ms'] / floor:.2f}" if base else "-"
        lines.append(f"| {case} | " + " | ".join(cells) + f" | {floor:.4f} | {dist} |")
    summary = []
    for (i, key), values in ratios.items():
        if values:
            summary.append(f"- {i} {LABELS[key]}/ {base_impl}: geometric mean "
                           f"{statistics.geometric_mean(values):.3f} over "
                           f"{len(values)} cases ({min(values):.2f}-{max(values):.2f}); {base_impl} at least as fast "
                           f"on {sum(v >= 1 for v in values)}")
    return "\n".join(lines + ([""] + summary if summary else []))


def compare(base: list[dict[str, Any]], head: list[dict[str, Any]], names: tuple[str, str] = ("base", "head")
            ) -> str:
    """Two runs of the same cases side by side (one source tree's kernels against another's, each timed in its own
    process of one call): per case and implementation timed in both, each run's ms and head / base; each other
    implementation's ratio to the first (as markdown's) in both runs, the anchor that takes the drift between the
    processes out of a change's effect; the first implementation's kernels (--profile) in both runs. Below, per
    implementation, the geometric mean of head / base, and per other implementation that of its ratio to the first
    in each run."""
    b_name, h_name = names
    pick = {side: {(r["case"], r["impl"]): r for r in records if r.get("ms") is not None}
            for side, records in (("base", base), ("head", head))}
    both = [key for key in pick["head"] if key in pick["base"]]
    if not both:
        return f"no case and implementation timed in both {b_name} and {h_name}"
    first = both[0][1]
    lines = [f"| case | impl | {b_name} ms | {h_name} ms | {h_name} / {b_name} | / {first}: {b_name} | / {first}: "
             f"{h_name} |", "|---|---|---|---|---|---|---|"]
    change: dict[str, list[float]] = {}
    anchor: dict[str, tuple[list[float], list[float]]] = {}
    for case, impl in both:
        b, h = pick["base"][case, impl]["ms"], pick["head"][case, impl]["ms"]
        change.setdefault(impl, []).append(h / b)
        cells = ["-", "-"]
        ours = (pick["base"].get((case, first)), pick["head"].get((case, first)))
        if impl != first and all(ours):
            to_first = (b / ours[0]["ms"], h / ours[1]["ms"])
            for values, ratio in zip(anchor.setdefault(impl, ([], [])), to_first):
                values.append(ratio)
            cells = [f"{ratio:.3f}" for ratio in to_first]
        lines.append(f"| {case} | {impl} | {b:.4f} | {h:.4f} | {h / b:.3f} | " + " | ".join(cells) + " |")
    kernels = [(case, *(pick[side][case, first].get("kernels") or {} for side in ("base", "head")))
               for case, impl in both if impl == first]
    if any(in_base or in_head for _, in_base, in_head in kernels):
        lines += ["", f"| case | {first} kernel | {b_name} us | {h_name} us |", "|---|---|---|---|"]
        for case, in_base, in_head in kernels:
            for name in dict.fromkeys([*in_base, *in_head]):
                cells = ["-" if run.get(name) is None else f"{run[name]:.1f}" for run in (in_base, in_head)]
                lines.append(f"| {case} | {kernel_label(name)} | " + " | ".join(cells) + " |")
    summary = [f"- {impl}: {h_name} / {b_name} geometric mean {statistics.geometric_mean(values):.3f} over "
               f"{len(values)} cases ({min(values):.3f}-{max(values):.3f})" for impl, values in change.items()]
    summary += [f"- {impl} / {first}: geometric mean {statistics.geometric_mean(b):.3f} in {b_name}, "
                f"{statistics.geometric_mean(h):.3f} in {h_name}" for impl, (b, h) in anchor.items()]
    return "\n".join(lines + [""] + summary)


class ResultFileError(ValueError):
    """A result file that cannot be read as tilela bench results; the message is one line naming the file."""


def load_result(path: Path | str) -> dict[str, Any]:
    """A result file written by `tilela bench` ({"op", "records"}), checked enough for markdown() and the charts."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ResultFileError(f"{path}: no such file") from None
    except OSError as exc:
        raise ResultFileError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ResultFileError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("op"), str) or not isinstance(data.get("records"), list):
        raise ResultFileError(f"{path}: not a tilela bench result (expected an object with \"op\" and \"records\")")
    if data["op"] not in OPS:
        raise ResultFileError(f"{path}: results of an unknown op {data['op']!r} (known: {', '.join(sorted(OPS))})")
    for i, r in enumerate(data["records"]):
        needed = ("case", "impl") + (("floor_ms",) if isinstance(r, dict) and r.get("ms") is not None else ())
        missing = [key for key in needed if not isinstance(r, dict) or key not in r]
        if missing:
            raise ResultFileError(f"{path}: record {i} is not a tilela bench record (no {', '.join(missing)})")
    return data


def merged(paths: list[Path], op: str | None = None) -> list[dict[str, Any]]:
    """merge() of the result files at paths."""
    return merge([(Path(path).name, load_result(path)) for path in paths], op)


def merge(results: list[tuple[str, dict[str, Any]]], op: str | None = None) -> list[dict[str, Any]]:
    """The records of several results (file name, load_result's data) of one op: a later file's records of a case (its
    float64 checks, or its timings and their failures) replace every earlier record of that case and kind, so each
    row of the table comes from one run (its implementations side by side); records timed eagerly because their graph
    capture failed are left out (their ms include launch gaps and host copies, so they do not compare with CUDA-graph
    ones; a graph-timed record's own eager_ms stays). For a grid measured over several calls or GPUs
    (benchmarks/device_pair.sh)."""
    rows: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for name, data in results:
        if op is not None and data["op"] != op:
            raise ValueError(f"{name}: expected results of op {op!r}, got {data['op']!r}")
        op = data["op"]
        fresh: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
        for r in data["records"]:
            if r.get("ms") is not None and r.get("timing", "cuda_graph") != "cuda_graph":
                continue
            kind = r.get("kind") or ("check" if r.get("rel_err") is not None else "time")  # files before "kind"
            fresh.setdefault((r["case"], kind), {})[r["impl"]] = dict(r, file=name)
        rows.update(fresh)
    records = [r for row in rows.values() for r in row.values()]
    bench: Bench = importlib.import_module(OPS[op]).BENCH
    order = {c.name: i for i, c in enumerate(bench.check_cases + bench.cases(False))}
    impls = list(bench.impls)
    return sorted(records, key=lambda r: (r.get("ms") is not None, order.get(r["case"], len(order)),
                                          impls.index(r["impl"]) if r["impl"] in impls else len(impls)))


def merged_by_op(paths: list[Path], op: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """op -> merge() of its files among paths (in the order the ops first appear); op: only that op's files.
    Raises ResultFileError for a file that is not a result file, or when no file holds op's results."""
    by_op: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for path in paths:
        data = load_result(path)
        by_op.setdefault(data["op"], []).append((Path(path).name, data))
    if op is not None:
        if op not in by_op:
            raise ResultFileError(f"no results of op {op!r} among the {len(paths)} files (they hold {sorted(by_op)})")
        by_op = {op: by_op[op]}
    return {name: merge(results, name) for name, results in by_op.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tilela bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", choices=sorted(OPS), required=False,
                        help="the op to benchmark; with --report or --plot, report only its files")
    parser.add_argument("--report", type=Path, nargs="*", default=None, metavar="JSON",
                        help="print a markdown table per op of these result files (a later file's records of a case "
                             "replace the earlier ones of it: each row is one run; implementations timed eagerly "
                             "left out) and the geometric mean of each ratio instead of running")
    parser.add_argument("--eager", action="store_true",
                        help="with --report: each implementation's eager ms (one call per input set from the host, "
                             "launch gaps and host overhead included) and host ms (its host time to issue a call) "
                             "beside its graph ms")
    parser.add_argument("--compare", type=Path, nargs=2, default=None, metavar=("BASE", "HEAD"),
                        help="print two result files of the same cases side by side (e.g. a change's kernels against "
                             "the base revision's, each run in its own process of one call; benchmarks/device_ab.sh) "
                             "instead of running")
    parser.add_argument("--plot", action="store_true",
                        help="write PNG charts of the result files (speed-up against FLA and FlashQLA per case, "
                             "latency against sequence length) instead of running; needs matplotlib")
    parser.add_argument("--out-dir", type=Path, default=Path("."), help="where --plot writes its charts (default .)")
    parser.add_argument("files", type=Path, nargs="*", metavar="JSON", help="result files for --report / --plot")
    parser.add_argument("--quick", action="store_true", help="a subset of the cases")
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--impls", default=None, help="comma-separated subset of the implementations")
    parser.add_argument("--cases", default=None, help="comma-separated case names, run in this order")
    parser.add_argument("--no-checks", dest="checks", action="store_false",
                        help="skip the float64 check cases (e.g. when another process of the same run does them)")
    parser.add_argument("--profile", action="store_true",
                        help="also record each implementation's kernels and their us per call (torch.profiler)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default benchmarks/results/<op>-<time>.json)")
    args = parser.parse_args(argv)
    if args.compare is not None:
        return _compare(args.compare, args.op)
    if args.report is not None or args.plot:
        return _report_and_plot(parser, args)
    if args.files:
        parser.error(f"result files {[str(f) for f in args.files]} given without --report or --plot")
    if args.op is None:
        parser.error("--op is required unless --report or --plot is given")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or Path("benchmarks/results") / f"{args.op}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(records):
        out.write_text(json.dumps({"op": args.op, "quick": args.quick, "time": stamp, "records": records}, indent=1))

    records = run(args.op, quick=args.quick, replays=args.replays,
                  impls=None if args.impls is None else args.impls.split(","), save=save,
                  only=None if args.cases is None else args.cases.split(","), checks=args.checks,
                  profile=args.profile)
    save(records)
    print(markdown(records))
    print(f"\nwritten {out}")
    return 0


def _compare(paths: list[Path], op: str | None) -> int:
    """--compare BASE HEAD: 0, or 2 with one line on stderr for a file that is not a result file or results of
    different ops."""
    try:
        base, head = (load_result(path) for path in paths)
        if base["op"] != head["op"] or (op is not None and op != base["op"]):
            raise ResultFileError(f"{paths[0]}, {paths[1]}: expected results of one op{f' ({op!r})' if op else ''}, "
                                  f"got {base['op']!r} and {head['op']!r}")
        print(compare(merge([(paths[0].name, base)]), merge([(paths[1].name, head)]), (paths[0].stem, paths[1].stem)))
    except ResultFileError as exc:
        print(f"tilela bench: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _report_and_plot(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """--report / --plot: 0, or 2 with one line on stderr for a file that is not a result file or absent
    matplotlib."""
    from .plot import PlotError, charts

    paths = (args.report or []) + args.files
    if not paths:
        parser.error("--report / --plot need result files")
    try:
        by_op = merged_by_op(paths, args.op)
        if args.report is not None:
            for op, records in by_op.items():
                if len(by_op) > 1:
                    print(f"## {op}\n")
                print(markdown(records, args.eager) + ("\n" if len(by_op) > 1 else ""))
        if args.plot:
            for path in charts(by_op, args.out_dir):
                print(f"written {path}")
    except (ResultFileError, PlotError) as exc:
        print(f"tilela bench: error: {exc}", file=sys.stderr)
        return 2
    return 0
