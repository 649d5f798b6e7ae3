"""Chunk-local cumsum of the log gate.

    gc_t = scale * sum_{s = c(t)}^{t} max(g_s, LOG_GATE_FLOOR),    c(t) = first token of t's chunk,

chunks being C consecutive tokens counted from every sequence start (the last one may be shorter). The floor
(tilela._gates) keeps exp(gc_i - gc_j) exact where a gate's exp underflows: 0 across such a token, the small
gates beside it kept.
Scalar g [B,T,H] or per-channel g [B,T,H,K]; `scale` is e.g. log2(e) for the exp2 kernels.
"""
import torch

from .._gates import floor_log_gate
from ._common import F64, chunk_slices, sequences


def chunk_local_cumsum(g, chunk_size=64, cu_seqlens=None, scale=None):
    g = floor_log_gate(g.to(F64))
    gc = torch.zeros_like(g)
    for _, b, bos, eos in sequences(g.shape[0], g.shape[1], cu_seqlens):
        for sl in chunk_slices(bos, eos, chunk_size):
            gc[b, sl] = g[b, sl].cumsum(0)
    return gc if scale is None else gc * scale
