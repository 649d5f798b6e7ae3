"""Host-side choices of the Hopper state/output launcher (no GPU needed): which pass serves a call, which DV block
the warp-specialised pass takes, and the errors for a pass that cannot serve the call."""

import pytest
import torch

pytest.importorskip("tilelang")

from tilela.kernels.hopper import chunk_fwd_ws  # noqa: E402
from tilela.kernels.hopper.chunk_fwd import chunk_forward  # noqa: E402


@pytest.mark.parametrize("K,gate,delta,dtype,covered", [
    (128, "scalar", True, "bfloat16", True), (64, "none", False, "float16", True),
    (256, "scalar", True, "bfloat16", False), (128, "channel", False, "bfloat16", True),
    (128, "channel", True, "bfloat16", False), (128, "scalar", False, "float32", False),
])
def test_ws_covers(K, gate, delta, dtype, covered):
    assert chunk_fwd_ws.covers(K, K, gate, delta, dtype) is covered


@pytest.mark.parametrize("K,V,grid,block", [(128, 128, 33, 32), (128, 128, 34, 64), (128, 128, 66, 64),
                                            (128, 128, 67, 128), (128, 128, 512, 128), (64, 64, 8, 32), (64, 64, 100, 64),
                                            (128, 256, 34, 128), (128, 256, 33, 64)])
def test_ws_block_follows_grid_size(K, V, grid, block):
    assert chunk_fwd_ws.default_block_DV(K, V, grid, 132) == block


@pytest.mark.parametrize("grid,block", [(33, 64), (66, 128), (128, 128), (500, 128)])
def test_ws_block_without_output_group(grid, block):
    """The state pass alone (the split's transitions, V = 2K): K / 2 runs its chain 1.9x faster than K at a full GPU
    (2.2 against 4.2 us), so it wins while its twice the CTAs take fewer than 1.9x the waves of K."""
    assert chunk_fwd_ws.default_block_DV(128, 256, grid, 132, store_output=False) == block


@pytest.mark.parametrize("K,grid,rule,block", [
    (128, 16, "delta", 16), (128, 17, "delta", 32), (128, 16, "gdn", 32),  # K / 8 measured for delta_rule alone
    (64, 8, "delta", 32),  # 16 columns only at K = 128
    (128, 33, "plain", 32), (128, 34, "plain", 64), (128, 66, "plain", 64), (128, 67, "plain", 32),
    (128, 100, "plain", 128), (128, 199, "plain", 32), (128, 199, "vd", 128),
])
def test_ws_block_by_update_rule(K, grid, rule, block):
    """Each update rule at its own chunk periods: the ungated delta rule takes K / 8 blocks up to one wave; the
    plain update from V ("plain") and through Vd ("vd") part where the waves of K / 4 blocks cost less than K's."""
    assert chunk_fwd_ws.default_block_DV(K, K, grid, 132, rule=rule) == block


def _inputs(K):
    q = torch.zeros(1, 64, 1, K, dtype=torch.bfloat16)
    return q, q, q.clone(), torch.zeros(1, 64, 1), torch.zeros(1, 64, 1), torch.zeros(1, 64, 1, 64)


def test_unknown_kernel_is_rejected():
    with pytest.raises(ValueError, match="kernel: expected 'auto', 'ws' or 'loop', got 'fast'"):
        chunk_forward(*_inputs(128), 1.0, kernel="fast")


def test_ws_outside_its_coverage_is_rejected():
    with pytest.raises(ValueError, match="K=256"):
        chunk_forward(*_inputs(256), 1.0, kernel="ws")


def test_sequence_split_needs_the_ws_pass():
    from tilela.kernels.hopper.seq_split import SegmentPlan

    with pytest.raises(ValueError, match="K=256"):
        chunk_forward(*_inputs(256), 1.0, segments=SegmentPlan.of([64], 1))
    with pytest.raises(ValueError, match="segments: the sequence split runs on the warp-specialised pass"):
        chunk_forward(*_inputs(128), 1.0, kernel="loop", segments=SegmentPlan.of([64], 1))


def test_sequence_split_takes_no_per_channel_gate():
    from tilela.kernels.hopper.seq_split import SegmentPlan

    q, k, v = _inputs(128)[:3]
    with pytest.raises(ValueError, match="segments: the sequence split takes no per-channel gate"):
        chunk_forward(q, k, v, torch.zeros(1, 64, 1, 128), None, None, 1.0, segments=SegmentPlan.of([64], 1))


def test_raw_gate_is_for_the_per_channel_ws_pass():
    with pytest.raises(ValueError, match="g_is_cumsum=False: only the warp-specialised pass under a per-channel gate"):
        chunk_forward(*_inputs(128), 1.0, g_is_cumsum=False)
    q, k, v = _inputs(128)[:3]
    with pytest.raises(ValueError, match=r"g_is_cumsum=False.*kernel='loop'"):
        chunk_forward(q, k, v, torch.zeros(1, 64, 1, 128), None, None, 1.0, kernel="loop", g_is_cumsum=False)


@pytest.mark.parametrize("kwargs", [dict(block_DV=8), dict(block_DV=64, kernel="loop"),
                                    dict(block_DV=128, segments="plan")])
def test_block_DV_is_for_the_unsplit_ws_pass(kwargs):
    from tilela.kernels.hopper.seq_split import SegmentPlan

    if kwargs.get("segments") == "plan":
        kwargs["segments"] = SegmentPlan.of([64], 1)
    with pytest.raises(ValueError, match=r"block_DV: the unsplit warp-specialised pass takes one of \(128, 64, 32, 16\)"):
        chunk_forward(*_inputs(128), 1.0, **kwargs)


@pytest.mark.parametrize("gate,delta,rule", [("scalar", True, "gdn"), ("none", True, "delta"),
                                             ("scalar", False, "vd"), ("none", False, "plain"),
                                             ("channel", False, "plain")])
def test_update_rule_keys_the_chunk_periods(gate, delta, rule):
    """The plain update without a scalar gate adds K^T V from the input slots (no Vd): its own periods."""
    assert chunk_fwd_ws.update_rule(gate, delta) == rule
    assert chunk_fwd_ws.direct_v(gate, delta) == (rule == "plain")


@pytest.mark.parametrize("block_DV,gate,delta,store_output,stages", [
    (128, "none", False, True, 3),  # q, k, v slots beside S_s and P_s: no Vd_s
    (128, "scalar", False, True, 2),  # Vd_s's two slots leave room for two
    (128, "none", False, False, 4),  # the transitions: k and v alone, up to four
    (32, "scalar", True, True, 3),  # the delta rule keeps its three (its periods were measured there)
    (128, "scalar", True, True, 2),
])
def test_input_stages_fill_shared_memory(block_DV, gate, delta, store_output, stages):
    assert chunk_fwd_ws.input_stages(128, block_DV, gate, delta, store_output) == stages
