"""Extreme layouts and inputs on the PyTorch path: skewed varlen batches cost what their tokens cost."""

import time

import pytest
import torch
import torch.nn.functional as F

import tilela
from tilela import reference
from tilela._validation import check_cu_seqlens
from tilela.bench import rel_l2
from tilela.torch_path.chunk import ChunkLayout, Dims

SKEWED = [1] * 63 + [2048 - 63]  # 63 one-token sequences beside one long one


def inputs(T, H=2, HV=4, K=64, V=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1),
        k=F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1),
        v=torch.randn(1, T, HV, V, generator=gen),
        g_scalar=F.logsigmoid(torch.randn(1, T, HV, generator=gen)),
        g_channel=F.logsigmoid(torch.randn(1, T, HV, K, generator=gen)),
        beta=torch.rand(1, T, HV, generator=gen),
    )


def cu_of(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


OPS = {  # op -> (gate input, uses beta)
    "chunk_gated_delta_rule": ("g_scalar", True),
    "chunk_kda": ("g_channel", True),
    "chunk_delta_rule": (None, True),
    "chunk_linear_attn": (None, False),
    "chunk_simple_gla": ("g_scalar", False),
    "chunk_gla": ("g_channel", False),
}


def run(op, x, **kw):
    gate, uses_beta = OPS[op]
    args = [x["q"], x["k"], x["v"]] + ([x[gate]] if gate else []) + ([x["beta"]] if uses_beta else [])
    return getattr(tilela, op)(*args, **kw)


def recurrent(op, x, **kw):
    gate, uses_beta = OPS[op]
    return reference.recurrent(x["q"], x["k"], x["v"], g=x[gate] if gate else None,
                               beta=x["beta"] if uses_beta else None, **kw)


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "chunk_kda"])
def test_skewed_varlen_runs_within_twice_the_dense_time(op):
    """63 one-token sequences and one long one against one dense sequence of the same 2048 tokens (best of three,
    interleaved, after a warm-up). Padding every sequence to the longest fails this by two orders of magnitude."""
    x = inputs(sum(SKEWED))
    cu = cu_of(SKEWED)
    times = {"dense": [], "skewed": []}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the host's other jobs disturb a multi-threaded run far more
    try:
        for _ in range(4):
            for layout, cu_seqlens in (("dense", None), ("skewed", cu)):
                start = time.perf_counter()
                run(op, x, cu_seqlens=cu_seqlens)
                times[layout].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    dense, skewed = min(times["dense"][1:]), min(times["skewed"][1:])
    assert skewed < 2 * dense, (skewed, dense)


def test_skewed_layout_holds_each_token_once_plus_a_short_tail():
    T = sum(SKEWED)
    dims = Dims(B=1, T=T, H=1, HV=1, K=1, V=1, N=len(SKEWED), seq_bounds=check_cu_seqlens(cu_of(SKEWED), None, 1, T))
    layout = ChunkLayout.of(dims, 64, torch.device("cpu"))
    slots = sum(group.index.numel() for group in layout.groups)
    assert slots == T  # 31 full chunks, one-token tails
    assert layout.steps == (1,) * 31
    assert sorted(layout.slot.tolist()) == list(range(T))


