"""gla_factors on Hopper: the state-independent factors of a chunk under a per-key-channel gate (ladder level 3,
GLA; and level 5, KDA), for every chunk at once. Mirrors reference.chunk_math.gated_factors (and, from the raw gate,
reference.cumsum.chunk_local_cumsum first; Kg as reference.chunk_math.wy_form's K ⊙ exp(gc); Ab as
reference.kkt.kkt_solve with beta_columns):

    Qg = Q ⊙ exp(gc)                               the output's state term:   O = scale Qg S + P V
    Kd = K ⊙ exp(gc_last - gc)                     the state update:          S <- D ⊙ S + Kd^T V
    P  = scale tril_incl(Gamma ⊙ Q K^T),           Gamma_ijd = exp(gc_id - gc_jd)
    D  = exp(gc_last)                              per chunk and key channel ([tile slots, HV, K], fp32)
with the delta rule (KDA), from the same key operand of the scores:
    Kg = K ⊙ exp(gc)                               Vnew = Ab (V - Kg S)
    Ab = A diag(beta),  A = (I + strictLower(diag(beta) (Gamma ⊙ K K^T)))^-1      kkt_solve.py's UT transform at 64

(gc: the chunk-local cumsum of the log gate, [.., K] per token and value head; log gates <= 0, so gc falls along
the chunk and gc_last is its least value in every channel). With them the state/output pass (chunk_fwd_ws.py,
gate "channel") runs the scalar gate's chain: no score product and no [64, K] exponent tile on the serial path,
only the per-row decay D of S.

One CTA of 128 threads per (64-row tile, value head): tiles come from common.locate_tile (varlen without host
synchronisation), chunks are tiles, D is indexed by tile slot. gc lives in registers (common.gate_column): thread tx
owns four key channels (a warp's lanes cover all K) and a run of 64 K / 512 consecutive rows, summed there from the
raw gate (any gate form, so gc never goes through global memory) or read as gc; rows past the sequence end hold gc of
its last row. Every global access of a row is one 8-byte vector (bf16), the wild channels' reloads aside. q and k
land in the score operands' shared memory and are rewritten there in place, four rows of a run at a time (their
reads, then their writes), so the CTA holds three 64 x K operand tiles and the inverse's buffers: three CTAs per SM
for bf16.

The scores exp(gc_i - gc_j) (q_i . k_j) and (k_i . k_j), split by key channel, decided per tile:
  - calm channels, which decay by at most e^-160 over the tile (gc_last >= -160): one product each of the query
    operand (Q ⊙ exp(gc - r)) and of the key rows' operand (K ⊙ exp(gc - r)) with the key operand
    (K ⊙ exp(r - gc)), around the channel's reference point r = gc_last / 2, so every factor stays within
    [e^-80, e^80] (the fp32/bf16 exponent range) and a causal pair's product is exp(gc_i - gc_j) <= 1; over the
    calm channels (the operands hold 0 in the wild ones);
  - wild channels (gc_last < -160): term by term, exp(gc_i - gc_j) <= 1 formed on its own for every causal pair,
    added onto the products' accumulators, NWB channels at a time (their gc, q and k staged in shared memory; the
    set is uniform over the CTA, from a ballot of every warp's lanes, which cover all channels).
So the scores are exact for any gate; a gate that leaves every channel calm (e.g. FLA's bounded form) costs one
product each.
Causal entries only (select, not multiply). The score operands are bf16 for bf16 inputs, fp32 (tf32) for fp16
ones (common.channel_score_dtype). Qg, Kd, Kg have non-positive exponents and leave in the input dtype, as do P and
Ab; both leave through shared memory as whole rows.
Rows past the sequence end are not stored: the next sequence's tile owns them. Every global access is in bounds by
construction (rows tested against the sequence end, q and k's landing against the token count; a row of D per tile
slot of the grid, A_log and dt_bias indexed within their lengths), so the kernel compiles without TileLang's
per-access bounds tests (launch.GUARDED). A's scores go straight from the key rows' product into kkt_solve.py's
inverse (tile_inverse, blocked, one value head).
"""

