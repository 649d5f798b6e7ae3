"""The public ops (PyTorch path here) against the independent float64 token recurrence
(reference layer A) on odd shapes: varlen with 0-, 1- and non-multiple-of-64-token sequences,
GVA ratio 3, K != V, strong and zero decay, initial state."""

import pytest
import torch
import torch.nn.functional as F

import tilela
from tilela import ops, reference
from tilela.bench import rel_l2

LENGTHS = (1, 70, 0, 130, 5)
H, HV, K, V = 2, 6, 16, 24


def make_inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(LENGTHS)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, HV, V, generator=gen)
    beta = torch.rand(1, T, HV, generator=gen)
    g_scalar = F.logsigmoid(torch.randn(1, T, HV, generator=gen))
    g_scalar[..., 0] = 0.0  # a head that never forgets
    g_scalar[..., 1] = -20.0  # a head that forgets everything at once
    g_channel = F.logsigmoid(torch.randn(1, T, HV, K, generator=gen))
    g_channel[..., 0, :] = 0.0
    g_channel[..., 1, : K // 2] = -20.0
    h0 = torch.randn(len(LENGTHS), HV, K, V, generator=gen)
    cast = lambda x: x.to(dtype)
    return dict(q=cast(q), k=cast(k), v=cast(v), beta=beta, g_scalar=g_scalar, g_channel=g_channel, h0=h0, cu=cu)


# (op, gate input, uses beta)
OPS = [
    ("chunk_gated_delta_rule", "g_scalar", True),
    ("chunk_kda", "g_channel", True),
    ("chunk_delta_rule", None, True),
    ("chunk_linear_attn", None, False),
    ("chunk_simple_gla", "g_scalar", False),
    ("chunk_gla", "g_channel", False),
]


def call(op, x, gate, uses_beta, **kw):
    args = [x["q"], x["k"], x["v"]]
    if gate:
        args.append(x[gate])
    if uses_beta:
        args.append(x["beta"])
    plain = {"normalize": False} if op == "chunk_linear_attn" else {}  # the recurrence, not FLA's normaliser
    return getattr(tilela, op)(*args, **kw, **plain)


@pytest.mark.parametrize("op,gate,uses_beta", OPS)
def test_varlen_gva_against_token_recurrence(op, gate, uses_beta):
    x = make_inputs()
    o, S = call(op, x, gate, uses_beta, initial_state=x["h0"], output_final_state=True, cu_seqlens=x["cu"])
    ref_o, ref_S = reference.recurrent(
        x["q"], x["k"], x["v"], g=x[gate] if gate else None, beta=x["beta"] if uses_beta else None,
        initial_state=x["h0"], cu_seqlens=x["cu"],
    )
    assert o.shape == (1, sum(LENGTHS), HV, V) and o.dtype == torch.float32
    assert S.shape == (len(LENGTHS), HV, K, V) and S.dtype == torch.float32
    assert rel_l2(o, ref_o) < 1e-4
    assert rel_l2(S, ref_S) < 1e-4
    # a length-0 sequence hands its initial state straight through
    assert torch.allclose(S[2], x["h0"][2])


@pytest.mark.parametrize("op,gate,uses_beta", OPS)
def test_dense_batch_and_bf16(op, gate, uses_beta):
    gen = torch.Generator().manual_seed(1)
    B, T = 2, 77
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).bfloat16()
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).bfloat16()
    v = torch.randn(B, T, HV, V, generator=gen).bfloat16()
    x = dict(q=q, k=k, v=v, beta=torch.rand(B, T, HV, generator=gen),
             g_scalar=F.logsigmoid(torch.randn(B, T, HV, generator=gen)),
             g_channel=F.logsigmoid(torch.randn(B, T, HV, K, generator=gen)))
    o, S = call(op, x, gate, uses_beta, scale=0.5, output_final_state=True)
    ref_o, ref_S = reference.recurrent(q, k, v, g=x[gate] if gate else None, beta=x["beta"] if uses_beta else None,
                                       scale=0.5)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert rel_l2(o, ref_o) < 1e-2  # bf16 output rounding
    assert rel_l2(S, ref_S) < 1e-4  # inputs are exactly bf16 values; the state is accumulated in float32


def test_qk_l2norm_in_kernel_equals_normalising_first():
    x = make_inputs()
    q_raw, k_raw = x["q"] * 3.0, x["k"] * 0.25
    o1, _ = tilela.chunk_gated_delta_rule(q_raw, k_raw, x["v"], x["g_scalar"], x["beta"], cu_seqlens=x["cu"],
                                          use_qk_l2norm_in_kernel=True)
    o2, _ = tilela.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g_scalar"], x["beta"], cu_seqlens=x["cu"])
    assert rel_l2(o1, o2.double()) < 1e-4


