"""Cycles one CTA spends in kkt_solve's tile inverse (kkt_solve.tile_inverse) per 64-token tile, read from clock64
stamps around it on the device, and the inverse checked against float64.

    python benchmarks/inverse_latency.py [--chunk 64] [--pair 2] [--method blocked] [--ctas-per-sm 1 4] [--tiles-per-cta 64]
    python benchmarks/inverse_latency.py --compile-only     # lower and compile for sm_90a, no device

A pass that forms A itself runs the inverse in one warp group beside the state chain, so what decides is that group's
latency per chunk, not kkt_solve's throughput. Each CTA (128 threads, P value heads a pass) walks its tiles in turn:
it fills the inverse's inputs (Xd, and at chunk 32 and 64 the fp16 tile Ts) from a tile's
L = strictLower(diag(beta) (Gamma ⊙ K K^T)) as kkt_solve's extraction leaves them, stamps clock64 after a barrier,
runs the inverse into the output staging, stamps after a barrier, and stores the staging to A. The grid is the SM
count times --ctas-per-sm (1: the inverse alone on an SM; 4: kkt_solve's occupancy), so the stamps give one warp
group's cycles per inverse with and without neighbours.
Inputs are of realistic scale: l2-normalised bf16 keys (K = 128), beta a sigmoid, g a log-sigmoid gate's cumsum.
"""

import argparse
import json
import statistics

import tilelang.language as T
import torch

from tilela.kernels.hopper.common import TILE
from tilela.kernels.hopper.kkt_solve import BLOCK, KSTEP, THREADS, inverse_buffers, tile_inverse
from tilela.kernels.hopper.launch import compiled, jit_kernel


