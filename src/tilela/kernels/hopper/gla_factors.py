"""gla_factors on Hopper: the state-independent factors of a chunk under a per-key-channel gate (ladder level 3,
GLA; and level 5, KDA), for every chunk at once. Mirrors reference.chunk_math.gated_factors (and, from the raw gate,
reference.cumsum.chunk_local_cumsum first; Kg as reference.chunk_math.wy_form's K ⊙ exp(gc)):

    Qg = Q ⊙ exp(gc)                               the output's state term:   O = scale Qg S + P V
    Kd = K ⊙ exp(gc_last - gc)                     the state update:          S <- D ⊙ S + Kd^T V
    P  = scale tril_incl(Gamma ⊙ Q K^T),           Gamma_ijd = exp(gc_id - gc_jd)
    D  = exp(gc_last)                              per chunk and key channel ([tile slots, HV, K], fp32)
    Kg = K ⊙ exp(gc)                               with the delta rule (KDA): R = diag(beta) (V - Kg S)

(gc: the chunk-local cumsum of the log gate, [.., K] per token and value head; log gates <= 0, so gc falls along
the chunk and gc_last is its least value in every channel). With them the state/output pass (chunk_fwd_ws.py,
gate "channel") runs the scalar gate's chain: no score product and no [64, K] exponent tile on the serial path,
only the per-row decay D of S.

One CTA of 128 threads per (64-row tile, value head): tiles come from common.locate_tile (varlen without host
synchronisation), chunks are tiles, D is indexed by tile slot. With cumsum the kernel reads the raw gate, floors it
(common.floor_log_gate) and sums it along each column of the tile itself (one thread per key channel, as
hopper/cumsum.py), so gc never goes through global memory; else it reads gc. Rows past the sequence end hold gc of
its last row.

The scores, two ways, chosen per tile:
  - the tile decays by at most e^-80 in every channel (gc_last >= -80): one 64x64 product of (Q ⊙ exp gc) and
    (K ⊙ exp(-gc)), whose factors stay below e^80 (within the fp32/bf16 exponent range);
  - else the sub-chunk references of chunk_fwd.py's per-channel path (exact while no key channel decays by more
    than e^-80 within 16 tokens): query rows of 16-row sub-chunk a against R_a = gc of the row before it
    (R_0 = 0), one 64x64 product per sub-chunk, keeping a's rows.
Causal entries only (select, not multiply: the products above the diagonal may be huge). The score operands are bf16
for bf16 inputs, fp32 (tf32) for fp16 ones (common.channel_score_dtype). Qg and Kd have non-positive exponents and
leave in the input dtype, as does P. Rows past the sequence end are not stored: the next sequence's tile owns them.
"""

import tilelang.language as T

from .common import LOG2E, TILE, channel_score_dtype, floor_log_gate, locate_tile, subchunk_scores

THREADS = 128
DECAY_LIMIT = 80.0  # the one-product scores while no channel decays by more than e^-80 over the tile


