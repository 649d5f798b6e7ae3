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