def latency_kernel(chunk: int, pair: int, method: str) -> T.PrimFunc:
    """CTA b inverts tiles b, b + grid, ... of L [tiles, P, 64, 64] (float32, block diagonal with C x C blocks) into
    A [tiles, 64, P, C] (bf16, row i the C columns of its chunk) and writes each inverse's cycles to cycles[tile]."""
    C, P = chunk, pair
    NB = TILE // BLOCK
    tiles = T.dynamic("tiles")
    invert = tile_inverse(C, P, method)

    @T.prim_func
    def inverse_latency(
        L: T.Tensor((tiles, P, TILE, TILE), "float32"),
        A: T.Tensor((tiles, TILE, P, C), "bfloat16"),
        cycles: T.Tensor((tiles,), "int64"),
        grid: T.int32,
    ):
        with T.Kernel(grid, threads=THREADS) as cta:
            tx = T.get_thread_binding()
            k_s = T.alloc_shared((TILE, KSTEP), "bfloat16")  # the output staging
            out_s = T.view(k_s, (TILE, KSTEP // C, C), "bfloat16")
            beta_s = T.alloc_shared((P, TILE), "float32")  # not read: the inverse is unscaled
            inv = inverse_buffers(C, P, method)
            T.annotate_layout(inv.layouts)
            start = T.alloc_var("int64")
            for step in T.serial(T.ceildiv(tiles - cta, grid)):
                t = cta + step * grid
                # the extraction's results: I + L on the diagonal blocks, the rest of -L in the tile
                for p, b, r, c in T.Parallel(P, NB, BLOCK, BLOCK):
                    Xd_rc = T.if_then_else(c < r, L[t, p, b * BLOCK + r, b * BLOCK + c], 0.0)
                    inv.Xd[p * NB + b, r, c] = Xd_rc + T.if_then_else(r == c, 1.0, 0.0)
                if C >= 32:  # the tile's -L below its diagonal 16x16 blocks, 0 above them
                    for p, r, c in T.Parallel(P, TILE, TILE):
                        inv.Ts[p, r, c] = T.cast(T.if_then_else(r // BLOCK > c // BLOCK, -L[t, p, r, c], 0.0),
                                                 "float16")
                T.sync_threads()
                start = T.call_extern("int64", "clock64")
                invert(inv, out_s, beta_s, tx)
                T.sync_threads()
                if tx == 0:
                    cycles[t] = T.call_extern("int64", "clock64") - start
                for i, p, j in T.Parallel(TILE, P, C):
                    A[t, i, p, j] = out_s[i, p, j]
                T.sync_threads()  # the next tile's inputs overwrite what the stores read

    return inverse_latency


def inputs(tiles: int, chunk: int, pair: int, device: str, seed: int = 0) -> torch.Tensor:
    """L [tiles, P, 64, 64] float32: each C x C diagonal block strictLower(diag(beta) (Gamma ⊙ K K^T)) of one chunk,
    keys l2-normalised and rounded to bf16 (K = 128), beta a sigmoid, g the cumsum of a log-sigmoid gate."""
    generator = torch.Generator().manual_seed(seed)
    shape = (tiles, pair, TILE // chunk, chunk)
    k = torch.randn(*shape, 128, generator=generator, dtype=torch.float64)
    k = torch.nn.functional.normalize(k, dim=-1).bfloat16().double()
    beta = torch.sigmoid(torch.randn(*shape, generator=generator, dtype=torch.float64))
    g = torch.nn.functional.logsigmoid(torch.randn(*shape, generator=generator, dtype=torch.float64) + 4).cumsum(-1)
    blocks = torch.tril(beta[..., None] * (k @ k.transpose(-1, -2)) * torch.exp(g[..., None] - g[..., None, :]), -1)
    return _tiles(blocks).to(device=device, dtype=torch.float32)


def _tiles(blocks: torch.Tensor) -> torch.Tensor:
    """[tiles, P, n, C, C] diagonal blocks -> [tiles, P, n C, n C] block-diagonal tiles."""
    tiles, pair, n, C, _ = blocks.shape
    out = blocks.new_zeros(tiles, pair, n * C, n * C)
    for b in range(n):
        out[:, :, b * C:(b + 1) * C, b * C:(b + 1) * C] = blocks[:, :, b]
    return out


def reference(L: torch.Tensor, chunk: int) -> torch.Tensor:
    """A [tiles, 64, P, C] in float64: row i of (I + L)^-1 restricted to its chunk's C columns."""
    L64 = L.double().cpu()
    eye = torch.eye(TILE, dtype=torch.float64)
    X = torch.linalg.solve_triangular(eye + L64, eye.expand_as(L64), upper=False, unitriangular=True)
    rows = torch.arange(TILE)
    cols = rows[:, None] // chunk * chunk + torch.arange(chunk)
    return X[:, :, rows[:, None], cols].permute(0, 2, 1, 3)


def measure(chunk: int, pair: int, method: str, ctas_per_sm: int, tiles_per_cta: int) -> dict:
    """One run on the current device: the median (and 10th / 90th percentile) cycles of an inverse over a grid of
    SMs x ctas_per_sm CTAs walking tiles_per_cta tiles each, and the staged A's relative L2 error against float64."""
    kernel = compiled(latency_kernel, chunk, pair, method)  # once a process, whatever the occupancy
    grid = torch.cuda.get_device_properties(0).multi_processor_count * ctas_per_sm
    tiles = grid * tiles_per_cta
    L = inputs(tiles, chunk, pair, "cuda")
    A = torch.empty(tiles, TILE, pair, chunk, dtype=torch.bfloat16, device="cuda")
    cycles = torch.zeros(tiles, dtype=torch.int64, device="cuda")
    kernel(L, A, cycles, grid)  # the first walk warms the instruction cache; the second is timed
    kernel(L, A, cycles, grid)
    torch.cuda.synchronize()
    exact = reference(L, chunk)
    values = sorted(cycles.cpu().tolist())
    return {"chunk": chunk, "pair": pair, "method": method, "ctas_per_sm": ctas_per_sm,
            "tiles": tiles,
            "cycles_median": statistics.median(values), "cycles_p10": values[len(values) // 10],
            "cycles_p90": values[len(values) * 9 // 10],
            "rel_l2": ((A.double().cpu() - exact).norm() / exact.norm()).item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk", type=int, default=64, choices=(16, 32, 64))
    parser.add_argument("--pair", type=int, default=2, choices=(1, 2))
    parser.add_argument("--method", default="blocked", choices=("blocked", "neumann"))
    parser.add_argument("--ctas-per-sm", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tiles-per-cta", type=int, default=64)
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    if args.compile_only:
        jit_kernel(latency_kernel, args.chunk, args.pair, args.method)
        print(f"compiled: chunk {args.chunk}, pair {args.pair}, {args.method}")
        return
    for per_sm in args.ctas_per_sm:
        print(json.dumps(measure(args.chunk, args.pair, args.method, per_sm, args.tiles_per_cta)))


if __name__ == "__main__":
    main()
