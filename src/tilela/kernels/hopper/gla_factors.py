"""gla_factors on Hopper: the state-independent factors of a chunk under a per-key-channel gate (ladder level 3,
GLA; and level 5, KDA), for every chunk at once. Mirrors reference.chunk_math.gated_factors (and, from the raw gate,
reference.cumsum.chunk_local_cumsum first; Kg as reference.chunk_math.wy_form's K ⊙ exp(gc); A as
reference.kkt.kkt_solve):

    Qg = Q ⊙ exp(gc)                               the output's state term:   O = scale Qg S + P V
    Kd = K ⊙ exp(gc_last - gc)                     the state update:          S <- D ⊙ S + Kd^T V
    P  = scale tril_incl(Gamma ⊙ Q K^T),           Gamma_ijd = exp(gc_id - gc_jd)
    D  = exp(gc_last)                              per chunk and key channel ([tile slots, HV, K], fp32)
with the delta rule (KDA), from the same key operand of the scores:
    Kg = K ⊙ exp(gc)                               R = diag(beta) (V - Kg S)
    A  = (I + strictLower(diag(beta) (Gamma ⊙ K K^T)))^-1      kkt_solve.py's UT transform at chunk 64

(gc: the chunk-local cumsum of the log gate, [.., K] per token and value head; log gates <= 0, so gc falls along
the chunk and gc_last is its least value in every channel). With them the state/output pass (chunk_fwd_ws.py,
gate "channel") runs the scalar gate's chain: no score product and no [64, K] exponent tile on the serial path,
only the per-row decay D of S.

One CTA of 128 threads per (64-row tile, value head): tiles come from common.locate_tile (varlen without host
synchronisation), chunks are tiles, D is indexed by tile slot. The gc tile comes from common.gate_tile: summed in
the tile from the raw gate (any gate form, so gc never goes through global memory) or read as gc. Rows past the
sequence end hold gc of its last row.

The scores exp(gc_i - gc_j) (q_i . k_j) and (k_i . k_j), two ways, chosen per tile:
  - the tile decays by at most e^-80 in every channel (gc_last >= -80): one product each of (Q ⊙ exp gc) and of
    (K ⊙ exp gc), Qg and Kg themselves (stored as formed), with the key operand (K ⊙ exp(-gc)), whose factors stay
    below e^80 (within the fp32/bf16 exponent range);
  - else per 16-row block a against the reference R_a = gc at its first row (kkt_solve.gated_kkt's): query and key
    rows i of block a as x_i exp(gc_i - R_a), formed once, times the key operand k_j exp(R_a - gc_j) over the rows
    j < 16 (a + 1), keeping a's rows. Only the diagonal 16x16 block has a positive exponent, over at most 15
    tokens: exact while no key channel decays by more than e^-80 within 16 tokens.
Causal entries only (select, not multiply: the products above the diagonal may be huge). The score operands are bf16
for bf16 inputs, fp32 (tf32) for fp16 ones (common.channel_score_dtype). Qg, Kd, Kg have non-positive exponents and
leave in the input dtype, as do P and A; A, and P of a one-product tile, leave through shared memory as whole rows.
Rows past the sequence end are not stored: the next sequence's tile owns them. A's scores go straight from the key
rows' product into kkt_solve.py's inverse (tile_inverse, blocked, one value head).
"""

import tilelang.language as T

from .common import LOG2E, TILE, channel_score_dtype, gate_tile, locate_tile
from .kkt_solve import BLOCK, inverse_buffers, tile_inverse

