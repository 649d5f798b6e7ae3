"""The PyTorch path: chunked, vectorised forward of every op, on any device.

One chunk step covers the whole ladder (seed 002 §1, seed 004 §"理论推导"). With gc the
chunk-local cumsum of the log gate g (scalar per token or per key channel, none = 0),
Gamma_ij = exp(gc_i - gc_j) (i >= j, exponent never positive) and S0 the state entering the chunk:

    delta rule:  A    = (I + strictLower(diag(beta) (Gamma ⊙ K K^T)))^-1      (UT transform)
                 U    = A diag(beta) V,   W = A diag(beta) (K ⊙ exp(gc))       (WY form)
                 Vnew = U - W S0
    plain:       Vnew = V
    output:      O      = scale [(Q ⊙ exp(gc)) S0 + tril(Gamma ⊙ Q K^T) Vnew]
    state:       S_next = exp(gc_last) S0 + (K ⊙ exp(gc_last - gc))^T Vnew

Sequences (dense rows or varlen pieces of ``cu_seqlens``) are packed into a zero-padded
``[N, Tp, ...]`` block, Tp a multiple of the chunk; a padded token has k = v = beta = g = 0 and
so leaves the state untouched. Arithmetic runs in float32 (float64 for float64 inputs).
This path mirrors reference layer B (``tilela.reference.chunked``) batched over sequences and
heads; it is what runs where no Hopper GPU is present.
"""

from __future__ import annotations

import torch

