"""Every shipped Hopper kernel family once on small varlen inputs, for compute-sanitizer (benchmarks/sanitize.sh).

    python benchmarks/sanitize_driver.py [--only cumsum,kkt,factors,ws,loop,split,public] [--match kda,gla]
                                         [--dtypes bf16,fp16] [--list]

Inputs: sequences of (1, 63, 64, 65, 130, 1, 7) tokens (one-token and non-multiple-of-64 ones, a 64-token boundary
and a sequence of three chunks), 2 q/k heads and 4 value heads (GVA 2; 2 value heads where a kernel has a separate
GVA-1 variant), an initial state, the final state stored. Families:
  cumsum  chunk_local_cumsum at every chunk size and gate dtype (public op), and the cumsum stage's in-kernel gate
          forms (through the launcher);
  kkt     kkt_solve at every chunk size, inverse, dtype, gate kind and value-head pairing (public op; the
          per-channel gate through the launcher);
  factors gla_factors at every shipped configuration (through the launcher: K, dtype, gc or the raw gate of each
          form and dtype, with and without the delta rule's Kg and A diag(beta));
  ws      the warp-specialised state/output pass at every DV block of every configuration it covers (levels 1-4 and
          GDN at K = 64 and 128; gla through gla_factors, summing the raw gate itself and from a given cumsum);
  loop    the single-warp-group pass for every level and KDA at K = 64 and 128, and the levels without a per-channel
          gate at K = 256;
  split   the sequence split (transitions, combine, outputs) in segments of 1 and 2 chunks for levels 1, 2, 4 and
          GDN, with and without an initial state (the plain update's combine kernel in both variants);
  public  every public op end to end (its dispatch), once per dtype.
Each call's outputs are checked against the float64 reference, so a run without the sanitizer is a quick
correctness check too: one line per call, exit status 1 on a mismatch or an exception.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import tilela
from tilela import reference
from tilela._gates import apply_gate
from tilela.bench import rel_l2

LENGTHS = (1, 63, 64, 65, 130, 1, 7)
H = 2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LEVELS = {  # level: (gate kind, delta rule)
    "linear_attn": ("none", False), "simple_gla": ("scalar", False), "gla": ("channel", False),
    "delta_rule": ("none", True), "gdn": ("scalar", True), "kda": ("channel", True),
}
TOL = 2e-2


def entry_points():
    """The Hopper backend's internal entry points this driver calls, all here so they are repointed in one place:
    the state/output pass as chunk_forward(q, k, v, g_cumsum, beta, A, scale, h0, output_final_state, cu_seqlens, *,
    kernel, block_DV, segments, g_is_cumsum) over hopper.plan_call / hopper.forward, the DV blocks and coverage of
    the warp-specialised pass, the segment plan of the sequence split, the kkt_solve launcher (the public op takes no
    per-channel gate, nor a raw gate to sum), the gla_factors launcher and the shipped cumsum / kkt / gla_factors
    configuration lists."""
    from tilela.kernels import hopper
    from tilela.kernels.hopper import launch, plan

    def chunk_forward(q, k, v, g, beta, A, scale, h0, output_final_state, cu, *, kernel="auto", block_DV=None,
                      segments=None, g_is_cumsum=True):
        gate = "none" if g is None else ("scalar" if g.dim() == 3 else "channel")
        bounds = cu.tolist()
        lengths = [e - s for s, e in zip(bounds, bounds[1:])]
        the_plan = hopper.plan_call(q, v, g, beta, scale, gate=gate, lengths=lengths,
                                    initial_state=h0 is not None, output_final_state=output_final_state, varlen=True,
                                    g_input="cumsum" if g_is_cumsum else "raw", kernel=kernel, block_DV=block_DV,
                                    split=segments)
        # the given A where the plan takes kkt_solve's A on gc (the loop pass); the warp-specialised pass's plan
        # launches kkt_solve for its Ab = A diag(beta) itself
        given = the_plan.kkt and g_is_cumsum and not the_plan.kkt[6]
        return hopper.forward(the_plan, q, k, v, g, beta, h0, cu, A=A if given else None)

    def cumsum_in_kernel_gate(key, raw, params, lower_bound, cu):
        return launch.launch_cumsum(key, raw, launch.Schedule.of(raw, cu), lower_bound, params)

    def kkt_solve(k, beta, g, chunk, cu, method="blocked", gate_in=None, params=None, scaled=False):
        """A of the kkt_solve launch on g: gc (scalar [.., HV] or per channel [.., HV, K]), or with gate_in (g dtype,
        form) GDN's raw scalar gate, which the kernel sums in its tiles (params: A_log and dt_bias stacked, None for
        the log form); scaled: Ab = A diag(beta), the warp-specialised pass's operand."""
        gate = "none" if g is None else ("scalar" if g.dim() == 3 else "channel")
        lengths = [k.shape[1]] * k.shape[0] if cu is None else cu.diff().tolist()
        key, steps = plan.kkt_plan(chunk, method, hopper.DTYPE_NAMES[k.dtype], gate, k.shape[2], beta.shape[2],
                                   lengths, hopper.multiprocessors(k.device), gate_in, scaled)
        return launch.launch_kkt(key, k, beta, g, launch.Schedule.of(k, cu), steps, None, params)[0]

    def factors(key, q, k, g, beta, scale, cu, params=None, lower=None):
        """(Qg, Ab = A diag(beta) or None) of gla_factors' configuration key on g (gc, or the raw gate of key's
        gate_in)."""
        Qg, _, _, _, A, _ = launch.launch_factors(key, q, k, g, beta, scale, launch.Schedule.of(q, cu), params, lower)
        return Qg, A

    return SimpleNamespace(
        chunk_forward=chunk_forward,
        dv_blocks=plan.dv_blocks,
        covers=lambda K, gate, delta, dtype: plan.covers(hopper.DTYPE_NAMES[dtype], K, K, gate, delta),
        ws_covers=lambda K, gate, delta, dtype: plan.ws_covers(hopper.DTYPE_NAMES[dtype], K, K, gate, delta),
        segment_plan=plan.SegmentPlan.of,
        kkt_solve=kkt_solve,
        factors=factors,
        factors_configs=hopper.GLA_FACTORS_CONFIGS,  # (K, dtype name, gate_in, delta rule)
        cumsum_in_kernel_gate=cumsum_in_kernel_gate,
        cumsum_configs=hopper.CUMSUM_CONFIGS,  # (chunk, g dtype name, gate form)
        kkt_configs=hopper.KKT_CONFIGS,  # (chunk, method, dtype name, gate, value heads per pass, gate_in, scaled)
    )