THREADS = 128
DECAY_LIMIT = 80.0  # the one-product scores while no channel decays by more than e^-80 over the tile
ROW_BLOCKS = tuple(range(TILE // BLOCK))  # a Python tuple: the loop over it unrolls when the kernel is parsed


def gla_factors_kernel(K: int, dtype: str, gate_in: tuple | None, delta: bool = False) -> T.PrimFunc:
    """Build the prim_func for static (K, input dtype, gate_in, whether the delta rule's Kg and A are written too;
    else they are one-element placeholders, as beta is). gate_in: None when g is the float32 chunk-local cumsum,
    else (g dtype, gate form) of the raw gate summed here (common.gate_tile, with params and gate_scale; placeholders
    otherwise). Tokens, heads (GVA ratio G = HV / H) and the varlen layout are symbolic, scale a run-time
    argument."""
    if K > THREADS:
        raise ValueError(f"K: one thread sums each key channel, so K <= {THREADS}, got {K}")
    C = TILE
    score_dtype = channel_score_dtype(dtype)
    num_tokens, H, HV, num_bounds, NSL, num_params = T.dynamic("num_tokens, H, HV, num_bounds, NSL, num_params")
    accum = "float32"
    g_dtype, form = (accum, None) if gate_in is None else gate_in
    invert = tile_inverse(C, 1, "blocked") if delta else None
    # P and A leave through the key operand's shared memory (dead by then), viewed as [C, n, C] in the input dtype
    staging = (C, K * (4 if score_dtype == accum else 2) // (2 * C), C)

    @T.macro
    def unit_lower_rows(KK, lo, hi, rows, beta_s, Xd, Lo, M10):
        """Rows [lo, hi) of I + L, L_ij = beta_i (Gamma ⊙ K K^T)_ij for i > j (KK: the key rows' scores), into the
        inverse's buffers (kkt_solve.inverse_buffers): the diagonal 16x16 blocks (Xd), -L_10 of each 32 half (Lo),
        -M_10 (M10); rows past the sequence end hold 0 (select: their exponent is unbounded)."""
        for i, j in T.Parallel(C, C):
            if lo <= i and i < hi:
                L = T.if_then_else(i < rows and j < i, beta_s[i] * KK[i, j], 0.0)
                if i // BLOCK == j // BLOCK:
                    Xd[i // BLOCK, i % BLOCK, j % BLOCK] = T.if_then_else(i == j, 1.0, L)
                elif i // BLOCK % 2 == 1 and j // BLOCK == i // BLOCK - 1:
                    Lo[i // (2 * BLOCK), i % BLOCK, j % BLOCK] = -L
                elif i >= 2 * BLOCK and j < 2 * BLOCK:
                    M10[0, i - 2 * BLOCK, j] = -L

    @T.macro
    def store_rows(out_s, dst, start, rows, hv):
        """dst's rows of the tile before the sequence end from the staging out_s[:, 0, :]: whole rows."""
        for i, j in T.Parallel(C, C):
            if i < rows:
                dst[0, start + i, hv, j] = out_s[i, 0, j]

    @T.macro
    def store_Qg_Kg(Q_s, Kq_s, k_s, g_s, start, rows, hv, Qg, Kg, formed):
        """Qg = Q ⊙ exp(gc) and (delta rule) Kg = K ⊙ exp(gc) of the tile's rows before the sequence end: formed,
        they are the one-product scores' operands Q_s and Kq_s as they are; else from q (in Q_s) and k_s."""
        for i, d in T.Parallel(C, K):
            if i < rows:
                if formed:
                    Qg[0, start + i, hv, d] = Q_s[i, d]
                    if delta:
                        Kg[0, start + i, hv, d] = Kq_s[i, d]
                else:
                    Qg[0, start + i, hv, d] = Q_s[i, d] * T.exp2(g_s[i, d])
                    if delta:
                        Kg[0, start + i, hv, d] = k_s[i, d] * T.exp2(g_s[i, d])

    @T.prim_func
    def gla_factors(
        q: T.Tensor((1, num_tokens, H, K), dtype),
        k: T.Tensor((1, num_tokens, H, K), dtype),
        g: T.Tensor((1, num_tokens, HV, K), g_dtype),
        beta: T.Tensor((1, num_tokens, HV) if delta else (1,), accum),
        params: T.Tensor((2, num_params), accum),
        cu_seqlens: T.Tensor((num_bounds,), "int32"),
        Qg: T.Tensor((1, num_tokens, HV, K), dtype),
        Kd: T.Tensor((1, num_tokens, HV, K), dtype),
        Kg: T.Tensor((1, num_tokens, HV, K) if delta else (1,), dtype),
        P: T.Tensor((1, num_tokens, HV, C), dtype),
        A: T.Tensor((1, num_tokens, HV, C) if delta else (1,), dtype),
        D: T.Tensor((NSL, HV, K), accum),
        scale: T.float32,
        gate_scale: T.float32,
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
            acc = T.alloc_local((1,), accum)
            least = T.alloc_var(accum)
            if start < end:
                rows = T.min(end - start, C)
                Q_s = T.alloc_shared((C, K), score_dtype)  # q; then the scores' query operand
                k_s = T.alloc_shared((C, K), dtype)
                g_s = T.alloc_shared((C, K), accum)  # gc * log2(e); rows past the end hold the last row's
                ab_s = T.alloc_shared((2, K), accum)  # gate_in's (a, b) of the value head's columns
                Kr_s = T.alloc_shared((C, K), score_dtype)  # the scores' key operand; then P's and A's staging
                out_s = T.view(Kr_s, staging, dtype)
                P_f = T.alloc_fragment((C, C), accum)
                Kq_s = None
                if delta:
                    Kq_s = T.alloc_shared((C, K), score_dtype)  # the key rows' operand of K K^T's scores
                    beta_s = T.alloc_shared((C,), accum)
                    KK = T.alloc_fragment((C, C), accum)
                    inv = inverse_buffers(C, 1, "blocked")
                    T.annotate_layout(inv.layouts)

                T.copy(q[0, start : start + C, hq, :], Q_s)
                T.copy(k[0, start : start + C, hq, :], k_s)
                if delta:
                    for i in T.Parallel(C):
                        beta_s[i] = T.if_then_else(i < rows, beta[0, start + i, hv], 0.0)
                gate_tile(g, params, gate_scale, start, end, hv, K, g_s, ab_s, acc, form)
                for i, d in T.Parallel(C, K):
                    if i < rows:
                        Kd[0, start + i, hv, d] = k_s[i, d] * T.exp2(g_s[C - 1, d] - g_s[i, d])
                for d in T.Parallel(K):
                    D[slot, hv, d] = T.exp2(g_s[C - 1, d])
                least = 0.0
                for d in T.unroll(K):
                    least = T.min(least, g_s[C - 1, d])
                if least >= -DECAY_LIMIT * LOG2E:  # one product each: the tile's factors stay below e^80
                    for i, d in T.Parallel(C, K):
                        Q_s[i, d] = Q_s[i, d] * T.exp2(g_s[i, d])
                        Kr_s[i, d] = k_s[i, d] * T.exp2(-g_s[i, d])
                        if delta:
                            Kq_s[i, d] = k_s[i, d] * T.exp2(g_s[i, d])
                    store_Qg_Kg(Q_s, Kq_s, k_s, g_s, start, rows, hv, Qg, Kg, True)
                    T.gemm(Q_s, Kr_s, P_f, transpose_B=True, clear_accum=True)
                    if delta:
                        T.gemm(Kq_s, Kr_s, KK, transpose_B=True, clear_accum=True)
                        unit_lower_rows(KK, 0, C, rows, beta_s, inv.Xd, inv.Lo, inv.M10)
                    for i, j in T.Parallel(C, C):  # whole rows through the key operand's memory, dead now
                        out_s[i, 0, j] = T.if_then_else(j <= i, P_f[i, j] * scale, 0)
                    store_rows(out_s, P, start, rows, hv)
                else:  # row block a against its reference R_a = g at its first row
                    store_Qg_Kg(Q_s, None, k_s, g_s, start, rows, hv, Qg, Kg, False)
                    for i, d in T.Parallel(C, K):
                        Q_s[i, d] = Q_s[i, d] * T.exp2(g_s[i, d] - g_s[i // BLOCK * BLOCK, d])
                        if delta:
                            Kq_s[i, d] = k_s[i, d] * T.exp2(g_s[i, d] - g_s[i // BLOCK * BLOCK, d])
                    for a in ROW_BLOCKS:
                        for j, d in T.Parallel((a + 1) * BLOCK, K):  # later rows: stale, in columns not kept
                            Kr_s[j, d] = k_s[j, d] * T.exp2(g_s[a * BLOCK, d] - g_s[j, d])
                        T.gemm(Q_s, Kr_s, P_f, transpose_B=True, clear_accum=True)
                        for i, j in T.Parallel(C, C):  # from the fragment: Kr_s is the next block's operand
                            if i // BLOCK == a and i < rows:
                                P[0, start + i, hv, j] = T.if_then_else(j <= i, P_f[i, j] * scale, 0)
                        if delta:
                            T.gemm(Kq_s, Kr_s, KK, transpose_B=True, clear_accum=True)
                            unit_lower_rows(KK, a * BLOCK, (a + 1) * BLOCK, rows, beta_s, inv.Xd, inv.Lo, inv.M10)

                if delta:
                    invert(inv.Xd, inv.Lo, inv.M10, inv.X00, inv.X11, inv.F32, inv.T16, inv.row, inv.Q_a, inv.Q_b,
                           inv.X_a, inv.F, out_s, tx)
                    store_rows(out_s, A, start, rows, hv)

    return gla_factors
