"""What every Hopper kernel builder shares (TileLang).

target() / pass_configs(): how every kernel is compiled: sm_90a, fast math for exp2, TileLang's automatic warp
specialisation only where asked (chunk_fwd's TMA pipeline gets a producer warp group; the latency-bound kkt_solve
and cumsum kernels want several small CTAs per SM instead), and its per-access bounds tests off where a kernel
guards its accesses itself (launch.GUARDED).

exp_e: exp through exp2 (gates are log-space, natural base).

log_gate / gate_column: a gate column's log gate from FLA's in-kernel gate input, and a tile's chunk-local cumsum
formed in registers, one thread per key channel (gla_factors reads the raw gate once instead of a float32 gc from
global memory); gate_tile: a tile of the float32 gc in shared memory.

locate_tile: the varlen schedule without host synchronisation. Tile slot s of a grid of floor(T / 64) + N slots
belongs to the last sequence n with floor(cu[n] / 64) + n <= s and starts at cu[n] + 64 (s - floor(cu[n] / 64) - n);
a warp finds n by a 32-way search, one round of loads for up to 32 sequences (search_rounds).
The map n -> floor(cu[n] / 64) + n is strictly increasing and leaves room for ceil(len_n / 64) tiles between
consecutive sequences (floor(a / 64) + ceil(l / 64) <= floor((a + l) / 64) + 1), so every tile of every sequence
has exactly one slot; the surplus slots find start >= end and exit. The dense [B, T] layout (flattened to one row of
B * T tokens) is dense_len = T: slot s is tile s % ceil(T / 64) of batch row s // ceil(T / 64).
"""

from types import SimpleNamespace

import tilelang.language as T
from tilelang import tvm

from ..._gates import LOG_GATE_FLOOR
from .plan import CHUNK

TILE = CHUNK  # tokens per CTA tile (and the chunk of the state/output passes)
LOG2E = 1.4426950408889634
SEARCH_WAYS = 32  # candidates locate_tile probes per round: one a lane of a warp


def exp_e(x):
    """exp(x) through the hardware exp2 unit."""
    return T.exp2(x * LOG2E)


def floor_log_gate(g):
    """g clamped from below at tilela._gates.LOG_GATE_FLOOR before any cumsum of raw gates (-inf included; a NaN
    gate stays NaN, as torch.clamp keeps it: a select, not fmaxf, which would drop the NaN). Callers apply it to
    values in shared memory or registers: on a global load, the branch on the loaded value (TileLang guards the
    load and reloads it) makes each of a thread's loads wait for the one before."""
    return T.Select(g < LOG_GATE_FLOOR, T.float32(LOG_GATE_FLOOR), g)


ATANH_TERMS = 6  # terms of log1p(e) = 2 atanh(s) = 2 s sum_n s^2n / (2n + 1): float32's precision for s <= 1/3


def log1p_of_exp(y):
    """log1p(exp(y)) for y <= 0 (e = exp(y) in (0, 1]) as 2 atanh(s), s = e / (2 + e) = 1 / (1 + 2 exp(-y)) <= 1/3
    (one exp2 and one reciprocal; exp(-y) = inf gives s = 0), summed to ATANH_TERMS terms with the 2 folded into
    the coefficients (the next term is below 2^-24 of the sum): float32's relative precision over the whole range,
    small values included (y << 0, a softplus of GDN's usual range), where fast math's log(1 + e) keeps them to an
    absolute 4e-7. Straight-line code: the gate loops unroll it 64 times a thread, and log1pf's branches there stall
    the warps on instruction fetch."""
    s = tvm.tirx.Var("s", "float32")
    series = T.float32(2.0 / (2 * ATANH_TERMS - 1))
    for n in range(ATANH_TERMS - 2, -1, -1):
        series = series * (s * s) + 2.0 / (2 * n + 1)
    return tvm.tirx.Let(s, 1.0 / (1.0 + T.exp2(1.0 - y * LOG2E)), s * series)


