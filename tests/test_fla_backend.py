"""tilela as a backend in FLA 0.6's registry: the verifier's decisions (no FLA needed), and, where fla-core imports,
FLA's own chunk_gated_delta_rule / chunk_kda running tilela's op once enable() registered it, falling back to FLA
where the verifier rejects and when FLA_TILELA=0."""

import functools
import inspect

import pytest
import torch
import torch.nn.functional as F

import tilela
from tilela import fla_backend, ops

B, T, H, HV, K, V = 1, 40, 2, 4, 16, 16
CU = torch.tensor([0, 15, 40])


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return dict(q=torch.randn(B, T, H, K, generator=gen), k=F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
                v=torch.randn(B, T, HV, V, generator=gen), g=F.logsigmoid(torch.randn(B, T, HV, generator=gen)),
                gc=F.logsigmoid(torch.randn(B, T, HV, K, generator=gen)), beta=torch.rand(B, T, HV, generator=gen))


def test_verifier_accepts_valid_cpu_calls_and_rejects_what_fla_raises_or_we_lack():
    x = inputs()
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert fla_backend.verify("chunk_gated_delta_rule", *args, cu_seqlens=CU) == (True, None)
    assert fla_backend.verify("chunk_kda", x["q"], x["k"], x["v"], x["gc"], x["beta"], state_v_first=True,
                              initial_state=torch.zeros(2, HV, V, K), cu_seqlens=CU) == (True, None)
    rejected = [
        ("chunk_gated_delta_rule", args, dict(head_first=False), "head_first"),
        ("chunk_gated_delta_rule", args, dict(allow_neg_eigval=True), "allow_neg_eigval"),
        ("chunk_gated_delta_rule", args, dict(use_gate_in_kernel=True), "A_log"),
        ("chunk_gated_delta_rule", args, dict(cp_context=object()), "cp_context"),
        ("chunk_gated_delta_rule", args, dict(state_v_first=True, transpose_state_layout=True), "transpose"),
        ("chunk_gated_delta_rule", args, dict(cu_seqlens=torch.tensor([0, 15, 41])), "cu_seqlens"),
        ("chunk_gated_delta_rule", args, dict(bogus_positional=None, scale="x"), "scale"),
        ("chunk_gated_delta_rule", args[:4] + (x["gc"],), {}, "beta"),
        ("chunk_kda", (x["q"], x["k"], x["v"], x["gc"], x["beta"]), dict(return_intermediate_states=True),
         "return_intermediate_states"),
        ("chunk_kda", (x["q"], x["k"], x["v"], x["g"], x["beta"]), {}, "g"),
    ]
    for name, a, kw, word in rejected:
        accepted, reason = fla_backend.verify(name, *a, **kw)
        assert not accepted and word in reason, (name, kw, reason)


