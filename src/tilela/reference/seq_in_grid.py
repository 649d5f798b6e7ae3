"""Layer C: the kernel control flow with the sequence axis in the grid (seed 002 §3.3, generalised).

Grid (sequence b, value head h, chunk bx); block bx recomputes its entering state from scratch,

    S_bx = step(... step(step(S0, chunk 0), chunk 1) ..., chunk bx-1),    step = chunk_math.chunk_forward's update,

then reads out O_bx = scale [(Q ⊙ exp(gc)) S_bx + tril_incl(Gamma ⊙ Q K^T) Vnew]: O(NC^2) chunk updates.
The final state is the entering state of a virtual chunk NC.
"""
from ._common import Problem, chunk_slices
from .cumsum import chunk_local_cumsum
from .chunk_math import chunk_forward


def _carried_state(p, gc, n, b, h, chunks):
    """S0 of sequence n, head h, carried through `chunks`: the prefix a block recomputes from scratch."""
    S = p.S0[n, h]
    for sl in chunks:
        S = chunk_forward(*p.chunk(gc, b, sl, h), S, p.scale)[1]
    return S


def seq_in_grid(q, k, v, g=None, beta=None, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64):
    p = Problem.prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    gc = chunk_local_cumsum(p.g, chunk_size, cu_seqlens)
    o, S_final = p.outputs()
    for n, b, bos, eos in p.seqs:  # grid.z
        chunks = chunk_slices(bos, eos, chunk_size)
        for h in range(p.v.shape[2]):  # grid.y
            for bx, sl in enumerate(chunks):  # grid.x
                S = _carried_state(p, gc, n, b, h, chunks[:bx])
                o[b, sl, h] = chunk_forward(*p.chunk(gc, b, sl, h), S, p.scale)[0]
            S_final[n, h] = _carried_state(p, gc, n, b, h, chunks)
    return o, S_final
