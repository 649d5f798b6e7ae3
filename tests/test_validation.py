"""Bad inputs raise ValueError/TypeError at the public boundary, naming the argument, what was
expected and what came."""

import numpy as np
import pytest
import torch

import tilela

B, T, H, HV, K, V = 1, 10, 2, 4, 8, 6


def good():
    gen = torch.Generator().manual_seed(0)
    return dict(
        q=torch.randn(B, T, H, K, generator=gen), k=torch.randn(B, T, H, K, generator=gen),
        v=torch.randn(B, T, HV, V, generator=gen), g=-torch.rand(B, T, HV, generator=gen),
        beta=torch.rand(B, T, HV, generator=gen),
    )


def gdn(**over):
    x = good()
    kw = {n: over.pop(n) for n in list(over) if n not in x}
    x.update(over)
    return tilela.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)


CASES = [
    # (overrides, exception, words the message must contain)
    (dict(q=torch.randn(T, H, K)), ValueError, ["q", "4-d", "3-d"]),
    (dict(k=torch.randn(B, T, H + 1, K)), ValueError, ["k", "[1, 10, 2, 8]", "[1, 10, 3, 8]"]),
    (dict(k=torch.randn(B, T, H, K + 1)), ValueError, ["k", "[1, 10, 2, 8]", "[1, 10, 2, 9]"]),
    (dict(v=torch.randn(B, T, 3, V)), ValueError, ["v", "multiple", "H = 2", "HV = 3"]),
    (dict(v=torch.randn(B, T + 1, HV, V)), ValueError, ["v", "T = 10", "[1, 11, 4, 6]"]),
    (dict(g=torch.randn(B, T, H)), ValueError, ["g", "[B, T, HV]", "[1, 10, 4]", "[1, 10, 2]"]),
    (dict(g=torch.randn(B, T, HV, K)), ValueError, ["g", "[1, 10, 4]", "[1, 10, 4, 8]"]),
    (dict(beta=torch.rand(B, T, HV, 1)), ValueError, ["beta", "[1, 10, 4]", "[1, 10, 4, 1]"]),
    (dict(g=None), TypeError, ["g", "None"]),
    (dict(q=torch.randn(B, T, H, K).int()), TypeError, ["q", "dtype", "int32"]),
    (dict(k=torch.randn(B, T, H, K).double()), TypeError, ["k", "float32", "float64"]),
    (dict(q=[1.0]), TypeError, ["q", "torch.Tensor", "list"]),
    (dict(beta=torch.rand(B, T, HV).bool()), TypeError, ["beta", "bool"]),
    (dict(scale="0.5"), TypeError, ["scale", "str"]),
    (dict(scale=True), TypeError, ["scale", "real number", "bool"]),
    (dict(scale=float("nan")), ValueError, ["scale", "finite", "nan"]),
    (dict(scale=float("inf")), ValueError, ["scale", "finite", "inf"]),
    (dict(scale=np.float32("-inf")), ValueError, ["scale", "finite", "-inf"]),
    (dict(scale=torch.tensor([0.5])), TypeError, ["scale", "1-d", "float32"]),
    (dict(scale=torch.tensor(True)), TypeError, ["scale", "0-d", "bool"]),
    (dict(scale=torch.tensor(0.5, device="meta")), ValueError, ["scale", "host", "meta"]),
    (dict(output_final_state="yes"), TypeError, ["output_final_state", "bool", "str"]),
    (dict(output_final_state=1), TypeError, ["output_final_state", "bool", "int"]),
    (dict(use_qk_l2norm_in_kernel="yes"), TypeError, ["use_qk_l2norm_in_kernel", "bool", "str"]),
    (dict(use_qk_l2norm_in_kernel=torch.tensor(True)), TypeError, ["use_qk_l2norm_in_kernel", "bool", "Tensor"]),
    (dict(cu_seqlens=torch.tensor([0, 6, 10]), cu_seqlens_cpu=torch.tensor([0, 4, 10])), ValueError,
     ["cu_seqlens, cu_seqlens_cpu", "equal", "cu_seqlens[1] = 6", "cu_seqlens_cpu[1] = 4"]),
    (dict(cu_seqlens=torch.tensor([0, 4, 10], device="meta")), ValueError, ["cu_seqlens", "meta", "cu_seqlens_cpu"]),
    (dict(cu_seqlens=torch.tensor([0.0, 4.0, 10.0])), TypeError, ["cu_seqlens", "integer", "float32"]),
    (dict(cu_seqlens=torch.tensor([1, 4, 10])), ValueError, ["cu_seqlens", "cu_seqlens[0] == 0", "got 1"]),
    (dict(cu_seqlens=torch.tensor([0, 6, 4, 10])), ValueError, ["cu_seqlens", "non-decreasing", "cu_seqlens[2] = 4"]),
    (dict(cu_seqlens=torch.tensor([0, 4, 12])), ValueError, ["cu_seqlens", "T = 10", "got 12"]),
    (dict(cu_seqlens=torch.tensor([0, 4, 8])), ValueError, ["cu_seqlens", "T = 10", "got 8"]),
    (dict(cu_seqlens=torch.tensor([[0, 10]])), ValueError, ["cu_seqlens", "1-d", "[1, 2]"]),
    (dict(cu_seqlens_cpu=torch.tensor([0, 10])), ValueError, ["cu_seqlens_cpu", "without cu_seqlens"]),
    (dict(cu_seqlens=torch.tensor([0, 10]), cu_seqlens_cpu=torch.tensor([0, 10], device="meta")), ValueError,
     ["cu_seqlens_cpu", "host", "meta"]),
    (dict(q=torch.randn(B, T, 0, K), k=torch.randn(B, T, 0, K)), ValueError, ["non-empty", "[1, 10, 0, 8]"]),
    (dict(beta=None), TypeError, ["beta", "None"]),
    (dict(cu_seqlens=torch.tensor([0, 4, 10]), initial_state=torch.zeros(1, HV, K, V)), ValueError,
     ["initial_state", "[2, 4, 8, 6]", "[1, 4, 8, 6]"]),
    (dict(initial_state=torch.zeros(1, HV, V, K)), ValueError, ["initial_state", "[1, 4, 8, 6]", "[1, 4, 6, 8]"]),
    (dict(initial_state=torch.zeros(1, HV, K, V, dtype=torch.bfloat16)), TypeError, ["initial_state", "bfloat16"]),
    (dict(g=torch.randn(B, T, HV, device="meta")), ValueError, ["g", "device", "meta", "cpu"]),
]


