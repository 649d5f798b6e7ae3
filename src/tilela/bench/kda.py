"""KDA forward benchmark: chunk_kda, ours against FLA's chunk_kda (Triton, FLA_FLASH_KDA=0) on identical inputs.

Inputs as Kimi Linear's layer feeds the op: l2-normalised bf16 q/k, bf16 v, sigmoid beta, the raw bf16 gate input
[B, T, HV, K] with the gate computed in the op (use_gate_in_kernel=True, A_log [HV] and dt_bias [HV * K] in
float32), float32 initial state, final state out. Two gate forms (FLA's two):
  softplus  g = -exp(A_log) softplus(g_raw + dt_bias)
  bounded   g = lower_bound sigmoid(exp(A_log) (g_raw + dt_bias)), safe_gate=True, lower_bound = -5
with g_raw normal, A_log = log(uniform(1, 16)) and dt_bias = softplus^-1(dt), dt log-uniform in [0.001, 0.1]
(the initialisation of FLA's KDA layer): a mean log gate of about -0.27 per token, down to about -30 on one token.
Implementations (given cu_seqlens and its host copy where varlen):
  tilela       tilela.chunk_kda (the Hopper kernels, both forms)
  tilela_loop  the bounded form through our pipeline on the single-warp-group pass (plan kernel="loop", whose
               scores are exact only while no channel decays by more than e^-80 within 16 tokens)
  tilela_c16   the bounded form through the short-chunk path (plan chunk=16: the cumsum, kkt_solve's Neumann
               inverse and the loop pass at chunk 16; the same exactness bound): beside tilela_loop, the chunk's
               effect alone
  tilela_dv16, tilela_dv32, tilela_dv64
               our pipeline with the warp-specialised pass's DV block fixed (each block it is built for,
               plan.dv_blocks; unsplit, unpipelined): with --profile, the chunk periods of plan.CHUNK_US["kda", ...]
  tilela_unsplit  our pipeline with the sequence split off (only the cases the op splits), to show what it gains
  tilela_unpipelined  our pipeline with the token-range pipeline off (only the cases the op pipelines), likewise; the
               op pipelines only in a CUDA graph's capture, so its eager column is unpipelined
  fla          fla.ops.kda.chunk_kda with FLA_FLASH_KDA=0 and FLA_FLASH_QLA=0 (Triton)
Cases (K = V = 128): HV in {8, 32, 64} (H = HV) x T in {8192, 32768}; varlen 1024x8 at h32; one 65536-token
sequence at h4/16 and at h4/4 (Kimi Linear's 32 heads sharded over 8 GPUs: the sequence split's case); FlashKDA's
published H200 cases, B = 1 and B = 2 at T = 8192, H = 64 (FlashKDA 1.209 and 1.627 ms there, FLA 0.5 1.810 and
3.576 ms); small calls, where a short chunk's shorter stages could pay: a serving-like batch of 40 sequences of
50-2000 tokens at h4/4, one 512-token sequence at h4/4 and h32/32.
Floor: q, k, v, the raw gate, beta read once, o written once, the state read and written once; FLOPs of the chunk
form per value head (K K^T and Q K^T with the gate folded in, A R, K S, Q S, P Vnew and K^T Vnew per chunk).
"""

import functools
import math

import torch
import torch.nn.functional as F

from tilela import reference

from . import Bench, Case, _try_import, hopper_plan
from .gdn import _boundaries, _serving_mix

DIM = 128
CHUNK = 64
LOWER_BOUND = -5.0
GRID = [((hv, hv), f"1x{T}", (T,), 1) for hv in (8, 32, 64) for T in (8192, 32768)]
EXTRA = [((32, 32), "1024x8", (1024,) * 8, 1), ((4, 16), "1x65536", (65536,), 1),
         ((64, 64), "2x8192", (8192,), 2), ((4, 4), "1x65536", (65536,), 1),
         ((4, 4), "serving40", _serving_mix(), 1), ((4, 4), "1x512", (512,), 1), ((32, 32), "1x512", (512,), 1)]
QUICK = ["1x8192_h64-64", "2x8192_h64-64", "1024x8_h32-32", "1x65536_h4-16"]
DV_BLOCKS = (16, 32, 64)  # plan.dv_blocks(DIM, "channel", True)


def _case(heads, layout, lengths, B, gate):
    h_qk, h_v = heads
    return Case(f"{layout}_h{h_qk}-{h_v}_{gate}",
                dict(lengths=lengths, B=B, varlen=len(lengths) > 1, H=h_qk, HV=h_v, K=DIM, V=DIM, gate=gate))


def cases(quick):
    layouts = [(h, lay, lengths, B) for h, lay, lengths, B in GRID + EXTRA
               if not quick or f"{lay}_h{h[0]}-{h[1]}" in QUICK]
    return [_case(*layout, gate) for layout in layouts for gate in ("softplus", "bounded")]