import tilelang.language as T

from .common import LOG2E, TILE, channel_score_dtype, gate_column, locate_tile
from .kkt_solve import BLOCK, inverse_buffers, tile_inverse
from .plan import FACTORS_PER_SM

THREADS = 128
VEC = 4  # key channels of a thread (one 8-byte bf16 access a row)
SUB = 4  # rows of a run landed in registers at once
FACTOR_LIMIT = 80.0  # a calm channel's operand factors stay within e^+-80: it decays by at most e^-160 over the tile
NWB = 8  # wild channels staged at a time
ROW_VEC = 8  # entries of a P or Ab row a thread stores at once (16 bytes)


def gla_factors_kernel(K: int, dtype: str, gate_in: tuple | None, delta: bool = False) -> T.PrimFunc:
    """Build the prim_func for static (K, input dtype, gate_in, whether the delta rule's Kg and Ab are written too;
    else they are one-element placeholders, as beta is). gate_in: None when g is the float32 chunk-local cumsum,
    else (g dtype, gate form) of the raw gate summed here (common.gate_column, with A_log, dt_bias and gate_scale;
    placeholders otherwise). Tokens, heads (GVA ratio G = HV / H) and the varlen layout are symbolic, scale a
    run-time argument."""
    if K % VEC or 32 % (K // VEC) or BLOCK % (TILE * K // (VEC * THREADS)):
        raise ValueError(f"K: a warp's lanes own all K channels, {VEC} each, and runs of rows within a 16-row block; "
                         f"got {K}")
    C = TILE
    run = C * K // (VEC * THREADS)  # rows of a thread's run
    score_dtype = channel_score_dtype(dtype)
    num_tokens, H, HV, num_bounds, NSL = T.dynamic("num_tokens, H, HV, num_bounds, NSL")
    num_a, num_b = T.dynamic("num_a, num_b")
    accum = "float32"
    g_dtype, form = (accum, None) if gate_in is None else gate_in
    invert = tile_inverse(C, 1, "blocked", scaled=True) if delta else None  # Ab, beta on its columns
    # P and A leave through the key operand's shared memory (dead by then), viewed as [C, n, C] in the input dtype
    staging = (C, K * (4 if score_dtype == accum else 2) // (2 * C), C)
    # three CTAs per SM while the bf16 operands fit (caps registers at 168), two with fp16's fp32 score operands: the
    # plan's cost model counts its waves by the same table
    min_blocks = FACTORS_PER_SM[dtype]

    @T.macro
    def unit_lower_rows(KK, rows, beta_s, Xd, Ts):
        """I + L, L_ij = beta_i (Gamma ⊙ K K^T)_ij for i > j (KK: the key rows' scores), into the inverse's inputs
        (kkt_solve.tile_inverse): the diagonal 16x16 blocks (Xd), -L_10 of each 32 half and -M_10 in their blocks
        of the fp16 tile Ts, and zeros in its blocks (0, 1) and (2, 3); rows past the sequence end hold 0."""
        for i, j in T.Parallel(C, C):
            L = T.if_then_else(i < rows and j < i, beta_s[0, i] * KK[i, j], 0.0)
            if i // BLOCK == j // BLOCK:
                Xd[i // BLOCK, i % BLOCK, j % BLOCK] = T.if_then_else(i == j, 1.0, L)
            elif i // BLOCK > j // BLOCK or i // BLOCK % 2 == 0 and j // BLOCK == i // BLOCK + 1:
                Ts[0, i, j] = T.cast(-L, Ts.dtype)

    @T.macro
    def wild_scores(wild, slots, num_wild, q, k, start, rows, hq, gl, r0, d0, Gw_s, Qw_s, Kw_s, P_f, KK):
        """P_f[i, j] += sum_d q_id k_jd exp(gc_id - gc_jd) and, with the delta rule, KK[i, j] += the same with k_id
        for q_id, over the wild channels d (wild[v]: the thread's channel d0 + v is wild, slots[v] its index among
        the num_wild), each exponent <= 0 on its own (entries j > i: stale, finite). NWB channels at a time: their
        owners stage gc (from registers) and q, k (again from global memory) as [NWB, C] rows."""
        for grp in T.serial(T.ceildiv(num_wild, NWB)):
            for v in T.unroll(VEC):
                w = slots[v] - grp * NWB
                if wild[v] != 0 and 0 <= w and w < NWB:
                    for i in T.unroll(run):
                        Gw_s[w, r0 + i] = gl[i, v]
                        Qw_s[w, r0 + i] = T.if_then_else(r0 + i < rows, T.cast(q[0, start + r0 + i, hq, d0 + v], accum),
                                                         0.0)
                        Kw_s[w, r0 + i] = T.if_then_else(r0 + i < rows, T.cast(k[0, start + r0 + i, hq, d0 + v], accum),
                                                         0.0)
            for w in T.serial(T.min(NWB, num_wild - grp * NWB)):
                for i, j in T.Parallel(C, C):
                    f = Kw_s[w, j] * T.exp2(T.min(Gw_s[w, i] - Gw_s[w, j], 0.0))
                    P_f[i, j] += Qw_s[w, i] * f
                    if delta:
                        KK[i, j] += Kw_s[w, i] * f

    @T.macro
    def store_rows(out_s, dst, start, rows, hv, tx, xs):
        """dst's rows of the tile before the sequence end from the staging out_s[:, 0, :]: thread tx stores ROW_VEC
        columns from ROW_VEC (tx % (C / ROW_VEC)) of every (THREADS ROW_VEC / C)-th row, each through xs (ROW_VEC
        elements) as one 16-byte store."""
        for r in T.unroll(C * C // (ROW_VEC * THREADS)):
            i = r * (THREADS * ROW_VEC // C) + tx // (C // ROW_VEC)
            j0 = tx % (C // ROW_VEC) * ROW_VEC
            for v in T.vectorized(ROW_VEC):
                xs[v] = out_s[i, 0, j0 + v]
            T.stg128(dst[0, start + i, hv, j0 : j0 + ROW_VEC], T.view(xs, (1,), "uint32x4")[0], pred=i < rows)

    @T.macro
    def land_rows(Q_s, Kr_s, row0, d0, qv, kv):
        """qv, kv <- q and k at rows [row0, row0 + SUB), key channels [d0, d0 + VEC), as landed in Q_s and Kr_s: a
        row group's reads all come before its writes, so TileLang's barrier planner (which cannot prove a thread's
        elements its own) puts its barriers between the two phases, not between every read and write."""
        for i in T.unroll(SUB):
            for v in T.vectorized(VEC):
                qv[i, v] = Q_s[row0 + i, d0 + v]
                kv[i, v] = Kr_s[row0 + i, d0 + v]

    @T.macro
    def store_row(x, dst, row, d0, start, hv):
        """dst[row] <- x at key channels [d0, d0 + VEC): one 8-byte store (an explicit one: nvcc splits the vector
        copy from a local array into two 4-byte stores)."""
        T.stg64(dst[0, start + row, hv, d0 : d0 + VEC], T.view(x, (1,), "uint32x2")[0])

    @T.macro
    def form_rows(Q_s, Kr_s, Kq_s, gl, last, half, wild, qv, kv, xq, xr, xk, xg, xd, xh, r0, d0, start, rows, hv, Qg,
                  Kd, Kg):
        """The thread's rows r0 + [0, run) and channels d0 + [0, VEC), SUB rows at a time: Qg, Kd, Kg (delta rule)
        to global memory (rows before the sequence end), and in place of the landed q and k the scores' operands:
        the query operand Q ⊙ exp(gc - r), the key operand K ⊙ exp(r - gc) and the key rows' operand
        K ⊙ exp(gc - r), r = gc_last / 2 (log2(e) r: half), 0 in a wild channel (select: its factors may be inf)."""
        for sb in T.unroll(run // SUB):
            land_rows(Q_s, Kr_s, r0 + sb * SUB, d0, qv, kv)
            for i in T.unroll(SUB):
                row = r0 + sb * SUB + i
                for v in T.unroll(VEC):
                    e = gl[sb * SUB + i, v]
                    xg[v] = qv[i, v] * T.exp2(e)
                    xd[v] = kv[i, v] * T.exp2(last[v] - e)
                    xh[v] = kv[i, v] * T.exp2(e)
                    xq[v] = T.if_then_else(wild[v] != 0, 0.0, qv[i, v] * T.exp2(e - half[v]))
                    xr[v] = T.if_then_else(wild[v] != 0, 0.0, kv[i, v] * T.exp2(half[v] - e))
                    xk[v] = T.if_then_else(wild[v] != 0, 0.0, kv[i, v] * T.exp2(e - half[v]))
                for v in T.vectorized(VEC):
                    Q_s[row, d0 + v] = xq[v]
                for v in T.vectorized(VEC):
                    Kr_s[row, d0 + v] = xr[v]
                if delta:
                    for v in T.vectorized(VEC):
                        Kq_s[row, d0 + v] = xk[v]
                if row < rows:
                    store_row(xg, Qg, row, d0, start, hv)
                    store_row(xd, Kd, row, d0, start, hv)
                    if delta:
                        store_row(xh, Kg, row, d0, start, hv)

    @T.prim_func
    def gla_factors(
        q: T.Tensor((1, num_tokens, H, K), dtype),
        k: T.Tensor((1, num_tokens, H, K), dtype),
        g: T.Tensor((1, num_tokens, HV, K), g_dtype),
        beta: T.Tensor((1, num_tokens, HV) if delta else (1,), accum),
        A_log: T.Tensor((num_a,), accum),
        dt_bias: T.Tensor((num_b,), accum),
        cu_seqlens: T.Tensor((num_bounds,), "int32"),
        Qg: T.Tensor((1, num_tokens, HV, K), dtype),
        Kd: T.Tensor((1, num_tokens, HV, K), dtype),
        Kg: T.Tensor((1, num_tokens, HV, K) if delta else (1,), dtype),
        P: T.Tensor((1, num_tokens, HV, C), dtype),
        Ab: T.Tensor((1, num_tokens, HV, C) if delta else (1,), dtype),
        D: T.Tensor((NSL, HV, K), accum),
        scale: T.float32,
        gate_scale: T.float32,
        num_slots: T.int32,
        dense_len: T.int32,
        search_steps: T.int32,
    ):
        with T.Kernel(num_slots, HV, threads=THREADS) as (slot, hv):
            T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            d0 = tx % (K // VEC) * VEC  # the thread's key channels d0 + [0, VEC) and rows r0 + [0, run)
            r0 = tx // (K // VEC) * run
            hq = T.alloc_var("int32")
            hq = hv // (HV // H)
            bounds = T.alloc_local((2,), "int32")
            locate_tile(slot, cu_seqlens, num_bounds, dense_len, search_steps, bounds)
            start = bounds[0]
            end = bounds[1]
            num_wild = T.alloc_var("int32")
            if start < end:
                rows = T.min(end - start, C)
                Q_s = T.alloc_shared((C, K), score_dtype)  # q; then the scores' query operand
                Kr_s = T.alloc_shared((C, K), score_dtype)  # k; then the scores' key operand; then P's and A's staging
                out_s = T.view(Kr_s, staging, dtype)
                last_s = T.alloc_shared((K,), accum)  # log2(e) gc at the tile's last row
                part_s = T.alloc_shared((C // run, K), accum)  # gate_column's run totals; then the wild channels' gc
                Gw_s = T.view(part_s, (NWB, C), accum)
                Qw_s = T.alloc_shared((NWB, C), accum)  # the wild channels' q and k
                Kw_s = T.alloc_shared((NWB, C), accum)
                gl = T.alloc_local((run, VEC), accum)  # log2(e) gc of the thread's rows and channels
                last = T.alloc_local((VEC,), accum)  # log2(e) gc_last of the thread's channels
                half = T.alloc_local((VEC,), accum)  # half of it: the calm operands' reference point
                wild = T.alloc_local((VEC,), "int32")  # whether each of them is wild; its index among the wild
                slots = T.alloc_local((VEC,), "int32")
                masks = T.alloc_local((VEC,), "uint32")  # the wild channels d0 + v over the lanes owning d0
                qv = T.alloc_local((SUB, VEC), score_dtype)  # q and k of SUB rows, as landed
                kv = T.alloc_local((SUB, VEC), score_dtype)
                xq = T.alloc_local((VEC,), score_dtype)  # a row's query operand, key operand, key rows' operand
                xr = T.alloc_local((VEC,), score_dtype)
                xk = T.alloc_local((VEC,), score_dtype)
                xg = T.alloc_local((VEC,), dtype)  # a row's Qg, Kd, Kg
                xd = T.alloc_local((VEC,), dtype)
                xh = T.alloc_local((VEC,), dtype)
                xs = T.alloc_local((ROW_VEC,), dtype)  # a row's ROW_VEC entries of P or Ab
                P_f = T.alloc_fragment((C, C), accum)
                Kq_s = KK = None
                if delta:
                    Kq_s = T.alloc_shared((C, K), score_dtype)  # the key rows' operand of K K^T's scores
                    beta_s = T.alloc_shared((1, C), accum)  # tile_inverse's (value heads, rows)
                    KK = T.alloc_fragment((C, C), accum)
                    inv = inverse_buffers(C, 1, "blocked")
                    T.annotate_layout(inv.layouts)

                T.copy(q[0, start : start + C, hq, :], Q_s)
                T.copy(k[0, start : start + C, hq, :], Kr_s)
                if delta:
                    for i in T.Parallel(C):
                        beta_s[0, i] = T.if_then_else(i < rows, beta[0, start + i, hv], 0.0)
                gate_column(g, A_log, dt_bias, gate_scale, start, end, hv, K, gl, part_s, form)
                if r0 + run == C:
                    for v in T.vectorized(VEC):
                        last_s[d0 + v] = gl[run - 1, v]
                    for v in T.unroll(VEC):
                        last[v] = T.exp2(gl[run - 1, v])
                    for v in T.vectorized(VEC):
                        D[slot, hv, d0 + v] = last[v]
                for v in T.vectorized(VEC):
                    last[v] = last_s[d0 + v]
                # the wild channels: lane l < K / VEC of every warp owns channels VEC l + [0, VEC)
                lane = tx % (K // VEC)
                for v in T.unroll(VEC):
                    half[v] = last[v] * 0.5
                    wild[v] = T.if_then_else(last[v] < -2 * FACTOR_LIMIT * LOG2E, 1, 0)
                    masks[v] = T.cast(T.ballot(wild[v]), "uint32") & T.uint32((1 << (K // VEC)) - 1)
                num_wild = 0
                for v in T.unroll(VEC):
                    slots[v] = num_wild + T.popcount(masks[v] & ((T.uint32(1) << T.cast(lane, "uint32")) - 1))
                    num_wild = num_wild + T.popcount(masks[v])
                form_rows(Q_s, Kr_s, Kq_s, gl, last, half, wild, qv, kv, xq, xr, xk, xg, xd, xh, r0, d0, start, rows, hv,
                          Qg, Kd, Kg)
                T.gemm(Q_s, Kr_s, P_f, transpose_B=True, clear_accum=True)
                if delta:
                    T.gemm(Kq_s, Kr_s, KK, transpose_B=True, clear_accum=True)
                if num_wild > 0:
                    wild_scores(wild, slots, num_wild, q, k, start, rows, hq, gl, r0, d0, Gw_s, Qw_s, Kw_s, P_f, KK)
                if delta:
                    unit_lower_rows(KK, rows, beta_s, inv.Xd, inv.Ts)
                for i, j in T.Parallel(C, C):  # whole rows through the key operand's memory, dead now
                    out_s[i, 0, j] = T.if_then_else(j <= i, P_f[i, j] * scale, 0)
                store_rows(out_s, P, start, rows, hv, tx, xs)

                if delta:
                    invert(inv, out_s, beta_s, tx)
                    store_rows(out_s, Ab, start, rows, hv, tx, xs)

    return gla_factors