@pytest.mark.parametrize("over,exc,words", CASES, ids=[str(i) for i in range(len(CASES))])
def test_bad_input_raises_named_error(over, exc, words):
    with pytest.raises(exc) as info:
        gdn(**over)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_cu_seqlens_with_batch_above_one():
    q, k = torch.randn(2, T, H, K), torch.randn(2, T, H, K)
    v, g, beta = torch.randn(2, T, HV, V), torch.randn(2, T, HV), torch.rand(2, T, HV)
    with pytest.raises(ValueError, match="batch size must be 1; got B = 2"):
        tilela.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 10]))


def test_ops_without_gate_reject_one_and_kda_needs_channel_gate():
    x = good()
    with pytest.raises(ValueError, match=r"g: expected shape \[B, T, HV, K\]"):
        tilela.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match=r"g: expected shape \[B, T, HV\]"):
        tilela.chunk_simple_gla(x["q"], x["k"], x["v"], torch.randn(B, T, HV, K))


@pytest.mark.parametrize("kw,exc,match", [
    (dict(chunk_size=48), ValueError, r"chunk_size: expected one of \(16, 32, 64\), got 48"),
    (dict(chunk_size=64.0), TypeError, "chunk_size: expected an int, got float"),
    (dict(method="lu"), ValueError, "method: expected one of"),
    (dict(g=torch.randn(B, T, H)), ValueError, r"g: expected shape \[B, T, HV\] = \[1, 10, 4\]"),
    (dict(k=torch.randn(B, T, H, 0)), ValueError, "k: expected a non-empty key dim K"),
    (dict(beta=torch.rand(B, T, 3)), ValueError, "beta: expected a head count HV that is a multiple"),
])
def test_kkt_solve_validation(kw, exc, match):
    x = good()
    args = {"k": x["k"], "beta": x["beta"], **kw}
    with pytest.raises(exc, match=match):
        tilela.kkt_solve(**args)


