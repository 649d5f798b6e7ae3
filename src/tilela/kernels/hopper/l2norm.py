"""l2norm on Hopper: FLA's use_qk_l2norm_in_kernel for q and k, one read and one write of each row.

    y_r = x_r / sqrt(sum_d x_rd^2 + eps)        per row r of x viewed as [rows, K], eps = 1e-6

Mirrors tilela.ops._l2norm (the PyTorch form the reference stack and the CPU path use): the sum of squares and the
product in float32, y stored in x's dtype. A CTA of 128 threads owns 4096 / K rows: the tile comes in as one
coalesced parallel load into float32 registers, each row's sum is a fragment reduction, and the tile leaves
normalised by one coalesced parallel store. Rows are symbolic, so every [B, T, H] shares one compiled kernel per
(K, dtype).
"""

import tilelang.language as T

THREADS = 128
ELEMENTS = 4096  # elements per CTA: 32 per thread


def l2norm_kernel(K: int, dtype: str) -> T.PrimFunc:
    """Build the prim_func for static (K, dtype); rows are symbolic."""
    if ELEMENTS % K:
        raise ValueError(f"K: expected a divisor of {ELEMENTS}, got {K}")
    ROWS = ELEMENTS // K
    num_rows = T.dynamic("num_rows")

    @T.prim_func
    def l2norm(x: T.Tensor((num_rows, K), dtype), y: T.Tensor((num_rows, K), dtype), eps: T.float32):
        with T.Kernel(T.ceildiv(num_rows, ROWS), threads=THREADS) as rb:
            x_f = T.alloc_fragment((ROWS, K), "float32")
            sq_f = T.alloc_fragment((ROWS, K), "float32")
            ss_f = T.alloc_fragment((ROWS,), "float32")
            r0 = rb * ROWS
            for i, d in T.Parallel(ROWS, K):
                x_f[i, d] = T.if_then_else(r0 + i < num_rows, T.cast(x[r0 + i, d], "float32"), 0.0)
            for i, d in T.Parallel(ROWS, K):
                sq_f[i, d] = x_f[i, d] * x_f[i, d]
            T.reduce_sum(sq_f, ss_f, dim=1)
            for i, d in T.Parallel(ROWS, K):
                if r0 + i < num_rows:
                    y[r0 + i, d] = T.cast(x_f[i, d] * T.rsqrt(ss_f[i] + eps), dtype)

    return l2norm
