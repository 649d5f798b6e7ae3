"""GDN forward benchmark: chunk_gated_delta_rule, ours against FLA and FlashQLA on identical inputs.

Inputs as FlashQLA's own benchmark: l2-normalised bf16 q/k, bf16 v, sigmoid beta and the log gate in
float32, float32 initial state, final state out. Two gate regimes, because FlashQLA's intra-card split
warms up until the decay has forgotten the past and so its speed depends on the gate values:
  mixed   g = logsigmoid(randn) / 16 with a quarter of the value heads at g = 0 (no decay)
  decay   g = logsigmoid(randn + 3) on every head
Implementations (all given cu_seqlens and, where they take it, its host copy):
  tilela      tilela.chunk_gated_delta_rule (TileLang kernels end to end; long sequences split across CTAs where
              kernels.hopper.plan.auto_split says so)
  tilela_unsplit  the same pipeline with the split off (only the cases the op splits), to show what it gains
  tilela_cumsum_first  the same pipeline with the gate summed by the chunk-local cumsum stage (its own launch)
              and kkt_solve reading gc, in place of kkt_solve summing the raw gate in its tiles
  tilela_unfolded  the same pipeline with the output group kept apart from the pass's two chain groups
              (make_plan's fold=False), where the op folds it into them (the unsplit pass at DV block 128, HV > H)
  fla         fla.ops.gated_delta_rule.chunk_gated_delta_rule with FLA_FLASH_QLA=0 (Triton)
  flash_qla   flash_qla.chunk_gated_delta_rule (TileLang)
Grid: head configs (h_qk/h_v) 2/8, 4/16, 8/24, 16/32, 16/64, 32/32 x layouts 1x32768, 1x8192, 1x2048,
28672+4096, 8192x4, 1024x8 (the last three varlen) x both gate regimes; K = V = 128. Beyond it (EXTRA): 1x65536 and
1x131072 at h2/8, h4/16, h16/32; one 16384-token sequence among 63 of 128 tokens; a serving-like batch of 40
sequences of 50-2000 tokens; a tiny 1x512 call. The model-call cases ("_l2norm", MODEL_CALL) give q and k as a
Qwen3-Next layer does, unnormalised, with use_qk_l2norm_in_kernel=True for every implementation.
Floor: q, k, v, g, beta read once, o written once, the state read and written once; FLOPs of the chunk
form (K K^T per q/k head; per value head K S, A R, Q S, Q K^T, P Vnew and K^T Vnew per chunk).
"""

import functools
import itertools

import torch
import torch.nn.functional as F

from tilela import reference

from . import Bench, Case, _try_import, hopper_plan, ours_variant

DIM = 128
CHUNK = 64
HEADS = ((2, 8), (4, 16), (8, 24), (16, 32), (16, 64), (32, 32))
LAYOUTS = {
    "1x32768": (32768,), "1x8192": (8192,), "1x2048": (2048,),
    "28672+4096": (28672, 4096), "8192x4": (8192,) * 4, "1024x8": (1024,) * 8,
}
QUICK = [((16, 32), "1x32768"), ((32, 32), "1x8192"), ((4, 16), "28672+4096"), ((16, 64), "1024x8")]


