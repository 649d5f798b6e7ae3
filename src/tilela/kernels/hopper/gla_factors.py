"""gla_factors on Hopper: the state-independent factors of a chunk under a per-key-channel gate (ladder level 3,
GLA), for every chunk at once. Mirrors reference.chunk_math.gated_factors:

    Qg = Q ⊙ exp(gc)                               the output's state term:   O = scale Qg S + P V
    Kd = K ⊙ exp(gc_last - gc)                     the state update:          S <- exp(gc_last) ⊙ S + Kd^T V
    P  = scale tril_incl(Gamma ⊙ Q K^T),           Gamma_ijd = exp(gc_id - gc_jd)

(gc: the chunk-local cumsum of the log gate, [.., K] per token and value head). With them the state/output pass
(chunk_fwd_ws.py, gate "channel") runs the scalar gate's chain: no score product and no [64, K] exponent tile on the
serial path, only the per-row decay exp(gc_last) of S.

One CTA of 128 threads per (64-row tile, value head): tiles come from kernels.locate_tile (varlen without host
synchronisation), chunks are tiles. The scores use the sub-chunk references of chunk_fwd.py's per-channel path
(exact while no key channel decays by more than e^-80 within 16 tokens): query rows of 16-row sub-chunk a against
R_a = gc of the row before it (R_0 = 0), one 64x64 product per sub-chunk, keeping a's rows; the operands are bf16 for
bf16 inputs, fp32 (tf32) for fp16 ones (kernels.channel_score_dtype). Qg and Kd have non-positive exponents and
leave in the input dtype, as does P. Rows past the sequence end read the gate of its last row (finite) and are not
stored: the next sequence's tile owns them.
"""

import tilelang.language as T

from .. import LOG2E, TILE, channel_score_dtype, locate_tile

SUB = 16  # rows of a sub-chunk of the scores
THREADS = 128


def gla_factors_kernel(K: int, dtype: str) -> T.PrimFunc:
    """Build the prim_func for static (K, input dtype); tokens, heads (GVA ratio G = HV / H) and the varlen layout
    are symbolic, scale a run-time argument."""
    C = TILE
    subchunks = tuple(range(C // SUB))
    score_dtype = channel_score_dtype(dtype)
    num_tokens, H, HV, num_bounds = T.dynamic("num_tokens, H, HV, num_bounds")
    accum = "float32"

    @T.prim_func
    def gla_factors(
        q: T.Tensor((1, num_tokens, H, K), dtype),
        k: T.Tensor((1, num_tokens, H, K), dtype),
        gc: T.Tensor((1, num_tokens, HV, K), accum),
        cu_seqlens: T.Tensor((num_bounds,), "int32"),
        Qg: T.Tensor((1, num_tokens, HV, K), dtype),
        Kd: T.Tensor((1, num_tokens, HV, K), dtype),
        P: T.Tensor((1, num_tokens, HV, C), dtype),
        scale: T.float32,
        num_slots: T.int32,
        dense_len: T.int32,
        search_steps: T.int32,
    ):
        with T.Kernel(num_slots, HV, threads=THREADS) as (slot, hv):
            hq = hv // (HV // H)
            bounds = T.alloc_local((2,), "int32")
            locate_tile(slot, cu_seqlens, num_bounds, dense_len, search_steps, bounds)
            start = bounds[0]
            end = bounds[1]
            if start < end:
                q_s = T.alloc_shared((C, K), dtype)
                k_s = T.alloc_shared((C, K), dtype)
                g_s = T.alloc_shared((C, K), accum)  # gc * log2(e), rows clamped to the sequence's last
                Qr_s = T.alloc_shared((C, K), score_dtype)  # q_i exp(gc_i - R_a), i in sub-chunk a
                Kr_s = T.alloc_shared((C, K), score_dtype)  # k_j exp(R_a - gc_j), j < 16 (a + 1)
                P_f = T.alloc_fragment((C, C), accum)
                Pa_f = T.alloc_fragment((C, C), accum)

                T.copy(q[0, start : start + C, hq, :], q_s)
                T.copy(k[0, start : start + C, hq, :], k_s)
                for i, d in T.Parallel(C, K):
                    g_s[i, d] = gc[0, T.min(start + i, end - 1), hv, d] * LOG2E
                for i, d in T.Parallel(C, K):
                    if start + i < end:
                        Qg[0, start + i, hv, d] = q_s[i, d] * T.exp2(g_s[i, d])
                        Kd[0, start + i, hv, d] = k_s[i, d] * T.exp2(g_s[C - 1, d] - g_s[i, d])
                for i, d in T.Parallel(C, K):
                    Qr_s[i, d] = q_s[i, d] * T.exp2(
                        g_s[i, d] - T.if_then_else(i >= SUB, g_s[T.max(i // SUB * SUB - 1, 0), d], 0))
                for a in subchunks:
                    for j, d in T.Parallel((a + 1) * SUB, K):
                        Kr_s[j, d] = k_s[j, d] * T.exp2((g_s[a * SUB - 1, d] if a > 0 else 0) - g_s[j, d])
                    if a == 0:
                        T.gemm(Qr_s, Kr_s, P_f, transpose_B=True, clear_accum=True)
                    else:
                        T.gemm(Qr_s, Kr_s, Pa_f, transpose_B=True, clear_accum=True)
                        for i, j in T.Parallel(C, C):
                            P_f[i, j] = T.if_then_else(i >= a * SUB, Pa_f[i, j], P_f[i, j])
                for i, j in T.Parallel(C, C):
                    if start + i < end:
                        P[0, start + i, hv, j] = T.if_then_else(j <= i, P_f[i, j] * scale, 0)

    return gla_factors
