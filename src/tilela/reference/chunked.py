"""Layer B: chunked and vectorised over heads and chunks (reference.chunk_math identities).

Each sequence is padded to whole chunks (zero q/k/v/beta, edge-repeated gc: padding leaves S unchanged).
Level 1 (no gate, no delta rule), seed 002 §3.2: the entering states are the right-shifted cumsum of the
chunk states,  S_c^prev = S0 + sum_{c' < c} K_{c'}^T V_{c'}.  Otherwise A, W, U and the scores are formed for
all chunks at once and only  Vnew_c = U_c - W_c S_c,  S_{c+1} = chunk_state(S_c, Vnew_c)  runs chunk by chunk.
"""
import torch

from ._common import Problem, head_major, pad_chunks
from .cumsum import chunk_local_cumsum
from .chunk_math import chunk_output, chunk_state, wy_form


def chunked(q, k, v, g=None, beta=None, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64):
    level1 = g is None and beta is None
    p = Problem.prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    gc = chunk_local_cumsum(p.g, chunk_size, cu_seqlens)
    o, S_final = p.outputs()
    for n, b, bos, eos in p.seqs:
        q_c, k_c, v_c = (pad_chunks(head_major(x, b, bos, eos), chunk_size) for x in (p.q, p.k, p.v))
        gc_c = pad_chunks(head_major(gc, b, bos, eos), chunk_size, edge=True)  # [HV, NC, C, Kg]
        if level1:
            states = torch.cumsum(k_c.transpose(-1, -2) @ v_c, dim=1)
            S = p.S0[n, :, None] + torch.cat([torch.zeros_like(p.S0[n, :, None]), states], dim=1)  # right shift
            Vnew = v_c
        else:
            beta_c = None if p.beta is None else pad_chunks(head_major(p.beta, b, bos, eos), chunk_size)
            W, U = wy_form(k_c, v_c, beta_c, gc_c)
            S, Vnew = [p.S0[n]], []
            for c in range(k_c.shape[1]):
                Vnew.append(U[:, c] - W[:, c] @ S[-1])
                S.append(chunk_state(k_c[:, c], gc_c[:, c], S[-1], Vnew[-1]))
            S, Vnew = torch.stack(S, dim=1), (torch.stack(Vnew, dim=1) if Vnew else v_c)
        o_c = chunk_output(q_c, k_c, gc_c, S[:, :-1], Vnew, p.scale)
        o[b, bos:eos] = o_c.flatten(1, 2)[:, :eos - bos].transpose(0, 1)
        S_final[n] = S[:, -1]
    return o, S_final
