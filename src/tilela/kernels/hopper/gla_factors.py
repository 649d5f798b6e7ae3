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
synchronisation), chunks are tiles, D is indexed by tile slot. The gc tile comes from common.gate_tile: summed in
the tile from the raw gate (any gate form, so gc never goes through global memory) or read as gc. Rows past the
sequence end hold gc of its last row.

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

from .common import LOG2E, TILE, channel_score_dtype, gate_tile, locate_tile, subchunk_scores

THREADS = 128
DECAY_LIMIT = 80.0  # the one-product scores while no channel decays by more than e^-80 over the tile


def gla_factors_kernel(K: int, dtype: str, gate_in: tuple | None, delta: bool = False) -> T.PrimFunc:
    """Build the prim_func for static (K, input dtype, gate_in, whether the delta rule's Kg is written too; else Kg
    is a one-element placeholder). gate_in: None when g is the float32 chunk-local cumsum, else (g dtype, gate form)
    of the raw gate summed here (common.gate_tile, with params and gate_scale; placeholders otherwise). Tokens,
    heads (GVA ratio G = HV / H) and the varlen layout are symbolic, scale a run-time argument."""
    if K > THREADS:
        raise ValueError(f"K: one thread sums each key channel, so K <= {THREADS}, got {K}")
    C = TILE
    score_dtype = channel_score_dtype(dtype)
    num_tokens, H, HV, num_bounds, NSL, num_params = T.dynamic("num_tokens, H, HV, num_bounds, NSL, num_params")
    accum = "float32"
    g_dtype, form = (accum, None) if gate_in is None else gate_in

    @T.prim_func
    def gla_factors(
        q: T.Tensor((1, num_tokens, H, K), dtype),
        k: T.Tensor((1, num_tokens, H, K), dtype),
        g: T.Tensor((1, num_tokens, HV, K), g_dtype),
        params: T.Tensor((2, num_params), accum),
        cu_seqlens: T.Tensor((num_bounds,), "int32"),
        Qg: T.Tensor((1, num_tokens, HV, K), dtype),
        Kd: T.Tensor((1, num_tokens, HV, K), dtype),
        Kg: T.Tensor((1, num_tokens, HV, K) if delta else (1,), dtype),
        P: T.Tensor((1, num_tokens, HV, C), dtype),
        D: T.Tensor((NSL, HV, K), accum),
        scale: T.float32,
        gate_scale: T.float32,
        num_slots: T.int32,
        dense_len: T.int32,
        search_steps: T.int32,
    ):
        with T.Kernel(num_slots, HV, threads=THREADS) as (slot, hv):
            hq = T.alloc_var("int32")
            hq = hv // (HV // H)
            bounds = T.alloc_local((2,), "int32")
            locate_tile(slot, cu_seqlens, num_bounds, dense_len, search_steps, bounds)
            start = bounds[0]
            end = bounds[1]
            acc = T.alloc_local((1,), accum)
            least = T.alloc_var(accum)
            if start < end:
                q_s = T.alloc_shared((C, K), dtype)
                k_s = T.alloc_shared((C, K), dtype)
                g_s = T.alloc_shared((C, K), accum)  # gc * log2(e); rows past the end hold the last row's
                ab_s = T.alloc_shared((2, K), accum)  # gate_in's (a, b) of the value head's columns
                Qr_s = T.alloc_shared((C, K), score_dtype)  # the scores' query operand
                Kr_s = T.alloc_shared((C, K), score_dtype)  # the scores' key operand
                P_f = T.alloc_fragment((C, C), accum)
                Pa_f = T.alloc_fragment((C, C), accum)

                T.copy(q[0, start : start + C, hq, :], q_s)
                T.copy(k[0, start : start + C, hq, :], k_s)
                gate_tile(g, params, gate_scale, start, end, hv, K, g_s, ab_s, acc, form)
                for i, d in T.Parallel(C, K):
                    if start + i < end:
                        Qg[0, start + i, hv, d] = q_s[i, d] * T.exp2(g_s[i, d])
                        Kd[0, start + i, hv, d] = k_s[i, d] * T.exp2(g_s[C - 1, d] - g_s[i, d])
                        if delta:
                            Kg[0, start + i, hv, d] = k_s[i, d] * T.exp2(g_s[i, d])
                for d in T.Parallel(K):
                    D[slot, hv, d] = T.exp2(g_s[C - 1, d])
                least = 0.0
                for d in T.unroll(K):
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