def test_verifier_on_a_gpu_without_hopper_kernels_falls_back():
    x = {n: t.to("meta") for n, t in inputs().items()}  # not the CPU, and no Hopper kernels serve it
    accepted, reason = fla_backend.verify("chunk_gated_delta_rule", x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert not accepted and "Hopper" in reason


def test_verifier_sends_every_kda_gate_to_the_hopper_kernels(monkeypatch):
    """On a Hopper GPU a KDA call runs ours for every gate form (the log gate with or without safe_gate, the
    in-kernel softplus and bounded sigmoid gates); safe_gate with the in-kernel gate outside -5 <= lower_bound < 0
    stays FLA's, which raises. The Hopper backend is stood in for on meta tensors."""
    from tilela.kernels import hopper

    monkeypatch.setattr(ops, "_hopper", lambda *tensors: hopper)
    D = 64  # a head dim the kernels serve
    q, k = (torch.empty(B, T, H, D, dtype=torch.bfloat16, device="meta") for _ in range(2))
    v, g = (torch.empty(B, T, HV, D, dtype=torch.bfloat16, device="meta") for _ in range(2))
    beta, A_log = torch.empty(B, T, HV, device="meta"), torch.empty(HV, device="meta")
    in_kernel = dict(use_gate_in_kernel=True, A_log=A_log)
    for kw in ({}, dict(safe_gate=True), in_kernel, dict(lower_bound=-5.0, **in_kernel),
               dict(lower_bound=-6.0, **in_kernel), dict(safe_gate=True, lower_bound=-5.0, **in_kernel)):
        assert fla_backend.verify("chunk_kda", q, k, v, g, beta, **kw) == (True, None), kw
    for kw in (dict(safe_gate=True, lower_bound=-6.0, **in_kernel), dict(safe_gate=True, **in_kernel)):
        accepted, reason = fla_backend.verify("chunk_kda", q, k, v, g, beta, **kw)
        assert not accepted and "FLA raises" in reason, (kw, reason)
    accepted, reason = fla_backend.verify("chunk_kda", *(t.float() for t in (q, k, v, g)), beta)  # not served
    assert not accepted and "not served" in reason


def _counted(op, calls):
    @functools.wraps(op)  # the verifier binds the op's signature
    def counted(*args, **kwargs):
        calls.append(op.__name__)
        return op(*args, **kwargs)

    return counted


@pytest.fixture
def fla_registered(monkeypatch):
    pytest.importorskip("triton")
    pytest.importorskip("fla.ops.gated_delta_rule")
    import fla.backends
    import fla.ops.kda

    monkeypatch.delenv("FLA_TILELA", raising=False)
    fla_backend.enable()
    calls = []
    for name in fla_backend.ENTRY_POINTS:
        monkeypatch.setattr(ops, name, _counted(getattr(ops, name), calls))
    yield calls
    fla.backends._operation_registries["gated_delta_rule"]._backends.pop(fla_backend.BACKEND_TYPE)
    fla.backends._function_registries[inspect.unwrap(fla.ops.kda.chunk_kda)]._backends.pop(fla_backend.BACKEND_TYPE)


def test_fla_s_functions_run_tilela_once_enabled(fla_registered, monkeypatch):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
    from fla.ops.kda import chunk_kda as fla_kda

    x = inputs()
    h0 = torch.randn(2, HV, V, K)
    got = fla_gdn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0, output_final_state=True,
                  use_qk_l2norm_in_kernel=True, state_v_first=True, cu_seqlens=CU)
    want = tilela.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                                         output_final_state=True, use_qk_l2norm_in_kernel=True, state_v_first=True,
                                         cu_seqlens=CU)
    assert fla_registered == ["chunk_gated_delta_rule"]  # FLA's call; tilela.chunk_gated_delta_rule is not counted
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    got = fla_kda(x["q"], x["k"], x["v"], torch.randn(B, T, HV, K), x["beta"], output_final_state=True,
                  use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=torch.zeros(HV * K), cu_seqlens=CU)
    assert fla_registered[-1] == "chunk_kda" and got[1].shape == (2, HV, K, V)
    # rejected by the verifier: FLA's default runs and raises its own error
    calls = len(fla_registered)
    with pytest.raises(ValueError, match="use_beta_sigmoid_in_kernel"):
        fla_gdn(x["q"], x["k"], x["v"], x["g"], x["beta"], allow_neg_eigval=True)
    # switched off at runtime: FLA's default (Triton, which has no CPU path here) runs instead of ours
    monkeypatch.setenv("FLA_TILELA", "0")
    with pytest.raises(Exception):
        fla_gdn(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert len(fla_registered) == calls


@pytest.mark.gpu
def test_on_hopper_ours_serves_inference_and_fla_the_rest(fla_registered, monkeypatch):
    """bf16 at K = V = 128 (what the kernels serve): ours runs and agrees with FLA's own Triton result
    (FLA_TILELA=0, FLA_TILELANG=0 for a pure-Triton FLA); with an input that requires grad FLA runs."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn

    gen = torch.Generator().manual_seed(0)
    T, Kd = 300, 128
    x = dict(q=torch.randn(1, T, H, Kd, generator=gen), k=torch.randn(1, T, H, Kd, generator=gen),
             v=torch.randn(1, T, HV, Kd, generator=gen), g=F.logsigmoid(torch.randn(1, T, HV, generator=gen)),
             beta=torch.rand(1, T, HV, generator=gen))
    x = {n: t.cuda().bfloat16() if n in "qkv" else t.cuda() for n, t in x.items()}
    cu = torch.tensor([0, 100, 300])
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)
    ours = fla_gdn(*x.values(), **kw)
    assert fla_registered == ["chunk_gated_delta_rule"]
    monkeypatch.setenv("FLA_TILELA", "0")
    monkeypatch.setenv("FLA_TILELANG", "0")
    theirs = fla_gdn(*x.values(), **kw)
    for a, b in zip(ours, theirs):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2
    monkeypatch.delenv("FLA_TILELA")
    fla_gdn(*(t.requires_grad_() if t.is_floating_point() else t for t in x.values()), **kw)
    assert fla_registered == ["chunk_gated_delta_rule"]
