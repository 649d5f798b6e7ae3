"""Launchers of the Hopper (sm_90a) kernels: allocate outputs, pick the compiled kernel, launch.

Inputs are validated once by tilela.ops; nothing is re-checked here. Nothing synchronises with the host: the
varlen tile schedule is found on the device (kernels.locate_tile) from sizes known on the host (T, N). Compiled
kernels are cached per static configuration only: kkt_solve and cumsum by (chunk, method, dtypes, gate, value
heads per pass), with token counts, head counts, K and varlen layouts symbolic; gla_factors by (K, dtype, cumsum);
chunk_fwd and chunk_fwd_ws by (K, V, scale, gate, update rule, dtypes, varlen / initial-state / final-state
switches, tiles), with token counts, head counts and varlen layouts symbolic. A new length, head count or varlen
layout never recompiles.
"""

import functools

import torch

try:  # the kernel modules import tilelang; without it available() is False and nothing here runs
    from .. import TILE, pass_configs, target
    from .cumsum import chunk_local_cumsum_kernel
    from .gla_factors import gla_factors_kernel
    from .kkt_solve import kkt_solve_kernel  # (before `def kkt_solve` below, which then owns the name)
    from .seq_combine import seq_combine_kernel
except ImportError:
    chunk_local_cumsum_kernel = gla_factors_kernel = kkt_solve_kernel = seq_combine_kernel = None

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

# The static configurations we ship (each one compiled by tests/test_compile.py):
#   chunk_local_cumsum_kernel(chunk, g dtype)
#   kkt_solve_kernel(chunk, method, k dtype, gate kind, value heads per pass); "blocked" at chunk 16 is the plain
#   in-place forward substitution of the 16x16 block (no coupling level)
#   gla_factors_kernel(K, q/k dtype, whether it sums the raw gate itself)
#   seq_combine_kernel(K, V, gate kind, whether an initial state is read): the plain update's sequence split
CUMSUM_CONFIGS = [(C, d) for C in (16, 32, 64) for d in ("float32", "bfloat16", "float16")]
KKT_METHODS = [(16, "blocked"), (32, "blocked"), (64, "blocked"), (16, "neumann"), (32, "neumann"), (64, "neumann")]
GLA_FACTORS_CONFIGS = [(K, d, cumsum) for K in (64, 128) for d in ("bfloat16", "float16") for cumsum in (False, True)]
SEQ_COMBINE_CONFIGS = [(K, K, gate, h0) for K in (64, 128) for gate in ("none", "scalar") for h0 in (False, True)]
KKT_CONFIGS = [
    (C, m, d, gate, pair)
    for C, m in KKT_METHODS
    for d in ("bfloat16", "float16")
    for gate in ("none", "scalar", "channel")
    for pair in ((1,) if gate == "channel" else (1, 2))
]


