"""tilela: chunkwise linear-attention kernels (GDN, KDA and the linear-attention ladder) in
TileLang for NVIDIA Hopper, a PyTorch path that runs anywhere, and a float64 reference stack."""

from .ops import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_gla,
    chunk_kda,
    chunk_linear_attn,
    chunk_local_cumsum,
    chunk_simple_gla,
    kkt_solve,
)
from .precompile import warmup

__version__ = "0.1.0"

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_kda",
    "chunk_delta_rule",
    "chunk_linear_attn",
    "chunk_simple_gla",
    "chunk_gla",
    "kkt_solve",
    "chunk_local_cumsum",
]