def make_inputs(K: int, dtype: torch.dtype, G: int = 2, seed: int = 0) -> dict:
    """Host inputs: q/k unit-norm in dtype, v in dtype, scalar and per-channel log gates (fp32, within the Hopper
    per-channel contract), beta, an fp32 initial state, cu_seqlens (int32)."""
    gen = torch.Generator().manual_seed(seed)
    T, HV = sum(LENGTHS), H * G
    return dict(
        q=F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1).to(dtype),
        k=F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1).to(dtype),
        v=torch.randn(1, T, HV, K, generator=gen).to(dtype),
        g_scalar=F.logsigmoid(torch.randn(1, T, HV, generator=gen) + 2),
        g_channel=F.logsigmoid(torch.randn(1, T, HV, K, generator=gen) + 2) / 4,
        beta=torch.randn(1, T, HV, generator=gen).sigmoid(),
        h0=torch.randn(len(LENGTHS), HV, K, K, generator=gen) * 0.1,
        cu=torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32),
    )


def cuda(x: dict) -> dict:
    return {n: t.cuda() for n, t in x.items()}


def gate_of(x: dict, gate: str):
    return {"none": None, "scalar": x["g_scalar"], "channel": x["g_channel"]}[gate]


def state_pass_job(ep, level: str, K: int, dtype: torch.dtype, h0: bool = True, half_beta: bool = False, **kw):
    """A call of the state/output pass (gc and A from the public cumsum and the kkt launcher), checked against
    reference.chunked; half_beta: beta in q's dtype; kw goes to chunk_forward (kernel, block_DV, segments,
    g_is_cumsum)."""
    gate, delta = LEVELS[level]

    def run():
        x = make_inputs(K, dtype)
        if half_beta:
            x["beta"] = x["beta"].to(dtype)
        d = cuda(x)
        g = gate_of(d, gate)
        gc = None if g is None else tilela.chunk_local_cumsum(g, 64, d["cu"], cu_seqlens_cpu=x["cu"])
        A = None if not delta else ep.kkt_solve(d["k"], d["beta"], gc, 64, d["cu"])
        g_in = g if not kw.get("g_is_cumsum", True) else gc  # the raw gate: the pass's plan sums it
        o, S = ep.chunk_forward(d["q"], d["k"], d["v"], g_in, d["beta"] if delta else None, A, K ** -0.5,
                                d["h0"] if h0 else None, True, d["cu"], **kw)
        ref_o, ref_S = reference.chunked(x["q"], x["k"], x["v"], g=gate_of(x, gate),
                                         beta=x["beta"].float() if delta else None,
                                         initial_state=x["h0"] if h0 else None, cu_seqlens=x["cu"])
        return rel_l2(o, ref_o), rel_l2(S, ref_S)

    return run


