"""kkt_solve on Hopper: the materialised UT-transform matrix of every chunk.

    A = (I + L)^-1,   L = strictLower(diag(beta) (Gamma ⊙ K K^T)),   Gamma_ij = exp(g_i - g_j)
    (or Ab = A diag(beta), "scaled": the operand of the warp-specialised pass's delta rule)

per chunk of C in {16, 32, 64} tokens (g: the chunk-local cumsum, so i > j gives an exponent <= 0; no gate:
Gamma = 1). Mirrors reference.kkt.kkt_solve (beta_columns where scaled) with reference.inverse.blocked_inverse
("blocked") or the same recursion over reference.inverse.neumann_inverse_16 ("neumann"); seeds 000 (blocked
recursion) and 003 (Neumann 16x16).

One CTA owns a 64-row tile of one sequence and group_steps groups of P value heads of one q/k head, which it runs in
turn (P = 2 when G is even: the forward substitution then keeps all 128 threads busy): K K^T is formed once
(bf16/fp16 wgmma, fp32 accumulator) and its ten lower 16x16 blocks are kept in shared memory for them. On large
grids a CTA runs all ceil(G / P) groups of its q/k head; on small ones one, the head's groups side by side in CTAs
of their own (plan.kkt_group_steps). With a
per-key-channel gate (KDA: Gamma_ijd = exp(g_id - g_jd)) the scores differ per value head: each value head forms
its own ten blocks, one 64x64 product per 16-row block against a reference gate (gated_kkt), P = 1, from a gc tile
in shared memory read once per value head (the loop pass's pipeline; before the warp-specialised pass gla_factors.py
forms KDA's A from its own score products and this file's inverse, tile_inverse). A tile
holds 64 / C independent chunks, so the tile matrix is block diagonal with C x C blocks, each inverted by the
recursion of seed 000:

  level 0   the four 16x16 diagonal blocks X_b = L_bb^-1, either by forward substitution, each lane forming COLS
            columns in registers (blocked) or by (I+L)^-1 = (I-L)(I+L^2)(I+L^4)(I+L^8) with fp16 GEMM operands and the
            four blocks batched into one 64x16 @ 16x64 product whose diagonal blocks are kept (neumann);
  level 1   C >= 32: the 16x16 coupling X_10 = (X_1 (-L_10)) X_0 of each 32 half, one warp's two chained mma.sync
            products (fp16 operands, fp32 accumulation), the first result kept in registers as the second's left
            operand;
  level 2   C == 64: the 32x32 coupling (X_11 (-M_10)) X_00, two tensor-core GEMMs of the CTA (fp16 operands: the
            11-bit mantissa of tf32; fp32 accumulation).

Levels 1 and 2 work on one fp16 64x64 tile a head (Ts), each operand read where it lies: the extraction leaves -L_10
and -M_10 in their blocks, level 0 its X_b in the diagonal blocks, level 1 its X_10 over -L_10 (tile_inverse). Each
level stages its own blocks of the output from fp32, rounded once (beta on the columns where scaled). Level 0's
input, I + L_bb, lives in (n, 17, 16) fp32 shared blocks (Xd; the 17-row stride puts two neighbouring blocks half a
bank row apart), K K^T's lower blocks likewise, with rows r of r // 2 odd rotated by 8 columns where the tensor-core
accumulator writes them (block_layout). The K slice arrives by one TMA load (a warp's elected lane; its
shared-memory swizzle is K K^T's operand layout) where K K^T is formed once a tile, and by the threads' 16-byte
loads under the per-channel gate (once per value head). The output is staged in the shared memory of the K slice,
dead after the GEMM, and leaves as 16-byte row stores of the live rows and value heads. Varlen needs no host
synchronisation: tile slot s belongs to the last sequence n with floor(cu[n] / 64) + n <= s (common.locate_tile: a
warp's search of cu_seqlens); the grid is an upper bound (floor(T / 64) + N slots) whose surplus slots exit. The
dense [B, T] layout is the special case dense_len = T.
Rows past a sequence end are masked (select, not multiply): a product entry meets only the two rows it pairs, and
every entry with a row past the end is selected away, so whatever those rows hold (the next sequence's, by TMA;
the sequence's last row, clamped, under the per-channel gate) leaves rows < len exact.
Every global access is in bounds by construction (the TMA load's rows past the tensor end and columns past K
zero-filled; under the per-channel gate K's rows clamped to the sequence and its columns tested against K,
the gate and beta read and A and gc written for live rows and value heads only, A_log and dt_bias indexed within
their lengths, locate_tile's probes within cu_seqlens), so the kernel compiles without TileLang's per-access
bounds tests (launch.GUARDED).
"""

