"""Autograd through the attention ops: the backward recomputes the forward on the PyTorch path and backpropagates
(tilela/_library.py). Checked by torch.autograd.gradcheck on tiny float64 inputs, and fp32/bf16 gradients against
float64 autograd of the token recurrence (tilela.reference.recurrent), for every input that can carry a gradient."""

import pytest
import torch
import torch.nn.functional as F

import tilela
from tilela import reference

CU = torch.tensor([0, 3, 3, 11])
T, H, HV, K, V = 11, 1, 2, 4, 3
TINY = (CU, H, HV, K, V)
HOPPER = (torch.tensor([0, 70, 200]), 2, 4, 64, 64)  # sizes the Hopper kernels serve, several chunks per sequence


def leaves(dtype=torch.float64, seed=0, sizes=TINY):
    cu, H, HV, K, V = sizes
    T = int(cu[-1])
    gen = torch.Generator().manual_seed(seed)
    x = dict(q=torch.randn(1, T, H, K, generator=gen), k=F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1),
             v=torch.randn(1, T, HV, V, generator=gen), gs=F.logsigmoid(torch.randn(1, T, HV, generator=gen) + 1),
             gc=F.logsigmoid(torch.randn(1, T, HV, K, generator=gen) + 1), beta=torch.rand(1, T, HV, generator=gen),
             h0=torch.randn(len(cu) - 1, HV, K, V, generator=gen), raw=torch.randn(1, T, HV, generator=gen),
             rawc=torch.randn(1, T, HV, K, generator=gen), A_log=torch.randn(HV, generator=gen) * 0.3,
             dt_bias=torch.randn(HV, generator=gen), dt_bias_c=torch.randn(HV * K, generator=gen),
             g_gamma=-torch.rand(HV, generator=gen), z0=torch.rand(len(cu) - 1, 1, H, K, generator=gen))
    return {n: t.to(dtype).requires_grad_() for n, t in x.items()}


# name: (the op called on the leaves as FLA code would, the leaves it reads)
CASES = {
    "gdn": (lambda x: tilela.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["gs"], x["beta"], None, x["h0"], True,
                                                    cu_seqlens=CU), ("q", "k", "v", "gs", "beta", "h0")),
    "gdn_options": (lambda x: tilela.chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], x["raw"], x["raw"] * 0.5, 0.7, x["h0"], True, use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, cu_seqlens=CU, use_gate_in_kernel=True,
        A_log=x["A_log"], dt_bias=x["dt_bias"]), ("q", "k", "v", "raw", "h0", "A_log", "dt_bias")),
    "kda": (lambda x: tilela.chunk_kda(x["q"], x["k"], x["v"], x["gc"], x["beta"], None, x["h0"], True,
                                       cu_seqlens=CU), ("q", "k", "v", "gc", "beta", "h0")),
    "kda_gate": (lambda x: tilela.chunk_kda(x["q"], x["k"], x["v"], x["rawc"], x["beta"], None, x["h0"], True,
                                            use_gate_in_kernel=True, lower_bound=-2.0, cu_seqlens=CU,
                                            A_log=x["A_log"], dt_bias=x["dt_bias_c"]),
                 ("q", "k", "v", "rawc", "beta", "h0", "A_log", "dt_bias_c")),
    "delta_rule": (lambda x: tilela.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], None, x["h0"], True,
                                                     cu_seqlens=CU), ("q", "k", "v", "beta", "h0")),
    "linear_attn": (lambda x: tilela.chunk_linear_attn(x["q"], x["k"], x["v"], None, x["h0"], True, False,
                                                       cu_seqlens=CU), ("q", "k", "v", "h0")),
    "linear_attn_normalize": (lambda x: _flat(tilela.chunk_linear_attn(
        x["q"].abs() + 0.5, x["k"].abs() + 0.5, x["v"], None, (x["h0"], x["z0"]), True, cu_seqlens=CU)),
        ("q", "k", "v", "h0", "z0")),
    "simple_gla": (lambda x: tilela.chunk_simple_gla(x["q"], x["k"], x["v"], x["gs"], x["g_gamma"], None, x["h0"],
                                                     True, cu_seqlens=CU), ("q", "k", "v", "gs", "g_gamma", "h0")),
    "gla": (lambda x: tilela.chunk_gla(x["q"], x["k"], x["v"], x["gc"], None, x["h0"].transpose(-1, -2), True, True,
                                       cu_seqlens=CU),
            ("q", "k", "v", "gc", "h0")),
}


