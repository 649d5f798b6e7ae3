"""Sequence split, step 2 under the plain update (kernels.hopper.seq_split): the entering state of every segment and
the final state of every sequence, from the segments' transitions. Mirrors reference.seq_split.entering_states:

    m_j            = exp(sum over the chunks of segment j of gc at the chunk's last token)    (1 without a gate)
    S_in(first_n)  = h0_n (0 without an initial state)
    S_in(j + 1)    = m_j S_in(j) + B_j                       for the segments j of sequence n, in order
    final_n        = S_in(first_{n+1})                        (after the sequence's last segment)

(B_j: segment j's state from a zero entering state, the transitions' pass; without the delta rule the transition
matrix M of a segment is the scalar m_j times I.) gc is the chunk-local cumsum of a scalar log gate, [1, T, HV];
segments start at chunk boundaries of their sequence, so its chunks are the sequence's.

Grid (K / ROWS, N, HV), 128 threads: a CTA owns ROWS rows of one sequence's K x V state for one value head, in
fp32 registers, and walks the sequence's segments in order. B_j does not depend on the state, so it comes through
a two-stage cp.async pipeline and a step is one fused multiply-add and a store. With a gate the decays of up to 128
segments are summed first, one segment per thread, 16 chunk-end loads in flight at a time (all issued before the
first sum uses one, rows clamped into the segment: a sum right behind each load would wait out every latency).
"""

import tilelang.language as T

from .common import TILE, exp_e

ROWS = 16  # state rows per CTA: K / 16 CTAs per sequence and value head
THREADS = 128
UNROLL = 16  # chunk-end loads in flight per thread


def seq_combine_kernel(K: int, V: int, gate: str, use_initial_state: bool) -> T.PrimFunc:
    """Build the prim_func for static (K, V, gate "none" or "scalar", whether an initial state is read); segment
    and sequence counts, tokens, value heads and segment lengths are symbolic."""
    if gate not in ("none", "scalar"):
        raise ValueError(f"gate: the combine takes 'none' or 'scalar' (scalar transitions), got {gate!r}")
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