def jobs(ep, dtypes: list[str]) -> list[tuple[str, str, object]]:
    """(family, name, call returning its relative errors) for every kernel configuration the driver runs."""
    out = []
    for C, g_dtype, form in ep.cumsum_configs:
        def cumsum(C=C, g_dtype=g_dtype, form=form):
            x = make_inputs(64, torch.bfloat16)
            if form == "log":  # the public op
                g = x["g_scalar"].to(getattr(torch, g_dtype))
                gc = tilela.chunk_local_cumsum(g.cuda(), C, x["cu"].cuda(), cu_seqlens_cpu=x["cu"])
                return (rel_l2(gc, reference.chunk_local_cumsum(g, C, x["cu"])),)
            raw = x["g_channel"].to(getattr(torch, g_dtype)) * 8  # FLA's in-kernel gate input, [B, T, HV, K]
            params = torch.stack((torch.full(raw.shape[2:], math.log(4.0)), torch.full(raw.shape[2:], -3.0)))
            lower = -5.0 if form == "sigmoid" else None
            gc = ep.cumsum_in_kernel_gate((C, g_dtype, form), raw.cuda(), params.cuda(), lower, x["cu"].cuda())
            return (rel_l2(gc, reference.chunk_local_cumsum(apply_gate(raw.double(), form, *params.double(), lower),
                                                            C, x["cu"])),)
        out.append(("cumsum", f"cumsum C{C} {g_dtype} {form}", cumsum))
    for C, method, dtype_name, gate, pair, gate_in, scaled in ep.kkt_configs:
        if {"bfloat16": "bf16", "float16": "fp16"}[dtype_name] not in dtypes:
            continue

        def kkt(C=C, method=method, dtype=getattr(torch, dtype_name), gate=gate, pair=pair, gate_in=gate_in,
                scaled=scaled):
            x = make_inputs(128, dtype, G=2 if pair == 2 else 1)
            g = gate_of(x, gate)
            d = cuda(x)
            if gate_in is not None:  # the raw scalar gate summed in the tile: the log gate or the softplus input
                form = gate_in[1]
                raw = (g if form == "log" else g * 8).to(getattr(torch, gate_in[0]))
                params = None if form == "log" else torch.stack((torch.full(raw.shape[2:], math.log(4.0)),
                                                                 torch.full(raw.shape[2:], -3.0)))
                A = ep.kkt_solve(d["k"], d["beta"], raw.cuda(), C, d["cu"], method, gate_in,
                                 None if params is None else params.cuda(), scaled)
                g = raw.double() if params is None else apply_gate(raw.double(), form, *params.double(), None)
                gc = reference.chunk_local_cumsum(g, C, x["cu"])
                return (rel_l2(A, reference.kkt_solve(x["k"], x["beta"], gc, C, x["cu"], beta_columns=scaled)),)
            gc = None if g is None else reference.chunk_local_cumsum(g, C, x["cu"])
            if gate == "channel" or scaled:  # the launcher: the public op takes neither
                A = ep.kkt_solve(d["k"], d["beta"], None if gc is None else gc.float().cuda(), C, d["cu"], method,
                                 scaled=scaled)
            else:
                A = tilela.kkt_solve(d["k"], d["beta"], None if gc is None else gc.float().cuda(), C, d["cu"],
                                     method=method, cu_seqlens_cpu=x["cu"])
            return (rel_l2(A, reference.kkt_solve(x["k"], x["beta"], gc, C, x["cu"], beta_columns=scaled)),)
        gate_name = gate if gate_in is None else f"{gate} raw {gate_in[0]} {gate_in[1]}"
        out.append(("kkt", f"kkt C{C} {method} {dtype_name} {gate_name} pair{pair}{' Ab' if scaled else ''}", kkt))
    for K, dtype_name, gate_in, delta in ep.factors_configs:
        if {"bfloat16": "bf16", "float16": "fp16"}[dtype_name] not in dtypes:
            continue

        def factors(K=K, dtype_name=dtype_name, gate_in=gate_in, delta=delta):
            x = make_inputs(K, getattr(torch, dtype_name))
            g, params, lower = x["g_channel"], None, None
            raw = g
            if gate_in is not None:  # the raw gate summed in the tile: the log gate, or an in-kernel form's input
                form = gate_in[1]
                raw = (g if form == "log" else g * 8).to(getattr(torch, gate_in[0]))
                # the softplus form about -40 per token: every channel wild (gla_factors' term-by-term scores)
                a, b = (16.0, 3.0) if form == "softplus" else (4.0, -3.0)
                params = (torch.full((raw.shape[2], 1), math.log(a)), torch.full(raw.shape[2:], b))
                lower = -5.0 if form == "sigmoid" else None
                g = apply_gate(raw.double(), form, *(p.double() for p in params), lower)
            gc = reference.chunk_local_cumsum(g, 64, x["cu"])
            d = cuda(x)
            g_dev = (gc.float() if gate_in is None else raw).cuda()
            Qg, A = ep.factors((K, dtype_name, gate_in, delta), d["q"], d["k"], g_dev, d["beta"] if delta else None,
                               K ** -0.5, d["cu"], None if params is None else tuple(p.cuda() for p in params), lower)
            G = x["v"].shape[2] // H
            # Qg against the float64 value rounded to its dtype: fp16 flushes the wild gates' factors as it must
            Qg_ref = (x["q"].double().repeat_interleave(G, dim=2) * gc.exp()).to(Qg.dtype).double()
            errors = (rel_l2(Qg, Qg_ref),)
            if delta:
                errors += (rel_l2(A, reference.kkt_solve(x["k"], x["beta"], gc, 64, x["cu"], beta_columns=True)),)
            return errors
        out.append(("factors", f"factors K{K} {dtype_name} gate_in {gate_in} delta {delta}", factors))
    for name in dtypes:
        dtype = DTYPES[name]
        for level, (gate, delta) in LEVELS.items():
            for K in (64, 128):
                if ep.ws_covers(K, gate, delta, dtype):
                    for i, block in enumerate(ep.dv_blocks(K, gate, delta)):
                        kw, variant = dict(kernel="ws", block_DV=block), ""
                        if gate == "channel":  # gla_factors summing the raw gate, and from a given cumsum
                            kw["g_is_cumsum"] = i % 2 == 1
                            variant = f" g_is_cumsum={kw['g_is_cumsum']}"
                        if level == "gdn":  # beta in fp32 and in q's dtype
                            kw["half_beta"] = i % 2 == 1
                            variant = f" half_beta={kw['half_beta']}"
                        out.append(("ws", f"ws {level} K{K} {name} DV{block}{variant}",
                                    state_pass_job(ep, level, K, dtype, **kw)))
            for K in (64, 128, 256):
                if ep.covers(K, gate, delta, dtype) and (gate == "channel" or K == 256 or level == "gdn"):
                    out.append(("loop", f"loop {level} K{K} {name}",
                                state_pass_job(ep, level, K, dtype, kernel="loop")))
            if gate != "channel":
                for K in (64, 128):
                    for segment_chunks, h0 in ((1, True), (2, False)):
                        plan = ep.segment_plan(LENGTHS, segment_chunks)
                        out.append(("split", f"split {level} K{K} {name} segments of {segment_chunks} h0={h0}",
                                    state_pass_job(ep, level, K, dtype, h0=h0, segments=plan)))
            out.append(("public", f"public {level} K128 {name}", public_job(level, dtype)))
            if level in ("gdn", "kda"):
                out.append(("public", f"public {level} K128 {name} in-kernel gate", public_job(level, dtype, True)))
    return out


