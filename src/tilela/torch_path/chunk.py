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
The chunk identities are ``tilela.reference.chunk_math``'s, run in the compute dtype and batched
over sequences and heads (reference layer B loops over sequences in float64); this is what runs
where no Hopper GPU is present.
"""

from __future__ import annotations

import torch

from .._validation import Dims
from ..reference.chunk_math import chunk_forward, ut_transform


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def valid_mask(dims: Dims, chunk_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, Tp] mask of the real tokens in the packed layout, Tp = whole chunks (at least one), their flat
    positions in it). Both are made on the host from the sequence bounds, so no value is read from the device."""
    lengths = torch.tensor([e - b for b, e in dims.seq_bounds], dtype=torch.int64)
    n_chunks = max(1, -(-int(lengths.max()) // chunk_size)) if len(lengths) else 1
    t = torch.arange(n_chunks * chunk_size)
    valid = t[None, :] < lengths[:, None]
    return valid.to(device), valid.flatten().nonzero().squeeze(1).to(device)


def pack(x: torch.Tensor, valid: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """[B, T, ...] (dense rows or one varlen row) -> zero-padded [N, Tp, ...]."""
    mask, index = valid
    flat = x.reshape(-1, *x.shape[2:]).to(dtype)
    out = flat.new_zeros(mask.numel(), *x.shape[2:]).index_copy(0, index, flat)
    return out.reshape(*mask.shape, *x.shape[2:])


def pack_hold(x: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``pack`` with each padded position holding its sequence's last value instead of 0.

    Used for an already cumsum'd gate: a padded row then sees Gamma = exp(gc_last - gc_j) <= 1,
    never the exp(0 - gc_j) that a zero pad would give.
    """
    out = pack(x, valid, dtype)
    last = (valid[0].cumsum(dim=1) - 1).clamp(min=0)
    return out.gather(1, last.view(*last.shape, *([1] * (out.dim() - 2))).expand_as(out))


def unpack(x: torch.Tensor, valid: torch.Tensor, dims: Dims, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``pack``: [N, Tp, ...] -> [B, T, ...]."""
    return x.flatten(0, 1).index_select(0, valid[1]).reshape(dims.B, dims.T, *x.shape[2:]).to(dtype)


def chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[N, Tp, HV, ...] -> [N, HV, NC, C, ...]."""
    N, Tp, HV = x.shape[:3]
    return x.reshape(N, Tp // chunk_size, chunk_size, HV, *x.shape[3:]).transpose(1, 3).transpose(2, 3)


def unchunk(x: torch.Tensor) -> torch.Tensor:
    """[N, HV, NC, C, ...] -> [N, Tp, HV, ...]."""
    N, HV, NC, C = x.shape[:4]
    return x.transpose(2, 3).transpose(1, 3).reshape(N, NC * C, HV, *x.shape[4:])


def gate_chunks(g: torch.Tensor | None, valid: torch.Tensor, like: torch.Tensor, chunk_size: int, hold: bool):
    """The log gate as [N, HV, NC, C, Kg] (Kg = 1 for a scalar gate, zeros without a gate), the
    layout ``reference.chunk_math`` takes. ``hold``: g is already cumsum'd, pad by holding the last value."""
    if g is None:
        return like.new_zeros(*like.shape[:-1], 1)
    gp = (pack_hold if hold else pack)(g, valid, like.dtype)
    return chunks(gp if gp.dim() == 4 else gp[..., None], chunk_size)


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
    gc = gate_chunks(g, valid, kc, C, hold=False).cumsum(dim=3)
    bc = None if beta is None else chunks(pack(beta, valid, cdt), C)

    if initial_state is None:
        S = qc.new_zeros(dims.N, dims.HV, dims.K, dims.V)
    else:
        S = initial_state.to(cdt)
    o = torch.empty_like(vc)
    for c in range(qc.shape[2]):
        b_c = None if bc is None else bc[:, :, c]
        o[:, :, c], S = chunk_forward(qc[:, :, c], kc[:, :, c], vc[:, :, c], gc[:, :, c], b_c, S, scale)
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
    A = ut_transform(kc, bc, gate_chunks(g, valid, kc, C, hold=True))  # [N, HV, NC, C, C]
    return unpack(unchunk(A), valid, dims, k.dtype)
