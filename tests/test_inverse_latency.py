"""benchmarks/inverse_latency.py: its inputs and float64 reference (CPU), its kernel's lowering for sm_90a, and on a
Hopper GPU the inverse it times against that reference."""

import shutil

import pytest
import torch

from tilela.kernels.hopper.common import TILE


@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_reference_inverts_each_chunk(inverse_latency, chunk):
    """Row i of the reference holds its chunk's C columns of (I + L)^-1: each chunk's rows times its block of I + L
    are the identity, and the strictly upper entries are zero."""
    L = inverse_latency.inputs(2, chunk, 2, "cpu").double()
    A = inverse_latency.reference(L, chunk)
    assert A.shape == (2, TILE, 2, chunk)
    eye = torch.eye(chunk, dtype=torch.float64)
    for c in range(TILE // chunk):
        rows = slice(c * chunk, (c + 1) * chunk)
        block = A[:, rows].permute(0, 2, 1, 3)  # [tiles, P, C, C]
        assert torch.allclose(block @ (eye + L[:, :, rows, rows]), eye.expand_as(block), atol=1e-12)
        assert torch.count_nonzero(torch.triu(block, 1)) == 0
    assert L.abs().max() > 0.01  # realistic keys: the couplings the inverse resolves are not negligible


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_kernel_compiles_for_sm90a(inverse_latency):
    """The timed kernel lowers and nvcc-compiles with the inverse between its two clock64 stamps."""
    from tilela.kernels.hopper.launch import jit_kernel

    source = jit_kernel(inverse_latency.latency_kernel, 64, 2, "blocked").get_kernel_source()
    assert source.count("clock64()") == 2 and "tl::mma_sync" in source


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_kernel_beside_chains_compiles_for_sm90a(inverse_latency):
    """With two chain groups: the inverse's stamps and each chain group's, the chains' products on wgmma, and the
    inverse group synchronised by its own 128-thread barrier (a CTA-wide one would wait for the chains)."""
    from tilela.kernels.hopper.launch import jit_kernel

    source = jit_kernel(inverse_latency.latency_kernel, 64, 1, "blocked", 2).get_kernel_source()
    assert source.count("clock64()") == 2 + 2 * 2 and "wgmma" in source
    assert f"__sync_thread_partial({inverse_latency.SOLVE_BARRIER}, 128)" in source


@pytest.mark.gpu
@pytest.mark.parametrize("chunk, pair, method", [(64, 2, "blocked"), (64, 1, "blocked"), (32, 2, "blocked"),
                                                 (16, 1, "blocked"), (64, 2, "neumann"), (32, 1, "neumann")])
def test_timed_inverse_matches_float64(inverse_latency, chunk, pair, method):
    record = inverse_latency.measure(chunk, pair, method, ctas_per_sm=1, tiles_per_cta=2)
    assert record["rel_l2"] < 1e-2
    assert record["cycles_median"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("pair", [1, 2])
def test_inverse_beside_chains_matches_float64(inverse_latency, pair):
    """Beside two chain groups the inverse is still exact, and every group's stamps were taken in each run."""
    record = inverse_latency.measure_beside_chains(64, pair, "blocked", chains=2, tiles_per_cta=4)
    assert record["rel_l2"] < 1e-2
    for group in ("inverse_alone", "chain_alone", "inverse_beside", "chain_beside"):
        assert record[f"{group}_p10"] > 0