@pytest.mark.parametrize("op", list(OPS))
def test_skewed_varlen_against_token_recurrence(op):
    """Full chunks of a long sequence beside tails of every padded length (1 to 64 tokens), empty sequences, an
    initial state; chunk_kda and chunk_gla take 16-token chunks on this path."""
    lengths = [1, 0, 300, 2, 3, 5, 9, 17, 33, 63, 64, 65, 0, 130, 16, 15]
    x = inputs(sum(lengths), H=2, HV=6, K=16, V=24, seed=1)
    cu = cu_of(lengths)
    h0 = torch.randn(len(lengths), 6, 16, 24, generator=torch.Generator().manual_seed(2))
    o, S = run(op, x, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    ref_o, ref_S = recurrent(op, x, cu_seqlens=cu, initial_state=h0)
    assert rel_l2(o, ref_o) < 1e-5 and rel_l2(S, ref_S) < 1e-5
    assert torch.equal(S[1], h0[1]) and torch.equal(S[12], h0[12])


EXTREME_GATES = [float("-inf"), -1e30, -1e7, -104.0, -88.0]
PLACEMENTS = {  # token positions given the extreme gate, in a [200, 70] varlen batch
    "one": [130],
    "several_in_a_chunk": [70, 75, 76, 90],
    "whole_chunk": list(range(128, 192)),
    "sequence_start": [200],
}


def extreme_gate_inputs(op, value, placement, dtype):
    """Ordinary logsigmoid gates with `value` at the placement's tokens: on every head for a scalar gate, and for a
    per-channel gate on every channel of head 0 and half the channels of the other heads."""
    gate, _ = OPS[op]
    x = inputs(270, H=2, HV=4, K=16, V=16, seed=3)
    g = x[gate].double()
    pos = PLACEMENTS[placement]
    if gate == "g_scalar":
        g[0, pos] = value
    else:
        g[0, pos, 0] = value
        g[0, pos, 1:, ::2] = value
    x[gate] = g.float()
    for name in ("q", "k", "v"):
        x[name] = x[name].to(dtype)
    return x, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("value", EXTREME_GATES, ids=str)
@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "chunk_kda", "chunk_simple_gla", "chunk_gla"])
def test_gates_whose_exp_underflows_reset_the_state_exactly(op, value, placement, dtype):
    """-inf and finite gates down to -1e30 act as the token recurrence says (the state decays to exactly 0 there),
    with no NaN and no loss of the small gates beside them; an initial state makes the reset visible."""
    x, g64 = extreme_gate_inputs(op, value, placement, dtype)
    cu = cu_of([200, 70])
    h0 = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(4))
    o, S = run(op, x, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    ref_o, ref_S = recurrent(op, {**x, OPS[op][0]: g64}, cu_seqlens=cu, initial_state=h0)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_l2(o, ref_o) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_l2(S, ref_S) < 1e-5


@pytest.mark.parametrize("layer", ["chunked", "seq_split"])  # seq_in_grid and seq_in_loop share chunked's cumsum
@pytest.mark.parametrize("placement", ["one", "several_in_a_chunk"])
@pytest.mark.parametrize("value", EXTREME_GATES, ids=str)
@pytest.mark.parametrize("gate", ["g_scalar", "g_channel"])
def test_float64_reference_layers_are_exact_at_underflowing_gates(gate, value, placement, layer):
    op = "chunk_gated_delta_rule" if gate == "g_scalar" else "chunk_kda"
    x, g64 = extreme_gate_inputs(op, value, placement, torch.float64)
    cu = cu_of([200, 70])
    h0 = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    kw = dict(g=g64, beta=x["beta"], initial_state=h0, cu_seqlens=cu)
    ref_o, ref_S = reference.recurrent(x["q"], x["k"], x["v"], **kw)
    o, S = getattr(reference, layer)(x["q"], x["k"], x["v"], **kw, chunk_size=32)
    torch.testing.assert_close(o, ref_o, rtol=0, atol=1e-12)
    torch.testing.assert_close(S, ref_S, rtol=0, atol=1e-12)


def test_chunk_primitives_stay_finite_at_underflowing_gates():
    """chunk_local_cumsum floors each gate, so kkt_solve on its output sees no -inf and no NaN, and equals the
    float64 reference fed the same floored cumsum."""
    x, _ = extreme_gate_inputs("chunk_gated_delta_rule", float("-inf"), "several_in_a_chunk", torch.float32)
    cu = cu_of([200, 70])
    gc = tilela.chunk_local_cumsum(x["g_scalar"], 64, cu)
    ref_gc = reference.chunk_local_cumsum(x["g_scalar"], 64, cu)
    assert torch.isfinite(gc).all() and rel_l2(gc, ref_gc) < 1e-6
    A = tilela.kkt_solve(x["k"], x["beta"], gc, 64, cu)
    assert torch.isfinite(A).all()
    assert rel_l2(A, reference.kkt_solve(x["k"], x["beta"], ref_gc, 64, cu)) < 1e-5


def test_nan_gate_stays_nan():
    g = torch.tensor([[[-1.0], [float("nan")], [float("-inf")]]])
    gc = tilela.chunk_local_cumsum(g)
    assert gc[0, 0, 0] == -1.0 and gc[0, 1:].isnan().all()