def available(*tensors: torch.Tensor) -> bool:
    """True when every tensor is on a CUDA device of compute capability 9.0 and TileLang imports."""
    if kkt_solve_kernel is None or not tensors or not all(t.is_cuda for t in tensors):
        return False
    return all(torch.cuda.get_device_capability(t.device) == (9, 0) for t in tensors)


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The SM count of a CUDA device (sizes the sequence split's grid)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def compiled(builder, *static, warp_specialized: bool = False):
    """The JIT kernel of builder(*static), compiled for sm_90a once per process (and cached on disk by TileLang).

    warp_specialized: let TileLang give the TMA pipeline a producer warp group (chunk_fwd's chunk loop); the
    latency-bound kkt_solve and cumsum kernels want several small CTAs per SM instead (PASS_CONFIGS)."""
    import tilelang

    return tilelang.compile(builder(*static), target=target(), pass_configs=pass_configs(warp_specialized),
                            execution_backend="tvm_ffi")


@functools.lru_cache(maxsize=None)
def _placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor standing in for an absent optional input (cu_seqlens of a dense batch, no gate)."""
    return torch.zeros(1, device=device, dtype=dtype)


def _schedule(x: torch.Tensor, cu_seqlens: torch.Tensor | None):
    """(cu_seqlens int32, num_slots, dense_len, search_steps) for a [B, T, ...] input; host sizes only."""
    B, Tn = x.shape[:2]
    if cu_seqlens is None:
        return _placeholder(x.device, torch.int32), B * -(-Tn // TILE), Tn, 0
    N = cu_seqlens.numel() - 1
    return cu_seqlens.to(torch.int32), Tn // TILE + N, 0, N.bit_length()


def chunk_local_cumsum(
    g: torch.Tensor, chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None, scale: float | None = None
) -> torch.Tensor:
    """Chunk-local cumsum of g ([B,T,H] or [B,T,H,K]) in float32, optionally times `scale`."""
    B, Tn = g.shape[:2]
    gc = torch.empty(g.shape, device=g.device, dtype=torch.float32)
    cu, num_slots, dense_len, steps = _schedule(g, cu_seqlens)
    if num_slots == 0 or g.numel() == 0:
        return gc
    kernel = compiled(chunk_local_cumsum_kernel, chunk_size, DTYPES[g.dtype])
    kernel(g.reshape(1, B * Tn, -1), cu, gc.view(1, B * Tn, -1), 1.0 if scale is None else float(scale),
           num_slots, dense_len, steps)
    return gc


def kkt_solve(
    k: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    method: str = "blocked",
) -> torch.Tensor:
    """A = (I + strictLower(diag(beta) (Gamma ⊙ K K^T)))^-1 per chunk, [B,T,HV,C] in k's dtype.

    k [B,T,H,K] (K a multiple of 64), beta [B,T,HV], g the chunk-local cumsum (natural log) of a scalar gate
    [B,T,HV], of a per-key-channel gate [B,T,HV,K] (KDA; one value head per pass), or None."""
    B, Tn, H, K = k.shape
    HV = beta.shape[2]
    A = torch.empty(B, Tn, HV, chunk_size, device=k.device, dtype=k.dtype)
    cu, num_slots, dense_len, steps = _schedule(k, cu_seqlens)
    if num_slots == 0:
        return A
    gate = "none" if g is None else ("channel" if g.dim() == 4 else "scalar")
    pair = 2 if (HV // H) % 2 == 0 and gate != "channel" else 1
    kernel = compiled(kkt_solve_kernel, chunk_size, method, DTYPES[k.dtype], gate, pair)
    g = _placeholder(k.device, torch.float32).view(1, 1, 1) if g is None else g.reshape(1, B * Tn, *g.shape[2:])
    kernel(k.reshape(1, B * Tn, H, K), beta.reshape(1, B * Tn, HV).float(), g.float(), cu,
           A.view(1, B * Tn, HV, chunk_size), HV // H, num_slots, dense_len, steps)
    return A


def gla_factors(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, scale: float,
                cu_seqlens: torch.Tensor | None = None, cumsum: bool = False):
    """(Qg, Kd, P, D) of a per-key-channel gate (gla_factors.py): Q ⊙ exp(gc) and K ⊙ exp(gc_last - gc) as
    [B, T, HV, K] and the scaled intra-chunk scores as [B, T, HV, 64], in q's dtype; D = exp(gc_last) per tile slot
    [slots, HV, K] fp32. q, k [B, T, H, K] (K 64 or 128); g [B, T, HV, K]: the chunk-local cumsum gc (chunks of
    64), or with cumsum=True the raw log gate, summed in the kernel."""
    B, Tn, H, K = q.shape
    HV = g.shape[2]
    Qg = torch.empty(B, Tn, HV, K, device=q.device, dtype=q.dtype)
    Kd = torch.empty_like(Qg)
    P = torch.empty(B, Tn, HV, TILE, device=q.device, dtype=q.dtype)
    cu, num_slots, dense_len, steps = _schedule(q, cu_seqlens)
    D = torch.empty(max(num_slots, 1), HV, K, device=q.device, dtype=torch.float32)
    if num_slots == 0:
        return Qg, Kd, P, D
    kernel = compiled(gla_factors_kernel, K, DTYPES[q.dtype], cumsum)
    kernel(q.reshape(1, B * Tn, H, K), k.reshape(1, B * Tn, H, K), g.float().reshape(1, B * Tn, HV, K), cu,
           Qg.view(1, B * Tn, HV, K), Kd.view(1, B * Tn, HV, K), P.view(1, B * Tn, HV, TILE), D, float(scale),
           num_slots, dense_len, steps)
    return Qg, Kd, P, D