from .._validation import Dims


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def valid_mask(dims: Dims, chunk_size: int, device: torch.device) -> torch.Tensor:
    """[N, Tp] mask of the real tokens in the packed layout, Tp = whole chunks (at least one)."""
    lengths = torch.tensor([e - b for b, e in dims.seq_bounds], dtype=torch.int64)
    n_chunks = max(1, -(-int(lengths.max()) // chunk_size)) if len(lengths) else 1
    t = torch.arange(n_chunks * chunk_size)
    return (t[None, :] < lengths[:, None]).to(device)


def pack(x: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, ...] (dense rows or one varlen row) -> zero-padded [N, Tp, ...]."""
    flat = x.reshape(-1, *x.shape[2:]).to(dtype)
    out = flat.new_zeros(*valid.shape, *x.shape[2:])
    out[valid] = flat
    return out


def pack_hold(x: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``pack`` with each padded position holding its sequence's last value instead of 0.

    Used for an already cumsum'd gate: a padded row then sees Gamma = exp(gc_last - gc_j) <= 1,
    never the exp(0 - gc_j) that a zero pad would give.
    """
    out = pack(x, valid, dtype)
    last = (valid.cumsum(dim=1) - 1).clamp(min=0)
    return out.gather(1, last.view(*last.shape, *([1] * (out.dim() - 2))).expand_as(out))


def unpack(x: torch.Tensor, valid: torch.Tensor, dims: Dims, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``pack``: [N, Tp, ...] -> [B, T, ...]."""
    return x[valid].reshape(dims.B, dims.T, *x.shape[2:]).to(dtype)


def chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[N, Tp, HV, ...] -> [N, HV, NC, C, ...]."""
    N, Tp, HV = x.shape[:3]
    return x.reshape(N, Tp // chunk_size, chunk_size, HV, *x.shape[3:]).transpose(1, 3).transpose(2, 3)


def unchunk(x: torch.Tensor) -> torch.Tensor:
    """[N, HV, NC, C, ...] -> [N, Tp, HV, ...]."""
    N, HV, NC, C = x.shape[:4]
    return x.transpose(2, 3).transpose(1, 3).reshape(N, NC * C, HV, *x.shape[4:])


def decayed_scores(x: torch.Tensor, y: torch.Tensor, gc: torch.Tensor | None) -> torch.Tensor:
    """tril(Gamma ⊙ X Y^T): sum_d x_id y_jd exp(gc_id - gc_jd) for i >= j, 0 above.

    gc: None (no gate), [..., C] (scalar gate) or [..., C, K] (per key channel).
    """
    C = x.shape[-2]
    lower = torch.ones(C, C, dtype=torch.bool, device=x.device).tril()
    if gc is None:
        scores = x @ y.transpose(-1, -2)
    elif gc.dim() == x.dim() - 1:
        diff = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, 0.0)
        scores = (x @ y.transpose(-1, -2)) * diff.exp()
    else:
        diff = (gc[..., :, None, :] - gc[..., None, :, :]).masked_fill(~lower[..., None], float("-inf"))
        scores = torch.einsum("...id,...jd,...ijd->...ij", x, y, diff.exp())
    return scores.masked_fill(~lower, 0.0)


def gate_factor(gc: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """exp(gc) shaped to scale the rows (and for per-channel gates the columns) of ``like`` [..., C, K]."""
    return gc.exp() if gc.dim() == like.dim() else gc.exp()[..., None]


def ut_inverse(k: torch.Tensor, beta: torch.Tensor, gc: torch.Tensor | None) -> torch.Tensor:
    """A = (I + strictLower(diag(beta) (Gamma ⊙ K K^T)))^-1 for a batch of chunks k [..., C, K]."""
    L = (decayed_scores(k, k, gc) * beta[..., :, None]).tril(-1)
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device).expand_as(L)
    return torch.linalg.solve_triangular(eye + L, eye, upper=False, unitriangular=True)


def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    dims: Dims,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked forward of the general gated (delta) rule; inputs validated by the caller."""
    C = chunk_size
    cdt = compute_dtype(q)
    valid = valid_mask(dims, C, q.device)
    G = dims.HV // dims.H
    qc = chunks(pack(q, valid, cdt).repeat_interleave(G, dim=2), C)  # [N, HV, NC, C, K]
    kc = chunks(pack(k, valid, cdt).repeat_interleave(G, dim=2), C)
    vc = chunks(pack(v, valid, cdt), C)  # [N, HV, NC, C, V]
    gc = None if g is None else chunks(pack(g, valid, cdt), C).cumsum(dim=3)
    bc = None if beta is None else chunks(pack(beta, valid, cdt), C)

    if initial_state is None:
        S = qc.new_zeros(dims.N, dims.HV, dims.K, dims.V)
    else:
        S = initial_state.to(cdt).clone()
    o = torch.empty_like(vc)
    for c in range(qc.shape[2]):
        q_c, k_c, v_c = qc[:, :, c], kc[:, :, c], vc[:, :, c]
        g_c = None if gc is None else gc[:, :, c]
        if bc is None:
            v_new = v_c
        else:
            b_c = bc[:, :, c]
            A = ut_inverse(k_c, b_c, g_c)
            U = A @ (b_c[..., None] * v_c)
            k_beta = b_c[..., None] * k_c
            W = A @ (k_beta if g_c is None else k_beta * gate_factor(g_c, k_c))
            v_new = U - W @ S
        q_dec = q_c if g_c is None else q_c * gate_factor(g_c, q_c)
        o[:, :, c] = scale * (q_dec @ S + decayed_scores(q_c, k_c, g_c) @ v_new)
        if g_c is None:
            S = S + k_c.transpose(-1, -2) @ v_new
        else:
            g_last = g_c[..., -1:, :] if g_c.dim() == k_c.dim() else g_c[..., -1:]
            k_dec = k_c * gate_factor(g_last - g_c, k_c)
            S_dec = S * (g_last.exp().transpose(-1, -2) if g_c.dim() == k_c.dim() else g_last.exp()[..., None])
            S = S_dec + k_dec.transpose(-1, -2) @ v_new
    out = unpack(unchunk(o), valid, dims, v.dtype)
    if not output_final_state:
        return out, None
    return out, S.to(torch.float64 if cdt == torch.float64 else torch.float32)


def chunk_local_cumsum(g: torch.Tensor, chunk_size: int, scale: float | None, dims: Dims) -> torch.Tensor:
    """Per-chunk inclusive prefix sum of g [B, T, H] or [B, T, H, K], restarting at every sequence."""
    cdt = compute_dtype(g)
    valid = valid_mask(dims, chunk_size, g.device)
    gp = pack(g, valid, cdt)
    N, Tp = gp.shape[:2]
    out = gp.reshape(N, Tp // chunk_size, chunk_size, *gp.shape[2:]).cumsum(dim=2).reshape(gp.shape)
    if scale is not None:
        out = out * scale
    return unpack(out, valid, dims, cdt)


def kkt_solve(k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None, chunk_size: int, dims: Dims) -> torch.Tensor:
    """Per chunk A = (I + strictLower(diag(beta) (Gamma ⊙ K K^T)))^-1, laid out [B, T, HV, C].

    g is the chunk-local cumsum of the log gate (as ``chunk_local_cumsum`` returns), or None.
    Row t holds row i (t's index inside its chunk); columns past the chunk's end are 0.
    """
    C = chunk_size
    cdt = compute_dtype(k)
    valid = valid_mask(dims, C, k.device)
    G = dims.HV // dims.H
    kc = chunks(pack(k, valid, cdt).repeat_interleave(G, dim=2), C)
    bc = chunks(pack(beta, valid, cdt), C)
    gc = None if g is None else chunks(pack_hold(g, valid, cdt), C)
    A = ut_inverse(kc, bc, gc)  # [N, HV, NC, C, C]
    return unpack(unchunk(A), valid, dims, k.dtype)
