"""chunk_local_cumsum on Hopper: the chunk-local prefix sum of the log gate, from the gate itself or from FLA's
in-kernel gate input.

    gc_t = scale * sum_{s = c(t)}^{t} max(f(g_s), LOG_GATE_FLOOR),    c(t) = first token of t's chunk
    f(x) = x                          form "log"
    f(x) = -a softplus(x + b)         form "softplus" (GDN's and KDA's in-kernel gate)
    f(x) = sigmoid(a (x + b))         form "sigmoid"  (KDA's bounded gate; scale = its lower bound)

with (a, b) per column of the gate (tilela._gates: a = exp(A_log), b = dt_bias; each given per column, per head or
once);
chunks of C from each sequence start; tilela._gates: the floor keeps the chunked forms exact where exp underflows,
a NaN gate stays NaN.

Mirrors reference.cumsum.chunk_local_cumsum of tilela._gates.apply_gate's log gate. The gate is viewed as [1, T, W]
with W = H (scalar gate) or H * K (per-channel gate). A CTA owns a 64-token x 128-column tile: the tile comes in as
one coalesced parallel load into shared memory, as it is (every load in flight at once: a thread walking global
memory row by row, or branching on each loaded value as the floor's select on a global load does, would wait out
64 dependent latencies); each thread then scans its column in shared memory in order, forming f (with the column's
(a, b) in registers) and the floor there, restarting the float32 sum at each chunk start, and the tile leaves by
one coalesced parallel store. Tiles come
from common.locate_tile (varlen without host synchronisation); chunks of C <= 64 align with tiles because both count
from the sequence start.
"""

import tilelang.language as T

from ..._gates import GATE_FORMS
from .common import TILE, exp_e, floored_log_gate, locate_tile

COLUMNS = 128  # columns (threads) per CTA


def chunk_local_cumsum_kernel(chunk: int, dtype: str, form: str = "log") -> T.PrimFunc:
    """Build the prim_func for static (chunk, input dtype, gate form); tokens, columns and sequences are symbolic.
    A_log and dt_bias hold the softplus and sigmoid forms' parameters (tilela._gates; a = exp(A_log) formed here),
    each of n elements covering the W columns in n equal runs (n = W, the value heads, or 1); the log form reads
    neither (placeholders)."""
    if form not in GATE_FORMS:
        raise ValueError(f"form: expected one of {GATE_FORMS}, got {form!r}")
    num_tokens, W, num_bounds = T.dynamic("num_tokens"), T.dynamic("W"), T.dynamic("num_bounds")
    num_a, num_b = T.dynamic("num_a"), T.dynamic("num_b")

    @T.prim_func
    def chunk_local_cumsum(
        g: T.Tensor((1, num_tokens, W), dtype),
        A_log: T.Tensor((num_a,), "float32"),
        dt_bias: T.Tensor((num_b,), "float32"),
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
            col = col0 + T.get_thread_binding()  # the column this thread scans
            acc = T.alloc_var("float32")
            a = T.alloc_var("float32")  # the column's (a, b): read by the in-kernel gate forms only
            b = T.alloc_var("float32")
            if start < end:
                for i, j in T.Parallel(TILE, COLUMNS):
                    tile[i, j] = T.if_then_else(start + i < end and col0 + j < W,
                                                T.cast(g[0, start + i, col0 + j], "float32"), 0.0)
                acc = 0.0
                if form != "log":
                    a = T.if_then_else(col < W, exp_e(A_log[col // (W // num_a)]), 0.0)
                    b = T.if_then_else(col < W, dt_bias[col // (W // num_b)], 0.0)
                for i in T.unroll(TILE):  # rows past the sequence end add to acc after every stored row
                    if i % chunk == 0:
                        acc = 0.0
                    acc += floored_log_gate(tile[i, T.get_thread_binding()], a, b, form)
                    tile[i, T.get_thread_binding()] = acc * scale
                for i, j in T.Parallel(TILE, COLUMNS):
                    if start + i < end and col0 + j < W:
                        gc[0, start + i, col0 + j] = tile[i, j]

    return chunk_local_cumsum