def public_job(level: str, dtype: torch.dtype, in_kernel_gate: bool = False):
    """The level's public op end to end; in_kernel_gate: GDN's and KDA's use_gate_in_kernel (KDA's bounded form)
    on a raw gate input, the reference's gate from it in float64."""
    op = {"linear_attn": "chunk_linear_attn", "simple_gla": "chunk_simple_gla", "gla": "chunk_gla",
          "delta_rule": "chunk_delta_rule", "gdn": "chunk_gated_delta_rule", "kda": "chunk_kda"}[level]
    gate, delta = LEVELS[level]

    def run():
        x = make_inputs(128, dtype)
        g = gate_of(x, gate)
        options = {"normalize": False} if op == "chunk_linear_attn" else {}  # linear_attn: the reference's recurrence
        if in_kernel_gate:
            g = g * 8  # the gate's input, beyond [-5, 0)
            HV = g.shape[2]
            A_log, dt_bias = torch.full((HV,), 1.0), torch.full((g[0, 0].numel(),), -2.0)  # [HV], [HV (* K)]
            lower = -5.0 if op == "chunk_kda" else None
            options = dict(use_gate_in_kernel=True, A_log=A_log.cuda(), dt_bias=dt_bias.cuda(),
                           **({"lower_bound": lower} if lower else {}))
            g_ref = apply_gate(g.double(), *tilela.ops.in_kernel_gate(g.double(), A_log.double(), dt_bias.double(),
                                                                      lower))
        d = cuda(x)
        args = [d["q"], d["k"], d["v"]] + ([g.cuda()] if gate != "none" else [])
        args += [d["beta"]] if delta else []
        o, S = getattr(tilela, op)(*args, initial_state=d["h0"], output_final_state=True, cu_seqlens=d["cu"],
                                   cu_seqlens_cpu=x["cu"], **options)
        ref_o, ref_S = reference.chunked(x["q"], x["k"], x["v"], g=g_ref if in_kernel_gate else g,
                                         beta=x["beta"] if delta else None, initial_state=x["h0"],
                                         cu_seqlens=x["cu"])
        return rel_l2(o, ref_o), rel_l2(S, ref_S)

    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None,
                        help="comma-separated families (cumsum, kkt, factors, ws, loop, split, public)")
    parser.add_argument("--match", default=None,
                        help="comma-separated words; keep the calls whose name holds one of them (e.g. kda)")
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--list", action="store_true", help="print the calls and exit")
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    todo = [job for job in jobs(entry_points(), dtypes) if (args.only is None or job[0] in args.only.split(","))
            and (args.match is None or any(word in job[1].split() for word in args.match.split(",")))]
    if args.list:
        print("\n".join(name for _, name, _ in todo))
        return 0
    if not torch.cuda.is_available():
        parser.error("needs a Hopper GPU")
    bad = 0
    for family, name, run in todo:
        start = time.time()
        try:
            errors = run()
            torch.cuda.synchronize()
            ok = all(e < TOL for e in errors)
            line = " ".join(f"{e:.2e}" for e in errors)
        except Exception:
            ok, line = False, traceback.format_exc(limit=3).strip().replace("\n", " | ")
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {line} ({time.time() - start:.1f} s)", flush=True)
    print(f"{len(todo)} calls, {bad} failed")
    return int(bool(bad))


if __name__ == "__main__":
    sys.exit(main())
