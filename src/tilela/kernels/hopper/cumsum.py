"""chunk_local_cumsum on Hopper: the chunk-local prefix sum of the log gate.

    gc_t = scale * sum_{s = c(t)}^{t} max(g_s, LOG_GATE_FLOOR),    c(t) = first token of t's chunk

(chunks of C from each sequence start; tilela._gates: the floor keeps the chunked forms exact where exp underflows,
a NaN gate stays NaN).

Mirrors reference.cumsum.chunk_local_cumsum. The gate is viewed as [1, T, W] with W = H (scalar gate) or H * K
(per-channel gate). A CTA owns a 64-token x 128-column tile: the tile comes in as one coalesced parallel load into
shared memory (every load in flight at once: a thread walking global memory row by row would wait out 64
dependent latencies), each thread then scans its column in shared memory in order, restarting the float32 sum at
each chunk start, and the tile leaves by one coalesced parallel store. Tiles come from common.locate_tile
(varlen without host synchronisation); chunks of C <= 64 align with tiles because both count from the sequence
start.
"""

import tilelang.language as T

from .common import TILE, floor_log_gate, locate_tile

COLUMNS = 128  # columns (threads) per CTA


def chunk_local_cumsum_kernel(chunk: int, dtype: str) -> T.PrimFunc:
    """Build the prim_func for static (chunk, input dtype); tokens, columns and sequences are symbolic."""
    num_tokens, W, num_bounds = T.dynamic("num_tokens"), T.dynamic("W"), T.dynamic("num_bounds")

    @T.prim_func
    def chunk_local_cumsum(
        g: T.Tensor((1, num_tokens, W), dtype),
        cu_seqlens: T.Tensor((num_bounds,), "int32"),
        gc: T.Tensor((1, num_tokens, W), "float32"),
        scale: T.float32,
        num_slots: T.int32,
        dense_len: T.int32,
        search_steps: T.int32,
    ):
        with T.Kernel(num_slots, T.ceildiv(W, COLUMNS), threads=COLUMNS) as (slot, cb):
            tile = T.alloc_shared((TILE, COLUMNS), "float32")
            bounds = T.alloc_local((2,), "int32")
            locate_tile(slot, cu_seqlens, num_bounds, dense_len, search_steps, bounds)
            start = bounds[0]
            end = bounds[1]
            col0 = cb * COLUMNS
            acc = T.alloc_var("float32")
            if start < end:
                for i, j in T.Parallel(TILE, COLUMNS):
                    tile[i, j] = T.if_then_else(start + i < end and col0 + j < W,
                                                floor_log_gate(T.cast(g[0, start + i, col0 + j], "float32")), 0.0)
                acc = 0.0
                for i in T.unroll(TILE):
                    if i % chunk == 0:
                        acc = 0.0
                    acc += tile[i, T.get_thread_binding()]
                    tile[i, T.get_thread_binding()] = acc * scale
                for i, j in T.Parallel(TILE, COLUMNS):
                    if start + i < end and col0 + j < W:
                        gc[0, start + i, col0 + j] = tile[i, j]

    return chunk_local_cumsum
