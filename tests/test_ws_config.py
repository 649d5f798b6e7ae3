"""The warp-specialised pass's static structure (kernels.hopper.chunk_fwd_ws, no GPU): input slots as shared memory
holds them."""

import pytest

pytest.importorskip("tilelang")

from tilela.kernels.hopper import chunk_fwd_ws  # noqa: E402


@pytest.mark.parametrize("block_DV,gate,delta,store_output,stages", [
    (128, "none", False, True, 3),  # q, k, v slots beside S_s and P_s: no Vd_s
    (128, "scalar", False, True, 2),  # Vd_s's two slots leave room for two
    (128, "none", False, False, 4),  # the transitions: k and v alone, up to four
    (32, "scalar", True, True, 3),  # the delta rule keeps its three (its periods were measured there)
    (128, "scalar", True, True, 2),
])
def test_input_stages_fill_shared_memory(block_DV, gate, delta, store_output, stages):
    assert chunk_fwd_ws.input_stages(128, block_DV, gate, delta, store_output) == stages


def test_ring_parities_follow_the_slot_fills():
    """Chunk c of a 3-slot ring: readers wait for the slot's (c // 3)-th fill, the writer for the release of chunk
    c - 3 (a fresh barrier passes parity 1, so chunks 0-2 do not wait)."""
    ring = chunk_fwd_ws.Ring("ready", "free", 3, 32, 128)
    assert [ring.slot(c) for c in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [ring.ready_parity(c) for c in range(7)] == [0, 0, 0, 1, 1, 1, 0]
    assert [ring.free_parity(c) for c in range(7)] == [1, 1, 1, 0, 0, 0, 1]


def test_every_shipped_configuration_fits_shared_memory():
    """The buffers WsConfig allocates (the input slots included) fit the 226 KiB the accounting allows, for every
    warp-specialised configuration tilela.precompile lists."""
    from tilela.precompile import jobs

    configs = {job.config for job in jobs() if job.kind == "ws"}
    assert configs
    for K, V, gate, delta, _, _, _, block_DV, store_output, _ in configs:
        cfg = chunk_fwd_ws.WsConfig.derive(K, V, gate, delta, block_DV, store_output)
        assert sum(buffer.bytes for buffer in cfg.shared) <= chunk_fwd_ws.SHARED_BYTES, cfg
        assert cfg.stages == chunk_fwd_ws.input_stages(K, block_DV, gate, delta, store_output)
