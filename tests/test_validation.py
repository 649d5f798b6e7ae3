"""Bad inputs raise ValueError/TypeError at the public boundary, naming the argument, what was
expected and what came."""

import pytest
import torch

import tilela

B, T, H, HV, K, V = 1, 10, 2, 4, 8, 6


def good():
    return dict(
        q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, HV, V),
        g=torch.randn(B, T, HV), beta=torch.rand(B, T, HV),
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
    with pytest.raises(TypeError, match="scale: expected a float"):
        tilela.chunk_local_cumsum(torch.randn(1, 4, 2), scale="e")


def test_cpu_copy_of_cu_seqlens_is_what_gets_checked():
    x = good()
    with pytest.raises(ValueError, match="cu_seqlens_cpu: expected shape"):
        tilela.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=torch.tensor([0, 4, 10]),
                                      cu_seqlens_cpu=torch.tensor([0, 10]))
