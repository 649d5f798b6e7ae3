"""Layer E: the sequence split (intra-card context parallelism, done exactly). The segments of a sequence run in
parallel from their own entering states, which come from composing the segments' affine transitions.

Over one chunk the state update is affine in the entering state (chunk_math: Vnew = U - W S0):

    S_next = T_c S0 + b_c,   T_c = diag(exp gc_last) - (K ⊙ exp(gc_last - gc))^T W,
                             b_c = (K ⊙ exp(gc_last - gc))^T U

so over a segment of chunks S_out = M S_in + B with M = T_n ... T_1 and B = S_out(S_in = 0). Three steps:
  1. per segment (parallel): M and B;
  2. per sequence, serial over its segments (K x K by K x V products): S_in(j + 1) = M_j S_in(j) + B_j;
  3. per segment (parallel): outputs and final state from S_in(j), by layer D's chunk loop.
No step relies on the decay forgetting the past, so the split is exact for every gate, g = 0 included.
Segments begin at chunk boundaries of their sequence, so the chunk-local gc is that of the whole sequence.
Without the delta rule M is the scalar m = exp(sum of g over the segment) times I, and step 2 needs only B and m
(entering_states); with it, step 2 takes [B | M] (transition_entering_states); kernels.hopper.seq_combine computes
both.

The warm-up (warmup_table, warmup_outputs; the stages kernels.hopper.warmup and the outputs pass compute): where the
log decay summed over the w chunks before a segment reaches WARMUP_BOUND, the segment's entering state is, to fp32
rounding, that of a zero state w chunks back: the past enters it scaled by exp(the sum) <= e^-17 < 2^-24 (the
delta rule's I - beta k k^T has norm <= 1 while beta ||k||^2 <= 2, as with l2-normalised keys and beta in [0, 1]).
So such a segment needs no M: the outputs pass starts w chunks early and stores from the segment on. A (sequence,
head) with a segment the decay does not bound within max_chunks (g = 0 heads) keeps the exact transitions.
"""
import torch

from ._common import F64, Problem, chunk_slices
from .chunked import chunked
from .chunk_math import chunk_forward, wy_form
from .cumsum import chunk_local_cumsum


def segment_transition(chunks):
    """(M, B) of a segment from its chunks' (k, v, gc, beta) in order."""
    M = B = None
    for k, v, gc, beta in chunks:
        W, U = wy_form(k, v, beta, gc)
        keys = k * (gc[-1:] - gc).exp()
        T_c = torch.diag(gc[-1].exp().expand(k.shape[-1])) - keys.T @ W
        M = T_c if M is None else T_c @ M
        B = keys.T @ U if B is None else T_c @ B + keys.T @ U
    return M, B


def entering_states(B, gc, cu_segments, first, h0, chunk_size=64):
    """Step 2 under the plain update, over a segment table: (S_in [S, HV, K, V], final [N, HV, K, V]) float64.
    B [S, HV, K, V]: each segment's state from a zero entering state; gc [1, T, HV]: the chunk-local cumsum of a
    scalar log gate (None: no gate), so m_j = exp(sum of gc at the last token of each chunk of segment j);
    cu_segments [S + 1]: the segments' token boundaries; first [N + 1]: sequence n's segments are first[n] to
    first[n + 1] - 1; h0 [N, HV, K, V] or None (zero)."""
    B = B.to(F64)
    bounds, first = cu_segments.tolist(), first.tolist()
    S_in = torch.empty_like(B)
    final = B.new_empty(len(first) - 1, *B.shape[1:])
    for n in range(len(first) - 1):
        S = B.new_zeros(B.shape[1:]) if h0 is None else h0[n].to(F64)
        for j in range(first[n], first[n + 1]):
            S_in[j] = S
            ends = [sl.stop - 1 for sl in chunk_slices(bounds[j], bounds[j + 1], chunk_size)]
            m = 1.0 if gc is None else gc[0, ends].to(F64).sum(0).exp()[:, None, None]
            S = m * S + B[j]
        final[n] = S
    return S_in, final


def transition_entering_states(BM, first, h0, warm=None):
    """Step 2 with the delta rule, over a segment table: S_in [S, HV, K, V] float64, segment j's entering state. BM
    [S, HV, K, V + K]: each segment's [B | M] (S_out = M S_in + B); first [N + 1]: sequence n's segments are
    first[n] to first[n + 1] - 1; h0 [N, HV, K, V] or None (zero); warm: the warm-up table (warmup_table) or None.
    A (sequence, head) the warm-up takes (warm[0] >= 0 at its first segment; every sequence of one segment) needs no
    entering state (the outputs pass starts from zero or from h0 itself): its rows are NaN (none is read)."""
    BM = BM.to(F64)
    K = BM.shape[2]
    V = BM.shape[3] - K
    first = first.tolist()
    S_in = BM.new_full((*BM.shape[:3], V), float("nan"))
    for n in range(len(first) - 1):
        j0, j1 = first[n], first[n + 1]
        for h in range(BM.shape[1]):
            if warm is not None and warm[0, j0, h] >= 0:
                continue
            S = BM.new_zeros(K, V) if h0 is None else h0[n, h].to(F64)
            S_in[j0, h] = S
            for j in range(j0, j1 - 1):
                S = BM[j, h, :, V:] @ S + BM[j, h, :, :V]
                S_in[j + 1, h] = S
    return S_in


WARMUP_BOUND = -17.0  # summed log decay over a warm-up: e^-17 < 2^-24, fp32's relative rounding


def initial_row(n: int) -> int:
    """warmup_table's entering row naming sequence n's initial state (h0[n]) rather than a row of S_in."""
    return -2 - n


