"""The token-range pipeline's host side (kernels.hopper.seq_pipeline) on the CPU: pipeline_forward with float64
stand-ins for gla_factors (the range's inputs as they are) and the state pass (reference layer B over the range from
its entering state) against the unpipelined reference, so the ranges' cuts, the states handed from range to range
and the output's pieces are checked without a GPU. The two streams, the TileLang launches and the bitwise match with
the unpipelined call are GPU tests (tests/test_gpu_kda.py)."""

import pytest
import torch
import torch.nn.functional as F

from tilela import reference
from tilela.kernels.hopper.seq_pipeline import pipeline_forward

F64 = torch.float64


def _kda(T, H=1, G=2, K=8, V=12, seed=0):
    """One sequence of KDA's inputs: a head without decay, a head with half its channels calm."""
    gen = torch.Generator().manual_seed(seed)
    HV = H * G
    g = F.logsigmoid(torch.randn(1, T, HV, K, generator=gen, dtype=F64))
    g[:, :, 0] = 0.0
    g[:, :, 1, : K // 2] = 0.0
    return dict(q=torch.randn(1, T, H, K, generator=gen, dtype=F64),
                k=F.normalize(torch.randn(1, T, H, K, generator=gen, dtype=F64), dim=-1),
                v=torch.randn(1, T, HV, V, generator=gen, dtype=F64), g=g,
                beta=torch.rand(1, T, HV, generator=gen, dtype=F64),
                initial_state=torch.randn(1, HV, K, V, generator=gen, dtype=F64))


@pytest.mark.parametrize("bounds", [(0, 200), (0, 64, 200), (0, 128, 192, 200), (0, 64, 128, 192, 193)],
                         ids=["one", "two", "three", "one-token-last"])
@pytest.mark.parametrize("with_h0", [True, False])
def test_pipeline_forward_matches_the_unpipelined_pass(bounds, with_h0):
    """Each range's pass enters from the state the previous one left (the initial state, or none, at the start),
    writes its piece of o, and the last range's state is the final one; the factors are formed range by range in
    order, each before its range's pass."""
    p = _kda(bounds[-1])
    h0 = p["initial_state"] if with_h0 else None
    o_ref, S_ref = reference.chunked(p["q"], p["k"], p["v"], g=p["g"], beta=p["beta"], initial_state=h0)
    calls = []

    def factors(q, k, g, beta):
        calls.append(("factors", q.shape[1]))
        return q, k, g, beta

    def state_pass(r, made, v, h, o, ht):
        calls.append(("pass", r))
        assert (h is None) == (r == 0 and h0 is None) and ht.dtype == F64
        q, k, g, beta = made
        o_r, S_r = reference.chunked(q, k, v, g=g, beta=beta, initial_state=h)
        o.copy_(o_r)
        ht.copy_(S_r)

    for final in (True, False):
        calls.clear()
        o, S = pipeline_forward(factors, state_pass, p["q"], p["k"], p["v"], p["g"], p["beta"], h0, final, bounds)
        torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12)
        if final:
            torch.testing.assert_close(S, S_ref, rtol=0, atol=1e-12)
        else:
            assert S is None
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        expected = [("factors", sizes[0])]
        for r, size in enumerate(sizes[1:]):
            expected += [("pass", r), ("factors", size)]
        assert calls == expected + [("pass", len(sizes) - 1)]
