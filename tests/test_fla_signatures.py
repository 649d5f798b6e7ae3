"""FLA 0.6 drop-in: every attention op's positional signature is FLA's (names, order, defaults), a call written
for FLA (all positional, all keyword) gives the float64 reference's answer, and each option does what its formula
says (checked against a hand-computed transform fed to the reference)."""

import inspect

import pytest
import torch
import torch.nn.functional as F

import tilela
from tilela import reference

P = inspect.Parameter
# FLA 0.6's parameters before ``**kwargs`` (from the released fla-core wheel): (name, default or P.empty)
FLA = {
    "chunk_gated_delta_rule": [
        ("q", P.empty), ("k", P.empty), ("v", P.empty), ("g", P.empty), ("beta", P.empty), ("scale", None),
        ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
        ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False), ("state_v_first", False),
        ("cu_seqlens", None), ("cu_seqlens_cpu", None), ("chunk_indices", None), ("cp_context", None)],
    "chunk_kda": [
        ("q", P.empty), ("k", P.empty), ("v", P.empty), ("g", P.empty), ("beta", P.empty), ("scale", None),
        ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
        ("use_gate_in_kernel", False), ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False),
        ("safe_gate", False), ("lower_bound", None), ("disable_recompute", False),
        ("return_intermediate_states", False), ("state_v_first", False), ("cu_seqlens", None),
        ("cu_seqlens_cpu", None), ("cp_context", None), ("use_graph", False), ("max_num_seqs", None)],
    "chunk_delta_rule": [
        ("q", P.empty), ("k", P.empty), ("v", P.empty), ("beta", P.empty), ("scale", None),
        ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
        ("cu_seqlens", None), ("cu_seqlens_cpu", None)],
    "chunk_linear_attn": [
        ("q", P.empty), ("k", P.empty), ("v", P.empty), ("scale", None), ("initial_state", None),
        ("output_final_state", False), ("normalize", True), ("cu_seqlens", None)],
    "chunk_simple_gla": [
        ("q", P.empty), ("k", P.empty), ("v", P.empty), ("g", None), ("g_gamma", None), ("scale", None),
        ("initial_state", None), ("output_final_state", False), ("state_v_first", False), ("cu_seqlens", None),
        ("cu_seqlens_cpu", None)],
    "chunk_gla": [
        ("q", P.empty), ("k", P.empty), ("v", P.empty), ("g", P.empty), ("scale", None), ("initial_state", None),
        ("output_final_state", False), ("state_v_first", False), ("cu_seqlens", None), ("cu_seqlens_cpu", None)],
}
# keyword-only options FLA reads from **kwargs, with FLA's defaults
FLA_KWARGS = {
    "chunk_gated_delta_rule": {"use_gate_in_kernel": False, "A_log": None, "dt_bias": None, "chunk_size": 64},
    "chunk_kda": {"A_log": None, "dt_bias": None, "chunk_size": 64},
    "chunk_delta_rule": {"chunk_size": 64},
    "chunk_linear_attn": {"cu_seqlens_cpu": None},  # ours: FLA has no host copy here
    "chunk_simple_gla": {"chunk_size": None},
    "chunk_gla": {},
}
CU = torch.tensor([0, 5, 5, 70, 100])
B, T, H, HV, K, V = 1, 100, 2, 4, 16, 8


@pytest.mark.parametrize("name", list(FLA))
def test_positional_parameters_are_fla_s(name):
    params = list(inspect.signature(getattr(tilela, name)).parameters.values())
    positional = [(p.name, p.default) for p in params if p.kind is P.POSITIONAL_OR_KEYWORD]
    assert positional == FLA[name]
    keyword_only = {p.name: p.default for p in params if p.kind is P.KEYWORD_ONLY}
    assert keyword_only == {**FLA_KWARGS[name], "check_finite": False}  # ours: the opt-in finiteness check


