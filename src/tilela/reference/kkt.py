"""kkt_solve: the materialised UT-transform matrix of every chunk (FLA's chunk_scaled_dot_kkt + solve_tril).

    A = (I + strictLower(diag(beta) (Gamma ⊙ K K^T)))^-1,   Gamma[i, j, d] = exp(gc_id - gc_jd)

with g = gc already the chunk-local cumsum (scalar [B,T,HV] or per-channel [B,T,HV,K]). Row t of the output
[B,T,HV,C] is row i (t's index in its chunk) of its chunk's A; columns past the chunk's length are 0.
Chunks restart at sequence starts; value head h uses k head h // G. `inverse` names a routine of
reference.inverse.INVERSES ("neumann" = blocked recursion with Neumann 16x16 diagonal blocks). beta_columns:
A diag(beta) instead (column j times beta of the chunk's token j), as the Hopper gla_factors stage writes it for KDA
and kkt_solve's scaled configurations for the warp-specialised pass.
"""
import torch

from ._common import F64, expand_heads, gate_channels, head_major, pad_chunks, sequences
from .chunk_math import ut_transform
from .inverse import INVERSES


def kkt_solve(k, beta, g=None, chunk_size=64, cu_seqlens=None, inverse="solve", beta_columns=False):
    B, T, HV = beta.shape
    k, beta, gc = expand_heads(k, HV), beta.to(F64), gate_channels(g, B, T, HV)
    A = torch.zeros(B, T, HV, chunk_size, dtype=F64)
    for _, b, bos, eos in sequences(B, T, cu_seqlens):
        k_c, beta_c = (pad_chunks(head_major(x, b, bos, eos), chunk_size) for x in (k, beta))
        gc_c = pad_chunks(head_major(gc, b, bos, eos), chunk_size, edge=True)
        A_c = ut_transform(k_c, beta_c, gc_c, INVERSES[inverse])  # [HV, NC, C, C]
        if beta_columns:
            A_c = A_c * beta_c[..., None, :]
        A[b, bos:eos] = A_c.flatten(1, 2)[:, :eos - bos].transpose(0, 1)
    return A
