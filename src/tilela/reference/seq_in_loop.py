"""Layer D: the production layout, sequence loop inside the block (seed 002 §6.4.2 ref_D, generalised).

Grid (DV block, sequence x head); the block owns the state strip S[:, dv] and walks the chunks in order:

    O_c[:, dv] = scale [(Q_c ⊙ exp(gc)) S[:, dv] + tril_incl(Gamma ⊙ Q_c K_c^T) Vnew[:, dv]]     (readout first)
    S[:, dv]   = exp(gc_last) ⊙ S[:, dv] + (K_c ⊙ exp(gc_last - gc))^T Vnew[:, dv]               (update after)
    Vnew[:, dv] = U[:, dv] - W S[:, dv]

DV is a free dimension of every GEMM (A, W and the scores contract over DK or C only), so the split is
dependency-free: any block_dv gives the same numbers.
"""
from ._common import Problem, chunk_slices
from .cumsum import chunk_local_cumsum
from .chunk_math import chunk_forward


def seq_in_loop(q, k, v, g=None, beta=None, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64,
                block_dv=32):
    p = Problem.prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    gc = chunk_local_cumsum(p.g, chunk_size, cu_seqlens)
    o, S_final = p.outputs()
    for dv0 in range(0, p.v.shape[-1], block_dv):  # grid.x: DV blocks
        dv = slice(dv0, dv0 + block_dv)
        for n, b, bos, eos in p.seqs:  # grid.y: sequence x head
            for h in range(p.v.shape[2]):
                S = p.S0[n, h, :, dv]
                for sl in chunk_slices(bos, eos, chunk_size):  # T.Pipelined over the chunks
                    o[b, sl, h, dv], S = chunk_forward(*p.chunk(gc, b, sl, h, dv), S, p.scale)
                S_final[n, h, :, dv] = S
    return o, S_final
