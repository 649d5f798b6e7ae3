"""kkt_solve: the materialised UT-transform matrix of every chunk (FLA's chunk_scaled_dot_kkt + solve_tril).

    A = (I + strictLower(diag(beta) (Gamma ⊙ K K^T)))^-1,   Gamma[i, j, d] = exp(gc_id - gc_jd)

with g = gc already the chunk-local cumsum (scalar [B,T,HV] or per-channel [B,T,HV,K]). Row t of the output
[B,T,HV,C] is row i (t's index in its chunk) of its chunk's A; columns past the chunk's length are 0.
Chunks restart at sequence starts; value head h uses k head h // G. `inverse` names a routine of
reference.inverse.INVERSES ("neumann" = blocked recursion with Neumann 16x16 diagonal blocks). wy_factors: the
same chunks' A diag(beta) and the WY form's W.
"""
import torch

from ._common import F64, expand_heads, gate_channels, head_major, pad_chunks, sequences
from .chunk_math import ut_transform
from .inverse import INVERSES


def kkt_solve(k, beta, g=None, chunk_size=64, cu_seqlens=None, inverse="solve"):
    return _per_chunk(k, beta, g, chunk_size, cu_seqlens,
                      lambda k_c, beta_c, gc_c: (ut_transform(k_c, beta_c, gc_c, INVERSES[inverse]),))[0]


def wy_factors(k, beta, g=None, chunk_size=64, cu_seqlens=None):
    """(Ab, W) of every chunk: Ab = A diag(beta) in kkt_solve's [B,T,HV,C] layout and the WY form's W = Ab (K ⊙
    exp(gc)) [B,T,HV,K] (chunk_math.wy_form's), as the Hopper gla_factors stage writes them for KDA."""
    def form(k_c, beta_c, gc_c):
        Ab = ut_transform(k_c, beta_c, gc_c) * beta_c[..., None, :]
        return Ab, Ab @ (k_c * gc_c.exp())
    return _per_chunk(k, beta, g, chunk_size, cu_seqlens, form)


def _per_chunk(k, beta, g, chunk_size, cu_seqlens, form):
    """form(k_c, beta_c, gc_c) of every sequence's chunks ([HV, NC, C, ...] each, the last chunk zero-padded, gc
    edge-padded) back in the [B, T, HV, ...] layout, one float64 tensor per result."""
    B, T, HV = beta.shape
    k, beta, gc = expand_heads(k, HV), beta.to(F64), gate_channels(g, B, T, HV)
    out = None
    for _, b, bos, eos in sequences(B, T, cu_seqlens):
        k_c, beta_c = (pad_chunks(head_major(x, b, bos, eos), chunk_size) for x in (k, beta))
        gc_c = pad_chunks(head_major(gc, b, bos, eos), chunk_size, edge=True)
        results = form(k_c, beta_c, gc_c)
        if out is None:
            out = [torch.zeros(B, T, HV, r.shape[-1], dtype=F64) for r in results]
        for o, r in zip(out, results):
            o[b, bos:eos] = r.flatten(1, 2)[:, :eos - bos].transpose(0, 1)
    return out