def log_gate(x, a, b, form: str):
    """The log gate of one gate column from g's value x (float32) and the column's (a, b), a = exp(A_log) as the
    callers form it from A_log (tilela._gates):
        "log" x,   "softplus" -a softplus(x + b),   "sigmoid" sigmoid(a (x + b))
    (the sigmoid form's lower bound is the caller's scale on the sum). softplus(y) = max(y, 0) + log1p(exp(-|y|)):
    no overflow for large y."""
    if form == "softplus":
        y = tvm.tirx.Var("y", "float32")
        return tvm.tirx.Let(y, x + b, -a * (T.max(y, 0.0) + log1p_of_exp(-T.abs(y))))
    if form == "sigmoid":
        return 1.0 / (1.0 + exp_e(-a * (x + b)))
    return x


def floored_log_gate(x, a, b, form: str):
    """log_gate floored (floor_log_gate) for the log and softplus forms; a sigmoid is >= 0 (NaN stays either way)."""
    if form == "sigmoid":
        return log_gate(x, a, b, form)
    y = tvm.tirx.Var("g", "float32")  # bound once: the floor's select reads it twice
    return tvm.tirx.Let(y, log_gate(x, a, b, form), floor_log_gate(y))


@T.macro
def gate_tile(g, start, end, hv, width, g_s):
    """g_s[i, d] <- log2(e) gc of token start + i, value head hv, key channel d < width (0 for d >= width), from g
    [1, T, HV, width], the float32 chunk-local cumsum, for the 64 rows of a tile: one chunk from start, rows past
    the sequence end holding its last row's gc."""
    for i, d in T.Parallel(TILE, g_s.shape[1]):
        g_s[i, d] = T.if_then_else(d < width, g[0, T.min(start + i, end - 1), hv, d] * LOG2E, 0.0)


