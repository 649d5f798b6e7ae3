"""tilela: chunkwise linear-attention kernels (GDN, KDA and the linear-attention ladder) in
TileLang for NVIDIA Hopper, a PyTorch path that runs anywhere, and a float64 reference stack."""

from importlib import metadata as _metadata

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
from .precompile import warmup  # noqa: F401  (public, not an op: outside __all__'s op list)

try:  # the installed distribution's version; "0+unknown" only for a source tree that is not installed
    __version__ = _metadata.version("tilela")
except _metadata.PackageNotFoundError:
    __version__ = "0+unknown"

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