def gla_factors_kernel(K: int, dtype: str, cumsum: bool, delta: bool = False) -> T.PrimFunc:
    """Build the prim_func for static (K, input dtype, whether g is the raw gate to sum here or gc already, whether
    the delta rule's Kg is written too; else Kg is a one-element placeholder); tokens, heads (GVA ratio G = HV / H)
    and the varlen layout are symbolic, scale a run-time argument."""
    if K > THREADS:
        raise ValueError(f"K: one thread sums each key channel, so K <= {THREADS}, got {K}")
    C = TILE
    score_dtype = channel_score_dtype(dtype)
    num_tokens, H, HV, num_bounds, NSL = T.dynamic("num_tokens, H, HV, num_bounds, NSL")
    accum = "float32"

    @T.prim_func
    def gla_factors(
        q: T.Tensor((1, num_tokens, H, K), dtype),
        k: T.Tensor((1, num_tokens, H, K), dtype),
        g: T.Tensor((1, num_tokens, HV, K), accum),
        cu_seqlens: T.Tensor((num_bounds,), "int32"),
        Qg: T.Tensor((1, num_tokens, HV, K), dtype),
        Kd: T.Tensor((1, num_tokens, HV, K), dtype),
        Kg: T.Tensor((1, num_tokens, HV, K) if delta else (1,), dtype),
        P: T.Tensor((1, num_tokens, HV, C), dtype),
        D: T.Tensor((NSL, HV, K), accum),
        scale: T.float32,
        num_slots: T.int32,
        dense_len: T.int32,
        search_steps: T.int32,
    ):
        with T.Kernel(num_slots, HV, threads=THREADS) as (slot, hv):
            tx = T.get_thread_binding()
            hq = T.alloc_var("int32")
            hq = hv // (HV // H)
            bounds = T.alloc_local((2,), "int32")
            locate_tile(slot, cu_seqlens, num_bounds, dense_len, search_steps, bounds)
            start = bounds[0]
            end = bounds[1]
            acc = T.alloc_var(accum)
            least = T.alloc_var(accum)
            if start < end:
                q_s = T.alloc_shared((C, K), dtype)
                k_s = T.alloc_shared((C, K), dtype)
                g_s = T.alloc_shared((C, K), accum)  # gc * log2(e); rows past the end hold the last row's
                Qr_s = T.alloc_shared((C, K), score_dtype)  # the scores' query operand
                Kr_s = T.alloc_shared((C, K), score_dtype)  # the scores' key operand
                P_f = T.alloc_fragment((C, C), accum)
                Pa_f = T.alloc_fragment((C, C), accum)

                T.copy(q[0, start : start + C, hq, :], q_s)
                T.copy(k[0, start : start + C, hq, :], k_s)
                if cumsum:  # rows past the end add 0: they end up with the last row's sum
                    for i, d in T.Parallel(C, K):
                        g_s[i, d] = T.if_then_else(start + i < end, floor_log_gate(g[0, start + i, hv, d]), 0.0)
                    if tx < K:
                        acc = 0.0
                        for i in T.serial(C):
                            acc += g_s[i, tx]
                            g_s[i, tx] = acc * LOG2E
                else:
                    for i, d in T.Parallel(C, K):
                        g_s[i, d] = g[0, T.min(start + i, end - 1), hv, d] * LOG2E
                for i, d in T.Parallel(C, K):
                    if start + i < end:
                        Qg[0, start + i, hv, d] = q_s[i, d] * T.exp2(g_s[i, d])
                        Kd[0, start + i, hv, d] = k_s[i, d] * T.exp2(g_s[C - 1, d] - g_s[i, d])
                        if delta:
                            Kg[0, start + i, hv, d] = k_s[i, d] * T.exp2(g_s[i, d])
                for d in T.Parallel(K):
                    D[slot, hv, d] = T.exp2(g_s[C - 1, d])
                least = 0.0
                for d in T.serial(K):
                    least = T.min(least, g_s[C - 1, d])
                if least >= -DECAY_LIMIT * LOG2E:  # one product: the tile's factors stay below e^80
                    for i, d in T.Parallel(C, K):
                        Qr_s[i, d] = q_s[i, d] * T.exp2(g_s[i, d])
                        Kr_s[i, d] = k_s[i, d] * T.exp2(-g_s[i, d])
                    T.gemm(Qr_s, Kr_s, P_f, transpose_B=True, clear_accum=True)
                else:  # sub-chunk a's rows against its reference R_a
                    subchunk_scores(q_s, k_s, g_s, Qr_s, Kr_s, P_f, Pa_f, K, T.exp2)
                for i, j in T.Parallel(C, C):
                    if start + i < end:
                        P[0, start + i, hv, j] = T.if_then_else(j <= i, P_f[i, j] * scale, 0)

    return gla_factors