def _serving_mix(n=40, low=50, high=2000, seed=0):
    """A serving-like prefill batch: n sequences of lengths drawn uniformly from [low, high] (seeded, so every run
    times the same layout)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(int(x) for x in torch.randint(low, high + 1, (n,), generator=gen))


# layouts users hit beyond the grid, each at its own head configurations: long context on tensor-parallel shards,
# one long sequence among many short ones, a serving-like mix, a tiny call
EXTRA = [
    *((heads, "1x65536", (65536,)) for heads in ((2, 8), (4, 16), (16, 32))),
    *((heads, "1x131072", (131072,)) for heads in ((2, 8), (4, 16), (16, 32))),
    *((heads, "skew16384+63x128", (16384,) + (128,) * 63) for heads in ((4, 16), (16, 32))),
    *((heads, "serving40", _serving_mix()) for heads in ((4, 16), (16, 32))),
    *((heads, "1x512", (512,)) for heads in ((2, 8), (16, 32))),
]


# the op as a model layer calls it: q and k normalised inside the op (use_qk_l2norm_in_kernel)
MODEL_CALL = [((16, 64), "8192x4", LAYOUTS["8192x4"]), ((16, 32), "1x8192", LAYOUTS["1x8192"]),
              ((16, 32), "serving40", _serving_mix()), ((2, 8), "1x512", (512,))]


def _case(heads, layout, gate, lengths, l2norm=False):
    h_qk, h_v = heads
    return Case(f"{layout}_h{h_qk}-{h_v}_{gate}{'_l2norm' if l2norm else ''}",
                dict(lengths=lengths, varlen=len(lengths) > 1, H=h_qk, HV=h_v, K=DIM, V=DIM, gate=gate,
                     l2norm=l2norm))


def cases(quick):
    pairs = QUICK if quick else [(h, lay) for lay in LAYOUTS for h in HEADS]
    layouts = [(h, lay, LAYOUTS[lay]) for h, lay in pairs] + ([] if quick else EXTRA)
    return [_case(h, lay, gate, lengths) for h, lay, lengths in layouts for gate in ("mixed", "decay")] + (
        [] if quick else [_case(h, lay, "mixed", lengths, l2norm=True) for h, lay, lengths in MODEL_CALL])


def make_inputs(case, seed):
    p = case.params
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, H, HV, K, V = sum(p["lengths"]), p["H"], p["HV"], p["K"], p["V"]
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    unit = (lambda x: x) if p["l2norm"] else (lambda x: F.normalize(x, dim=-1))  # noqa: E731
    q = unit(randn(1, T, H, K)).to(torch.bfloat16)
    k = unit(randn(1, T, H, K)).to(torch.bfloat16)
    v = randn(1, T, HV, V).to(torch.bfloat16)
    if p["gate"] == "mixed":
        g = F.logsigmoid(randn(1, T, HV)) / 16
        g[:, :, : HV // 4] = 0.0
    else:
        g = F.logsigmoid(randn(1, T, HV) + 3)
    beta = randn(1, T, HV).sigmoid()
    h0 = randn(len(p["lengths"]), HV, K, V) * 0.1
    x = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
    if p["varlen"]:
        x.update(_boundaries(tuple(p["lengths"])))
    return x


@functools.lru_cache(maxsize=8)
def _boundaries(lengths):
    """cu_seqlens on the GPU and its pinned host copy, int32 (ours) and int64 (FLA's and FlashQLA's), one set per
    layout shared by every input set: FLA and FlashQLA cache tables per cu_seqlens tensor, and FLA copies the host
    one inside a CUDA graph capture, which needs it pinned."""
    out = {}
    for suffix, dtype in (("", torch.int32), ("_long", torch.int64)):
        cu_cpu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=dtype).pin_memory()
        out.update({f"cu_seqlens{suffix}": cu_cpu.cuda(), f"cu_seqlens_cpu{suffix}": cu_cpu})
    return out


def op_plan(case, sms: int = 132):
    """The plan the op makes for this case's inputs (hopper_plan on meta tensors of the bench's shapes and dtypes)
    on a GPU of `sms` SMs inside a CUDA graph's capture, without a GPU: what precompiling a case's kernels needs."""
    p = case.params
    T, N = sum(p["lengths"]), len(p["lengths"])
    meta = lambda *shape, dtype=torch.float32: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    x = dict(q=meta(1, T, p["H"], p["K"], dtype=torch.bfloat16), v=meta(1, T, p["HV"], p["V"], dtype=torch.bfloat16),
             g=meta(1, T, p["HV"]), beta=meta(1, T, p["HV"]), initial_state=meta(N, p["HV"], p["K"], p["V"]))
    if p["varlen"]:
        x["cu_seqlens"] = meta(N + 1, dtype=torch.int32)
    return hopper_plan(x, p["lengths"], p["K"], "scalar", sms=sms, graph=True)


def _ours(case, x):
    import tilela

    o, _ = tilela.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                         output_final_state=True, cu_seqlens=x.get("cu_seqlens"),
                                         cu_seqlens_cpu=x.get("cu_seqlens_cpu"),
                                         use_qk_l2norm_in_kernel=case.params["l2norm"])
    return o


def _ours_unsplit(case, x):
    """None on the model-call cases: the pipeline below the op takes normalised q and k."""
    if case.params["l2norm"]:
        return None
    return ours_variant(x, case.params["lengths"], case.params["K"], "scalar", split=None)


def _ours_unfolded(case, x):
    """None on the model-call cases, as _ours_unsplit, and where the op's plan does not fold."""
    lengths, K = case.params["lengths"], case.params["K"]
    if case.params["l2norm"] or not hopper_plan(x, lengths, K, "scalar").passes[0].folded:
        return None
    return ours_variant(x, lengths, K, "scalar", fold=False)