@pytest.mark.parametrize("name", list(FLA))
def test_matches_the_installed_fla(name):
    """Where FLA is importable, its own signature gives the same positional parameters and defaults."""
    pytest.importorskip("triton")
    fla_ops = pytest.importorskip("fla.ops")
    fla_params = inspect.signature(inspect.unwrap(getattr(fla_ops, name))).parameters.values()
    assert [(p.name, p.default) for p in fla_params if p.kind is P.POSITIONAL_OR_KEYWORD] == FLA[name]


def inputs(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = dict(q=torch.randn(B, T, H, K, generator=gen), k=F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
             v=torch.randn(B, T, HV, V, generator=gen), beta=torch.rand(B, T, HV, generator=gen),
             gs=F.logsigmoid(torch.randn(B, T, HV, generator=gen) + 2),
             gc=F.logsigmoid(torch.randn(B, T, HV, K, generator=gen) + 2),
             h0=torch.randn(len(CU) - 1, HV, K, V, generator=gen), raw=torch.randn(B, T, HV, generator=gen))
    return {n: (t.to(dtype) if n in "qkv" else t) for n, t in x.items()}


def ref(q, k, v, g=None, beta=None, scale=None, h0=None, cu=CU):
    o, s = reference.recurrent(q, k, v, g, beta, scale, h0, cu)
    return o, s


def close(got, want, tol=2e-5):
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


# op: (the gate input, takes beta); the reference's g and beta follow
CALLS = {"chunk_gated_delta_rule": ("gs", True), "chunk_kda": ("gc", True), "chunk_delta_rule": (None, True),
         "chunk_linear_attn": (None, False), "chunk_simple_gla": ("gs", False), "chunk_gla": ("gc", False)}


def _args(name, x):
    gate, takes_beta = CALLS[name]
    fixed = [x["q"], x["k"], x["v"]] + ([x[gate]] if gate else []) + ([x["beta"]] if takes_beta else [])
    want = ref(x["q"], x["k"], x["v"], x[gate] if gate else None, x["beta"] if takes_beta else None, 0.3, x["h0"])
    return fixed, want


@pytest.mark.parametrize("name", list(FLA))
def test_all_positional_and_all_keyword_calls(name):
    x = inputs()
    fixed, want = _args(name, x)
    op = getattr(tilela, name)
    names = [n for n, _ in FLA[name]]
    values = dict(zip(names, fixed))
    values.update(scale=0.3, initial_state=x["h0"], output_final_state=True, cu_seqlens=CU)
    if name == "chunk_linear_attn":
        values["normalize"] = False
    positional = [values.get(n, default) for n, default in FLA[name]]
    for o, s in (op(*positional), op(**values)):
        close(o, want[0])
        close(s, want[1])


def test_gdn_l2norm_beta_sigmoid_and_neg_eigval():
    x = inputs()
    qn = x["q"] / (x["q"].pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    kn = x["k"] / (x["k"].pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    for allow, factor in ((False, 1.0), (True, 2.0)):
        o, s = tilela.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["gs"], x["raw"], initial_state=x["h0"],
                                             output_final_state=True, use_qk_l2norm_in_kernel=True,
                                             use_beta_sigmoid_in_kernel=True, allow_neg_eigval=allow, cu_seqlens=CU)
        want = ref(qn, kn, x["v"], x["gs"], factor * torch.sigmoid(x["raw"].double()), None, x["h0"])
        close(o, want[0], 1e-4)
        close(s, want[1], 1e-4)
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        tilela.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["gs"], x["beta"], allow_neg_eigval=True)


@pytest.mark.parametrize("name", ["chunk_gated_delta_rule", "chunk_kda", "chunk_simple_gla", "chunk_gla"])
def test_state_v_first_transposes_the_state_in_and_out(name):
    x = inputs()
    fixed, want = _args(name, x)
    op = getattr(tilela, name)
    o, s = op(*fixed, scale=0.3, initial_state=x["h0"].transpose(-1, -2).contiguous(), output_final_state=True,
              state_v_first=True, cu_seqlens=CU)
    close(o, want[0])
    close(s, want[1].transpose(-1, -2))
    assert s.is_contiguous()


@pytest.mark.parametrize("name", ["chunk_gated_delta_rule", "chunk_kda"])
def test_transpose_state_layout_is_a_deprecated_alias(name):
    x = inputs()
    fixed, want = _args(name, x)
    op = getattr(tilela, name)
    with pytest.warns(DeprecationWarning):
        _, s = op(*fixed, scale=0.3, initial_state=x["h0"].transpose(-1, -2), output_final_state=True,
                  cu_seqlens=CU, transpose_state_layout=True)
    close(s, want[1].transpose(-1, -2))
    with pytest.raises(ValueError, match="transpose_state_layout"):
        op(*fixed, state_v_first=True, transpose_state_layout=True)


def test_gdn_gate_in_kernel():
    x = inputs()
    A_log, dt_bias = torch.randn(HV), torch.randn(HV)
    for bias in (dt_bias, None):
        o, s = tilela.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["raw"], x["beta"], output_final_state=True,
                                             cu_seqlens=CU, use_gate_in_kernel=True, A_log=A_log, dt_bias=bias)
        raw = x["raw"].double() + (0 if bias is None else bias.double())
        g = -A_log.double().exp() * torch.log1p(raw.exp())
        want = ref(x["q"], x["k"], x["v"], g, x["beta"])
        close(o, want[0])
        close(s, want[1])
    with pytest.raises(ValueError, match="A_log"):
        tilela.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["raw"], x["beta"], use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="A_log: expected 4 elements"):
        tilela.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["raw"], x["beta"], use_gate_in_kernel=True,
                                      A_log=torch.zeros(3))
    # without the flag A_log and dt_bias are ignored, as FLA does
    close(tilela.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["gs"], x["beta"], cu_seqlens=CU, A_log=A_log)[0],
          ref(x["q"], x["k"], x["v"], x["gs"], x["beta"])[0])


