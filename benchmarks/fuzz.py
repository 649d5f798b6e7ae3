"""Seeded random sweep of the public ops against the float64 reference (tilela.reference.chunked), per op family.

    python benchmarks/fuzz.py [--device cuda] [--configs 200] [--seed 0] [--max-seconds 480] [--split]
                              [--families gdn,kda,...] [--no-extreme] [--tol 0.01] [--out failures.json]
                              [--workers N]
    python benchmarks/fuzz.py --repro gdn:37 [--split] [--seed 0]      # one configuration again, verbosely

Configuration i of a family comes from its own generator (seed, family, i), so any failure is rerun alone with
--repro. Each configuration draws: the layout (dense batch or varlen with 1-token, empty, non-multiple-of-64 and
multiple-of-64 sequences), q/k heads and the GVA ratio, K and V (mostly the Hopper sizes 64 / 128, some 256 or
K != V, which the PyTorch path serves), bf16 or fp16, per value head a gate regime (never decaying g = 0, mild,
ordinary, strong; with scalar gates, unless --no-extreme, a few tokens whose exp underflows: -inf, -1e30, -1e4),
beta, an initial state or none, the default or a random scale (on CUDA the default: the state passes compile per
scale), and in-kernel q/k l2norm; for GDN and KDA, three in ten take FLA's in-kernel gate instead (a raw input
with A_log and dt_bias; KDA's bounded sigmoid form), the reference reading the float64 gate formed from it.
Per-channel gates stay within the Hopper kernels' contract (no key channel decays by more than e^-80 within 16
tokens).

Every configuration checks, on --device:
  - o and the final state against the float64 reference: rel L2 < --tol (failure kind "error", or "non_finite");
  - a rerun on the same inputs gives bitwise-identical results ("nondeterministic");
  - every tenth one: NaN put into k at one token of one sequence stays in that sequence and in the value heads that
    read that k head, forward in time; every other output equals the clean run's bit for bit ("nan_leak").
--split forces the sequence split on every call that can take it (segments of 1, 2 or 4 chunks; the Hopper path's
plan is replaced, see `internals`), so short layouts exercise the split's transitions and combines.

One line per failure, then a table per family; --out writes the failures (with their configurations) as JSON.
The sweep stops at --max-seconds (round-robin over the families, so each gets its share) or after --configs each.
The op runs in this process; the float64 reference, the slow part, in --workers processes (default: all cores but
one), which then catch up on what is in flight.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import multiprocessing
import os
import random
import sys
import time
import zlib
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

import tilela
from tilela import reference
from tilela.bench import rel_l2

FAMILIES = {  # family: (public op, gate kind, delta rule)
    "gdn": ("chunk_gated_delta_rule", "scalar", True),
    "kda": ("chunk_kda", "channel", True),
    "delta_rule": ("chunk_delta_rule", "none", True),
    "linear_attn": ("chunk_linear_attn", "none", False),
    "simple_gla": ("chunk_simple_gla", "scalar", False),
    "gla": ("chunk_gla", "channel", False),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
EXTREME = [float("-inf"), -1e30, -1e4]


def internals(device: str):
    """The Hopper backend's internal entry points the sweep uses, all here so they are repointed in one place:
    ``split_spy(segment_chunks)``, a context manager that records every sequence-split plan the op makes (a list
    of segment sizes, None for unsplit calls the split could take) and, with segment_chunks, replaces the plan by
    SegmentPlan.of(lengths, segment_chunks). Off CUDA the split never runs: the spy records nothing."""
    if device != "cuda":
        @contextlib.contextmanager
        def no_split(segment_chunks: int | None = None):
            yield []

        return no_split
    from tilela.kernels.hopper import plan as hopper_plan

    @contextlib.contextmanager
    def split_spy(segment_chunks: int | None = None):
        plans, auto_split = [], hopper_plan.auto_split

        def plan(lengths, *args, **kwargs):
            chosen = auto_split(lengths, *args, **kwargs) if segment_chunks is None else \
                hopper_plan.SegmentPlan.of(lengths, segment_chunks)
            plans.append(None if chosen is None else chosen.segment_chunks)
            return chosen

        hopper_plan.auto_split = plan
        hopper_plan._plan.cache_clear()  # plans are cached per call facts: make every call decide again
        try:
            yield plans
        finally:
            hopper_plan.auto_split = auto_split
            hopper_plan._plan.cache_clear()

    return split_spy


def draw_lengths(rng: random.Random, total: int) -> list[int]:
    """Varlen sequence lengths: a mix of 0, 1, short, chunk multiples and their neighbours, and long ones."""
    lengths = []
    while sum(lengths) < total:
        kind = rng.random()
        if kind < 0.15:
            lengths.append(1)
        elif kind < 0.2:
            lengths.append(0)
        elif kind < 0.45:
            lengths.append(rng.randint(2, 63))
        elif kind < 0.7:
            lengths.append(64 * rng.randint(1, 4) + rng.choice([-1, 0, 1]))
        else:
            lengths.append(rng.randint(65, max(66, total // 2)))
    return lengths if any(lengths) else lengths + [1]


def make_config(family: str, index: int, seed: int, split: bool, extreme: bool, custom_scale: bool = True) -> dict:
    """The configuration of sweep entry (family, index): plain data, kept in the JSON of a failure. custom_scale
    False keeps the default scale where one is drawn (the same draws otherwise): the Hopper state passes take the
    scale as a compile-time constant, so each new one compiles them (seconds a configuration)."""
    rng = random.Random(zlib.crc32(f"{seed}:{family}:{index}".encode()))
    _, gate, delta = FAMILIES[family]
    H = rng.choice([1, 1, 2, 4])
    G = rng.choice([1, 1, 2, 3, 4])
    sizes = [64, 128] if gate == "channel" else [64, 128, 128, 256]
    K = rng.choice(sizes)
    V = K if rng.random() < 0.9 else rng.choice([k for k in (64, 128) if k != K] or [32])
    total = rng.choice([64, 200, 700, 1500])
    if K == 256:
        total = min(total, 700)
    varlen = split or rng.random() < 0.7
    cfg = dict(family=family, index=index, dtype=rng.choice(list(DTYPES)), H=H, G=G, K=K, V=V,
               varlen=varlen, initial_state=rng.random() < 0.6, scale=None if rng.random() < 0.7 else
               rng.choice([0.05, 0.3, 1.0]), l2norm=delta and rng.random() < 0.3,
               nan_probe=index % 10 == 0, split=rng.choice([1, 2, 4]) if split else None, seed=rng.getrandbits(31))
    if not custom_scale:
        cfg["scale"] = None
    if varlen:
        cfg["lengths"] = draw_lengths(rng, total)
    else:
        cfg["B"], cfg["T"] = rng.randint(1, 3), rng.randint(1, total)
    HV = H * G
    if gate != "none":
        regimes = ["zero", "mild", "ordinary", "strong"]
        cfg["regimes"] = [rng.choice(regimes) for _ in range(HV)]
        cfg["extreme"] = ([(rng.random(), rng.choice(EXTREME)) for _ in range(rng.randint(1, 3))]
                          if gate == "scalar" and extreme and rng.random() < 0.25 else [])
    # FLA's in-kernel gate (GDN's softplus form, KDA's bounded sigmoid form) on a raw input, instead of the regimes
    cfg["in_kernel_gate"] = delta and gate != "none" and rng.random() < 0.3
    return cfg


def make_inputs(cfg: dict) -> dict:
    """The inputs of a configuration on the host: q/k/v in its dtype, gates and beta fp32, state fp32."""
    gen = torch.Generator().manual_seed(cfg["seed"])
    _, gate, delta = FAMILIES[cfg["family"]]
    H, HV, K, V = cfg["H"], cfg["H"] * cfg["G"], cfg["K"], cfg["V"]
    if cfg["varlen"]:
        B, T = 1, sum(cfg["lengths"])
        cu = torch.tensor([0, *torch.tensor(cfg["lengths"]).cumsum(0).tolist()], dtype=torch.int32)
        N = len(cfg["lengths"])
    else:
        B, T, cu, N = cfg["B"], cfg["T"], None, cfg["B"]
    dtype = DTYPES[cfg["dtype"]]
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    if not cfg["l2norm"]:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    x = dict(q=q.to(dtype), k=k.to(dtype), v=torch.randn(B, T, HV, V, generator=gen).to(dtype), g=None, beta=None,
             initial_state=torch.randn(N, HV, K, V, generator=gen) * 0.1 if cfg["initial_state"] else None,
             cu_seqlens=cu)
    if delta:
        x["beta"] = torch.randn(B, T, HV, generator=gen).sigmoid()
    if gate != "none":
        shape = (B, T, HV) if gate == "scalar" else (B, T, HV, K)
        z = torch.randn(*shape, generator=gen)
        g = torch.empty(shape)
        for h, regime in enumerate(cfg["regimes"]):
            g[:, :, h] = {"zero": torch.zeros_like(z[:, :, h]), "mild": F.logsigmoid(z[:, :, h]) / 16,
                          "ordinary": F.logsigmoid(z[:, :, h]),
                          "strong": (F.logsigmoid(z[:, :, h] - 4) * 4).clamp(min=-5.0)}[regime]
        for where, value in cfg.get("extreme", []):
            g.view(B * T, HV)[int(where * B * T)] = value
        x["g"] = g
    if cfg.get("in_kernel_gate"):  # the op reads the raw input; the reference the float64 gate formed from it
        raw = (torch.randn(*x["g"].shape, generator=gen) * 3).to(dtype)
        A_log = torch.empty(HV).uniform_(1, 16, generator=gen).log()
        dt_bias = torch.randn(x["g"][0, 0].numel(), generator=gen) - 3  # [HV] or [HV * K]
        lower = -5.0 if gate == "channel" else None
        x["gate_input"] = dict(g=raw, A_log=A_log, dt_bias=dt_bias, lower_bound=lower)
        a, x_b = A_log.double().exp().view(HV, *(1,) * (len(shape) - 3)), raw.double() + dt_bias.double().view(
            shape[2:])  # FLA's formulas in float64, apart from ours (tilela._gates)
        x["g"] = -a * F.softplus(x_b) if lower is None else lower * torch.sigmoid(a * x_b)
    return x


def reference_outputs(cfg: dict, x: dict):
    _, _, delta = FAMILIES[cfg["family"]]
    q, k = x["q"], x["k"]
    if cfg["l2norm"]:
        q, k = F.normalize(q.double(), dim=-1), F.normalize(k.double(), dim=-1)
    return reference.chunked(q, k, x["v"], g=x["g"], beta=x["beta"] if delta else None, scale=cfg["scale"],
                             initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])


def call(cfg: dict, x: dict, device: str):
    op, gate, delta = FAMILIES[cfg["family"]]
    dev = {n: None if t is None else t.to(device) for n, t in x.items() if n != "gate_input"}
    if "gate_input" in x:
        gate_input = x["gate_input"]
        dev["g"] = gate_input["g"].to(device)
    args = [dev["q"], dev["k"], dev["v"]] + ([dev["g"]] if gate != "none" else []) + ([dev["beta"]] if delta else [])
    kw = dict(cu_seqlens=dev["cu_seqlens"], cu_seqlens_cpu=x["cu_seqlens"]) if cfg["varlen"] else {}
    if delta:
        kw["use_qk_l2norm_in_kernel"] = cfg["l2norm"]
    if op == "chunk_kda":  # its gates keep the kernels' contract (no channel decays past e^-80 within 16 tokens)
        kw["safe_gate"] = True
    if op == "chunk_linear_attn":  # the recurrence the reference computes: no FLA normaliser
        kw["normalize"] = False
    if "gate_input" in x:
        kw.update(use_gate_in_kernel=True, A_log=gate_input["A_log"].to(device),
                  dt_bias=gate_input["dt_bias"].to(device))
        if gate_input["lower_bound"] is not None:
            kw["lower_bound"] = gate_input["lower_bound"]
    return getattr(tilela, op)(*args, scale=cfg["scale"], initial_state=dev["initial_state"],
                               output_final_state=True, **kw)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN included, which torch.equal never finds equal)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


def nan_probe(cfg: dict, x: dict, device: str, clean) -> str | None:
    """NaN into k at one token t of the longest sequence, on q/k head 0: outputs outside that sequence or outside
    value heads 0 .. G - 1, and those before t, must equal the clean run's (on CUDA those before the start of t's
    64-token chunk: the Hopper kernels' chunk form may carry it back within its chunk, docs/exactness.md); None or
    what leaked."""
    G = cfg["G"]
    bounds = ([(b * x["q"].shape[1], (b + 1) * x["q"].shape[1]) for b in range(x["q"].shape[0])] if not cfg["varlen"]
              else list(zip(x["cu_seqlens"][:-1].tolist(), x["cu_seqlens"][1:].tolist())))
    n = max(range(len(bounds)), key=lambda i: bounds[i][1] - bounds[i][0])
    bos, eos = bounds[n]
    t = (bos + eos) // 2
    bad = {**x, "k": x["k"].clone()}
    bad["k"].view(-1, *x["k"].shape[2:])[t, 0] = float("nan")
    o, S = call(cfg, bad, device)
    o, o_clean = o.reshape(-1, *o.shape[2:]).cpu(), clean[0].reshape(-1, *o.shape[2:]).cpu()
    first = bos + (t - bos) // 64 * 64 if device == "cuda" else t
    reach = torch.zeros(o.shape[:2], dtype=torch.bool)
    reach[first:eos, :G] = True
    if not same_bits(o[~reach], o_clean[~reach]):
        return f"outputs outside sequence {n} tokens {first}..{eos - 1} heads 0..{G - 1} changed"
    others = torch.ones(S.shape[:2], dtype=torch.bool)
    others[n, :G] = False
    if not same_bits(S[others].cpu(), clean[1][others].cpu()):
        return "final states of other sequences or heads changed"
    return None


def describe(cfg: dict) -> str:
    layout = f"varlen {tuple(cfg['lengths'])}" if cfg["varlen"] else f"dense B{cfg['B']} T{cfg['T']}"
    parts = [cfg["dtype"], f"K{cfg['K']} V{cfg['V']}", f"H{cfg['H']} G{cfg['G']}", layout]
    if cfg.get("in_kernel_gate"):
        parts.append("in-kernel gate")
    elif cfg.get("regimes"):
        parts.append("gates " + ",".join(sorted(set(cfg["regimes"]))))
    if cfg.get("extreme"):
        parts.append("extreme " + ",".join(str(v) for _, v in cfg["extreme"]))
    parts += [name for name in ("initial_state", "l2norm") if cfg[name]]
    if cfg["scale"] is not None:
        parts.append(f"scale {cfg['scale']}")
    return " ".join(parts)


def run_on_device(cfg: dict, device: str, spy) -> dict:
    """The op on --device: its outputs on the host, whether it was split, and the failures found without the
    reference (a rerun that differs, a NaN that leaks)."""
    x = make_inputs(cfg)
    with spy(cfg["split"]) as plans:
        o, S = call(cfg, x, device)
        o2, S2 = call(cfg, x, device)
        probe = nan_probe(cfg, x, device, (o, S)) if cfg["nan_probe"] else None
    failures = []
    if not (same_bits(o, o2) and same_bits(S, S2)):
        failures.append(dict(kind="nondeterministic", detail="a rerun on the same inputs differs"))
    if probe is not None:
        failures.append(dict(kind="nan_leak", detail=probe))
    return dict(o=o.cpu(), S=S.cpu(), plans=plans, failures=failures)


def check_reference(cfg: dict, o: torch.Tensor, S: torch.Tensor, tol: float) -> tuple[list[dict], dict]:
    """(failures, stats) of the outputs against the float64 reference (runs in a worker process)."""
    start = time.time()
    ref_o, ref_S = reference_outputs(cfg, make_inputs(cfg))
    err_o, err_S = rel_l2(o, ref_o), rel_l2(S, ref_S)
    failures = []
    if not (torch.isfinite(o).all() and torch.isfinite(S).all()):
        failures.append(dict(kind="non_finite", detail=f"o finite {bool(torch.isfinite(o).all())}, "
                                                       f"S finite {bool(torch.isfinite(S).all())}"))
    elif not (err_o < tol and err_S < tol):
        failures.append(dict(kind="error", detail=f"rel L2 o {err_o:.2e} S {err_S:.2e} (tol {tol})"))
    return failures, dict(err_o=err_o, err_S=err_S, reference_s=time.time() - start)


def run_config(cfg: dict, device: str, tol: float, spy) -> tuple[list[dict], dict]:
    """(failures, stats) of one configuration, in this process."""
    result = run_on_device(cfg, device, spy)
    failures, stats = check_reference(cfg, result["o"], result["S"], tol)
    return label(cfg, result, failures), dict(stats, split=any(p is not None for p in result["plans"]))


def label(cfg: dict, result: dict, failures: list[dict]) -> list[dict]:
    """The device's and the reference's failures of a configuration, with what identifies it."""
    out = result["failures"] + failures
    for f in out:
        f.update(family=cfg["family"], index=cfg["index"], config=cfg, plans=result["plans"])
    return out


def summary_table(stats: dict[str, list[dict]], failures: list[dict], seconds: dict[str, float]) -> str:
    rows = ["| family | configs | failed | max rel L2 o | max rel L2 S | split | op s | reference s |",
            "|---|---|---|---|---|---|---|---|"]
    for family, entries in stats.items():
        failed = len({f["index"] for f in failures if f["family"] == family})
        finite = [e for e in entries if math.isfinite(e["err_o"]) and math.isfinite(e["err_S"])]
        rows.append(f"| {family} | {len(entries)} | {failed} | "
                    f"{max((e['err_o'] for e in finite), default=float('nan')):.2e} | "
                    f"{max((e['err_S'] for e in finite), default=float('nan')):.2e} | "
                    f"{sum(e['split'] for e in entries)} | {seconds[family]:.0f} | "
                    f"{sum(e.get('reference_s', 0.0) for e in entries):.0f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--configs", type=int, default=200, help="configurations per family")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=480.0)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--split", action="store_true", help="force the sequence split wherever it can run")
    parser.add_argument("--no-extreme", dest="extreme", action="store_false",
                        help="no gates whose exp underflows")
    parser.add_argument("--tol", type=float, default=1e-2)
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the failures")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="processes for the float64 reference (0: in this process)")
    parser.add_argument("--repro", default=None, metavar="FAMILY:INDEX", help="run one configuration, verbosely")
    args = parser.parse_args(argv)
    families = args.families.split(",")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"--families: unknown {unknown}; choose from {list(FAMILIES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible (use --device cpu for the PyTorch path)")
    spy = internals(args.device)
    if args.repro:
        family, index = args.repro.split(":")
        cfg = make_config(family, int(index), args.seed, args.split, args.extreme, args.device != "cuda")
        print(json.dumps(cfg))
        failures, stats = run_config(cfg, args.device, args.tol, spy)
        print(describe(cfg), stats, *(f"{f['kind']}: {f['detail']}" for f in failures), sep="\n")
        return int(bool(failures))

    start = time.time()
    stats = {f: [] for f in families}
    seconds = {f: 0.0 for f in families}
    failures = []

    def record(cfg, result, checked):
        """Fold one configuration's outcome into the totals; checked: the reference check's future or None."""
        try:
            found, entry = checked.result() if checked is not None else ([], dict(err_o=math.nan, err_S=math.nan))
        except Exception as error:  # the reference itself failed
            found, entry = [dict(kind="exception", detail=f"reference: {error!r}"[:500])], dict(err_o=math.nan,
                                                                                                  err_S=math.nan)
        found = label(cfg, result, found)
        stats[cfg["family"]].append(dict(entry, split=any(p is not None for p in result["plans"])))
        for f in found:
            print(f"FAIL {cfg['family']}#{cfg['index']} {f['kind']}: {f['detail']} [{describe(cfg)}]", flush=True)
        failures.extend(found)

    # the op runs here, the float64 reference (the slow part) in worker processes, --workers of them
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(args.workers, mp_context=context, initializer=torch.set_num_threads, initargs=(1,)) \
        if args.workers else None
    pending = collections.deque()
    for index in range(args.configs):
        if time.time() - start > args.max_seconds:
            print(f"stopped at the time limit ({args.max_seconds:.0f} s) before configuration {index}")
            break
        for family in families:
            cfg = make_config(family, index, args.seed, args.split, args.extreme, args.device != "cuda")
            t0 = time.time()
            try:
                result = run_on_device(cfg, args.device, spy)
            except Exception as error:  # a crash is a failure of its configuration; the sweep goes on
                result = dict(plans=[], failures=[dict(kind="exception", detail=repr(error)[:500])])
            seconds[family] += time.time() - t0
            if "o" not in result:
                record(cfg, result, None)
                continue
            if pool is None:
                checked = Future()
                checked.set_result(check_reference(cfg, result.pop("o"), result.pop("S"), args.tol))
            else:
                checked = pool.submit(check_reference, cfg, result.pop("o"), result.pop("S"), args.tol)
            pending.append((cfg, result, checked))
            while len(pending) > 2 * max(args.workers, 1):
                record(*pending.popleft())
    while pending:
        record(*pending.popleft())
    if pool is not None:
        pool.shutdown()
    print(summary_table(stats, failures, seconds))
    split = "forced" if args.split else "auto"
    print(f"{sum(len(s) for s in stats.values())} configurations, {len(failures)} failures, "
          f"{time.time() - start:.0f} s, seed {args.seed}, device {args.device}, split {split}")
    if args.out is not None:
        args.out.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, failures=failures),
                                       indent=1, default=str))
    return int(bool(failures))


if __name__ == "__main__":
    sys.exit(main())
