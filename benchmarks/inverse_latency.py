"""Cycles one CTA spends in kkt_solve's tile inverse (kkt_solve.tile_inverse) per 64-token tile, read from clock64
stamps around it on the device, and the inverse checked against float64.

    python benchmarks/inverse_latency.py [--chunk 64] [--pair 2] [--method blocked] [--ctas-per-sm 1 4] [--tiles-per-cta 64]
    python benchmarks/inverse_latency.py --chains 2 [--pair 1]   # beside two chain groups' products, one CTA an SM
    python benchmarks/inverse_latency.py --compile-only [--chains 2]     # lower and compile for sm_90a, no device

A pass that forms A itself runs the inverse in one warp group beside the state chain, so what decides is that group's
latency per chunk, not kkt_solve's throughput. Each CTA (128 threads, P value heads a pass) walks its tiles in turn:
it fills the inverse's inputs (Xd, and at chunk 32 and 64 the fp16 tile Ts) from a tile's
L = strictLower(diag(beta) (Gamma ⊙ K K^T)) as kkt_solve's extraction leaves them, stamps clock64 after a barrier,
runs the inverse into the output staging, stamps after a barrier, and stores the staging to A. The grid is the SM
count times --ctas-per-sm (1: the inverse alone on an SM; 4: kkt_solve's occupancy), so the stamps give one warp
group's cycles per inverse with and without neighbours.
Inputs are of realistic scale: l2-normalised bf16 keys (K = 128), beta a sigmoid, g a log-sigmoid gate's cumsum.

--chains N: what the inverse and the recurrence cost each other in one CTA, the question a pass with a solve group
beside its chain groups has to answer. The CTA gets N more warp groups, each running the products of one transposed
chain group of the GDN pass at DV block 128 (chunk_fwd_ws.chain_group: (K S)^T = S^T K^T with S^T from registers,
U^T = V^T Ab^T, X^T Ab^T, S^T += Vd^T K; 64 columns, K = 128) on operands resident in shared memory, with clock64
stamps around their loop. Three runs at one CTA an SM: the inverse alone, the chains alone, and both, the chains'
chunk count matched to the inverse's span; each group's cycles per tile (inverse) or per chunk (chain) in each.
"""

import argparse
import json
import statistics

import tilelang.language as T
import torch

from tilela.kernels.hopper.common import TILE
from tilela.kernels.hopper.kkt_solve import BLOCK, KSTEP, THREADS, inverse_buffers, tile_inverse
from tilela.kernels.hopper.launch import compiled, jit_kernel

COLS = 64  # a transposed chain group's columns of S (chunk_fwd_ws: DV block 128, two chain groups)
SOLVE_BARRIER = 1  # the inverse group's named barrier beside chain groups (0 is the CTA's)