def test_chunk_local_cumsum_validation():
    with pytest.raises(ValueError, match="g: expected a 3-d"):
        tilela.chunk_local_cumsum(torch.randn(4, 4))
    with pytest.raises(TypeError, match="scale: expected a real number or None, got str"):
        tilela.chunk_local_cumsum(torch.randn(1, 4, 2), scale="e")
    with pytest.raises(ValueError, match="scale: expected a finite number, got nan"):
        tilela.chunk_local_cumsum(torch.randn(1, 4, 2), scale=float("nan"))
    g = torch.randn(1, 4, 2)
    assert torch.equal(tilela.chunk_local_cumsum(g, scale=np.float32(0.5)), tilela.chunk_local_cumsum(g, scale=0.5))


def test_cpu_copy_of_cu_seqlens_is_what_gets_checked():
    x = good()
    with pytest.raises(ValueError, match="cu_seqlens_cpu: expected shape"):
        tilela.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=torch.tensor([0, 4, 10]),
                                      cu_seqlens_cpu=torch.tensor([0, 10]))


@pytest.mark.parametrize("scale", [np.float32(0.25), np.float64(0.25), np.float16(0.25), torch.tensor(0.25),
                                   torch.tensor(0.25, dtype=torch.float64), np.int64(2), 2])
def test_numpy_and_torch_scalars_are_numbers(scale):
    o, _ = gdn(scale=scale)
    assert torch.equal(o, gdn(scale=float(scale))[0])


def test_negative_scale_negates_the_output():
    o, S = gdn(scale=-0.5, output_final_state=True)
    o_pos, S_pos = gdn(scale=0.5, output_final_state=True)
    assert torch.equal(o, -o_pos) and torch.equal(S, S_pos)


