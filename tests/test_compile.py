"""Every shipped chunk_local_cumsum / kkt_solve / gla_factors / seq_combine / l2norm configuration lowers and
nvcc-compiles for sm_90a (no GPU needed).

Sizes (tokens, heads, sequences; K too in cumsum and kkt_solve) are symbolic, so the static configurations listed in
tilela.kernels.hopper are the whole set: every head count (and K = 64, 128, 256) shares one compiled kernel.
The configurations are compiled once, in parallel over the machine's cores, and each test checks its own.
"""

import os
import shutil
from concurrent.futures import ProcessPoolExecutor

import pytest

tilelang = pytest.importorskip("tilelang")

from tilela.kernels import hopper  # noqa: E402
from tilela.kernels.hopper.cumsum import chunk_local_cumsum_kernel  # noqa: E402
from tilela.kernels.hopper.gla_factors import gla_factors_kernel  # noqa: E402
from tilela.kernels.hopper.kkt_solve import kkt_solve_kernel  # noqa: E402
from tilela.kernels.hopper.l2norm import l2norm_kernel  # noqa: E402
from tilela.kernels.hopper.seq_combine import seq_combine_kernel  # noqa: E402

pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found"),
]

CASES = ([("cumsum", c) for c in hopper.CUMSUM_CONFIGS] + [("kkt_solve", c) for c in hopper.KKT_CONFIGS]
         + [("gla_factors", c) for c in hopper.GLA_FACTORS_CONFIGS]
         + [("seq_combine", c) for c in hopper.SEQ_COMBINE_CONFIGS]
         + [("l2norm", c) for c in hopper.L2NORM_CONFIGS])
BUILDERS = {"cumsum": chunk_local_cumsum_kernel, "kkt_solve": kkt_solve_kernel, "gla_factors": gla_factors_kernel,
            "seq_combine": seq_combine_kernel, "l2norm": l2norm_kernel}


def _lower(case):
    """CUDA source of one configuration, lowered with the target pinned to sm_90a and compiled by nvcc (an nvcc
    error raises)."""
    from tilelang import tvm

    from tilela.kernels.hopper.common import pass_configs, target
    from tilela.kernels.hopper.launch import GUARDED

    kind, static = case
    builder = BUILDERS[kind]
    tgt = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    assert str(tgt) == str(target())
    with tvm.transform.PassContext(opt_level=3, config=pass_configs(False, builder in GUARDED)), tgt:
        artifact = tilelang.lower(builder(*static), target=tgt, enable_device_compile=True)
    return artifact.kernel_source


@pytest.fixture(scope="module")
def compiled():
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(CASES, pool.map(_lower, CASES)))


@pytest.mark.parametrize("case", CASES, ids=[f"{k}-{'-'.join(map(str, c))}" for k, c in CASES])
def test_compiles_for_sm90a(compiled, case, smem_banks):
    source = compiled[case]
    assert "__global__" in source
    if case[0] == "kkt_solve":
        _, _, dtype, gate, *_ = case[1]
        if gate == "channel" and dtype == "float16":  # the gated scores in fp32 (tf32 MMAs): fp16 would cap them at 65504
            assert "mma_sync<tl::DataType::kTensorFloat32" in source
        else:
            assert "wgmma" in source  # K K^T on the tensor cores
        assert f"__launch_bounds__(128, {2 if gate == 'channel' else 4})" in source
        # the K slice by TMA (one elected lane) where K K^T is formed once a tile; per value head by the threads
        assert ("tl::tma_load(k_desc" in source) == (gate != "channel")
        # A and Ab (scaled: beta folded into the inverse's fp32 assembly) leave as staged, in 16-byte row stores
        assert "*(uint4*)(A + " in source
        # the 16x16 blocks of K K^T (kkt_solve.block_layout) take the wgmma accumulator's 8-byte row pieces and
        # give 16-byte row reads without bank conflicts
        blocks = [row for row in smem_banks.count(source, 128) if row[2] == "KKs" and row[3] >= 8]
        assert blocks and all(wavefronts == ideal for *_, wavefronts, ideal, _, _ in blocks), blocks
        if case[1][0] >= 32:  # levels 1 and 2 on the fp16 tile, each warp's coupling on mma.sync; the tile keeps
            # its allocation name, so the kernel cache's key (the source) is the same in every process (a name bound
            # by a loop target is deduplicated in no fixed order)
            assert "half_t*)Ts)" in source and "tl::mma_sync" in source
    if case[0] == "l2norm":  # 16-byte loads and stores of the rows
        assert "*(uint4*)(x + " in source and "*(uint4*)(y + " in source
    if case[0] == "seq_combine":
        K, _, transition, *_ = case[1]
        if transition == "matrix":  # M_j one step ahead (cp.async); thread r reads its row, padded to K + 4 floats
            assert "cp_async_wait<1>" in source and f"(((int)threadIdx.x) * {K + 4})) + (k4 * 4))" in source
        else:  # the transitions' states arrive through the cp.async pipeline
            assert "cp_async" in source
    if case[0] == "gla_factors":
        _, dtype, _, delta = case[1]
        if delta:  # the inverse's fp16 tile under its allocation name, level 1 on mma.sync (as kkt_solve's)
            assert "half_t*)Ts)" in source and "tl::mma_sync" in source
        if dtype == "float16":  # the sub-chunk score operands in fp32 (tf32 MMAs), as kkt_solve's
            assert "mma_sync<tl::DataType::kTensorFloat32" in source
        else:
            assert "wgmma" in source
