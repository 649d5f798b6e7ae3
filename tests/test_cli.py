"""The command line on the CPU: --version and `python -m tilela`, info, check, precompile's selection and its
one-line failure without TileLang or nvcc, bench --report over every committed result file and its one-line errors,
bench --plot, and the progress line."""

import glob
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tilela
from tilela import check, cli, info, precompile
from tilela._progress import Progress

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted(glob.glob(str(ROOT / "benchmarks" / "results" / "*.json")))


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"tilela {tilela.__version__}"


def test_python_dash_m_runs_the_command():
    env = {"PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-m", "tilela", "--version"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"tilela {tilela.__version__}"
    done = subprocess.run([sys.executable, "-m", "tilela", "frobnicate"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 2 and "invalid choice: 'frobnicate'" in done.stderr


def test_info_names_each_ops_path(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"tilela        {tilela.__version__}" in out and f"torch         {torch.__version__}" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert set(lines) == set(check.ATTENTION_OPS) | set(check.PRIMITIVES)
    if not torch.cuda.is_available():
        assert "device        no CUDA device" in out
        assert all("PyTorch path: no CUDA device" in line for line in lines.values())
        assert "(on Hopper: kernels for bf16/fp16, K = V in 64/128/256)" in lines["chunk_gated_delta_rule"]
        assert "(on Hopper: kernels for bf16/fp16, K = V in 64/128)" in lines["chunk_gla"]
        assert "(on Hopper: kernels for bf16/fp16, K = V in 64/128)" in lines["chunk_kda"]


def test_info_paths_follow_the_library_rule(monkeypatch):
    """The path comes from tilela.ops' own rules through info.hopper_route: a device the ops take to the Hopper
    kernels gets "Hopper kernels" where kernels.hopper.plan.covers says so, the PyTorch path where it does not."""
    from tilela import ops
    from tilela.kernels.hopper import plan

    monkeypatch.setattr(ops, "_hopper", lambda *tensors: object())
    device = {"name": "NVIDIA H200", "capability": (9, 0), "sms": 132}
    paths = info.op_paths(device, None, torch.device("cpu"))
    assert paths["chunk_gated_delta_rule"] == "Hopper kernels (bf16/fp16, K = V in 64/128/256)"
    assert paths["chunk_kda"] == "Hopper kernels (bf16/fp16, K = V in 64/128)"
    assert paths["kkt_solve"] == "Hopper kernel"
    monkeypatch.setattr(plan, "covers", lambda dtype, K, V, gate, delta: K == 64)
    assert info.op_paths(device, None, torch.device("cpu"))["chunk_linear_attn"] == (
        "PyTorch path on Hopper for bf16 K=128 V=128: the kernels cover bf16/fp16/fp32/fp64, K in 64, "
        "V in 16/32/64/128/192/256/512")
    ampere = {"name": "NVIDIA A100", "capability": (8, 0), "sms": 108}
    assert info.why_not_hopper(ampere, None) == "NVIDIA A100 is sm_80; the kernels are built for sm_90a (Hopper)"


def test_check_quick_passes_on_cpu(capsys):
    assert cli.main(["check", "--device", "cpu", "--quick", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "(seed 3)" in out and f"{len(check.plan(True))}/{len(check.plan(True))} passed" in out
    for op in [*check.ATTENTION_OPS, *check.PRIMITIVES]:
        assert any(line.startswith(op + " ") and line.endswith("PASS") for line in out.splitlines()), op


def test_check_fails_a_wrong_op(monkeypatch, capsys):
    real = check.run_op

    def off_by_a_little(op, x):
        out, state = real(op, x)
        return (out * 1.05, state) if op == "chunk_simple_gla" else (out, state)

    monkeypatch.setattr(check, "run_op", off_by_a_little)
    assert check.main("cpu", quick=True, seed=0) == 1
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines() if line.endswith("FAIL")] == ["chunk_simple_gla"]


def test_check_inputs_are_what_the_table_says():
    x = check.make_inputs(check.QUICK, torch.bfloat16, "cpu", seed=1)
    assert x["cu_seqlens"].tolist() == [0, 1, 64, 194] and x["q"].dtype == torch.bfloat16
    assert torch.allclose(x["q"].float().norm(dim=-1), torch.ones(1, 194, 1), atol=1e-2)
    assert (x["g"][..., 0] == 0).all() and (x["g"][..., 1] < 0).all() and (x["g_channel"][..., 0, :] == 0).all()
    assert x["v"].shape == (1, 194, 2, 64) and x["initial_state"].shape == (3, 2, 64, 64)


def test_precompile_ships_every_kernel_the_gdn_bench_plans():
    """plan_jobs of the op's plan for every GDN bench case (tilela.bench.gdn.op_plan, on 132 SMs and on 78: the
    split's picks differ) names kernels precompile.jobs() ships, the split's warm-up table, combine and both passes
    included; a case's kernels are what benchmarks/precompile.py's cases= compiles."""
    pytest.importorskip("tilelang")
    from tilela.bench import gdn

    shipped = {(job.kind, job.config) for job in precompile.jobs()}
    kinds = set()
    for case in gdn.cases(False):
        for sms in (132, 78):
            plan = gdn.op_plan(case, sms)
            wanted = precompile.plan_jobs(plan)
            assert {(job.kind, job.config) for job in wanted} <= shipped, case.name
            assert len(wanted) == len(set(wanted))
            assert (plan.split is None) == ("combine" not in {job.kind for job in wanted})
            kinds |= {job.kind for job in wanted}
    assert kinds == {"kkt", "ws", "combine"}


def test_precompile_selects_by_op_dtype_and_head_dim(capsys):
    pytest.importorskip("tilelang")
    gdn = precompile.select(["gdn"], ["bfloat16"], [128])
    assert gdn and all("chunk_gated_delta_rule" in job.ops for job in gdn)
    assert {job.kind for job in gdn} == {"kkt", "l2norm", "combine", "chunk_fwd", "ws"}  # kkt sums g
    assert all(job.dtype in (None, "bfloat16") and job.K in (None, 128) for job in gdn)
    assert all(job.config[:2] == (64, "blocked") and job.config[5] for job in gdn if job.kind == "kkt")
    assert {job.kind for job in precompile.select(["chunk_gla"])} == {"cumsum", "gla", "chunk_fwd", "ws"}
    assert len(precompile.select(["kkt_solve"])) == sum(c[5] is None and not c[6]  # A, from gc
                                                        for c in tilela.kernels.hopper.KKT_CONFIGS)
    assert len(precompile.select()) == len(precompile.jobs())
    with pytest.raises(ValueError, match="ops: expected names among"):
        precompile.select(["gdm"])
    with pytest.raises(ValueError, match=r"dtypes: expected values among \['bfloat16', 'float16'\], got \['float32'\]"):
        precompile.select(dtypes=[torch.float32])
    assert cli.main(["precompile", "--ops", "gdn", "--dtypes", "bfloat16", "--head-dims", "128", "--list"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{len(gdn)} kernels"


@pytest.mark.parametrize("missing", ["tilelang", "nvcc"])
def test_precompile_without_tilelang_or_nvcc_says_so_in_one_line(monkeypatch, capsys, missing):
    if missing == "tilelang":
        monkeypatch.setattr(info, "_tilelang", lambda: (None, "ModuleNotFoundError: No module named 'tilelang'"))
    else:
        monkeypatch.setattr(info, "_tilelang", lambda: (object(), None))
        monkeypatch.setattr(info, "nvcc_version", lambda: None)
    assert cli.main(["precompile", "--ops", "gdn"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tilela precompile: error: needs ")
    assert ("pip install tilelang" if missing == "tilelang" else "nvcc") in err
    with pytest.raises(RuntimeError, match="needs "):
        tilela.warmup(["gdn"])


@pytest.mark.compile
def test_warmup_compiles_a_kernel_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    one = [job for job in precompile.select(["chunk_local_cumsum"]) if job.config == (16, "float16", "log")]
    monkeypatch.setattr(precompile, "select", lambda *args: one)
    results = tilela.warmup(["chunk_local_cumsum"], progress=False)
    assert [(r.job, r.error) for r in results] == [(one[0], None)]
    assert any(path.is_file() for path in tmp_path.rglob("*"))


def test_report_over_every_committed_result_file(capsys):
    assert len(RESULTS) > 10
    assert cli.main(["bench", "--report", *RESULTS]) == 0
    out = capsys.readouterr().out
    ops = list(dict.fromkeys(json.loads(Path(path).read_text())["op"] for path in RESULTS))  # first appearance
    assert len(ops) > 1 and [line[3:] for line in out.splitlines() if line.startswith("## ")] == ops
    assert "| 1x8192_h2-8_mixed | " in out and "| L3_chunk_gla_T8192_H16 | " in out


@pytest.mark.parametrize("content,message", [
    (None, "no such file"),
    ('{"op": "gdn", "records": [', "not valid JSON"),
    ('{"results": []}', 'not a tilela bench result (expected an object with "op" and "records")'),
    ('[1, 2]', "not a tilela bench result"),
    ('{"op": "attention", "records": []}', "results of an unknown op 'attention'"),
    ('{"op": "gdn", "records": [{"impl": "tilela"}]}', "record 0 is not a tilela bench record (no case)"),
])
def test_report_errors_are_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "result.json"
    if content is not None:
        path.write_text(content)
    assert cli.main(["bench", "--report", RESULTS[0], str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"tilela bench: error: {path}: {message}")


def test_plot_writes_the_charts(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    gdn_ladder = [p for p in RESULTS if Path(p).name.startswith(("gdn-", "ladder-"))]
    assert cli.main(["bench", "--plot", "--out-dir", str(tmp_path), *gdn_ladder]) == 0
    names = {"gdn-speedup.png", "gdn-latency.png", "ladder-speedup.png", "ladder-latency.png"}
    assert {p.name for p in tmp_path.iterdir()} == names
    for name in names:
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) < 150_000
    assert capsys.readouterr().out.count("written ") == 4


def test_chart_titles_name_every_gpu_of_the_merged_files():
    """Merged result files may come from different GPUs (each case's row is one run): a title names them all."""
    from tilela.bench.plot import _device

    h100, h200 = ({"device": {"name": name}} for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"))
    assert _device([h200, h100, h200, {}]) == "NVIDIA H200 and NVIDIA H100 80GB HBM3"
    assert _device([h200]) == "NVIDIA H200" and _device([{}]) == "GPU"


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert cli.main(["bench", "--plot", RESULTS[0]]) == 2
    assert capsys.readouterr().err == ("tilela bench: error: --plot needs matplotlib: pip install matplotlib "
                                       "(or pip install 'tilela[plot]')\n")


def test_progress_line():
    stream = io.StringIO()
    with Progress("check", total=3, enabled=True, stream=stream, interval=60) as bar:
        bar.update("chunk_kda bf16")
        bar.advance()
    text = stream.getvalue()
    assert text.startswith("\rcheck 0/3 chunk_kda bf16 0s") and "\rcheck 1/3 chunk_kda bf16 0s" in text
    assert text.endswith("\n") and text.count("\n") == 1
    quiet = io.StringIO()  # not a terminal: nothing
    with Progress("check", total=3, stream=quiet) as bar:
        bar.update("x")
        bar.advance()
    assert quiet.getvalue() == ""