def test_numpy_bools_are_bools():
    o, S = gdn(output_final_state=np.bool_(True), use_qk_l2norm_in_kernel=np.True_)
    o_ref, S_ref = gdn(output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.equal(o, o_ref) and torch.equal(S, S_ref)
    assert gdn(output_final_state=np.bool_(False))[1] is None


def test_equal_host_copies_of_cu_seqlens_are_accepted():
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    o, _ = gdn(cu_seqlens=cu, cu_seqlens_cpu=cu.long())
    assert torch.equal(o, gdn(cu_seqlens=cu)[0])


META_OPS = [  # op, gate shape suffix (None: no gate), beta
    ("chunk_gated_delta_rule", (), True), ("chunk_kda", (K,), True), ("chunk_delta_rule", None, True),
    ("chunk_linear_attn", None, False), ("chunk_simple_gla", (), False), ("chunk_gla", (K,), False),
]


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("op,gate,uses_beta", META_OPS)
def test_meta_inputs_give_meta_outputs(op, gate, uses_beta, varlen):
    """All inputs on the meta device (varlen boundaries from their host copy): validation reads no value and the
    outputs come back with their shapes and dtypes."""
    Tm, Bm = 200, (1 if varlen else 3)

    def meta(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    args = [meta(Bm, Tm, H, K, dtype=torch.bfloat16), meta(Bm, Tm, H, K, dtype=torch.bfloat16),
            meta(Bm, Tm, HV, V, dtype=torch.bfloat16)]
    if gate is not None:
        args.append(meta(Bm, Tm, HV, *gate))
    if uses_beta:
        args.append(meta(Bm, Tm, HV))
    cu = torch.tensor([0, 1, 130, 130, 200])
    N = 4 if varlen else Bm
    kw = dict(cu_seqlens=cu.to("meta"), cu_seqlens_cpu=cu) if varlen else {}
    if op == "chunk_linear_attn":
        kw["normalize"] = False  # the state alone (FLA's default normaliser returns (S, z))
    o, S = getattr(tilela, op)(*args, initial_state=meta(N, HV, K, V), output_final_state=True, **kw)
    assert o.device.type == "meta" and o.shape == (Bm, Tm, HV, V) and o.dtype == torch.bfloat16
    assert S.device.type == "meta" and S.shape == (N, HV, K, V) and S.dtype == torch.float32


def test_meta_primitives():
    cu = torch.tensor([0, 1, 70, 100])
    kw = dict(cu_seqlens=cu.to("meta"), cu_seqlens_cpu=cu)
    g = torch.empty(1, 100, HV, device="meta")
    gc = tilela.chunk_local_cumsum(g, 32, **kw)
    assert gc.device.type == "meta" and gc.shape == g.shape and gc.dtype == torch.float32
    A = tilela.kkt_solve(torch.empty(1, 100, H, K, device="meta"), torch.empty(1, 100, HV, device="meta"), gc, 32,
                         **kw)
    assert A.device.type == "meta" and A.shape == (1, 100, HV, 32)


@pytest.mark.parametrize("varlen", [False, True])
def test_fake_tensors_trace_without_reading_values(varlen):
    """Under FakeTensorMode (what tracing runs) the PyTorch path reads no value: no data-dependent shape, the
    boundaries from their real host copy; without that copy a clear error."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cu = torch.tensor([0, 1, 70, 100])
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        q, v = torch.empty(1, 100, H, K), torch.empty(1, 100, HV, V)
        g, beta = torch.empty(1, 100, HV, K), torch.empty(1, 100, HV)
        kw = dict(cu_seqlens=mode.from_tensor(cu), cu_seqlens_cpu=cu) if varlen else {}
        o, S = tilela.chunk_kda(q, q, v, g, beta, output_final_state=True, check_finite=True, **kw)
        assert o.shape == (1, 100, HV, V) and S.shape == (3 if varlen else 1, HV, K, V)
        assert tilela.kkt_solve(q, beta, None, 32, **kw).shape == (1, 100, HV, 32)
        if varlen:
            with pytest.raises(ValueError, match="cu_seqlens: a meta or fake tensor has no values"):
                tilela.chunk_kda(q, q, v, g, beta, cu_seqlens=kw["cu_seqlens"])


ZERO = torch.zeros(HV)


@pytest.mark.parametrize("form,A_log,dt_bias,lower,match", [
    ("tanh", None, None, None, "gate_form: expected one of"),
    ("log", ZERO, ZERO, None, "A_log, dt_bias, lower_bound: only with an in-kernel gate form"),
    ("log", None, None, -5.0, "A_log, dt_bias, lower_bound: only with an in-kernel gate form"),
    ("softplus", torch.zeros(K), ZERO, None, r"A_log: expected one of the shapes \[\[4\], \[1\]\] .*got \[8\]"),
    ("softplus", ZERO, torch.zeros(2, HV), None, r"dt_bias: expected one of the shapes .*got \[2, 4\]"),
    ("softplus", ZERO, torch.zeros(HV, dtype=torch.int32), None, "dt_bias: expected"),
    ("softplus", ZERO, None, None, "dt_bias: expected a torch.Tensor, got NoneType"),
    ("sigmoid", ZERO, torch.zeros(1), None, "lower_bound: the sigmoid form takes one"),
    ("softplus", ZERO, ZERO, -5.0, "lower_bound: the sigmoid form takes one"),
    ("sigmoid", torch.zeros(1), ZERO, float("nan"), "lower_bound: expected a finite float"),
])
def test_the_custom_op_checks_its_in_kernel_gate_arguments(form, A_log, dt_bias, lower, match):
    """torch.ops.tilela.chunk_attention, called directly, takes no gate arguments the public ops would not build."""
    x = good()
    with pytest.raises((ValueError, TypeError), match=match):
        torch.ops.tilela.chunk_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, None, "scalar", True,
                                         None, False, False, form, A_log, dt_bias, lower)


def test_check_finite_reads_the_in_kernel_gate_as_formed():
    """A raw gate input of +inf is a reset (g = -inf) and passes; a NaN in A_log makes that head's gate NaN."""
    raw = torch.randn(B, T, HV)
    raw[0, 3, 1] = float("inf")
    gdn(g=raw, use_gate_in_kernel=True, A_log=torch.zeros(HV), check_finite=True)
    with pytest.raises(ValueError, match=r"g: expected finite values .* head 2\]"):
        gdn(g=raw, use_gate_in_kernel=True, A_log=torch.tensor([0.0, 0.0, float("nan"), 0.0]), check_finite=True)
    with pytest.raises(ValueError, match="A_log: expected g's device cpu, got meta"):
        gdn(g=raw, use_gate_in_kernel=True, A_log=torch.zeros(HV, device="meta"))