def test_kda_gates_in_kernel():
    x = inputs()
    raw = torch.randn(B, T, HV, K)
    A_log, dt_bias = torch.randn(HV) * 0.5, torch.randn(HV * K)
    pre = raw.double() + dt_bias.double().view(HV, K)
    a = A_log.double().exp()[:, None]
    cases = [(dict(A_log=A_log, dt_bias=dt_bias), -a * torch.log1p(pre.exp())),
             (dict(A_log=A_log, dt_bias=dt_bias, lower_bound=-3.0, safe_gate=True), -3.0 * torch.sigmoid(a * pre)),
             (dict(dt_bias=dt_bias.view(HV, K), lower_bound=-2.0), -2.0 * torch.sigmoid(pre))]
    for options, g in cases:
        o, s = tilela.chunk_kda(x["q"], x["k"], x["v"], raw, x["beta"], output_final_state=True, cu_seqlens=CU,
                                use_gate_in_kernel=True, **options)
        want = ref(x["q"], x["k"], x["v"], g, x["beta"])
        close(o, want[0])
        close(s, want[1])
    for options in (dict(dt_bias=dt_bias), dict(A_log=A_log, safe_gate=True), dict(A_log=A_log, safe_gate=True,
                                                                                 lower_bound=-6.0)):
        with pytest.raises(ValueError, match="A_log|lower_bound"):
            tilela.chunk_kda(x["q"], x["k"], x["v"], raw, x["beta"], use_gate_in_kernel=True, **options)


def test_simple_gla_g_gamma_and_optional_g():
    x = inputs()
    gamma = -torch.rand(HV)
    cases = [(dict(g_gamma=gamma), gamma.double().expand(B, T, HV)),
             (dict(g=x["gs"], g_gamma=gamma), x["gs"].double() + gamma.double()), (dict(), None)]
    for options, g in cases:
        o, s = tilela.chunk_simple_gla(x["q"], x["k"], x["v"], output_final_state=True, cu_seqlens=CU, **options)
        want = ref(x["q"], x["k"], x["v"], g)
        close(o, want[0])
        close(s, want[1])