def test_float64_inputs_match_reference_to_rounding():
    x = make_inputs(dtype=torch.float64)
    o, S = tilela.chunk_kda(x["q"], x["k"], x["v"], x["g_channel"].double(), x["beta"].double(),
                            initial_state=x["h0"].double(), output_final_state=True, cu_seqlens=x["cu"])
    ref_o, ref_S = reference.recurrent(x["q"], x["k"], x["v"], g=x["g_channel"], beta=x["beta"],
                                       initial_state=x["h0"], cu_seqlens=x["cu"])
    assert o.dtype == torch.float64 and S.dtype == torch.float64
    assert rel_l2(o, ref_o) < 1e-12 and rel_l2(S, ref_S) < 1e-12


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_chunk_primitives_against_reference(chunk_size):
    x = make_inputs()
    g_cum = tilela.chunk_local_cumsum(x["g_scalar"], chunk_size, x["cu"])
    ref_cum = reference.chunk_local_cumsum(x["g_scalar"], chunk_size, x["cu"])
    assert rel_l2(g_cum, ref_cum) < 1e-6
    scaled = tilela.chunk_local_cumsum(x["g_channel"], chunk_size, x["cu"], scale=1.4426950408889634)
    assert rel_l2(scaled, reference.chunk_local_cumsum(x["g_channel"], chunk_size, x["cu"], scale=1.4426950408889634)) < 1e-6
    for g in (None, g_cum):
        A = tilela.kkt_solve(x["k"], x["beta"], g, chunk_size, x["cu"])
        ref_A = reference.kkt_solve(x["k"], x["beta"], None if g is None else ref_cum, chunk_size, x["cu"])
        assert A.shape == (1, sum(LENGTHS), HV, chunk_size)
        assert rel_l2(A, ref_A) < 1e-5


class _Reached(Exception):
    """Raised by a stand-in (kernel launches, the custom op) when a call reaches it."""


def _reached(*args, **kwargs):
    raise _Reached


@pytest.fixture
def fake_hopper(monkeypatch):
    """ops hands every call to a Hopper backend whose real plan decides and whose launches raise _Reached."""
    from types import SimpleNamespace

    from tilela.kernels.hopper import DTYPE_NAMES, plan

    backend = SimpleNamespace(plan=plan, DTYPE_NAMES=DTYPE_NAMES, plan_call=_reached, forward=_reached)
    monkeypatch.setattr(ops, "_hopper", lambda *tensors: backend)


def test_kda_takes_the_hopper_kernels_for_every_gate(fake_hopper):
    """On a Hopper device chunk_kda runs the kernels for every gate form, bounded or not, safe_gate or not, eagerly
    and through the custom op (autograd); float32 inputs take the PyTorch path, exact for any gate."""
    gen = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(1, 70, 2, 64, generator=gen), dim=-1).bfloat16() for _ in range(2))
    v = torch.randn(1, 70, 2, 64, generator=gen).bfloat16()
    g = F.logsigmoid(torch.randn(1, 70, 2, 64, generator=gen)) * 20  # down to about -60 per token: unbounded
    beta = torch.rand(1, 70, 2, generator=gen)
    for kw in ({}, dict(safe_gate=True), dict(use_gate_in_kernel=True, lower_bound=-5.0),
               dict(use_gate_in_kernel=True, A_log=torch.zeros(2))):
        with pytest.raises(_Reached):
            tilela.chunk_kda(q, k, v, g, beta, **kw)
    with pytest.raises(_Reached):  # through the custom op (autograd)
        tilela.chunk_kda(q, k, v.float().requires_grad_().bfloat16(), g, beta)
    o, _ = tilela.chunk_kda(q.float(), k.float(), v.float(), g, beta)
    ref, _ = reference.recurrent(q, k, v, g, beta)
    assert rel_l2(o, ref) < 1e-4