from types import SimpleNamespace

import tilelang
import tilelang.language as T
from tvm.script.ir_builder import IRBuilder

from .common import LOG2E, TILE, channel_score_dtype, exp_e, floored_log_gate, gate_tile, locate_tile

BLOCK = 16  # diagonal block size of the recursion
COLS = 2  # columns of a diagonal block's inverse one lane forms (level 0, blocked)
KSTEP = 128  # K columns per GEMM step (one step for K <= 128)
THREADS = 128
ACC = "float32"
MIN_BLOCKS = 4  # caps registers at 128 per thread: four CTAs per SM (shared memory allows it too)
CHANNEL_MIN_BLOCKS = 2  # per-channel gate: its gc and score tiles leave room for two CTAs at most (bf16), so no cap


def inverse_buffers(C: int, P: int, method: str) -> SimpleNamespace:
    """tile_inverse's buffers for P value heads at chunk C, allocated in the calling kernel's body under their names
    (as chunk_fwd_ws.allocate_shared does: unnamed, their generated names would vary between processes, and with
    them the kernel cache's keys): Xd (I + L_bb of the P * NB diagonal 16x16 blocks on entry; Neumann's fp32
    blocks), col and bcol (blocked: a lane's columns of level 0 and their column factors), Ts (C >= 32: one fp16
    64x64 tile a head, -L_10 and -M_10 in their blocks on entry, the levels' operands), each level-1 warp's fragments
    (`warps`: F1 and H1 by warp), F32 (level 2's accumulator, C == 64) and Neumann's scratch (None where a
    configuration has none); layouts: Xd's (linear), for the caller's one T.annotate_layout."""
    NB = TILE // BLOCK
    shapes = {  # name: (allocator, shape, dtype)
        "Xd": (T.alloc_shared, (P * NB, BLOCK + 1, BLOCK), ACC),
        "col": (T.alloc_local, (COLS, BLOCK), ACC),
        "bcol": (T.alloc_local, (COLS,), ACC),  # their column factors (beta where scaled)
    }
    if C >= 32:
        shapes["Ts"] = (T.alloc_shared, (P, TILE, TILE), "float16")
        for w in range(2 * P):
            shapes.update({f"F1_{w}": (T.alloc_fragment, (BLOCK, BLOCK), ACC),
                           f"H1_{w}": (T.alloc_fragment, (BLOCK, BLOCK), "float16")})
    if C == 64:
        shapes["F32"] = (T.alloc_fragment, (32, 32), ACC)
    if method == "neumann":
        shapes.update(Q_a=(T.alloc_shared, (P, TILE, BLOCK), "float16"),
                      Q_b=(T.alloc_shared, (P, BLOCK, TILE), "float16"),
                      X_a=(T.alloc_shared, (P, TILE, BLOCK), "float16"),
                      F=(T.alloc_fragment, (TILE, TILE), ACC))
    inv = SimpleNamespace(**dict.fromkeys(("Ts", "F32", "Q_a", "Q_b", "X_a", "F")))
    for name, (alloc, shape, dtype) in shapes.items():
        setattr(inv, name, IRBuilder.name(name, alloc(shape, dtype)))
    inv.warps = SimpleNamespace(**{kind: [getattr(inv, f"{kind}_{w}", None) for w in range(2 * P)]
                                   for kind in ("F1", "H1")})
    inv.layouts = {inv.Xd: tilelang.layout.make_linear_layout(inv.Xd)}
    return inv