def _flat(result):
    o, (state, z) = result
    return o, state, z


@pytest.mark.parametrize("name", list(CASES))
def test_gradcheck_float64(name):
    call, used = CASES[name]
    x = leaves()
    inputs = tuple(x[n] for n in used)

    def f(*args):
        return call({**x, **dict(zip(used, args))})

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)


@pytest.mark.parametrize("device,sizes", [("cpu", TINY), ("cpu", HOPPER),
                                          pytest.param("cuda", HOPPER, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("op,gate,delta", [("chunk_gated_delta_rule", "gs", True), ("chunk_kda", "gc", True),
                                           ("chunk_simple_gla", "gs", False), ("chunk_gla", "gc", False)])
def test_gradients_against_float64_recurrence(op, gate, delta, dtype, tol, device, sizes):
    """q, k, v in dtype (g, beta and the state in fp32) on the device (on a Hopper GPU the forward runs the
    kernels), gradients of a weighted sum of o and the final state against float64 autograd of the token
    recurrence on the CPU, relative to each gradient's norm."""
    cu = sizes[0]
    ref = leaves(sizes=sizes)
    gen = torch.Generator().manual_seed(1)
    weights = (torch.randn(ref["v"].shape, generator=gen, dtype=torch.float64),
               torch.randn(ref["h0"].shape, generator=gen, dtype=torch.float64))
    # inputs that are exact in dtype, so both sides see the same values
    with torch.no_grad():
        for n in ("q", "k", "v"):
            ref[n].copy_(ref[n].to(dtype).double())
    names = ("q", "k", "v", gate, "h0") + (("beta",) if delta else ())
    o, S = reference.recurrent(ref["q"], ref["k"], ref["v"], ref[gate], ref["beta"] if delta else None, None,
                               ref["h0"], cu)
    ((o * weights[0]).sum() + (S * weights[1]).sum()).backward()
    x = {n: ref[n].detach().to(device, dtype if n in "qkv" else torch.float32).requires_grad_() for n in names}
    o, S = getattr(tilela, op)(x["q"], x["k"], x["v"], x[gate], *([x["beta"]] if delta else []), initial_state=x["h0"],
                               output_final_state=True, cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)
    ((o.double().cpu() * weights[0]).sum() + (S.double().cpu() * weights[1]).sum()).backward()
    for n in names:
        assert x[n].grad.dtype == x[n].dtype and x[n].grad.device == x[n].device
        err = (x[n].grad.double().cpu() - ref[n].grad).norm() / ref[n].grad.norm()
        assert err < tol, f"{n}: relative error {err:.2e}"


def test_outputs_are_attached_to_autograd_and_no_grad_stays_cheap():
    x = leaves(torch.float32)
    o, S = tilela.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["gs"], x["beta"], output_final_state=True)
    assert o.requires_grad and S.requires_grad and o.grad_fn is not None
    with torch.no_grad():
        o, S = tilela.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["gs"], x["beta"], output_final_state=True)
    assert not o.requires_grad and o.grad_fn is None


def test_only_o_used_and_final_state_not_requested():
    x = leaves()
    o, S = tilela.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], cu_seqlens=CU)
    assert S is None
    o.sum().backward()
    want = leaves()
    reference.recurrent(want["q"], want["k"], want["v"], None, want["beta"], None, None, CU)[0].sum().backward()
    for n in ("q", "k", "v", "beta"):
        torch.testing.assert_close(x[n].grad, want[n].grad)
    assert x["h0"].grad is None
