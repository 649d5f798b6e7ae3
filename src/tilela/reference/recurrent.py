"""Layer A: the token recurrence itself (S in [K, V], all value heads of a sequence at once).

    S_t = diag(exp g_t) S_{t-1}
    delta rule: S_t += k_t (beta_t (v_t - k_t^T S_t))^T        plain: S_t += k_t v_t^T
    o_t = scale q_t^T S_t
"""
import torch

from ._common import Problem


def recurrent(q, k, v, g=None, beta=None, scale=None, initial_state=None, cu_seqlens=None):
    p = Problem.prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    o, S_final = p.outputs()
    for n, b, bos, eos in p.seqs:
        S = p.S0[n]  # [HV, K, V]
        for t in range(bos, eos):
            q_t, k_t, v_t = p.q[b, t], p.k[b, t], p.v[b, t]
            S = p.g[b, t].exp()[..., None] * S
            if p.beta is not None:
                v_t = p.beta[b, t, :, None] * (v_t - torch.einsum("hk,hkv->hv", k_t, S))
            S = S + k_t[..., None] * v_t[:, None, :]
            o[b, t] = p.scale * torch.einsum("hk,hkv->hv", q_t, S)
        S_final[n] = S
    return o, S_final