def test_in_kernel_gates_reach_the_gate_stages_raw(monkeypatch):
    """GDN's and KDA's in-kernel gate reach the Hopper pipeline as FLA's raw input: the plan's stage that sums the
    gate forms the log gate (tilela._gates.apply_gate: its form, A_log and dt_bias, KDA's lower
    bound): GDN's cumsum stage, KDA's gla_factors (no cumsum stage, no kkt_solve); eagerly and through the custom
    op."""
    from types import SimpleNamespace

    from tilela import _gates
    from tilela.kernels import hopper
    from tilela.kernels.hopper import DTYPE_NAMES, plan

    calls = []

    def forward(plan_, q, k, v, g, beta, h0, cu, gate_params=None, gate_scale=None):
        calls.append((plan_, g, gate_params, gate_scale))
        raise _Reached

    backend = SimpleNamespace(plan=plan, DTYPE_NAMES=DTYPE_NAMES, forward=forward,
                              plan_call=lambda *args, **kw: hopper.plan_call(*args, sms=132, **kw))
    monkeypatch.setattr(ops, "_hopper", lambda *tensors: backend)
    gen = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(1, 70, 2, 64, generator=gen), dim=-1).bfloat16() for _ in range(2))
    v, beta = torch.randn(1, 70, 2, 64, generator=gen).bfloat16(), torch.rand(1, 70, 2, generator=gen)
    raw = torch.randn(1, 70, 2, 64, generator=gen).bfloat16()
    A_log, dt_bias = torch.randn(2, generator=gen), torch.randn(2 * 64, generator=gen)
    for v_ in (v, v.float().requires_grad_().bfloat16()):
        with pytest.raises(_Reached):
            tilela.chunk_kda(q, k, v_, raw, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                             lower_bound=-5.0)
        with pytest.raises(_Reached):
            tilela.chunk_gated_delta_rule(q, k, v_, raw[..., 0], beta, use_gate_in_kernel=True, A_log=A_log,
                                          dt_bias=dt_bias[:2])
    a, b = A_log.double().exp(), dt_bias.double().view(2, 64)
    want = {"sigmoid": -5.0 * torch.sigmoid(a[:, None] * (raw.double() + b)),
            "softplus": -a * F.softplus(raw[..., 0].double() + dt_bias[:2].double())}
    assert len(calls) == 4
    for plan_, g, params, lower in calls:
        if plan_.gate == "channel":
            form = plan_.factors[2][1]
            assert plan_.cumsum is None and plan_.kkt is None and plan_.factors[2] == ("bfloat16", form)
        else:  # GDN's kkt_solve sums the gate
            form = plan_.kkt[5][1]
            assert plan_.cumsum is None and plan_.kkt[5] == ("bfloat16", form)
        assert g.dtype == torch.bfloat16
        assert (lower == -5.0) if form == "sigmoid" else lower is None
        assert all(x.dtype == torch.float32 for x in params)  # A_log and dt_bias as given: no stack, no exp
        assert rel_l2(_gates.apply_gate(g.double(), form, *(x.double() for x in params), lower), want[form]) < 1e-6


def test_eager_inference_skips_the_custom_op_and_autograd_takes_it(monkeypatch):
    """An eager call that records no autograd runs the implementation directly (one validation, no op dispatch: the
    host cost serving pays per call); a call that needs autograd goes through tilela::chunk_attention."""
    from tilela import _library

    gen = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(1, 20, 1, 8, generator=gen), dim=-1) for _ in range(2))
    v, beta = torch.randn(1, 20, 2, 8, generator=gen), torch.rand(1, 20, 2, generator=gen)
    monkeypatch.setattr(_library, "chunk_attention", _reached)
    tilela.chunk_delta_rule(q, k, v, beta)
    with torch.no_grad():
        tilela.chunk_delta_rule(q, k, v.requires_grad_(), beta)
    with pytest.raises(_Reached):
        tilela.chunk_delta_rule(q, k, v, beta)
    raw, A_log = torch.randn(1, 20, 2, generator=gen), torch.zeros(2, requires_grad=True)
    with pytest.raises(_Reached):  # only the in-kernel gate's parameters need gradients
        tilela.chunk_gated_delta_rule(q, k, v.detach(), raw, beta, use_gate_in_kernel=True, A_log=A_log)


def test_kda_reaches_the_kernels_through_context_parallelism(fake_hopper, tmp_path):
    """A KDA call through the cp_context path runs the kernels too (one gloo process)."""
    import torch.distributed as dist

    from tilela import distributed

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed without gloo")
    gen = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(1, 64, 1, 64, generator=gen), dim=-1).bfloat16() for _ in range(2))
    v, beta = torch.randn(1, 64, 1, 64, generator=gen).bfloat16(), torch.rand(1, 64, 1, generator=gen)
    g = F.logsigmoid(torch.randn(1, 64, 1, 64, generator=gen))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        ctx = distributed.build_cp_context(torch.tensor([0, 64]))
        with pytest.raises(_Reached):
            tilela.chunk_kda(q, k, v, g, beta, cp_context=ctx)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_l2norm_is_the_same_with_and_without_autograd(dtype):
    """use_qk_l2norm_in_kernel's two routes (a float32 copy under autograd; a reduction and one product into x's
    dtype otherwise) agree to a few roundings of x's dtype and with the float64 normalisation, zero rows included."""
    x = torch.randn(2, 70, 3, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[0, 5] = 0
    fast = ops._l2norm(x)
    slow = ops._l2norm(x.clone().requires_grad_())
    assert fast.dtype == slow.dtype == dtype
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(fast, slow.detach(), rtol=4 * ulp, atol=0)
    ref = x.double() * torch.rsqrt(x.double().pow(2).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(fast.double(), ref, rtol=max(ulp, 1e-6), atol=0)
