"""Plumbing shared by the reference layers: float64 upcast, GVA head mapping, per-sequence splitting, chunking.

GVA: value head h reads q/k head h // G (G = HV / H), so q and k are repeated G times along the head axis.
Varlen: with cu_seqlens sequence n is tokens cu_seqlens[n]:cu_seqlens[n+1] of batch row 0; without, it is row n.
Gate: g is None (no decay), [B,T,HV] (scalar) or [B,T,HV,K] (per key channel); internally it is always
[B,T,HV,Kg] with Kg = 1 for a scalar gate and an all-zero gate for None (exp(0) = 1 exactly).
"""
from dataclasses import dataclass

import torch

F64 = torch.float64


def sequences(B, T, cu_seqlens):
    """[(n, b, bos, eos)]: sequence n lives in batch row b, tokens bos:eos."""
    if cu_seqlens is None:
        return [(n, n, 0, T) for n in range(B)]
    bounds = cu_seqlens.tolist()
    return [(n, 0, bos, eos) for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:]))]


def chunk_slices(bos, eos, C):
    """Chunks of one sequence; the last one may be shorter than C."""
    return [slice(c0, min(c0 + C, eos)) for c0 in range(bos, eos, C)]


def expand_heads(x, HV):
    """[B,T,H,D] -> [B,T,HV,D] float64: value head h reads head h // (HV // H)."""
    return x.to(F64).repeat_interleave(HV // x.shape[2], dim=2)


def gate_channels(g, B, T, HV):
    """Log gate as [B,T,HV,Kg] float64 (Kg = 1 for a scalar gate; zeros when there is no gate)."""
    if g is None:
        return torch.zeros(B, T, HV, 1, dtype=F64)
    g = g.to(F64)
    return g.unsqueeze(-1) if g.dim() == 3 else g


def head_major(x, b, bos, eos):
    """Tokens bos:eos of batch row b as [HV, L, ...]."""
    return x[b, bos:eos].transpose(0, 1)


def pad_chunks(x, C, edge=False):
    """[HV, L, ...] -> [HV, NC, C, ...]: pad the token axis to a multiple of C with zeros, or (edge=True) with
    the last entry repeated, which keeps a chunk-local cumsum gc flat so no exponent gc_i - gc_j turns positive."""
    pad = -x.shape[1] % C
    if pad:
        fill = x[:, -1:].expand(-1, pad, *x.shape[2:]) if edge else x.new_zeros(x.shape[0], pad, *x.shape[2:])
        x = torch.cat([x, fill], dim=1)
    return x.reshape(x.shape[0], -1, C, *x.shape[2:])


@dataclass
class Problem:
    """Inputs of one call, upcast to float64, q/k expanded to the HV value heads."""

    q: torch.Tensor  # [B,T,HV,K]
    k: torch.Tensor  # [B,T,HV,K]
    v: torch.Tensor  # [B,T,HV,V]
    g: torch.Tensor  # [B,T,HV,Kg] raw log gate
    beta: torch.Tensor | None  # [B,T,HV] (delta rule) or None (plain update)
    scale: float
    S0: torch.Tensor  # [N,HV,K,V]
    seqs: list

    @classmethod
    def prepare(cls, q, k, v, g, beta, scale, initial_state, cu_seqlens):
        B, T, HV, V = v.shape
        K = q.shape[-1]
        seqs = sequences(B, T, cu_seqlens)
        S0 = (torch.zeros(len(seqs), HV, K, V, dtype=F64) if initial_state is None
              else initial_state.to(F64))
        return cls(q=expand_heads(q, HV), k=expand_heads(k, HV), v=v.to(F64), g=gate_channels(g, B, T, HV),
                   beta=None if beta is None else beta.to(F64), scale=K ** -0.5 if scale is None else scale,
                   S0=S0, seqs=seqs)

    def chunk(self, gc, b, sl, h, dv=slice(None)):
        """(q, k, v[:, dv], gc, beta) of tokens sl of batch row b for value head h."""
        beta = None if self.beta is None else self.beta[b, sl, h]
        return self.q[b, sl, h], self.k[b, sl, h], self.v[b, sl, h, dv], gc[b, sl, h], beta

    def outputs(self):
        """Zero o [B,T,HV,V] and S_final [N,HV,K,V] to be filled by a layer."""
        return torch.zeros_like(self.v), torch.zeros_like(self.S0)
