"""Sequence split, step 2 (kernels.hopper.seq_split): the entering state of every segment, from the segments'
transitions. Two forms, mirroring reference.seq_split's entering_states and transition_entering_states:

plain update (transition "none" / "scalar"): M_j = m_j I, and the final state of every sequence comes out too:

    m_j            = exp(sum over the chunks of segment j of gc at the chunk's last token)    (1 without a gate)
    S_in(first_n)  = h0_n (0 without an initial state)
    S_in(j + 1)    = m_j S_in(j) + B_j                       for the segments j of sequence n, in order
    final_n        = S_in(first_{n+1})                        (after the sequence's last segment)

(B_j: segment j's state from a zero entering state, the transitions' pass.) gc is the chunk-local cumsum of a
scalar log gate, [1, T, HV]; segments start at chunk boundaries of their sequence, so its chunks are the sequence's.

Grid (K / ROWS, N, HV), 128 threads: a CTA owns ROWS rows of one sequence's K x V state for one value head, in
fp32 registers, and walks the sequence's segments in order. B_j does not depend on the state, so it comes through
a two-stage cp.async pipeline and a step is one fused multiply-add and a store. With a gate the decays of up to 128
segments are summed first, one segment per thread, 16 chunk-end loads in flight at a time (all issued before the
first sum uses one, rows clamped into the segment: a sum right behind each load would wait out every latency).

delta rule (transition "matrix"): the transitions' pass gives [B_j | M_j] (K x (V + K)) per segment, and

    S_in(first_n)  = h0_n (0 without an initial state)
    S_in(j + 1)    = M_j S_in(j) + B_j                       in fp32 on the CUDA cores (exact to its rounding)

Under GDN's warm-up a (sequence, head) the table warms up (warm[0] >= 0 at its first segment) needs no entering
state (the outputs pass reads the initial state itself): its CTAs stop after the first row. Grid (V / COLUMNS, M,
HV) over the M sequences cut into more than one segment (the segment table's split; a sequence in one segment
enters from its initial state, which the launcher copies, or under the warm-up the outputs pass reads),
K threads: thread r owns row r of COLUMNS columns of the state; the CTA stages M_j in shared memory (rows padded by
VEC floats, so that the threads' 16-byte reads of their rows fall in distinct banks) one step ahead through
cp.async (M_j does not depend on the state; B_j comes ahead into registers too), keeps the state's columns there,
and a thread forms its row's COLUMNS sums over K per step.
"""

import tilelang.language as T

from .common import TILE, exp_e

ROWS = 16  # state rows per CTA: K / 16 CTAs per sequence and value head
THREADS = 128
UNROLL = 16  # chunk-end loads in flight per thread
COLUMNS = 8  # state columns per CTA of the delta rule's combine
VEC = 4  # M_j's row elements a thread reads at once (16 bytes; rows padded by VEC floats)
TRANSITIONS = ("none", "scalar", "matrix")