def _normalised(q, k, o, scale, cu, z0):
    """FLA's normaliser by a loop over tokens in float64."""
    out, zs = o.double().clone(), []
    G = o.shape[2] // k.shape[2]
    for n, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        z = torch.zeros(k.shape[2], k.shape[3], dtype=torch.float64) if z0 is None else z0[n, 0].double()
        for t in range(bos, eos):
            z = z + k[0, t].double()
            denom = (scale * q[0, t].double() * z).sum(-1) + 1e-10  # [H]
            out[0, t] /= denom.repeat_interleave(G)[:, None]
        zs.append(z)
    return out, torch.stack(zs)[:, None]


def test_linear_attn_normalize_is_fla_s_default():
    x = inputs()
    q, k = x["q"].abs(), x["k"].abs()  # positive feature maps keep the denominators away from 0
    raw, S = ref(q, k, x["v"], scale=0.3, h0=x["h0"])
    z0 = torch.rand(len(CU) - 1, 1, H, K)
    o, (s, z) = tilela.chunk_linear_attn(q, k, x["v"], 0.3, (x["h0"], z0), True, cu_seqlens=CU)
    want_o, want_z = _normalised(q, k, raw, 0.3, CU, z0)
    close(o, want_o, 1e-4)
    close(s, S)
    close(z, want_z)
    assert z.dtype == k.dtype
    # the pair comes back without output_final_state too, with the state None (as FLA)
    o2, (s2, z2) = tilela.chunk_linear_attn(q, k, x["v"], 0.3, x["h0"], cu_seqlens=CU)
    assert s2 is None
    close(o2, _normalised(q, k, raw, 0.3, CU, None)[0], 1e-4)
    # dense: one sequence per batch row
    qd, kd, vd = q.view(2, 50, H, K), k.view(2, 50, H, K), x["v"].view(2, 50, HV, V)
    od, (_, zd) = tilela.chunk_linear_attn(qd, kd, vd)
    rawd = ref(qd, kd, vd, cu=None)[0]
    for b in range(2):
        wo, wz = _normalised(qd[b:b + 1], kd[b:b + 1], rawd[b:b + 1], K ** -0.5, torch.tensor([0, 50]), None)
        close(od[b:b + 1], wo, 1e-4)
        close(zd[b:b + 1], wz)


def test_fla_s_rejections():
    x = inputs()
    q, k, v, gs, beta = x["q"], x["k"], x["v"], x["gs"], x["beta"]
    bad = [
        (lambda: tilela.chunk_gated_delta_rule(q, k, v, gs, beta, head_first=False), "head_first"),
        (lambda: tilela.chunk_delta_rule(q, k, v, beta, head_first=False), "head_first"),
        (lambda: tilela.chunk_simple_gla(q, k, v, gs, head_first=False), "head_first"),
        (lambda: tilela.chunk_gated_delta_rule(q, k, v, gs, beta, chunk_size=128), "chunk_size"),
        (lambda: tilela.chunk_kda(q, k, v, x["gc"], beta, chunk_size=16), "chunk_size"),
        (lambda: tilela.chunk_simple_gla(q, k, v, gs, chunk_size=48), "chunk_size"),
        (lambda: tilela.chunk_kda(q, k, v, x["gc"], beta, return_intermediate_states=True),
         "return_intermediate_states"),
    ]
    for call, name in bad:
        with pytest.raises(ValueError, match=name):
            call()
    with pytest.raises(TypeError, match="normalize"):
        tilela.chunk_linear_attn(q, k, v, normalize=1)
    with pytest.raises(TypeError, match="cp_context"):  # a tilela.distributed.CPContext is expected
        tilela.chunk_gated_delta_rule(q, k, v, gs, beta, cp_context=object())
    with pytest.raises(TypeError):
        tilela.chunk_gla(q, k, v, x["gc"], head_first=False)  # no **kwargs in FLA's chunk_gla either


def test_what_fla_ignores_is_ignored():
    x = inputs()
    want = tilela.chunk_kda(x["q"], x["k"], x["v"], x["gc"], x["beta"])[0]
    got = tilela.chunk_kda(x["q"], x["k"], x["v"], x["gc"], x["beta"], head_first=False, chunk_indices=None,
                           disable_recompute=True, use_graph=True, max_num_seqs=8, chunk_size=32)
    torch.testing.assert_close(got[0], want)