def warmup_table(gc, cu_segments, first, max_chunks, initial, chunk_size=64):
    """The warm-up of every segment and value head as [3, S, HV] int64 (the stage kernels.hopper.warmup computes):
    table[0] the chunks w the outputs pass starts before the segment (-1: the (sequence, head) takes the
    transitions); table[1] the state it starts from: r >= 0 the row r of the entering states S_in (the combine's),
    -1 zero, initial_row(n) the call's initial state h0[n]; table[2] the row of the final states ([N + 1] rows) the
    segment's final state goes to: its sequence n at a sequence's last segment, N at the others' (one row past the
    sequences' that no one reads, so that every segment stores without a branch). gc [1, T, HV] the
    chunk-local cumsum of a scalar log gate, summed in float32 in chunk order; cu_segments, first as
    entering_states'; initial: whether the call has initial states (else a sequence starts from zero, -1).

    Segment j of sequence n, first chunk c0 of its sequence: w = the fewest chunks (1 <= w <= max_chunks) whose
    summed decay is <= WARMUP_BOUND, from zero (w, -1); else (c0, the sequence's start) when c0 <= max_chunks; else
    unbounded, and then every segment j of the (sequence, head) is (-1, j) but its last, which is (0, j): the outputs
    pass enters it from S_in[j] alike, and the transitions skip it (no entering state reads a sequence's last
    transition). A first segment is (0, the sequence's start); the sequence's start is initial_row(n) with initial
    states, else -1."""
    bounds, first = cu_segments.tolist(), first.tolist()
    HV = gc.shape[-1]
    table = torch.empty(3, len(bounds) - 1, HV, dtype=torch.int64)
    N = len(first) - 1
    for n in range(N):
        j0, j1 = first[n], first[n + 1]
        start = initial_row(n) if initial else -1
        for h in range(HV):
            rows = [_warmup(gc[0, :, h].float(), bounds[j], (bounds[j] - bounds[j0]) // chunk_size, start, max_chunks,
                            chunk_size) for j in range(j0, j1)]
            if None in rows:
                rows = [(-1, j) for j in range(j0, j1 - 1)] + [(0, j1 - 1)]
            table[:2, j0:j1, h] = torch.tensor(rows, dtype=torch.int64).T
            table[2, j0:j1, h] = N
            table[2, j1 - 1, h] = n
    return table


def _warmup(gc, start, c0, sequence_start, max_chunks, chunk_size):
    """(w, entering row) of one segment starting at token start, chunk c0 of its sequence; None: unbounded."""
    total = torch.zeros((), dtype=torch.float32)
    for w in range(1, min(c0, max_chunks) + 1):
        total = total + gc[start - (w - 1) * chunk_size - 1]
        if total <= WARMUP_BOUND:
            return w, -1
    return (c0, sequence_start) if c0 <= max_chunks else None


def warmup_outputs(q, k, v, g, beta, scale, S_in, cu_segments, table, h0, sequences, chunk_size=64):
    """The outputs pass under a warm-up table, float64 (o [1, T, HV, V], final states [sequences, HV, K, V]):
    segment s and value head h run from table[0, s, h] chunks before the segment (0 where it is -1) from the state
    table[1, s, h] names (S_in's row, zero, or h0's row: warmup_table) to the segment's end; o keeps the segment's
    own rows, and the final state goes to row table[2, s, h] of [sequences + 1] rows, of which the first sequences
    are returned. Inputs in the varlen layout [1, T, ...], g the raw scalar log gate (a warm-up starts at a chunk
    boundary of the sequence, so its chunk-local cumsum is the call's); h0 [sequences, HV, K, V] the call's initial
    states or None."""
    bounds = cu_segments.tolist()
    HV, V = v.shape[2:]
    group = HV // q.shape[2]
    o = torch.zeros(v.shape, dtype=F64)
    final = torch.zeros(sequences + 1, HV, q.shape[-1], V, dtype=F64)
    for s, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        for h in range(HV):
            w, row, out = (int(x) for x in table[:, s, h])
            t0 = bos - max(w, 0) * chunk_size
            heads = slice(h // group, h // group + 1)
            entering = S_in[row] if row >= 0 else None if row == -1 else h0[-2 - row]
            start = None if entering is None else entering[h : h + 1][None]
            o_h, final_h = chunked(q[:, t0:eos, heads], k[:, t0:eos, heads], v[:, t0:eos, h : h + 1],
                                   None if g is None else g[:, t0:eos, h : h + 1], beta[:, t0:eos, h : h + 1], scale,
                                   start, chunk_size=chunk_size)
            o[:, bos:eos, h] = o_h[:, bos - t0 :, 0]
            final[out, h] = final_h[0, 0]
    return o, final[:sequences]


def seq_split(q, k, v, g=None, beta=None, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64,
              segment_chunks=2):
    p = Problem.prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    gc = chunk_local_cumsum(p.g, chunk_size, cu_seqlens)
    o, S_final = p.outputs()
    for n, b, bos, eos in p.seqs:
        chunks = chunk_slices(bos, eos, chunk_size)
        segments = [chunks[i : i + segment_chunks] for i in range(0, len(chunks), segment_chunks)]
        for h in range(p.v.shape[2]):
            transitions = [segment_transition([p.chunk(gc, b, sl, h)[1:] for sl in seg]) for seg in segments]
            S = p.S0[n, h]
            entering = []
            for M, B in transitions:
                entering.append(S)
                S = M @ S + B
            for seg, S_in in zip(segments, entering):
                for sl in seg:
                    o[b, sl, h], S_in = chunk_forward(*p.chunk(gc, b, sl, h), S_in, p.scale)
            S_final[n, h] = S.to(F64)
    return o, S_final
