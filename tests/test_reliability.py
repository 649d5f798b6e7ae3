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


# the recurrence of every op as tilela.reference computes it: chunk_linear_attn without FLA's default normaliser
PLAIN = {"chunk_linear_attn": dict(normalize=False)}


def run(op, x, **kw):
    gate, uses_beta = OPS[op]
    args = [x["q"], x["k"], x["v"]] + ([x[gate]] if gate else []) + ([x["beta"]] if uses_beta else [])
    return getattr(tilela, op)(*args, **PLAIN.get(op, {}), **kw)


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


LAYER_CASES = [("chunked", value, placement) for value in EXTREME_GATES for placement in ("one", "several_in_a_chunk")]
LAYER_CASES += [("seq_split", -1e30, "several_in_a_chunk")]  # the other layers share chunked's cumsum


@pytest.mark.parametrize("layer,value,placement", LAYER_CASES, ids=[f"{a}-{b}-{c}" for a, b, c in LAYER_CASES])
@pytest.mark.parametrize("gate", ["g_scalar", "g_channel"])
def test_float64_reference_layers_are_exact_at_underflowing_gates(gate, layer, value, placement):
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


CONTAINMENT_LENGTHS = [40, 70, 30]


def bad_inputs(op, name, value, t=90, head=1):
    """Varlen [40, 70, 30], GVA 2 (H = 2, HV = 4), an initial state; `value` put into `name` at token t (sequence 1,
    its token 50) on q/k head `head` (value heads 2 and 3) or value head `head`, one channel where it has some."""
    x = inputs(sum(CONTAINMENT_LENGTHS), H=2, HV=4, K=16, V=16, seed=5)
    gate, _ = OPS[op]
    x["g"] = x.pop(gate) if gate else None
    x["h0"] = torch.randn(3, 4, 16, 16, generator=torch.Generator().manual_seed(6))
    clean = {n: (None if a is None else a.clone()) for n, a in x.items()}
    if x[name].dim() == 4:
        x[name][0, t, head, 3] = value
    else:
        x[name][0, t, head] = value
    return clean, x


def call(op, x, **kw):
    gate, uses_beta = OPS[op]
    args = [x["q"], x["k"], x["v"]] + ([x["g"]] if gate else []) + ([x["beta"]] if uses_beta else [])
    return getattr(tilela, op)(*args, initial_state=x["h0"], output_final_state=True, cu_seqlens=cu_of(
        CONTAINMENT_LENGTHS), **PLAIN.get(op, {}), **kw)


BAD_CASES = [(op, name, value) for op, (gate, uses_beta) in OPS.items()
             for name in ["q", "k", "v"] + (["g"] if gate else []) + (["beta"] if uses_beta else [])
             for value in ([float("nan"), float("inf")] if name == "g" else [float("nan"), float("-inf")])]


@pytest.mark.parametrize("op,name,value", BAD_CASES, ids=[f"{o}-{n}-{v}" for o, n, v in BAD_CASES])
def test_non_finite_input_reaches_only_what_the_recurrence_reaches(op, name, value):
    """A non-finite value reaches its own sequence and the value heads that read it, forward in time only: the
    tokens (and final states) the token recurrence makes non-finite, and nothing else; all other outputs equal
    those of the clean input bit for bit."""
    clean, x = bad_inputs(op, name, value)
    o, S = call(op, x)
    o_clean, S_clean = call(op, clean)
    gate, uses_beta = OPS[op]
    ref_o, ref_S = reference.recurrent(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"] if uses_beta else None,
                                       initial_state=x["h0"], cu_seqlens=cu_of(CONTAINMENT_LENGTHS))
    hit = ~torch.isfinite(o).all(-1)
    assert torch.equal(hit, ~torch.isfinite(ref_o).all(-1))
    assert torch.equal(~torch.isfinite(S).all(-1).all(-1), ~torch.isfinite(ref_S).all(-1).all(-1))
    heads = [1] if name in ("v", "g", "beta") else [2, 3]
    expected_hit = torch.zeros_like(hit)
    expected_hit[0, 90:91 if name == "q" else 110, heads] = True
    assert torch.equal(hit, expected_hit)
    assert torch.equal(o[~hit], o_clean[~hit])
    finite_S = torch.isfinite(S).all(-1).all(-1)
    assert torch.equal(S[finite_S], S_clean[finite_S])


def test_non_finite_initial_state_stays_in_its_sequence_and_head():
    clean, x = bad_inputs("chunk_gated_delta_rule", "q", 1.0)
    x["q"] = clean["q"]
    x["h0"][1, 2, 5, 7] = float("nan")
    o, S = call("chunk_gated_delta_rule", x)
    o_clean, S_clean = call("chunk_gated_delta_rule", clean)
    hit = ~torch.isfinite(o).all(-1)
    expected_hit = torch.zeros_like(hit)
    expected_hit[0, 40:110, 2] = True  # sequence 1, value head 2
    assert torch.equal(hit, expected_hit) and torch.equal(o[~hit], o_clean[~hit])
    assert S[1, 2].isnan().any() and torch.equal(S[1, :2], S_clean[1, :2]) and torch.equal(S[0], S_clean[0])


