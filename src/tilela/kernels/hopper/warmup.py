"""The sequence split's warm-up table (kernels.hopper.seq_split, the delta rule with a scalar gate), formed by the
split's transitions pass (chunk_fwd_ws.py) before its chunk loop. Mirrors reference.seq_split.warmup_table:

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

A transitions CTA of segment j and value head h forms its segment's row with all its threads: n, j's sequence, as
the count of sequences that end before j (every sequence has a segment, so first is strictly increasing); thread t
takes segments first[n] + t, + threads, ...; the chunk-end loads of its window UNROLL at a time, all issued before
the sums that use them (rows clamped into the tensor; the ones past the window are not summed); __syncthreads_or
finds an unbounded segment of the (sequence, head). Every CTA of the (sequence, head) finds the same, and the
segment's CTA of the first DV block stores the segment's row: the table is whole when the transitions pass ends, for
the combine and the outputs pass after it.
"""

import tilelang.language as T

from ...reference.seq_split import WARMUP_BOUND
from .common import TILE as C

UNROLL = 16  # chunk-end loads in flight per thread


@T.macro
def warmup_row(gc, cu_segments, first, table, j, bh, max_chunks, initial, store, threads, through):
    """Segment j's row of the warm-up table for value head bh, stored in table[:, j, bh] where store is true; run by
    all `threads` threads of the CTA alike. through[0] <- 1 where segment j's transition is needed (its (sequence,
    head) has an unbounded segment and j is not the sequence's last), else 0. gc [1, T, HV] the chunk-local cumsum,
    cu_segments [S + 1], first [N + 1]; max_chunks, initial (1: the call has initial states) as int32 scalars."""
    tid = T.get_thread_binding()
    N = first.shape[0] - 1
    n = T.alloc_var("int32")
    n = 0
    for block in T.serial(T.ceildiv(N, threads)):
        n = n + T.syncthreads_count(block * threads + tid < N and first[T.min(block * threads + tid + 1, N)] <= j)
    j0 = first[n]
    count = first[n + 1] - j0
    bos = cu_segments[j0]
    start_row = T.if_then_else(initial > 0, -2 - n, -1)
    ends = T.alloc_local((UNROLL,), "float32")
    total = T.alloc_var("float32")
    w = T.alloc_var("int32")
    row = T.alloc_var("int32")
    own_w = T.alloc_var("int32")
    own_row = T.alloc_var("int32")
    start = T.alloc_var("int32")
    c0 = T.alloc_var("int32")
    reach = T.alloc_var("int32")
    unbounded = T.alloc_var("int32")
    unbounded = 0
    own_w = 0
    own_row = 0
    for block in T.serial(T.ceildiv(count, threads)):
        s = j0 + block * threads + tid
        w = 0
        if block * threads + tid < count:
            start = cu_segments[s]
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
            if s == j:
                own_w = w
                own_row = row
        unbounded = unbounded + T.syncthreads_or(w < 0)
    last = j == j0 + count - 1
    through[0] = T.if_then_else(unbounded > 0 and not last, 1, 0)
    if store and tid == (j - j0) % threads:
        table[0, j, bh] = T.if_then_else(unbounded > 0, T.if_then_else(last, 0, -1), own_w)
        table[1, j, bh] = T.if_then_else(unbounded > 0, j, own_row)
        table[2, j, bh] = T.if_then_else(last, n, N)
