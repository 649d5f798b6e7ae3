"""The sequence split's warm-up table (kernels.hopper.seq_split, the delta rule with a scalar gate). Mirrors
reference.seq_split.warmup_table:

    d_c  = gc at the last token of chunk c (chunk c's summed log decay)
    start_n = initial_row(n) = -2 - n with initial states (the outputs pass reads h0[n] itself), else -1 (zero)
    for segment j of sequence n, its first chunk c0 of the sequence, value head h:
      w_j = the fewest chunks w >= 1 with d_{c0-w} + ... + d_{c0-1} <= WARMUP_BOUND, if w <= max_chunks:
            the outputs pass enters it from a zero state w chunks back (table (w, -1)): what that drops of the
            past is scaled by exp(the sum) <= e^-17 < 2^-24 (with ||I - beta k k^T|| <= 1), below fp32's rounding
      else w_j = c0 from the sequence's initial state, if c0 <= max_chunks: exact (table (c0, start_n))
      else unbounded
    a sequence's first segment: (0, start_n); a (sequence, head) with an unbounded segment: (-1, j) for each of
    its segments j but the last, (0, j) there (the transitions' pass and the combine give its entering states,
    exactly; no entering state reads the last segment's transition, so its transitions' CTA runs no chunk)
    table[2]: n at a sequence's last segment (the outputs pass stores its final state as the sequence's), else
             N (one row past the N sequences' that no one reads: every segment's CTA stores without a branch)

table[0] holds w (-1: the transitions), table[1] the state the outputs pass starts from (a row of the entering
states S_in, -1: zero, -2 - n: the initial state h0[n]), table[2] the row of the final states ([N + 1] rows,
the first N the sequences'). The sums run in float32 in chunk order, as the reference's.

Grid (N, HV), 128 threads: thread t takes segments first[n] + t, + 128, ...; the chunk-end loads of its window
UNROLL at a time, all issued before the sums that use them (rows clamped into the tensor; the ones past the window
are not summed); __syncthreads_or finds an unbounded segment of the (sequence, head).
"""

import tilelang.language as T

from ...reference.seq_split import WARMUP_BOUND
from .common import TILE as C

THREADS = 128
UNROLL = 16  # chunk-end loads in flight per thread


def warmup_table_kernel() -> T.PrimFunc:
    """Build the prim_func; tokens, value heads, segment and sequence counts, max_chunks and initial (1: the call has
    initial states) are symbolic."""
    Tn, HV, S, S1, N1 = T.dynamic("Tn, HV, S, S1, N1")

    @T.prim_func
    def warmup_table(
        gc: T.Tensor((1, Tn, HV), "float32"),
        cu_segments: T.Tensor((S1,), "int32"),
        first: T.Tensor((N1,), "int32"),
        table: T.Tensor((3, S, HV), "int32"),
        max_chunks: T.int32,
        initial: T.int32,
    ):
        with T.Kernel(N1 - 1, HV, threads=THREADS) as (bn, bh):
            tid = T.get_thread_binding()
            j0 = first[bn]
            count = first[bn + 1] - j0
            bos = cu_segments[j0]
            start_row = T.if_then_else(initial > 0, -2 - bn, -1)
            ends = T.alloc_local((UNROLL,), "float32")
            total = T.alloc_var("float32")
            w = T.alloc_var("int32")
            row = T.alloc_var("int32")
            start = T.alloc_var("int32")
            c0 = T.alloc_var("int32")
            reach = T.alloc_var("int32")
            unbounded = T.alloc_var("int32")
            unbounded = 0
            for block in T.serial(T.ceildiv(count, THREADS)):
                j = j0 + block * THREADS + tid
                w = 0
                if block * THREADS + tid < count:
                    start = cu_segments[j]
                    c0 = (start - bos) // C
                    reach = T.min(c0, max_chunks)
                    total = 0.0
                    row = start_row
                    if c0 > 0:
                        w = -1
                        for b in T.serial(T.ceildiv(reach, UNROLL)):
                            if w < 0:
                                for u in T.unroll(UNROLL):
                                    ends[u] = gc[0, T.max(start - (b * UNROLL + u) * C - 1, 0), bh]
                                for u in T.unroll(UNROLL):
                                    if w < 0 and b * UNROLL + u < reach:
                                        total += ends[u]
                                        if total <= WARMUP_BOUND:
                                            w = b * UNROLL + u + 1
                                            row = -1
                        if w < 0 and c0 <= max_chunks:
                            w = c0
                    table[0, j, bh] = w
                    table[1, j, bh] = row
                    table[2, j, bh] = T.if_then_else(block * THREADS + tid == count - 1, bn, N1 - 1)
                unbounded = unbounded + T.syncthreads_or(w < 0)
            if unbounded > 0:
                for block in T.serial(T.ceildiv(count, THREADS)):
                    if block * THREADS + tid < count:
                        table[0, j0 + block * THREADS + tid, bh] = T.if_then_else(
                            block * THREADS + tid == count - 1, 0, -1)
                        table[1, j0 + block * THREADS + tid, bh] = j0 + block * THREADS + tid

    return warmup_table
