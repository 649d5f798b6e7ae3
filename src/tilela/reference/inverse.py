"""Inverses X = L^-1 of a unit lower-triangular C x C matrix L = I + N (N strictly lower), mirroring the kernels.
Leading batch dims are allowed. Document notation (seed 000 §2, seed 003):

    row       X[k,:] = e_k^T - sum_{j<k} L[k,j] X[j,:]   in place, row by row, with a backup of L[k,:k] (a16i_row)
    blocked   [[L00, 0], [L10, L11]]^-1 = [[X00, 0], [X11 (-L10) X00, X11]],  recursive down to `base`;
              -L10 is stored at extraction, the coupling is two chained GEMMs
    flat      on the (C/b) x (C/b) grid of b x b blocks:  X_ij = X_ii (-sum_{j<=l<i} L_il X_lj),  X_ii by `row`
    neumann   (I + N)^-1 = (I - N)(I + N^2)(I + N^4)(I + N^8)  since N^16 = 0 for C <= 16: six GEMMs
    solve     torch's unit-triangular solve (the float64 baseline)

inverse_cost counts the mathematically necessary FMAs (no products with the known 0/1 entries) and the
dependency-chain length, one step being one row of a forward substitution or one GEMM; it follows each
method's loop structure (GEMMs accumulating into one tile are chained).
"""
from functools import partial

import torch

from ._common import F64


def solve_unit_lower(L):
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device).expand_as(L)
    return torch.linalg.solve_triangular(L, eye, upper=False, unitriangular=True)


def row_forward_inplace(L):
    X = L.to(F64).clone()
    for ks in range(1, X.shape[-1]):
        row = X[..., ks, :ks].clone()  # a16i_row: L[ks, :ks] kept aside while row ks is rewritten
        acc = torch.zeros_like(X[..., ks, :])
        for kr in range(ks):
            acc -= X[..., kr, :] * row[..., kr, None]
        X[..., ks, :ks] = acc[..., :ks]
    return X


def blocked_inverse(L, base=16, base_inverse=row_forward_inplace):
    n = L.shape[-1]
    if n <= base:
        return base_inverse(L)
    h = n // 2
    L = L.to(F64)
    X = torch.zeros_like(L)
    X[..., :h, :h] = blocked_inverse(L[..., :h, :h], base, base_inverse)
    X[..., h:, h:] = blocked_inverse(L[..., h:, h:], base, base_inverse)
    neg_L10 = -L[..., h:, :h]
    X[..., h:, :h] = (X[..., h:, h:] @ neg_L10) @ X[..., :h, :h]
    return X


def flat_block_inverse(L, block=16):
    L = L.to(F64)
    X = torch.zeros_like(L)
    blk = [slice(i, i + block) for i in range(0, L.shape[-1], block)]
    for i in blk:
        X[..., i, i] = row_forward_inplace(L[..., i, i])
    for bi, i in enumerate(blk):
        for bj, j in enumerate(blk[:bi]):
            acc = sum(L[..., i, l] @ X[..., l, j] for l in blk[bj:bi])
            X[..., i, j] = -X[..., i, i] @ acc
    return X


def neumann_inverse_16(L, dtype=F64):
    """Neumann product with every GEMM operand, product and sum rounded to `dtype` (fp16 emulates FlashKDA)."""
    def rnd(x):
        return x.to(dtype).to(F64)

    eye = torch.eye(L.shape[-1], dtype=F64)
    N = rnd(L.to(F64) - eye)
    X = rnd(eye - N)
    power = N
    for _ in range(3):
        power = rnd(rnd(power) @ rnd(power))  # N^2, N^4, N^8
        X = rnd(X + rnd(X @ power))
    return X


INVERSES = {
    "solve": solve_unit_lower,
    "row": row_forward_inplace,
    "blocked": blocked_inverse,
    "flat": flat_block_inverse,
    # FlashKDA's 16x16 Neumann inverse as the diagonal-block inverse of the blocked recursion (C = 16: alone)
    "neumann": partial(blocked_inverse, base_inverse=neumann_inverse_16),
}


def _row_cost(n):
    # row ks: acc -= X[kr, :] L[ks, kr] for kr < ks; X[kr, c] is unknown only for c < kr
    return dict(fma=sum(kr for ks in range(1, n) for kr in range(ks)), chain=n - 1)


def _neumann_cost(n):
    fma = power = X = 0
    for _ in range(3):
        power += 1  # squaring depends on the previous power only
        X = max(X, power) + 1
        fma += 2 * n ** 3
    return dict(fma=fma, chain=X)


def _blocked_cost(n, base, base_cost):
    if n <= base:
        return base_cost(n)
    half = _blocked_cost(n // 2, base, base_cost)  # two independent halves: work doubles, depth does not
    return dict(fma=2 * half["fma"] + 2 * (n // 2) ** 3, chain=half["chain"] + 2)


def _flat_cost(n, block):
    m = n // block
    diag = _row_cost(block)
    ready = {(i, i): diag["chain"] for i in range(m)}
    fma = m * diag["fma"]
    for i in range(1, m):
        for j in range(i):
            acc = 0
            for l in range(j, i):  # acc += L_il X_lj, one GEMM each, chained through the accumulator
                acc = max(acc, ready[l, j]) + 1
            ready[i, j] = max(acc, ready[i, i]) + 1  # X_ij = -X_ii acc
            fma += (i - j + 1) * block ** 3
    return dict(fma=fma, chain=max(ready.values()))


def inverse_cost(method, C, block=16):
    """dict(fma=..., chain=...) of `method` ("row", "blocked", "flat", "neumann") for a C x C matrix."""
    if method == "row":
        return _row_cost(C)
    if method == "flat":
        return _flat_cost(C, block)
    return _blocked_cost(C, block, {"blocked": _row_cost, "neumann": _neumann_cost}[method])
