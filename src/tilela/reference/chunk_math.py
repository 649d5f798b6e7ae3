"""The chunk identities, for one chunk of L <= C tokens with start state S0 in [K, V].

gc is the chunk-local cumsum of the log gate ([L,1] scalar or [L,K] per key channel; zeros without a gate).

    Gamma-weighted scores   P(a, b)[i, j] = sum_d a_id b_jd exp(gc_id - gc_jd)   for j <= i (strict: j < i), else 0
    UT transform            A = (I + strictLower(diag(beta) (Gamma ⊙ K K^T)))^-1
    WY form                 W = A diag(beta) (K ⊙ exp(gc)),   U = A diag(beta) V;   plain update: W = 0, U = V
    new values              Vnew = U - W S0
    output                  O = scale [(Q ⊙ exp(gc)) S0 + tril_incl(Gamma ⊙ Q K^T) Vnew]
    next state              S_next = exp(gc_last) ⊙ S0 + (K ⊙ exp(gc_last - gc))^T Vnew
    gated factors           Qg = Q ⊙ exp(gc),  Kd = K ⊙ exp(gc_last - gc),  P = scale tril_incl(Gamma ⊙ Q K^T):
                            O = scale Qg S0 + P Vnew,  S_next = exp(gc_last) ⊙ S0 + Kd^T Vnew (no S0 inside them)

Every tensor may carry leading batch dims (heads, chunks). Exponents are masked before exp, so for a
non-positive gate no exponent is positive: the per-channel decay is an [L, L, K] tensor exp(gc_i - gc_j).
The functions keep their inputs' dtype and device: the PyTorch path (tilela.torch_path) runs them in float32.
"""
import torch

from .inverse import solve_unit_lower


def gamma_scores(a, b, gc, strict=False):
    L = a.shape[-2]
    causal = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(-1 if strict else 0)
    if gc.shape[-1] == 1:
        decay = torch.exp((gc - gc.transpose(-1, -2)).masked_fill(~causal, -torch.inf))
        return (a @ b.transpose(-1, -2)) * decay
    diff = gc[..., :, None, :] - gc[..., None, :, :]
    decay = torch.exp(diff.masked_fill(~causal[..., None], -torch.inf))
    return torch.einsum("...id,...jd,...ijd->...ij", a, b, decay)


def ut_transform(k, beta, gc, inverse=solve_unit_lower):
    L = k.shape[-2]
    return inverse(torch.eye(L, dtype=k.dtype, device=k.device) + beta[..., None] * gamma_scores(k, k, gc, strict=True))


def wy_form(k, v, beta, gc):
    """(W, U) with Vnew = U - W S0; beta None is the plain update S += k v^T (W = 0, U = V)."""
    if beta is None:
        return torch.zeros_like(k), v
    A = ut_transform(k, beta, gc)
    return A @ (beta[..., None] * k * gc.exp()), A @ (beta[..., None] * v)


def chunk_output(q, k, gc, S0, Vnew, scale):
    return scale * ((q * gc.exp()) @ S0 + gamma_scores(q, k, gc) @ Vnew)


def chunk_state(k, gc, S0, Vnew):
    gc_last = gc[..., -1:, :]
    return gc_last.exp().transpose(-1, -2) * S0 + (k * (gc_last - gc).exp()).transpose(-1, -2) @ Vnew


def gated_factors(q, k, gc, scale):
    """(Qg, Kd, P): the parts of a chunk's output and state update that do not depend on its entering state."""
    gc_last = gc[..., -1:, :]
    return q * gc.exp(), k * (gc_last - gc).exp(), scale * gamma_scores(q, k, gc)


def chunk_forward(q, k, v, gc, beta, S0, scale):
    """(O, S_next) of one chunk: readout with the entering state S0, then the state update."""
    W, U = wy_form(k, v, beta, gc)
    Vnew = U - W @ S0
    return chunk_output(q, k, gc, S0, Vnew, scale), chunk_state(k, gc, S0, Vnew)