def _ours_cumsum_first(case, x):
    """None on the model-call cases, as _ours_unsplit."""
    import tilela

    if case.params["l2norm"]:
        return None
    gc = tilela.chunk_local_cumsum(x["g"], CHUNK, x.get("cu_seqlens"), cu_seqlens_cpu=x.get("cu_seqlens_cpu"))
    return ours_variant(dict(x, g=gc), case.params["lengths"], case.params["K"], "scalar", g_input="cumsum")


def _fla(case, x):
    fla = _try_import("fla.ops.gated_delta_rule")
    if fla is None:
        return None
    o, _ = fla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                      output_final_state=True, cu_seqlens=x.get("cu_seqlens_long"),
                                      cu_seqlens_cpu=x.get("cu_seqlens_cpu_long"),
                                      use_qk_l2norm_in_kernel=case.params["l2norm"])
    return o


def _flash_qla(case, x):
    qla = _try_import("flash_qla")
    if qla is None:
        return None
    o, _ = qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                      output_final_state=True, cu_seqlens=x.get("cu_seqlens_long"),
                                      use_qk_l2norm_in_kernel=case.params["l2norm"])
    return o


def _reference(case, x):
    q, k = x["q"], x["k"]
    if case.params["l2norm"]:  # FLA's l2norm, x / sqrt(sum x^2 + 1e-6), in float64
        q, k = (t.double() * torch.rsqrt(t.double().pow(2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    o, _ = reference.chunked(q, k, x["v"], g=x["g"], beta=x["beta"], initial_state=x["initial_state"],
                             cu_seqlens=x.get("cu_seqlens_cpu"))
    return o


def cost(case):
    p = case.params
    H, HV, K, V, C = p["H"], p["HV"], p["K"], p["V"], CHUNK
    T, N = sum(p["lengths"]), len(p["lengths"])
    n_chunks = sum(-(-L // C) for L in p["lengths"])
    nbytes = 2 * T * H * K * 2 + 2 * T * HV * V * 2 + 2 * T * HV * 4 + 2 * N * HV * K * V * 4
    per_chunk = 2 * C * K * V * 3 + 2 * C * C * (2 * V + K)
    flops = n_chunks * (HV * per_chunk + H * 2 * C * C * K)
    return {"bytes": nbytes, "flops": flops}


BENCH = Bench(
    op="gdn",
    cases=cases,
    check_cases=[_case((2, 8), "1x2048", "mixed", (2048,)), _case((2, 6), "300+1+77+64", "decay", (300, 1, 77, 64)),
                 _case((2, 4), "200+1+63", "mixed", (200, 1, 63), l2norm=True)],
    make_inputs=make_inputs,
    impls={"tilela": _ours, "tilela_unsplit": _ours_unsplit, "tilela_cumsum_first": _ours_cumsum_first,
           "tilela_unfolded": _ours_unfolded, "fla": _fla, "flash_qla": _flash_qla},
    reference=_reference,
    cost=cost,
)