CHECKED = [  # op, tensor, position, words of the message
    ("chunk_gated_delta_rule", "q", (0, 90, 1, 3), ["q:", "nan", "batch 0, token 90, head 1, channel 3",
                                                   "sequence 1, its token 50"]),
    ("chunk_gated_delta_rule", "g", (0, 5, 2), ["g:", "inf", "batch 0, token 5, head 2]", "sequence 0, its token 5"]),
    ("chunk_kda", "g", (0, 139, 0, 15), ["g:", "nan", "token 139, head 0, channel 15", "sequence 2, its token 29"]),
    ("chunk_delta_rule", "beta", (0, 0, 3), ["beta:", "token 0, head 3"]),
    ("chunk_linear_attn", "v", (0, 40, 0, 0), ["v:", "token 40, head 0, channel 0", "sequence 1, its token 0"]),
    ("chunk_gla", "h0", (2, 1, 4, 5), ["initial_state:", "sequence 2, head 1, key 4, value 5"]),
]


@pytest.mark.parametrize("op,name,position,words", CHECKED)
def test_check_finite_names_the_tensor_and_the_first_bad_position(op, name, position, words):
    x = bad_inputs(op, "q", 1.0)[0]
    x[name][position] = float("inf") if "inf" in words else float("nan")
    call(op, x)  # off by default
    with pytest.raises(ValueError) as info:
        call(op, x, check_finite=True)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_check_finite_reports_the_first_of_several():
    x = bad_inputs("chunk_gated_delta_rule", "k", float("nan"), t=100)[1]
    x["k"][0, 60, 0, 7] = float("-inf")
    x["v"][0, 2, 0, 0] = float("nan")  # v comes after k in the argument order
    with pytest.raises(ValueError, match=r"^k: .* got -inf at \[batch 0, token 60, head 0, channel 7\]"):
        call("chunk_gated_delta_rule", x, check_finite=True)


def test_check_finite_passes_clean_inputs_and_reset_gates():
    x = bad_inputs("chunk_gated_delta_rule", "g", float("-inf"))[1]
    assert all(torch.equal(a, b) for a, b in zip(call("chunk_gated_delta_rule", x, check_finite=True),
                                                 call("chunk_gated_delta_rule", x)))
    with pytest.raises(TypeError, match="check_finite: expected a bool, got str"):
        call("chunk_gated_delta_rule", x, check_finite="yes")


def test_check_finite_on_the_primitives():
    x = bad_inputs("chunk_gated_delta_rule", "k", 0.0)[0]
    cu = cu_of(CONTAINMENT_LENGTHS)
    g = x["g"].clone()
    g[0, 45, 1] = float("nan")
    with pytest.raises(ValueError, match=r"g: .* nan at \[batch 0, token 45, head 1\] \(sequence 1, its token 5\)"):
        tilela.chunk_local_cumsum(g, 64, cu, check_finite=True)
    beta = x["beta"].clone()
    beta[0, 3, 0] = float("inf")
    with pytest.raises(ValueError, match=r"beta: .* inf at \[batch 0, token 3, head 0\]"):
        tilela.kkt_solve(x["k"], beta, None, 64, cu, check_finite=True)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("op", list(OPS))
def test_reruns_are_bitwise_identical(op, varlen):
    lengths = [1, 150, 0, 77, 64, 130]
    x = inputs(sum(lengths) if varlen else 2 * 150, H=2, HV=4, K=16, V=32, seed=7)
    if not varlen:
        x = {n: t.reshape(2, 150, *t.shape[2:]) for n, t in x.items()}
    N = len(lengths) if varlen else 2
    kw = dict(cu_seqlens=cu_of(lengths)) if varlen else {}
    h0 = torch.randn(N, 4, 16, 32, generator=torch.Generator().manual_seed(8))
    first = run(op, x, initial_state=h0, output_final_state=True, **kw)
    second = run(op, {n: t.clone() for n, t in x.items()}, initial_state=h0.clone(), output_final_state=True, **kw)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    if varlen:
        g = x["g_scalar"]
        assert torch.equal(tilela.chunk_local_cumsum(g, 32, kw["cu_seqlens"]),
                           tilela.chunk_local_cumsum(g.clone(), 32, kw["cu_seqlens"]))
        assert torch.equal(tilela.kkt_solve(x["k"], x["beta"], None, 32, kw["cu_seqlens"]),
                           tilela.kkt_solve(x["k"].clone(), x["beta"].clone(), None, 32, kw["cu_seqlens"]))