@T.macro
def gate_column(g, A_log, dt_bias, scale, start, end, hv, width, gl, part_s, form):
    """gl[i, v] <- log2(e) gc of row r0 + i of the tile from start (token start + r0 + i), value head hv, key channel
    d0 + v, in registers: gl is [RUN, VEC]; thread tx owns the VEC channels from d0 = VEC (tx % (width / VEC)) and
    the run of RUN rows from r0 = RUN (tx // (width / VEC)) (so RUN = TILE width / (VEC THREADS)); rows past the
    sequence end hold its last row's gc.
    form None: g [1, T, HV, width] is gc already (float32). Else g is the raw gate input of that form (log_gate;
    A_log and dt_bias its parameters, per value head and per column hv width + d, each or one value for all (entry
    min(hv or column, n - 1) of n); scale the factor on the sum, the sigmoid form's lower bound): a run's loads all in
    flight (VEC channels a load), then formed and floored (floored_log_gate) and summed; a run after the first adds
    the totals of the runs before it (part_s: [runs, width] float32 shared)."""
    run, vec = gl.shape
    tx = T.get_thread_binding()
    d0 = tx % (width // vec) * vec
    r = tx // (width // vec)
    r0 = r * run
    if form is None:
        for i in T.unroll(run):
            for v in T.vectorized(vec):
                gl[i, v] = g[0, T.min(start + r0 + i, end - 1), hv, d0 + v] * LOG2E
    else:
        ab = T.alloc_local((2, vec), "float32")
        for v in T.unroll(vec):
            ab[0, v] = exp_e(A_log[T.min(hv, A_log.shape[0] - 1)]) if form != "log" else 0.0
            ab[1, v] = dt_bias[T.min(hv * width + d0 + v, dt_bias.shape[0] - 1)] if form != "log" else 0.0
        for i in T.unroll(run):
            for v in T.vectorized(vec):
                gl[i, v] = T.if_then_else(start + r0 + i < end, T.cast(g[0, start + r0 + i, hv, d0 + v], "float32"), 0.0)
        # rows past the end add 0: they keep the last row's sum. The softplus form's long chain is formed on every
        # row (those rows hold g = 0) and masked after, so that the rows interleave (a guard per row serialises them)
        for i in T.unroll(run):
            for v in T.unroll(vec):
                if form == "softplus":
                    gl[i, v] = floored_log_gate(gl[i, v], ab[0, v], ab[1, v], form)
                else:
                    gl[i, v] = T.if_then_else(start + r0 + i < end, floored_log_gate(gl[i, v], ab[0, v], ab[1, v], form),
                                              0.0)
        if form == "softplus":
            for i in T.unroll(run):
                for v in T.unroll(vec):
                    gl[i, v] = T.if_then_else(start + r0 + i < end, gl[i, v], 0.0)
        for i in T.unroll(1, run):
            for v in T.unroll(vec):
                gl[i, v] += gl[i - 1, v]
        for v in T.vectorized(vec):
            part_s[r, d0 + v] = gl[run - 1, v]
        off = T.alloc_local((vec,), "float32")
        for v in T.unroll(vec):
            off[v] = 0.0
        for s in T.unroll(TILE // run - 1):
            if s < r:
                for v in T.unroll(vec):
                    off[v] += part_s[s, d0 + v]
        for i in T.unroll(run):
            for v in T.unroll(vec):
                gl[i, v] = (gl[i, v] + off[v]) * (scale * LOG2E)


SUB = 16  # rows of a sub-chunk of the per-channel scores
# a chunk's sub-chunks, as Python tuples: the loop over them unrolls when the kernel is parsed
SUBCHUNKS = {C: tuple(range(C // SUB)) for C in (SUB, TILE)}


@T.macro
def subchunk_scores(q_s, k_s, g_s, Qr_s, Kr_s, P_f, Pa_f, K, exp, C=TILE):
    """P_f[i, j] <- sum_d q_id k_jd exp(g_id - g_jd) for j <= i of a C-row chunk (C = 16 or 64) under a
    per-key-channel gate (g the chunk-local cumsum, its rows past a sequence end clamped to the last; entries j > i
    are stale: callers select them away). exp(g_i - g_j) cannot be split as exp(g_i) exp(-g_j) over a 64-row chunk
    (exp(-g_j) overflows once a channel has decayed by e^-88), so query rows of 16-row sub-chunk a use the reference
    R_a = g of the row before it (R_0 = 0): one C x C product of q_i exp(g_i - R_a) (Qr_s) and k_j exp(R_a - g_j)
    (Kr_s, key rows j < 16 (a + 1)) per sub-chunk, keeping a's rows (C = 16: one product, R_0 = 0). Only the
    diagonal 16x16 block has a positive exponent, R_a - g_j, over at most 16 tokens: exact while no channel decays
    by more than e^-80 within 16 tokens. exp: exp_e for g in natural-log units, T.exp2 for log2 units."""
    for i, d in T.Parallel(C, K):
        Qr_s[i, d] = q_s[i, d] * exp(g_s[i, d] - T.if_then_else(i >= SUB, g_s[T.max(i // SUB * SUB - 1, 0), d], 0))
    for a in SUBCHUNKS[C]:
        for j, d in T.Parallel((a + 1) * SUB, K):
            Kr_s[j, d] = k_s[j, d] * exp((g_s[a * SUB - 1, d] if a > 0 else 0) - g_s[j, d])
        if a == 0:
            T.gemm(Qr_s, Kr_s, P_f, transpose_B=True, clear_accum=True)
        else:
            T.gemm(Qr_s, Kr_s, Pa_f, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(C, C):
                P_f[i, j] = T.if_then_else(i >= a * SUB, Pa_f[i, j], P_f[i, j])


def channel_score_dtype(dtype: str) -> str:
    """Operand dtype of per-channel gated scores k_j exp(R - g_j): the input dtype, except fp32 (tf32 MMAs) for
    fp16 inputs, whose 65504 the factor exp(R - g_j) >= 1 may pass (bf16 has fp32's exponent range)."""
    return "float32" if dtype == "float16" else dtype


def extended_value(K, V):
    """Whether a state pass of these sizes is the delta rule's split transitions (V = 2K): v of K columns, extended to
    [v | 0] in the pass (hopper/chunk_fwd_ws.py)."""
    return V == 2 * K


def state_pass_contract(K, V, gate, delta, dtype, beta_dtype, scores=False, warmup=False, chunk=TILE):
    """The launch contract both state/output passes (hopper/chunk_fwd.py, hopper/chunk_fwd_ws.py) compile against,
    as a namespace: the dynamic sizes B, Tn, H, HV, NS1 (batch, tokens, q/k heads, value heads, len(cu_seqlens))
    and the types of the eighteen arguments, in order q, k, v, g, beta, A, h0, cu_seqlens, o, ht, kg, P, warm,
    order, h_init, first, max_chunks, initial.
    Arguments a configuration does not read (g without a gate; beta and A for the plain update; kg and P without
    the factors, so always on chunk_fwd.py, which forms the per-channel gate's products itself) are one-element
    placeholders.
    scores: the per-channel gate's factors (hopper/gla_factors.py) in place of the inputs: q, k carry Qg, Kd (then
    H = HV), g the decays D = exp(gc_last) [tile slots, HV, K] (tile slot of chunk c of sequence n:
    common.locate_tile's, floor(cu[n] / 64) + n + c, dense n ceil(Tn / 64) + c), P the intra-chunk scores [B, Tn,
    HV, 64] and, with the delta rule (KDA), kg = K ⊙ exp(gc) [B, Tn, HV, K] and Ab = A diag(beta) in A (beta then
    unread).
    warmup: the sequence split's warm-up table (hopper/warmup.py) in warm, [3, sequences, HV] int32: the chunks a
    segment's pass starts early (-1: none), the state it enters from (r >= 0: h0's row r, the split's entering
    states; -1: zero; -2 - n: h_init's row n, the call's initial state of sequence n) and the row of ht its final
    state goes to (n at sequence n's last segment, a row past the sequences' elsewhere); h_init [N, HV, K, V] fp32
    (a one-element placeholder without the warm-up or an initial state). The split's transitions pass under the
    warm-up forms the table (hopper/warmup.py) from the gate's cumsum in g, the segments' cu_seqlens, first [N + 1]
    (sequence n's segments first[n] to first[n + 1] - 1), max_chunks (the longest warm-up) and initial (1: the call
    has initial states); the other passes take a one-element first and ignore the scalars.
    order (varlen): the launch order of the sequences, [N] int32 (plan.launch_order: longest chains first, so that
    a skewed batch's long chains start in the first wave), or a one-element placeholder: batch order. The grid walks
    (V blocks, value heads, sequences), the sequences slowest (sequence_of).
    V = 2K (the delta rule's split transitions, hopper/chunk_fwd_ws.py): v and o have K columns, the pass extends
    the value to [V | 0] itself; h0 and ht have V."""
    B, Tn, H, HV, N0, N1, NS1, NSL, NW, NO, NI, NF = T.dynamic("B, Tn, H, HV, N0, N1, NS1, NSL, NW, NO, NI, NF")
    accum = "float32"
    V_in = K if extended_value(K, V) else V  # the value's columns in memory
    g_shape = [NSL, HV, K] if scores else {"none": [1], "scalar": [B, Tn, HV], "channel": [B, Tn, HV, K]}[gate]
    return SimpleNamespace(
        B=B, Tn=Tn, H=H, HV=HV, NS1=NS1, NO=NO,
        q=T.Tensor([B, Tn, H, K], dtype),
        k=T.Tensor([B, Tn, H, K], dtype),
        v=T.Tensor([B, Tn, HV, V_in], dtype),
        g=T.Tensor(g_shape, accum),
        beta=T.Tensor([B, Tn, HV] if delta and not scores else [1], beta_dtype),
        A=T.Tensor([B, Tn, HV, chunk] if delta else [1], dtype),
        h0=T.Tensor([N0, HV, K, V], accum),
        cu_seqlens=T.Tensor([NS1], "int32"),
        o=T.Tensor([B, Tn, HV, V_in], dtype),
        ht=T.Tensor([N1, HV, K, V], accum),
        kg=T.Tensor([B, Tn, HV, K] if scores and delta else [1], dtype),
        P=T.Tensor([B, Tn, HV, TILE] if scores else [1], dtype),
        warm=T.Tensor([3, NW, HV] if warmup else [1], "int32"),
        order=T.Tensor([NO], "int32"),
        h_init=T.Tensor([NI, HV, K, V] if warmup else [1], accum),
        first=T.Tensor([NF] if warmup else [1], "int32"),
        max_chunks=T.int32,
        initial=T.int32,
    )


def sequence_of(sig, order, z):
    """The sequence a state pass's CTA at grid index z (the slowest) runs: order[z] where the launch has an order
    table (NO > 1), else z."""
    return T.if_then_else(sig.NO > 1, order[z], z)


PASS_CONFIGS = {
    "tl.disable_warp_specialized": True,
    "tl.enable_fast_math": True,
}


def pass_configs(warp_specialized: bool, guarded: bool = False) -> dict:
    """guarded: the kernel guards every global access itself, so TileLang's safe-memory legalisation (a bounds test
    on each access, from the tensors' dynamic shapes) is off."""
    unguarded = {"tl.disable_safe_memory_legalize": True} if guarded else {}
    return dict(PASS_CONFIGS, **{"tl.disable_warp_specialized": not warp_specialized}, **unguarded)


def target():
    return tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})


def search_rounds(N: int) -> int:
    """Rounds of locate_tile's search over N sequences: the least r >= 1 with SEARCH_WAYS^r >= N."""
    rounds = 1
    while SEARCH_WAYS ** rounds < N:
        rounds += 1
    return rounds


@T.macro
def locate_tile(slot, cu_seqlens, num_bounds, dense_len, search_steps, bounds):
    """bounds (T.alloc_local((2,), "int32")) <- [start, end): the tile's first token and its sequence's end. Every
    thread of the CTA calls it (each warp searches on its own, in step)."""
    if dense_len > 0:
        tiles = T.ceildiv(dense_len, TILE)
        bounds[0] = (slot // tiles) * dense_len + (slot % tiles) * TILE
        bounds[1] = (slot // tiles + 1) * dense_len
    else:
        # search_steps (search_rounds(N)) rounds over the candidates [lo, lo + width): lane l probes lo + l stride,
        # the probes that pass (f(n) = floor(cu[n] / 64) + n <= slot; f increasing, lane 0's always passes) are the
        # first `hits`, and the range narrows to the last passing probe's stride; the last round's stride is 1, so
        # its lane hits - 1 read cu[n] and cu[n + 1] of the tile's sequence n
        lane = T.get_thread_binding() % SEARCH_WAYS
        lo = T.alloc_var("int32")
        width = T.alloc_var("int32")
        hits = T.alloc_var("int32")
        c0 = T.alloc_var("int32")
        c1 = T.alloc_var("int32")
        lo = 0
        width = num_bounds - 1
        hits = 1
        for _ in T.serial(search_steps):
            stride = T.ceildiv(width, SEARCH_WAYS)
            m = lo + T.min(lane * stride, width - 1)
            c0 = cu_seqlens[m]
            c1 = cu_seqlens[m + 1]
            hits = T.cast(T.popcount(T.ballot(lane * stride < width and c0 // TILE + m <= slot)), "int32")
            width = T.min(stride, width - (hits - 1) * stride)
            lo = lo + (hits - 1) * stride
        first = T.shfl_sync(c0, hits - 1)
        bounds[0] = first + (slot - first // TILE - lo) * TILE
        bounds[1] = T.shfl_sync(c1, hits - 1)