def make_inputs(case, seed):
    p = case.params
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, T, H, HV, K, V = p["B"], sum(p["lengths"]), p["H"], p["HV"], p["K"], p["V"]
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    q = F.normalize(randn(B, T, H, K), dim=-1).to(torch.bfloat16)
    k = F.normalize(randn(B, T, H, K), dim=-1).to(torch.bfloat16)
    v = randn(B, T, HV, V).to(torch.bfloat16)
    g = randn(B, T, HV, K).to(torch.bfloat16)
    A_log = torch.empty(HV, device="cuda").uniform_(1, 16, generator=gen).log()
    dt = torch.empty(HV * K, device="cuda").uniform_(math.log(1e-3), math.log(0.1), generator=gen).exp()
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    beta = randn(B, T, HV).sigmoid()
    h0 = randn(B * len(p["lengths"]), HV, K, V) * 0.1
    x = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0)
    if p["varlen"]:
        x.update(_boundaries(tuple(p["lengths"])))
    return x


def _gate_options(case):
    bounded = case.params["gate"] == "bounded"
    return dict(use_gate_in_kernel=True, safe_gate=bounded, lower_bound=LOWER_BOUND if bounded else None)


def _ours(case, x):
    import tilela

    o, _ = tilela.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                            output_final_state=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
                            cu_seqlens=x.get("cu_seqlens"), cu_seqlens_cpu=x.get("cu_seqlens_cpu"),
                            **_gate_options(case))
    return o


def _ours_plan(case, x, only=None, **options):
    """The case's gate form through the plan's stages with make_plan's options (kernel="loop": the gate formed in
    the cumsum stage, the single-warp-group pass, None for the softplus form, past its exactness bound; chunk=16
    there: the short-chunk path; block_DV:
    the warp-specialised pass's DV block; split=None, pipeline=None: the split, the token-range pipeline off).
    only ("split" or "pipeline"): None where the op's own plan in a graph's capture has none."""
    from tilela.kernels import hopper
    from tilela.ops import in_kernel_gate

    p = case.params
    bounded = p["gate"] == "bounded"
    if not bounded and options.get("kernel") == "loop":
        return None
    gate_in = in_kernel_gate(x["g"], x["A_log"], x["dt_bias"], LOWER_BOUND if bounded else None)
    lengths = list(p["lengths"]) * p["B"]
    if only and getattr(hopper_plan(x, lengths, p["K"], "channel", gate_form=gate_in.form, graph=True), only) is None:
        return None
    plan = hopper_plan(x, lengths, p["K"], "channel", gate_form=gate_in.form, **options)
    o, _ = hopper.forward(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], x.get("cu_seqlens"),
                          gate_params=gate_in.params, gate_scale=gate_in.lower_bound)
    return o


def _fla(case, x):
    fla = _try_import("fla.ops.kda")
    if fla is None:
        return None
    o, _ = fla.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                         output_final_state=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
                         cu_seqlens=x.get("cu_seqlens_long"), cu_seqlens_cpu=x.get("cu_seqlens_cpu_long"),
                         **_gate_options(case))
    return o


def _reference(case, x):
    """The float64 token-level maths: the gate from its raw input (FLA's formulas), then reference.chunked."""
    HV, K = case.params["HV"], case.params["K"]
    raw = x["g"].double() + x["dt_bias"].double().view(HV, K)
    a = x["A_log"].double().exp().view(HV, 1)
    g = LOWER_BOUND * torch.sigmoid(a * raw) if case.params["gate"] == "bounded" else -a * F.softplus(raw)
    o, _ = reference.chunked(x["q"], x["k"], x["v"], g=g, beta=x["beta"], initial_state=x["initial_state"],
                             cu_seqlens=x.get("cu_seqlens_cpu"))
    return o


def cost(case):
    p = case.params
    H, HV, K, V, C = p["H"], p["HV"], p["K"], p["V"], CHUNK
    B, T, N = p["B"], sum(p["lengths"]), p["B"] * len(p["lengths"])
    n_chunks = p["B"] * sum(-(-L // C) for L in p["lengths"])
    nbytes = B * T * (2 * H * K * 2 + 2 * HV * V * 2 + HV * K * 2 + HV * 4) + 2 * N * HV * K * V * 4
    per_chunk = 2 * C * K * V * 3 + 2 * C * C * (2 * V + 2 * K)
    return {"bytes": nbytes, "flops": n_chunks * HV * per_chunk}


BENCH = Bench(
    op="kda",
    cases=cases,
    check_cases=[_case((2, 2), "1x2048", (2048,), 1, "softplus"),
                 _case((2, 4), "300+1+77+64", (300, 1, 77, 64), 1, "bounded")],
    make_inputs=make_inputs,
    impls={"tilela": _ours, "tilela_loop": functools.partial(_ours_plan, kernel="loop"),
           "tilela_c16": functools.partial(_ours_plan, kernel="loop", chunk=16),
           **{f"tilela_dv{block}": functools.partial(_ours_plan, block_DV=block, split=None, pipeline=None)
              for block in DV_BLOCKS},
           "tilela_unsplit": functools.partial(_ours_plan, split=None, only="split"),
           "tilela_unpipelined": functools.partial(_ours_plan, pipeline=None, only="pipeline"),
           "fla": _fla},
    reference=_reference,
    cost=cost,
)