def latency_kernel(chunk: int, pair: int, method: str, chains: int = 0) -> T.PrimFunc:
    """CTA b inverts tiles b, b + grid, ... of L [tiles, P, 64, 64] (float32, block diagonal with C x C blocks) into
    A [tiles, 64, P, C] (bf16, row i the C columns of its chunk) and writes each inverse's cycles to cycles[tile].
    With chains > 0 the inverse runs in warp group 0 only where `invert` is nonzero, and warp group 1 + n runs
    `chunks` chunks of a transposed chain group's products, its loop's cycles in chain_cycles[b, n]."""
    C, P = chunk, pair
    NB = TILE // BLOCK
    tiles = T.dynamic("tiles")
    inverse = tile_inverse(C, P, method)

    def group_sync():
        return T.sync_threads(SOLVE_BARRIER, THREADS) if chains else T.sync_threads()

    @T.macro
    def invert_tiles(L, A, cycles, grid, cta, inv, out_s, beta_s, tx):
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
            group_sync()
            start = T.call_extern("int64", "clock64")
            inverse(inv, out_s, beta_s, tx)
            group_sync()
            if tx == 0:
                cycles[t] = T.call_extern("int64", "clock64") - start
            for i, p, j in T.Parallel(TILE, P, C):
                A[t, i, p, j] = out_s[i, p, j]
            group_sync()  # the next tile's inputs overwrite what the stores read

    @T.macro
    def chain(n, chunks, chain_cycles, cta, tx, k_s, v_s, A_s, S_f, X_f, Vn_f, S16, X16, Vd16):
        """chunk_fwd_ws.chain_group's transposed products for `chunks` chunks on fixed operands (S^T decaying by 1/2
        a chunk, so its values stay bounded), stamped by the group's first thread."""
        start = T.alloc_var("int64")
        T.clear(S_f)
        start = T.call_extern("int64", "clock64")
        for _ in T.serial(chunks):
            T.copy(S_f, S16)
            T.gemm(S16, k_s, X_f, transpose_B=True, clear_accum=True)
            T.wgmma_gemm(v_s[n, :, :], A_s, Vn_f, transpose_A=True, transpose_B=True, clear_accum=True)
            for j, i in T.Parallel(COLS, TILE):
                X16[j, i] = T.cast(-0.5 * X_f[j, i], "bfloat16")
            T.wgmma_gemm(X16, A_s, Vn_f, transpose_B=True)
            for j, d in T.Parallel(COLS, KSTEP):
                S_f[j, d] = 0.5 * S_f[j, d]
            T.wait_wgmma(0)
            for j, i in T.Parallel(COLS, TILE):
                Vd16[j, i] = T.cast(Vn_f[j, i], "bfloat16")
            T.wgmma_gemm(Vd16, k_s, S_f)
            T.wait_wgmma(0)
        if tx % THREADS == 0:
            chain_cycles[cta, n] = T.call_extern("int64", "clock64") - start

    @T.prim_func
    def inverse_latency(
        L: T.Tensor((tiles, P, TILE, TILE), "float32"),
        A: T.Tensor((tiles, TILE, P, C), "bfloat16"),
        cycles: T.Tensor((tiles,), "int64"),
        chain_cycles: T.Tensor((T.dynamic("ctas"), max(chains, 1)), "int64"),
        grid: T.int32,
        invert: T.int32,
        chunks: T.int32,
    ):
        with T.Kernel(grid, threads=THREADS * (1 + chains)) as cta:
            tx = T.get_thread_binding()
            k_s = T.alloc_shared((TILE, KSTEP), "bfloat16")  # the output staging
            out_s = T.view(k_s, (TILE, KSTEP // C, C), "bfloat16")
            beta_s = T.alloc_shared((P, TILE), "float32")  # not read: the inverse is unscaled
            inv = inverse_buffers(C, P, method)
            T.annotate_layout(inv.layouts)
            if chains == 0:
                invert_tiles(L, A, cycles, grid, cta, inv, out_s, beta_s, tx)
            else:
                chain_k = T.alloc_shared((TILE, KSTEP), "bfloat16")  # the chains' operands: K, then V and Ab
                v_s = T.alloc_shared((chains, TILE, COLS), "bfloat16")
                A_s = T.alloc_shared((TILE, TILE), "bfloat16")
                fragments = [(T.alloc_fragment((COLS, KSTEP), "float32"), T.alloc_fragment((COLS, TILE), "float32"),
                              T.alloc_fragment((COLS, TILE), "float32"), T.alloc_fragment((COLS, KSTEP), "bfloat16"),
                              T.alloc_fragment((COLS, TILE), "bfloat16"), T.alloc_fragment((COLS, TILE), "bfloat16"))
                             for _ in range(chains)]
                for i, d in T.Parallel(TILE, KSTEP):
                    chain_k[i, d] = T.cast(0.01 * ((i + d) % 7), "bfloat16")
                for n, i, j in T.Parallel(chains, TILE, COLS):
                    v_s[n, i, j] = T.cast(0.01 * ((i * j) % 5), "bfloat16")
                for i, j in T.Parallel(TILE, TILE):
                    A_s[i, j] = T.cast(T.if_then_else(i >= j, 0.01, 0.0), "bfloat16")
                T.sync_threads()
                if tx < THREADS:
                    if invert != 0:
                        invert_tiles(L, A, cycles, grid, cta, inv, out_s, beta_s, tx)
                elif tx < 2 * THREADS:
                    chain(0, chunks, chain_cycles, cta, tx, chain_k, v_s, A_s, *fragments[0])
                if chains == 2:
                    if tx >= 2 * THREADS:
                        chain(1, chunks, chain_cycles, cta, tx, chain_k, v_s, A_s, *fragments[1])

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
    L, A, cycles = _buffers(grid * tiles_per_cta, chunk, pair)
    chain_cycles = torch.zeros(grid, 1, dtype=torch.int64, device="cuda")
    kernel(L, A, cycles, chain_cycles, grid, 1, 0)  # the first walk warms the instruction cache; the second is timed
    kernel(L, A, cycles, chain_cycles, grid, 1, 0)
    torch.cuda.synchronize()
    return {"chunk": chunk, "pair": pair, "method": method, "ctas_per_sm": ctas_per_sm, "tiles": L.shape[0],
            **_spread("cycles", cycles), "rel_l2": _error(L, A, chunk)}


def measure_beside_chains(chunk: int, pair: int, method: str, chains: int, tiles_per_cta: int) -> dict:
    """The inverse and `chains` chain groups in one CTA an SM (--chains): the inverse's cycles per tile and the
    chains' per chunk, each alone and both together, the chains' chunk count in the joint run matched to the
    inverse's span alone (from the two runs' elapsed times), so that each runs beside the other throughout."""
    kernel = compiled(latency_kernel, chunk, pair, method, chains)
    grid = torch.cuda.get_device_properties(0).multi_processor_count
    L, A, cycles = _buffers(grid * tiles_per_cta, chunk, pair)
    chain_cycles = torch.zeros(grid, chains, dtype=torch.int64, device="cuda")

    def run(invert: int, chunks: int) -> float:
        """ms of the second of two launches (the first warms the instruction cache)."""
        kernel(L, A, cycles, chain_cycles, grid, invert, chunks)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kernel(L, A, cycles, chain_cycles, grid, invert, chunks)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    record = {"chunk": chunk, "pair": pair, "method": method, "chains": chains, "tiles": L.shape[0]}
    record["inverse_alone_ms"] = run(1, 0)
    record.update(_spread("inverse_alone", cycles))
    record["chains_alone_ms"] = run(0, tiles_per_cta)
    record.update(_spread("chain_alone", chain_cycles / tiles_per_cta))
    chunks = max(1, round(tiles_per_cta * record["inverse_alone_ms"] / record["chains_alone_ms"]))
    cycles.zero_()
    record["joint_chunks"], record["joint_ms"] = chunks, run(1, chunks)
    record.update(_spread("inverse_beside", cycles))
    record.update(_spread("chain_beside", chain_cycles / chunks))
    record["rel_l2"] = _error(L, A, chunk)
    return record


def _buffers(tiles: int, chunk: int, pair: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's L (inputs), A and cycles on the device."""
    L = inputs(tiles, chunk, pair, "cuda")
    A = torch.empty(tiles, TILE, pair, chunk, dtype=torch.bfloat16, device="cuda")
    return L, A, torch.zeros(tiles, dtype=torch.int64, device="cuda")


def _spread(name: str, values: torch.Tensor) -> dict:
    """The median, 10th and 90th percentile of values under name_median, name_p10, name_p90."""
    ordered = sorted(values.flatten().cpu().tolist())
    return {f"{name}_median": statistics.median(ordered), f"{name}_p10": ordered[len(ordered) // 10],
            f"{name}_p90": ordered[len(ordered) * 9 // 10]}


def _error(L: torch.Tensor, A: torch.Tensor, chunk: int) -> float:
    """The staged A's relative L2 error against the float64 inverse."""
    exact = reference(L, chunk)
    return ((A.double().cpu() - exact).norm() / exact.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk", type=int, default=64, choices=(16, 32, 64))
    parser.add_argument("--pair", type=int, default=2, choices=(1, 2))
    parser.add_argument("--method", default="blocked", choices=("blocked", "neumann"))
    parser.add_argument("--ctas-per-sm", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tiles-per-cta", type=int, default=64)
    parser.add_argument("--chains", type=int, default=0, choices=(0, 1, 2))
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    if args.compile_only:
        jit_kernel(latency_kernel, args.chunk, args.pair, args.method, args.chains)
        print(f"compiled: chunk {args.chunk}, pair {args.pair}, {args.method}, {args.chains} chain groups")
        return
    if args.chains:
        print(json.dumps(measure_beside_chains(args.chunk, args.pair, args.method, args.chains, args.tiles_per_cta)))
        return
    for per_sm in args.ctas_per_sm:
        print(json.dumps(measure(args.chunk, args.pair, args.method, per_sm, args.tiles_per_cta)))


if __name__ == "__main__":
    main()
