"""Int32 tables a plan computes on the host (the split's segment table, a launch order), on the device without
synchronising with it.

A table is named by a hashable key and a function `host(key) -> list[int]`. On a GPU it comes in one non-blocking
copy from pinned memory, cached per (key, device, stream), so a repeated call copies nothing. Inside a CUDA-graph
capture the graph reads a copy made before the capture when there is one (torch.cuda.graph synchronises the device
before it captures, so that copy has landed; it is then kept for good, as the graph reads it at every replay); else
the copy is a node of the graph, reading the key's pinned host table, which lives as long as the process.
"""

from __future__ import annotations

import functools
from typing import Callable, Hashable

import torch

Host = Callable[[Hashable], "list[int]"]
EAGER_TABLES = 64  # tables kept outside captures (the latest first), per process
_EAGER: dict[tuple, torch.Tensor] = {}  # (host, key, device, stream) -> table; insertion order: oldest first
_GRAPH: dict[tuple, torch.Tensor] = {}  # (host, key, device) -> the table captured graphs read


def device_table(host: Host, key: Hashable, device: torch.device) -> torch.Tensor:
    """host(key) as an int32 tensor on device (see the module's docstring for the copies)."""
    if device.type != "cuda":
        return torch.tensor(host(key), dtype=torch.int32, device=device)
    if torch.cuda.is_current_stream_capturing():
        return _captured(host, key, device)
    return _eager(host, key, device, torch.cuda.current_stream(device).cuda_stream)


@functools.cache
def _pinned(host: Host, key: Hashable) -> torch.Tensor:
    """host(key) pinned (never freed: a captured graph's copy reads it on every replay)."""
    return torch.tensor(host(key), dtype=torch.int32).pin_memory()


def _copied(host: Host, key: Hashable, device: torch.device) -> torch.Tensor:
    return _pinned(host, key).to(device, non_blocking=True)


def latest(cache: dict, name: Hashable, make: Callable[[], object], kept: int):
    """cache[name], made by make() where absent, as the newest entry; the `kept` newest entries are kept."""
    value = cache.pop(name, None)
    if value is None:
        value = make()
    cache[name] = value
    while len(cache) > kept:
        del cache[next(iter(cache))]
    return value


def _eager(host: Host, key: Hashable, device: torch.device, stream: int) -> torch.Tensor:
    """A table outside a capture, per key, device and stream (the copy is ordered on the stream that reads it); the
    EAGER_TABLES latest are kept."""
    return latest(_EAGER, (host, key, device, stream), lambda: _copied(host, key, device), EAGER_TABLES)


def _captured(host: Host, key: Hashable, device: torch.device) -> torch.Tensor:
    """A table inside a capture: a copy made on the device before it (kept from then on), else a copy node."""
    table = _GRAPH.get((host, key, device))
    if table is None:
        table = next((t for (h, k, d, _), t in reversed(_EAGER.items()) if (h, k, d) == (host, key, device)), None)
        if table is None:
            return _copied(host, key, device)
        _GRAPH[(host, key, device)] = table
    return table