def block_layout(buffer):
    """The layout of a (n, BLOCK + 1, BLOCK) fp32 buffer of 16x16 blocks that a tensor-core accumulator fills: blocks
    BLOCK + 1 rows apart (two neighbouring blocks half a bank row apart), rows linear, except that a row r with
    r // 2 odd holds its columns rotated by 8. An accumulator's 8-byte row pieces reach rows r and r + 2 in one
    phase, which the rotation puts on distinct banks; 4-column groups stay contiguous (16-byte row reads)."""
    return T.Layout(buffer.shape, lambda b, r, c: (b * (BLOCK + 1) + r) * BLOCK + (c + r // 2 % 2 * 8) % BLOCK)


def tile_inverse(C: int, P: int, method: str, scaled: bool = False):
    """The macro invert(inv, out_s, beta_s, tx) (inv: inverse_buffers' buffers; out_s a (TILE, >= P, C) shared
    staging, beta_s (P, TILE) fp32, tx the thread): the block-diagonal inverse of P value heads' tiles into
    out_s[i, p, :] (row i keeps the C columns of its own chunk), by levels 0-2 of the module docstring. scaled:
    Ab = A diag(beta) instead, column j of head p times beta_s[p, j] (j the tile row of the column's token) as each
    level stages its fp32 blocks, so out_s holds Ab rounded once and leaves as it is staged; beta_s is not read
    otherwise.

    On entry Xd holds I + L_bb of the diagonal blocks and, at C >= 32, Ts holds -L_10 of each 32 half and -M_10 in
    their blocks (C == 64: blocks (0, 1) and (2, 3), which level 2's X_00 and X_11 span, zero). Each level stages
    its own blocks of out_s from fp32 (the blocks above each chunk's diagonal are zero-filled, four columns a store) and
    leaves in the fp16 tile Ts what a later level reads, so every operand is read where it lies: level 0 its X_b
    in Ts's diagonal blocks. Level 1: warp w = 2 p + x forms X_10 = (X_11 (-L_10)) X_00 of head p's 32 half x as
    two chained mma.sync products, the first result kept in registers as the second's left operand (fp16 operands,
    fp32 accumulation), and at C == 64 writes it into Ts in place of -L_10. Level 2 (C == 64): the whole CTA forms
    each head's (X_11 (-M_10)) X_00 over Ts's 32x32 blocks, the first product's result in place of -M_10."""
    NB = TILE // BLOCK

    def column(value, beta_s, p, j):
        """An fp32 entry of column j (a tile row) of head p as staged: times beta_s[p, j] where scaled."""
        return value * beta_s[p, j] if scaled else value

    @T.macro
    def neumann_blocks(p, Xd, Q_a, Q_b, X_a, F):
        """Xd[p*NB + b] <- (I + L_b)^-1 for the NB diagonal blocks of head p (Xd holds I + L_b on entry).

        (I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8) since L^16 = 0. The NB blocks go through each product
        together: stacked 64x16 (A operand) times side by side 16x64 (B operand), of which the diagonal 16x16
        blocks are the NB block products. Operands fp16, accumulation fp32; Xd keeps X in fp32."""
        for i, j in T.Parallel(TILE, BLOCK):
            eye = T.if_then_else(i % BLOCK == j, 1.0, 0.0)
            Q_a[p, i, j] = Xd[p * NB + i // BLOCK, i % BLOCK, j] - eye
            Q_b[p, i % BLOCK, (i // BLOCK) * BLOCK + j] = Xd[p * NB + i // BLOCK, i % BLOCK, j] - eye
            X_a[p, i, j] = 2.0 * eye - Xd[p * NB + i // BLOCK, i % BLOCK, j]
            Xd[p * NB + i // BLOCK, i % BLOCK, j] = 2.0 * eye - Xd[p * NB + i // BLOCK, i % BLOCK, j]
        for level in T.unroll(6):  # Q1 = L^2, X1 = X0 (I + Q1), Q2, X2, Q3, X3
            if level % 2 == 0:
                T.gemm(Q_a[p, :, :], Q_b[p, :, :], F, clear_accum=True)
                for i, j in T.Parallel(TILE, TILE):
                    if i // BLOCK == j // BLOCK:
                        Q_a[p, i, j % BLOCK] = F[i, j]
                        Q_b[p, i % BLOCK, j] = F[i, j]
            else:
                T.gemm(X_a[p, :, :], Q_b[p, :, :], F, clear_accum=True)
                for i, j in T.Parallel(TILE, TILE):
                    if i // BLOCK == j // BLOCK:
                        Xd[p * NB + i // BLOCK, i % BLOCK, j % BLOCK] += F[i, j]
                        X_a[p, i, j % BLOCK] = Xd[p * NB + i // BLOCK, i % BLOCK, j % BLOCK]

    @T.macro
    def forward_substitution(Xd, col, bcol, Ts, out_s, beta_s, tx):
        """Level 0, blocked: the P * NB diagonal 16x16 blocks of Xd inverted into their blocks of out_s (as staged)
        and, at C >= 32, of Ts (fp16), each rounded once from fp32. Lane (b, u) owns columns t = COLS u + j,
        j < COLS, of block b (BLOCK / COLS lanes a block) and forms them down the rows in registers,
        X_rt = delta_rt - sum_m<r L_rm X_mt: an entry of L a lane reads serves its COLS columns, so a warp's 16-byte
        read of L (a wavefront a quarter warp, whose lanes share one block) serves 32 COLS / BLOCK blocks."""
        lanes = BLOCK // COLS * P * NB
        b = tx // (BLOCK // COLS) % (P * NB)
        t = tx % (BLOCK // COLS) * COLS
        p, i0 = b // NB, b % NB * BLOCK  # the block's head and first tile row
        lane = tx < (lanes + 31) // 32 * 32  # whole warps (the rest of the last repeats its blocks)
        if lane:
            for r in T.unroll(BLOCK):
                for j in T.unroll(COLS):
                    col[j, r] = T.if_then_else(r == t + j, 1.0, 0.0)
                for m in T.unroll(r):
                    for j in T.unroll(COLS):
                        col[j, r] -= Xd[b, r, m] * col[j, m]
            for j in T.unroll(COLS):
                bcol[j] = beta_s[p, i0 + t + j] if scaled else 1.0
            for r in T.unroll(BLOCK):
                for j in T.vectorized(COLS):
                    out_s[i0 + r, p, i0 % C + t + j] = T.cast(col[j, r] * bcol[j], out_s.dtype)
                if C >= 32:
                    for j in T.vectorized(COLS):
                        Ts[p, i0 + r, i0 + t + j] = T.cast(col[j, r], "float16")

    @T.macro
    def level0(inv, out_s, beta_s, tx):
        """The P * NB diagonal 16x16 blocks inverted, into their blocks of out_s and, at C >= 32, of Ts."""
        if method == "blocked":
            forward_substitution(inv.Xd, inv.col, inv.bcol, inv.Ts, out_s, beta_s, tx)
        else:
            for p in T.unroll(P):
                neumann_blocks(p, inv.Xd, inv.Q_a, inv.Q_b, inv.X_a, inv.F)
            for p, b, r, c in T.Parallel(P, NB, BLOCK, BLOCK):
                out_s[b * BLOCK + r, p, (b * BLOCK + c) % C] = column(inv.Xd[p * NB + b, r, c], beta_s, p,
                                                                      b * BLOCK + c)
                if C >= 32:
                    inv.Ts[p, b * BLOCK + r, b * BLOCK + c] = T.cast(inv.Xd[p * NB + b, r, c], "float16")

    @T.macro
    def level1_warp(w, Ts, W, out_s, beta_s):
        """Warp w's level-1 coupling (head w // 2, 32 half w % 2): X_10 = (X_11 (-L_10)) X_00 over Ts's 16x16
        blocks, into its block of out_s and, where level 2 reads it (C == 64), into Ts in place of -L_10."""
        p, h = w // 2, w % 2 * 32
        T.gemm(Ts[p, h + BLOCK : h + 32, h + BLOCK : h + 32], Ts[p, h + BLOCK : h + 32, h : h + BLOCK], W.F1[w],
               clear_accum=True)
        T.copy(W.F1[w], W.H1[w])
        T.gemm(W.H1[w], Ts[p, h : h + BLOCK, h : h + BLOCK], W.F1[w], clear_accum=True)
        for r, c in T.Parallel(BLOCK, BLOCK):
            out_s[h + BLOCK + r, p, (h + c) % C] = column(W.F1[w][r, c], beta_s, p, h + c)
        if C == 64:
            T.copy(W.F1[w], Ts[p, h + BLOCK : h + 32, h : h + BLOCK])

    @T.macro
    def level1(Ts, W, out_s, beta_s, tx):
        """Level 1 of warps 0 to 2 P - 1 (warp w = 2 p + x), each in a branch of its own thread range."""
        if tx < 32:
            level1_warp(0, Ts, W, out_s, beta_s)
        elif tx < 64:
            level1_warp(1, Ts, W, out_s, beta_s)
        elif tx < 96:
            if P == 2:
                level1_warp(2, Ts, W, out_s, beta_s)
        else:
            if P == 2:
                level1_warp(3, Ts, W, out_s, beta_s)

    @T.macro
    def invert(inv, out_s, beta_s, tx):
        # zeros in each chunk's blocks above the diagonal, four columns a store; the levels stage the rest
        if C >= 32:
            for p, i, q in T.Parallel(P, TILE, C // 4):
                if i % C // BLOCK < q * 4 // BLOCK:
                    for c in T.vectorized(4):
                        out_s[i, p, q * 4 + c] = T.cast(0, out_s.dtype)
        level0(inv, out_s, beta_s, tx)
        if C >= 32:
            level1(inv.Ts, inv.warps, out_s, beta_s, tx)
        if C == 64:  # level 2: X_10 = (X_11 (-M_10)) X_00 between the two 32 halves
            for p in T.unroll(P):
                T.gemm(inv.Ts[p, 32:TILE, 32:TILE], inv.Ts[p, 32:TILE, 0:32], inv.F32, clear_accum=True)
                T.copy(inv.F32, inv.Ts[p, 32:TILE, 0:32])
                T.gemm(inv.Ts[p, 32:TILE, 0:32], inv.Ts[p, 0:32, 0:32], inv.F32, clear_accum=True)
                for r, c in T.Parallel(32, 32):
                    out_s[32 + r, p, c] = column(inv.F32[r, c], beta_s, p, c)

    return invert


def kkt_solve_kernel(chunk: int, method: str, dtype: str, gate: str, pair: int, gate_in: tuple | None = None,
                     scaled: bool = False) -> T.PrimFunc:
    """Build the prim_func for static (chunk, method, dtype, gate, pair, gate_in, scaled); gate "none", "scalar" or
    "channel" (per key channel: one value head per pass, K <= 128, g the float32 chunk-local cumsum [.., HV, K]).
    scaled: store Ab = A diag(beta) (column j times beta of the chunk's token j; reference.kkt.kkt_solve's
    beta_columns), the warp-specialised pass's operand, instead of A (not under the per-channel gate). gate_in
    (scalar gate at chunk 64 only): None when g is the float32 chunk-local cumsum, else (g dtype, gate form) of the
    raw gate [1, T, HV], which the kernel sums itself (chunk_local_cumsum's stage, one warp per value head scanning
    the tile's rows: chunk_cumsum) and writes to gc for the state pass, so no cumsum launch runs before it;
    A_log and dt_bias its in-kernel gate's parameters (each per value head or one value) and gate_scale the factor on
    the sum (placeholders and 1 otherwise). Every size (tokens, heads, K, sequences) is symbolic, so a new T, head
    count or varlen layout reuses the compiled kernel; so is group_steps, the groups of P value heads a CTA runs in
    turn (plan.kkt_group_steps; the grid's third dimension spans the rest)."""
    C, P = chunk, pair
    scalar, channel = gate == "scalar", gate == "channel"
    row_blocks = tuple(range(TILE // BLOCK))
    if channel and pair != 1:
        raise ValueError(f"pair: a per-channel gate takes one value head per pass, got {pair}")
    if channel and scaled:
        raise ValueError("scaled: Ab for the warp-specialised pass comes from gla_factors under a per-channel gate, "
                         "got scaled=True with gate 'channel'")
    if gate_in is not None and not (scalar and chunk == TILE):
        raise ValueError(f"gate_in: kkt_solve sums the scalar gate at chunk {TILE} only, got gate {gate!r} at chunk "
                         f"{chunk}")
    g_dtype, form = (ACC, None) if gate_in is None else gate_in
    score_dtype = channel_score_dtype(dtype)
    NB = TILE // BLOCK  # diagonal 16x16 blocks per tile
    num_tokens, H, HV = T.dynamic("num_tokens"), T.dynamic("H"), T.dynamic("HV")  # HV = G * H
    K = T.dynamic("KB") * 64  # K a multiple of 64: column bounds checks are uniform over 16-byte vectors
    num_bounds = T.dynamic("num_bounds")  # N + 1
    g_tokens, g_heads = T.dynamic("g_tokens"), T.dynamic("g_heads")  # (1, 1) dummy when ungated
    num_a, num_b, gc_tokens = T.dynamic("num_a, num_b, gc_tokens")  # placeholders unless gate_in
    invert = tile_inverse(C, P, method, scaled)

    @T.macro
    def chunk_cumsum(g_s, gc, start, rows, hv0, heads, gate_scale, tx):
        """g_s[p] <- log2(e) gate_scale x the running sum of g_s[p] over the tile's rows (the chunk-local cumsum:
        the tile is one chunk), in float32 by warp p: lane l sums rows 2l and 2l + 1 in order, the lanes' pair sums
        are scanned by shuffles (offsets 1, 2, 4, 8, 16), and each row adds the lanes' total before it; the rows
        before the sequence end of the live value heads p < heads also to gc (unscaled by log2(e))."""
        if tx < 32 * P:
            p, lane = tx // 32, tx % 32
            first = T.alloc_var(ACC)
            first = g_s[p, 2 * lane]
            pair = T.alloc_var(ACC)
            pair = first + g_s[p, 2 * lane + 1]
            for d in T.unroll(5):
                before = T.shfl_up(pair, 1 << d)
                if lane >= (1 << d):
                    pair = pair + before
            inclusive = T.alloc_var(ACC)  # row 2l + 1's sum; row 2l's leaves the second row out
            inclusive = pair
            pair = T.shfl_up(inclusive, 1)
            if lane == 0:
                pair = 0.0
            g_s[p, 2 * lane + 1] = inclusive * gate_scale
            g_s[p, 2 * lane] = (pair + first) * gate_scale
        for p, i in T.Parallel(P, TILE):
            if i < rows and p < heads:
                gc[0, start + i, hv0 + p] = g_s[p, i]
        for p, i in T.Parallel(P, TILE):
            g_s[p, i] = g_s[p, i] * LOG2E

    @T.macro
    def load_k(k, start, end, hk, kb, k_s):
        """k_s <- the tile's K columns [kb KSTEP, (kb + 1) KSTEP) of q/k head hk (zero past K), rows past the sequence
        end repeating its last row (finite, and masked by every product a live row takes): in bounds without
        TileLang's per-access tests (launch.GUARDED)."""
        for i, d in T.Parallel(TILE, KSTEP):
            k_s[i, d] = T.if_then_else(kb * KSTEP + d < K, k[0, T.min(start + i, end - 1), hk, kb * KSTEP + d],
                                       T.cast(0, dtype))

    @T.macro
    def tma_k(k, start, hk, kb, k_s, landed, tx):
        """k_s <- the tile's rows [start, start + 64) and K columns [kb KSTEP, (kb + 1) KSTEP) of q/k head hk by one
        TMA load, waited for on `landed` (phase kb % 2; a later step's load starts once every thread has read the
        slice). Columns past K and rows past the tensor end arrive as zeros; rows past the sequence end hold the next
        sequence's, whatever their values: a product entry only meets the two rows it pairs, and every entry with a
        row past the end is selected away (extract), so they reach nothing a live row reads."""
        if kb > 0:
            T.fence_proxy_async()
            T.sync_threads()
        if tx < 32:  # one warp: TileLang elects the lane that issues the load
            T.tma_copy(k[0, start : start + TILE, hk, kb * KSTEP : (kb + 1) * KSTEP], k_s, barrier=landed[0])
            T.barrier_arrive(landed[0])
        T.barrier_wait(landed[0], kb % 2)

    @T.macro
    def fetch(beta, g, A_log, dt_bias, G, grp, start, rows, hk, tx, raw):
        """raw <- beta, the scalar gate (g, or the raw gate as float32) and its A_log and dt_bias of row tx % TILE of
        value head tx // TILE of group grp (0 past the sequence end, the q/k head's value heads or its groups), as
        loads left in flight: nothing reads raw before the group's step stores it to shared memory."""
        hv = hk * G + grp * P + tx // TILE
        live = tx < P * TILE and tx % TILE < rows and grp * P + tx // TILE < G and grp < T.ceildiv(G, P)
        raw[0] = T.if_then_else(live, beta[0, start + tx % TILE, hv], 0.0)
        if scalar:
            raw[1] = T.if_then_else(live, T.cast(g[0, start + tx % TILE, hv], ACC), 0.0)
        if gate_in is not None:
            raw[2] = A_log[T.min(hv, num_a - 1)]
            raw[3] = dt_bias[T.min(hv, num_b - 1)]

    @T.macro
    def extract_block(KKs, beta_s, g_s, rows, Xd, Ts, kk, tx, bi, bj, dest):
        """Thread tx's four entries of L (extract) in block (bi, bj) of each head into dest: "Xd" its diagonal block
        bi (I + L), "Ts" block (bi, bj) of the head's fp16 tile (-L)."""
        r = tx % (THREADS // 2) // (BLOCK // 4)
        c0 = tx % (BLOCK // 4) * 4
        for c in T.vectorized(4):
            kk[c] = KKs[bi * (bi + 1) // 2 + bj, r, c0 + c]
        for p in T.unroll(P):
            i = bi * BLOCK + r
            for c in T.vectorized(4):
                # on a diagonal block, 1 strictly below the diagonal and 0 elsewhere: a factor, not a select, so the
                # four entries stay one vector. The exponent is zeroed on and above the diagonal (>= 0 there), so
                # those entries are exactly 0 and 1 wherever K K^T is finite (under the per-channel gate: within the
                # e^-80 bound of gated_kkt; neumann reads them)
                below = T.cast(c0 + c < r, ACC) if dest == "Xd" else 1.0
                x = beta_s[p, i] * kk[c]
                if scalar:
                    x = x * T.exp2((g_s[p, i] - g_s[p, bj * BLOCK + c0 + c]) * below)
                L = T.if_then_else(i < rows, x, 0.0)
                if dest == "Xd":
                    Xd[p * NB + bi, r, c0 + c] = L * below + T.cast(r == c0 + c, ACC)
                else:
                    Ts[p, i, bj * BLOCK + c0 + c] = T.cast(-L, Ts.dtype)

    @T.macro
    def extract(KKs, beta_s, g_s, rows, Xd, Ts, kk, tx):
        """From K K^T's lower blocks, each head p's L_ij = beta_i (K K^T)_ij exp(g_i - g_j) (i = 16 bi + r > j =
        16 bj + c in one chunk; a per-channel gate is in KKs already) into the inverse's inputs
        (tile_inverse): I + L on the diagonal blocks (Xd), -L_10 of each 32 half (C >= 32) and -M_10 (C == 64) in
        their blocks of Ts, and at C == 64 zeros in the blocks above the diagonal that level 2's operands X_00 and
        X_11 span, (0, 1) and (2, 3). Rows past the sequence end are 0 (selected, not multiplied: their exponent is
        unbounded). Thread tx forms four neighbouring entries of a row, r = (tx % 64) / 4, c = 4 (tx % 4) + 0..3, of
        the block its half of the CTA (h = tx / 64) takes in each step, two blocks a step: one 16-byte read of KKs
        (into kk) serves the P heads."""
        h = tx // (THREADS // 2)
        for step in T.unroll(NB // 2):  # the diagonal blocks 2 step + h
            extract_block(KKs, beta_s, g_s, rows, Xd, Ts, kk, tx, 2 * step + h, 2 * step + h, "Xd")
        if C >= 32:  # L_10 of 32 half h
            extract_block(KKs, beta_s, g_s, rows, Xd, Ts, kk, tx, 2 * h + 1, 2 * h, "Ts")
        if C == 64:  # M_10's blocks (2 + a, h), and the zero blocks
            for a in T.unroll(2):
                extract_block(KKs, beta_s, g_s, rows, Xd, Ts, kk, tx, 2 + a, h, "Ts")
            for p, a, r, c in T.Parallel(P, 2, BLOCK, BLOCK):
                Ts[p, 32 * a + r, 32 * a + BLOCK + c] = T.cast(0, Ts.dtype)

    @T.macro
    def gated_kkt(k_s, g_s, Qr, Kr, KK, KKs):
        """KKs <- the lower 16x16 blocks of (Gamma ⊙ K K^T) for one value head under a per-channel gate, from its K
        tile k_s and log2(e) gc tile g_s (common.gate_tile: rows past the sequence end hold its last row's):
        exp(g_id - g_jd) = exp(g_id - R_ad) exp(R_ad - g_jd) with R_a the gate at the first row of row block a, so
        off the diagonal block both exponents are <= 0 and on it the positive one spans at most 16 tokens (exact
        while no channel decays by more than e^-80 within 16 tokens, as in chunk_fwd.py). Qr holds every row
        against its own block's reference, formed once; row block a takes its rows of the 64 x 64 product of Qr and
        Kr = the rows j < 16 (a + 1) of k_j exp(R_a - g_j), zero outside a's chunk (selected: R_a - g_j is
        unbounded there). Kr's later rows are zeros, in columns not extracted."""
        for i, d in T.Parallel(TILE, KSTEP):
            Qr[i, d] = T.if_then_else(d < K, k_s[i, d] * T.exp2(g_s[i, d] - g_s[i // BLOCK * BLOCK, d]), 0.0)
        T.clear(Kr)
        for a in row_blocks:
            for j, d in T.Parallel((a + 1) * BLOCK, KSTEP):
                Kr[j, d] = T.if_then_else(j // C == a * BLOCK // C and d < K,
                                          k_s[j, d] * T.exp2(g_s[a * BLOCK, d] - g_s[j, d]), 0.0)
            T.gemm(Qr, Kr, KK, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(TILE, TILE):
                if i // BLOCK == a and j // BLOCK <= a:
                    KKs[a * (a + 1) // 2 + j // BLOCK, i % BLOCK, j % BLOCK] = KK[i, j]

    @T.prim_func
    def kkt_solve(
        k: T.Tensor((1, num_tokens, H, K), dtype),
        beta: T.Tensor((1, num_tokens, HV), ACC),
        g: T.Tensor((1, g_tokens, g_heads, K) if channel else (1, g_tokens, g_heads), g_dtype),
        A_log: T.Tensor((num_a,), ACC),
        dt_bias: T.Tensor((num_b,), ACC),
        cu_seqlens: T.Tensor((num_bounds,), "int32"),
        A: T.Tensor((1, num_tokens, HV, C), dtype),
        gc: T.Tensor((1, gc_tokens, g_heads) if gate_in else (1,), ACC),
        G: T.int32,
        group_steps: T.int32,
        gate_scale: T.float32,
        num_slots: T.int32,
        dense_len: T.int32,
        search_steps: T.int32,
    ):
        groups = T.ceildiv(G, P)  # of P value heads per q/k head, group_steps of them a CTA in turn
        with T.Kernel(num_slots, H, T.ceildiv(groups, group_steps), threads=THREADS) as (slot, hk, bz):
            tx = T.get_thread_binding()
            T.annotate_min_blocks_per_sm(CHANNEL_MIN_BLOCKS if channel else MIN_BLOCKS)
            bounds = T.alloc_local((2,), "int32")
            locate_tile(slot, cu_seqlens, num_bounds, dense_len, search_steps, bounds)
            start = bounds[0]
            end = bounds[1]

            if start < end:
                rows = T.min(end - start, TILE)
                k_s = T.alloc_shared((TILE, KSTEP), dtype)  # K slice; later the output staging (same bytes)
                out_s = T.view(k_s, (TILE, KSTEP // C, C), dtype)
                KK = T.alloc_fragment((TILE, TILE), ACC)
                KKs = T.alloc_shared((NB * (NB + 1) // 2, BLOCK + 1, BLOCK), ACC)  # lower 16x16 blocks of K K^T
                beta_s = T.alloc_shared((P, TILE), ACC)
                g_s = T.alloc_shared((P, TILE), ACC)
                inv = inverse_buffers(C, P, method)
                T.annotate_layout({KKs: block_layout(KKs), **inv.layouts})
                if channel:  # row block a's scores against the reference R_a = g at its first row
                    gc_s = T.alloc_shared((TILE, KSTEP), ACC)  # log2(e) gc of the value head
                    Qr = T.alloc_shared((TILE, KSTEP), score_dtype)  # k_i exp(g_i - R_a(i))
                    Kr = T.alloc_shared((TILE, KSTEP), score_dtype)  # k_j exp(R_a - g_j), j in a's chunk, j < a's end

                k_landed = None if channel else T.alloc_barrier(32)  # tma_k's (a warp arrives), one phase a K step
                raw = T.alloc_local((4,), ACC)  # fetch's beta, gate, A_log and dt_bias of one row
                kk = T.alloc_local((4,), ACC)  # extract's four entries of K K^T
                fetch(beta, g, A_log, dt_bias, G, bz * group_steps, start, rows, hk, tx, raw)  # in flight during K K^T

                # K K^T of the tile for the CTA's value heads (all of q/k head hk); its lower blocks go to shared
                if not channel:
                    T.clear(KK)
                    for kb in T.serial(T.ceildiv(K, KSTEP)):
                        tma_k(k, start, hk, kb, k_s, k_landed, tx)
                        T.gemm(k_s, k_s, KK, transpose_B=True)
                    for i, j in T.Parallel(TILE, TILE):
                        if i // BLOCK >= j // BLOCK:
                            KKs[(i // BLOCK) * (i // BLOCK + 1) // 2 + j // BLOCK, i % BLOCK, j % BLOCK] = KK[i, j]

                for step in T.serial(group_steps):
                    grp = bz * group_steps + step
                    if grp < groups:
                        hv0 = hk * G + grp * P
                        if tx < P * TILE:  # from the registers fetch filled; then the next group's fetch is in flight
                            beta_s[tx // TILE, tx % TILE] = raw[0]
                            if scalar and gate_in is None:
                                g_s[tx // TILE, tx % TILE] = raw[1] * LOG2E
                            elif scalar:  # the formed, floored gate (0 past the live rows); summed below
                                g_s[tx // TILE, tx % TILE] = T.if_then_else(
                                    tx % TILE < rows and grp * P + tx // TILE < G,
                                    floored_log_gate(raw[1], exp_e(raw[2]), raw[3], form), 0.0)
                        fetch(beta, g, A_log, dt_bias, G, grp + 1, start, rows, hk, tx, raw)
                        if gate_in is not None:
                            chunk_cumsum(g_s, gc, start, rows, hv0, G - grp * P, gate_scale, tx)
                        if channel:  # the value head's own scores; k_s is the previous group's output staging
                            load_k(k, start, end, hk, 0, k_s)
                            gate_tile(g, start, end, hv0, K, gc_s)
                            gated_kkt(k_s, gc_s, Qr, Kr, KK, KKs)

                        # extraction: I + L on the diagonal blocks, -L_10 and -M_10 off them (L_ij, i > j, same chunk)
                        extract(KKs, beta_s, g_s, rows, inv.Xd, inv.Ts, kk, tx)
                        invert(inv, out_s, beta_s, tx)

                        # write back the rows of this sequence, for the live value heads, as staged
                        for i, p, j in T.Parallel(TILE, P, C):
                            if i < rows and grp * P + p < G:
                                A[0, start + i, hv0 + p, j] = out_s[i, p, j]

    return kkt_solve
