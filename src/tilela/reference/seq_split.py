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
(entering_states, the stage kernels.hopper.seq_combine computes).
"""
import torch

from ._common import F64, Problem, chunk_slices
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