def seq_combine_kernel(K: int, V: int, gate: str, use_initial_state: bool, warmup: bool = False) -> T.PrimFunc:
    """Build the prim_func for static (K, V, transition: "none" or "scalar" (the plain update's m_j I), "matrix"
    (the delta rule's M_j), whether an initial state is read, whether the warm-up table is read (matrix only));
    segment and sequence counts, tokens, value heads and segment lengths are symbolic."""
    if gate not in TRANSITIONS:
        raise ValueError(f"gate: the combine takes one of {TRANSITIONS} (the transitions' form), got {gate!r}")
    if warmup and gate != "matrix":
        raise ValueError(f"warmup: the warm-up table belongs to the delta rule's combine ('matrix'), got {gate!r}")
    if gate == "matrix":
        return _matrix_combine(K, V, use_initial_state, warmup)
    if K % ROWS:
        raise ValueError(f"K: a multiple of {ROWS}, got {K}")
    S, N1, N, N0, HV, Tn, S1 = T.dynamic("S, N1, N, N0, HV, Tn, S1")
    accum = "float32"
    scalar = gate == "scalar"

    @T.prim_func
    def seq_combine(
        B: T.Tensor((S, HV, K, V), accum),
        g: T.Tensor((1, Tn, HV) if scalar else (1,), accum),
        cu_segments: T.Tensor((S1,), "int32"),
        first: T.Tensor((N1,), "int32"),
        h0: T.Tensor((N0, HV, K, V), accum),
        S_in: T.Tensor((S, HV, K, V), accum),
        ht: T.Tensor((N, HV, K, V), accum),
    ):
        with T.Kernel(K // ROWS, N1 - 1, HV, threads=THREADS) as (bk, bn, bh):
            r0 = bk * ROWS
            S_f = T.alloc_fragment((ROWS, V), accum)
            B_s = T.alloc_shared((ROWS, V), accum)
            m_s = T.alloc_shared((THREADS,), accum)
            decay = T.alloc_var(accum)
            ends = T.alloc_local((UNROLL,), accum)
            bos = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            j0 = first[bn]
            count = first[bn + 1] - j0

            if use_initial_state:
                T.copy(h0[bn, bh, r0 : r0 + ROWS, :], S_f)
            else:
                T.clear(S_f)
            for block in T.serial(T.ceildiv(count, THREADS)):
                base = j0 + block * THREADS
                if scalar:
                    tid = T.get_thread_binding()
                    decay = 0.0
                    if block * THREADS + tid < count:
                        bos = cu_segments[base + tid]
                        eos = cu_segments[base + tid + 1]
                        for c0 in T.serial(T.ceildiv(eos - bos, TILE * UNROLL)):
                            for c1 in T.unroll(UNROLL):  # all loads first (rows clamped), then the sums
                                ends[c1] = g[0, T.max(T.min(bos + (c0 * UNROLL + c1 + 1) * TILE, eos) - 1, 0), bh]
                            for c1 in T.unroll(UNROLL):
                                decay += T.if_then_else(bos + (c0 * UNROLL + c1) * TILE < eos, ends[c1], 0.0)
                    m_s[tid] = exp_e(decay)
                for i in T.Pipelined(T.min(count - block * THREADS, THREADS), num_stages=2):
                    T.copy(B[base + i, bh, r0 : r0 + ROWS, :], B_s)
                    T.copy(S_f, S_in[base + i, bh, r0 : r0 + ROWS, :])
                    for r, c in T.Parallel(ROWS, V):
                        if scalar:
                            S_f[r, c] = m_s[i] * S_f[r, c] + B_s[r, c]
                        else:
                            S_f[r, c] = S_f[r, c] + B_s[r, c]
            T.copy(S_f, ht[bn, bh, r0 : r0 + ROWS, :])

    return seq_combine


def _matrix_combine(K: int, V: int, use_initial_state: bool, warmup: bool) -> T.PrimFunc:
    """The delta rule's combine (module docstring): S_in [S, HV, K, V] from [B | M] [S, HV, K, V + K]."""
    if V % COLUMNS:
        raise ValueError(f"V: a multiple of {COLUMNS}, got {V}")
    S, N1, N0, HV, NW, M = T.dynamic("S, N1, N0, HV, NW, M")
    accum = "float32"

    @T.prim_func
    def matrix_combine(
        BM: T.Tensor((S, HV, K, V + K), accum),
        first: T.Tensor((N1,), "int32"),
        split: T.Tensor((M,), "int32"),
        h0: T.Tensor((N0, HV, K, V), accum),
        warm: T.Tensor((3, NW, HV) if warmup else (1,), "int32"),
        S_in: T.Tensor((S, HV, K, V), accum),
    ):
        with T.Kernel(V // COLUMNS, M, HV, threads=K) as (bv, bm, bh):
            bn = split[bm]
            c0 = bv * COLUMNS
            M_s = T.alloc_shared((2, K, K + VEC), accum)
            S_s = T.alloc_shared((K, COLUMNS), accum)
            acc = T.alloc_local((COLUMNS,), accum)
            m = T.alloc_local((VEC,), accum)
            Bn = T.alloc_local((COLUMNS,), accum)  # B of the step ahead
            r = T.get_thread_binding()
            j0 = first[bn]
            count = first[bn + 1] - j0
            for c in T.unroll(COLUMNS):
                S_s[r, c] = h0[bn, bh, r, c0 + c] if use_initial_state else 0.0
                S_in[j0, bh, r, c0 + c] = S_s[r, c]
            steps = T.if_then_else(warm[0, j0, bh] < 0, count - 1, 0) if warmup else count - 1
            if steps > 0:
                T.async_copy(BM[j0, bh, :, V : V + K], M_s[0, :, 0:K])
                for c in T.unroll(COLUMNS):
                    Bn[c] = BM[j0, bh, r, c0 + c]
            for j in T.serial(steps):
                for c in T.unroll(COLUMNS):
                    acc[c] = Bn[c]
                if j + 1 < steps:  # the next step's M and B in flight while this one's products run
                    T.async_copy(BM[j0 + j + 1, bh, :, V : V + K], M_s[(j + 1) % 2, :, 0:K])
                    for c in T.unroll(COLUMNS):
                        Bn[c] = BM[j0 + j + 1, bh, r, c0 + c]
                    T.ptx_wait_group(1)
                else:
                    T.ptx_wait_group(0)
                T.sync_threads()
                for k4 in T.serial(K // VEC):
                    for kk in T.vectorized(VEC):
                        m[kk] = M_s[j % 2, r, k4 * VEC + kk]
                    for kk in T.unroll(VEC):
                        for c in T.unroll(COLUMNS):
                            acc[c] += m[kk] * S_s[k4 * VEC + kk, c]
                T.sync_threads()
                for c in T.unroll(COLUMNS):
                    S_s[r, c] = acc[c]
                    S_in[j0 + j + 1, bh, r, c0 + c] = acc[c]

    return matrix_combine
