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
    assert any(config[10:] == (True,) for config in configs)  # GDN's folded pass
    for K, V, gate, delta, _, _, _, block_DV, store_output, _, *folded in configs:
        cfg = chunk_fwd_ws.WsConfig.derive(K, V, gate, delta, block_DV, store_output, folded=folded == [True])
        assert sum(buffer.bytes for buffer in cfg.shared) <= chunk_fwd_ws.SHARED_BYTES, cfg
        if not cfg.folded:
            assert cfg.stages == chunk_fwd_ws.input_stages(K, block_DV, gate, delta, store_output)


@pytest.mark.parametrize("K,gate,block_DV,chains", [
    (128, "scalar", 128, 2),  # GDN at full width: two chain groups of 64 columns
    (64, "none", 64, 2),  # delta_rule at K = 64: two of 32
    (128, "scalar", 64, 1),  # GDN at DV 64: one chain group, the value group's warps idle
    (128, "scalar", 32, 0),  # smaller DV blocks keep the state and value groups
    (64, "scalar", 32, 0),
    (128, "channel", 64, 0),  # KDA: its value group reads Vnew_s as Vd
])
def test_chain_groups_hand_over_to_the_output_group_only(K, gate, block_DV, chains):
    """With chain groups (delta rule with output, no per-channel gate, at DV block K or at 64 with K = 128) each
    writes its part of S_s and Vnew_s (128 arrivals a group), the output group alone reads them (128), Vd needs no
    ring and Vnew_s has two slots; the input slots are released by the chain groups and the output group."""
    cfg = chunk_fwd_ws.WsConfig.derive(K, K, gate, True, block_DV, True)
    assert cfg.chains == chains
    if chains:
        assert (cfg.S_ring.writers, cfg.S_ring.readers) == (chains * 128, 128)
        assert (cfg.Vn_ring.writers, cfg.Vn_ring.readers, cfg.Vn_ring.slots) == (chains * 128, 128, 2)
        assert cfg.Vd_ring is None and not cfg.value_writes_vd
        assert "Vd_s" not in {buffer.name for buffer in cfg.shared}
        assert cfg.inputs.readers == (chains + 1) * chunk_fwd_ws.GROUP
    else:
        assert cfg.S_ring.writers == 128 and cfg.Vn_ring.writers == 128
        assert cfg.inputs.readers == 3 * chunk_fwd_ws.GROUP


@pytest.mark.parametrize("K,gate,block_DV,transposed", [
    (128, "scalar", 128, True),  # GDN at full width: halves of 64 columns, a warp group's 64 product rows
    (128, "none", 128, True),  # delta_rule
    (128, "scalar", 64, True),  # one chain group of 64 columns
    (64, "scalar", 64, False),  # halves of 32 columns: below a warp group's rows, the chain stays untransposed
    (128, "scalar", 32, False),  # no chain groups
])
def test_transposed_chain_groups_hand_over_S_and_Vnew_transposed(K, gate, block_DV, transposed):
    """The chain groups run transposed where each holds 64 columns of the DV block; S_s and Vnew_s then hold S^T
    and Vnew^T (rows by DV column), else S and Vnew."""
    cfg = chunk_fwd_ws.WsConfig.derive(K, K, gate, True, block_DV, True)
    assert cfg.transposed == transposed
    shapes = {buffer.name: buffer.shape for buffer in cfg.shared}
    C = chunk_fwd_ws.CHUNK
    assert shapes["S_s"] == ((2, block_DV, K) if transposed else (2, K, block_DV))
    assert shapes["Vn_s"][1:] == ((block_DV, C) if transposed else (C, block_DV))


def test_the_warm_up_serves_the_scalar_gate_only():
    """The pass reads a per-channel gate's decays by the tile slots of the sequence's own chunks; a warm-up (which
    starts chunks before a segment) is the scalar gate's (the split of GDN), so the builder refuses the pair."""
    with pytest.raises(ValueError, match="warm-up serves the scalar gate"):
        chunk_fwd_ws.chunk_fwd_ws_kernel(128, 128, 128**-0.5, "channel", True, is_varlen=True, block_DV=64,
                                         warmup=True)


def test_folded_pass_hands_over_through_the_input_slots_only():
    """Folded (the output formed by the two chain groups): no S_s, Vnew_s or output-group P_s; the scores in an input
    slot buffer of their own beside each chain group's O staging, three input slots, released by the chain groups
    alone (the scores group's reads end before their wait for its "scored"); the four groups' registers after
    setmaxnreg sum to the 512 (65536 over the launch's 512 threads) a CTA has."""
    cfg = chunk_fwd_ws.WsConfig.derive(128, 128, "scalar", True, 128, True, folded=True)
    assert cfg.folded and cfg.S_ring is None and cfg.Vn_ring is None and cfg.Vd_ring is None
    shapes = {buffer.name: buffer.shape for buffer in cfg.shared}
    C = chunk_fwd_ws.CHUNK
    assert "S_s" not in shapes and "Vn_s" not in shapes
    assert shapes["P_s"] == (3, C, C) and shapes["O_s"] == (2, C, 64)
    assert cfg.stages == 3 and cfg.inputs.readers == 2 * chunk_fwd_ws.GROUP
    assert sum(buffer.bytes for buffer in cfg.shared) <= chunk_fwd_ws.SHARED_BYTES
    assert 2 * chunk_fwd_ws.FOLDED_CHAIN_REGS + chunk_fwd_ws.SCORES_REGS + chunk_fwd_ws.FOLDED_LOAD_REGS == 512


@pytest.mark.parametrize("K,gate,delta,block_DV,store_output", [
    (128, "scalar", True, 64, True),  # one chain group
    (64, "scalar", True, 64, True),  # halves of 32 columns, untransposed
    (128, "channel", True, 64, True),  # KDA: no chain groups
    (128, "scalar", False, 128, True),  # the plain update
    (128, "scalar", True, 128, False),  # no output to fold
])
def test_folding_needs_two_transposed_chain_groups(K, gate, delta, block_DV, store_output):
    with pytest.raises(ValueError, match="folded: the output folds into two transposed chain groups"):
        chunk_fwd_ws.WsConfig.derive(K, K, gate, delta, block_DV, store_output, folded=True)


def test_the_folded_pass_takes_no_warm_up():
    with pytest.raises(ValueError, match="folded: the output folds into the chain groups of the unsplit pass"):
        chunk_fwd_ws.chunk_fwd_ws_kernel(128, 128, 128**-0.5, "scalar", True, is_varlen=True, block_DV=128,
                                         warmup=True, folded=True)
