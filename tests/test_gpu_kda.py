"""chunk_kda on the H200 through the public op against the float64 reference, on our kernels end to end (the
PyTorch path is made to raise): K = V = 64 and 128, bf16 and fp16, GVA 1 and 2, odd varlen with length-1 sequences,
dense batches, initial and final state, channels that never decay beside channels at KDA's lower bound (-5 per
token), FLA's in-kernel options (the softplus and bounded gates, q/k l2norm, beta sigmoid), and gates far past any
bound (wild channels, resets), chunk_gla's too."""

import math

import pytest
import torch
import torch.nn.functional as F

import tilela
from tilela import ops, reference
from tilela.bench import rel_l2

pytestmark = pytest.mark.gpu

TOL = 1e-2


def make(lengths, B, H, HV, K, dtype, seed):
    """q, k unit-norm; v normal; beta in (0, 1); a per-channel log gate with a quarter of each head's channels at 0,
    a quarter at -5 on every token (KDA's lower bound) and the rest logsigmoid values; initial states."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, K, generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(B, T, HV, K, generator=gen) + 2)
    g[..., : K // 4] = 0.0
    g[..., K // 4: K // 2] = -5.0
    beta = torch.randn(B, T, HV, generator=gen).sigmoid()
    h0 = torch.randn(B * len(lengths), HV, K, K, generator=gen) * 0.1
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32) if B == 1 else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu)


@pytest.fixture
def kernels_only(monkeypatch):
    """Any call that would take the PyTorch path raises, so a passing test ran our kernels."""
    def refuse(*args, **kwargs):
        raise AssertionError("chunk_kda took the PyTorch path")

    monkeypatch.setattr(ops.torch_path, "chunk_attention", refuse)


def run(x, **options):
    cu = x["cu_seqlens"]
    o, S = tilela.chunk_kda(*(x[n].cuda() for n in ("q", "k", "v", "g", "beta")),
                            initial_state=x["initial_state"].cuda(), output_final_state=True,
                            cu_seqlens=None if cu is None else cu.cuda(), cu_seqlens_cpu=cu, **options)
    torch.cuda.synchronize()
    return o, S


CASES = [  # lengths, B, H, HV, K, dtype
    ((1, 130, 64, 7, 300), 1, 2, 2, 128, torch.bfloat16),
    ((1, 1, 65, 190, 2), 1, 2, 4, 64, torch.float16),
    ((200,), 2, 4, 4, 128, torch.float16),
    ((1,), 1, 1, 2, 64, torch.bfloat16),
    ((2000, 3), 1, 1, 1, 128, torch.bfloat16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{'+'.join(map(str, c[0]))}x{c[1]}_h{c[2]}-{c[3]}_K{c[4]}")
def test_kda_against_float64_reference(kernels_only, case):
    lengths, B, H, HV, K, dtype = case
    x = make(lengths, B, H, HV, K, dtype, seed=sum(lengths) + K)
    o, S = run(x)
    ref_o, ref_S = reference.chunked(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"],
                                     initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])
    assert o.dtype == dtype and o.shape == x["v"].shape and S.dtype == torch.float32
    assert rel_l2(o, ref_o) < TOL, f"o rel L2 {rel_l2(o, ref_o):.3e}"
    assert rel_l2(S, ref_S) < TOL, f"final state rel L2 {rel_l2(S, ref_S):.3e}"


@pytest.mark.parametrize("form", ["softplus", "bounded"])
def test_kda_fla_options_against_float64_reference(kernels_only, form):
    """The raw gate through use_gate_in_kernel (the softplus form; the bounded form with safe_gate), unnormalised q/k
    through use_qk_l2norm_in_kernel and beta logits through use_beta_sigmoid_in_kernel: the transforms in float64,
    then the reference."""
    lengths, HV, K = (1, 257, 64), 4, 128
    x = make(lengths, 1, 2, HV, K, torch.bfloat16, seed=7)
    gen = torch.Generator().manual_seed(8)
    raw = torch.randn(1, sum(lengths), HV, K, generator=gen)
    # FLA's KDA layer initialisation: A_log = log(uniform(1, 16)), dt_bias = softplus^-1(dt), dt in [1e-3, 0.1]
    A_log = (torch.rand(HV, generator=gen) * 15 + 1).log()
    dt = torch.exp(torch.rand(HV * K, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    q_raw, k_raw = (torch.randn(x["q"].shape, generator=gen).to(torch.bfloat16) for _ in range(2))
    beta_logit = torch.randn(x["beta"].shape, generator=gen)
    lower = -5.0 if form == "bounded" else None
    y = dict(x, q=q_raw, k=k_raw, g=raw.to(torch.bfloat16), beta=beta_logit)
    o, S = run(y, safe_gate=lower is not None, use_gate_in_kernel=True, A_log=A_log.cuda(), dt_bias=dt_bias.cuda(),
               lower_bound=lower, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    a = A_log.double().exp().view(HV, 1)
    pre = y["g"].double() + dt_bias.double().view(HV, K)
    g = lower * torch.sigmoid(a * pre) if lower is not None else -a * F.softplus(pre)
    unit = lambda t: F.normalize(t.double(), dim=-1)  # noqa: E731
    ref_o, ref_S = reference.chunked(unit(q_raw), unit(k_raw), x["v"], g=g, beta=beta_logit.double().sigmoid(),
                                     initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])
    assert rel_l2(o, ref_o) < TOL and rel_l2(S, ref_S) < TOL


WILD = [(op, K, dtype) for op in ("kda", "gla") for K, dtype in ((128, torch.bfloat16), (64, torch.float16))]


@pytest.mark.parametrize("op,K,dtype", WILD, ids=[f"{o}-K{K}-{str(d)[6:]}" for o, K, d in WILD])
def test_wild_gates_on_the_kernels(kernels_only, op, K, dtype):
    """Gates far past any bound, on the kernels (gla_factors' wild channels, which decay by more than e^-160 over a
    chunk): channels decaying by e^-30 on every token, single tokens at -200 at a 16-row block's first row, inside
    one and at a tile's last row, a -1e4 token (a reset), beside channels at 0 and the -5 bound, and either side of
    the calm limit (-2.45 per token: e^-157 over a whole tile, its factors near e^+-78; -2.55: e^-163); odd varlen."""
    x = make((1, 130, 64, 7, 300), 1, 2, 4, K, dtype, seed=11)
    g = x["g"]
    g[..., K // 2: K // 2 + 8] = -30.0
    g[..., K // 2 + 8: K // 2 + 12] = -2.45
    g[..., K // 2 + 12: K // 2 + 16] = -2.55
    last = 202  # the 300-token sequence's first token
    for t, d in ((16, -1), (37, -2), (63, -3), (64 * 3 + 5, -4), (80, -5)):
        g[0, last + t, :, d] = -200.0
    g[0, last + 250, :, -6] = -1e4
    cu = x["cu_seqlens"]
    if op == "kda":
        o, S = run(x)
        ref_o, ref_S = reference.chunked(x["q"], x["k"], x["v"], g=g, beta=x["beta"],
                                         initial_state=x["initial_state"], cu_seqlens=cu)
    else:
        o, S = tilela.chunk_gla(*(x[n].cuda() for n in ("q", "k", "v", "g")), initial_state=x["initial_state"].cuda(),
                                output_final_state=True, cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)
        ref_o, ref_S = reference.chunked(x["q"], x["k"], x["v"], g=g, initial_state=x["initial_state"],
                                         cu_seqlens=cu)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_l2(o, ref_o) < TOL, f"o rel L2 {rel_l2(o, ref_o):.3e}"
    assert rel_l2(S, ref_S) < TOL, f"final state rel L2 {rel_l2(S, ref_S):.3e}"


def _passes(K):
    """(kernel, DV block, chunk): the single-warp-group pass ("loop") at chunk 64 and at 16 (the short-chunk path:
    kkt_solve's Neumann inverse) and the warp-specialised pass at each DV block it is built for."""
    from tilela.kernels.hopper import plan

    return [("loop", None, 64), ("loop", None, 16)] + [("ws", block, 64) for block in plan.dv_blocks(K, "channel", True)
                                                       if block >= 32 or K >= 128]


@pytest.mark.parametrize("case,state_pass", [(case, p) for case in CASES for p in _passes(case[4])],
                         ids=lambda x: f"{x[0]}{x[1] or ''}_C{x[2]}" if isinstance(x[0], str)
                         else f"{'+'.join(map(str, x[0]))}x{x[1]}_K{x[4]}")
def test_kda_state_passes_against_float64_reference(case, state_pass):
    """The per-channel delta rule through the plan's stages on either state pass: the loop pass reads gc and A (at
    chunk 64, and at 16 with kkt_solve's Neumann inverse); the warp-specialised pass (gla_factors with Kg and Ab =
    A diag(beta), summing the raw gate in its tile, then the pass with Kg and P in their own input slots) at every
    DV block it is built for."""
    from tilela.kernels import hopper

    lengths, B, H, HV, K, dtype = case
    kernel, block, chunk = state_pass
    x = make(lengths, B, H, HV, K, dtype, seed=sum(lengths) + (block or 0) + chunk)
    d = {n: None if t is None else t.cuda() for n, t in x.items()}
    plan = hopper.plan_call(d["q"], d["v"], d["g"], d["beta"], K**-0.5, gate="channel",
                            lengths=list(lengths) * B, initial_state=True, output_final_state=True,
                            varlen=x["cu_seqlens"] is not None, kernel=kernel, block_DV=block, chunk=chunk)
    factors = (K, hopper.DTYPE_NAMES[dtype], ("float32", "log"), True) if kernel == "ws" else None
    assert plan.output.kernel == kernel and plan.factors == factors and (plan.cumsum is None) == (kernel == "ws")
    assert kernel == "ws" or (plan.cumsum[0], plan.kkt[:2]) == (chunk, (chunk, "neumann" if chunk == 16 else "blocked"))
    o, S = hopper.forward(plan, d["q"], d["k"], d["v"], d["g"], d["beta"], d["initial_state"], d["cu_seqlens"])
    ref_o, ref_S = reference.chunked(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"],
                                     initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])
    assert rel_l2(o, ref_o) < TOL, f"o rel L2 {rel_l2(o, ref_o):.3e}"
    assert rel_l2(S, ref_S) < TOL, f"final state rel L2 {rel_l2(S, ref_S):.3e}"


SPLIT_CASES = {  # lengths, B, H, HV, K, dtype, segment chunks, initial state: KDA's sequence split forced
    "varlen_seg2": ((1, 700, 0, 130, 64), 1, 2, 4, 128, torch.bfloat16, 2, True),
    "dense_seg3_fp16_K64": ((500,), 2, 1, 2, 64, torch.float16, 3, False),
    "long_seg16": ((8192,), 1, 4, 4, 128, torch.bfloat16, 16, True),
}


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_kda_sequence_split_matches_unsplit_and_reference(name):
    """The split (gla_factors over the segments' tiles, transitions on [V | 0], the combine, the outputs pass)
    against the unsplit pipeline on the same inputs and both against float64: varlen with empty and 1-token
    sequences, a dense batch, K = 64 in fp16; channels at 0 and at the -5 bound. The transitions' [0 | I] state goes
    through the pass's 16-bit products as the unsplit state does, so the two differ by that rounding."""
    from tilela.kernels import hopper
    from tilela.kernels.hopper.plan import SegmentPlan

    lengths, B, H, HV, K, dtype, segment_chunks, use_h0 = SPLIT_CASES[name]
    x = make(lengths, B, H, HV, K, dtype, seed=len(name))
    h0 = x["initial_state"] if use_h0 else None
    d = {n: None if t is None else t.cuda() for n, t in dict(x, initial_state=h0).items()}
    host = list(lengths) * B
    runs = []
    for split in (None, SegmentPlan.of(host, segment_chunks)):
        plan = hopper.plan_call(d["q"], d["v"], d["g"], d["beta"], K**-0.5, gate="channel", lengths=host,
                                initial_state=use_h0, output_final_state=True, varlen=B == 1 and len(lengths) > 1,
                                split=split, pipeline=None)
        assert (plan.split is None) == (split is None) and plan.factors is not None
        cu = d["cu_seqlens"] if B == 1 and len(lengths) > 1 else None
        runs.append(hopper.forward(plan, d["q"], d["k"], d["v"], d["g"], d["beta"], d["initial_state"], cu))
    (o0, S0), (o1, S1) = runs
    ref_o, ref_S = reference.chunked(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=h0,
                                     cu_seqlens=x["cu_seqlens"] if B == 1 and len(lengths) > 1 else None)
    assert rel_l2(o1, o0) < TOL and rel_l2(S1, S0) < TOL
    assert rel_l2(o1, ref_o) < TOL, f"o rel L2 {rel_l2(o1, ref_o):.3e}"
    assert rel_l2(S1, ref_S) < TOL, f"final state rel L2 {rel_l2(S1, ref_S):.3e}"


PIPELINE_CASES = {  # length, H, HV, K, dtype, varlen, initial state, gate form, token boundaries
    "h8_ranges4": (5000, 8, 8, 128, torch.bfloat16, False, True, "softplus", (0, 1024, 2048, 3520, 5000)),
    "varlen_one_token_last": (1153, 2, 4, 128, torch.bfloat16, True, False, "log", (0, 512, 1152, 1153)),
    "fp16_K64_bounded": (3000, 4, 4, 64, torch.float16, False, True, "sigmoid", (0, 640, 3000)),
}


@pytest.mark.parametrize("name", list(PIPELINE_CASES))
def test_kda_pipeline_matches_unpipelined_and_reference(name):
    """The token-range pipeline (gla_factors and the pass range by range on two streams) gives the unpipelined
    call's o and final state bit for bit: the same factors per chunk, the fp32 state handed over through the final
    and initial state slots; and both within TOL of float64 (the gate formed in the kernels from its raw input)."""
    from tilela.kernels import hopper
    from tilela.ops import in_kernel_gate

    T, H, HV, K, dtype, varlen, use_h0, form, bounds = PIPELINE_CASES[name]
    x = make((T,), 1, H, HV, K, dtype, seed=len(name))
    gen = torch.Generator().manual_seed(5)
    A_log = (torch.rand(HV, generator=gen) * 15 + 1).log()
    dt_bias = torch.randn(HV * K, generator=gen) - 3
    raw = torch.randn(1, T, HV, K, generator=gen).to(dtype)
    h0 = x["initial_state"] if use_h0 else None
    d = {n: None if t is None else t.cuda() for n, t in dict(x, initial_state=h0, g=raw).items()}
    if form == "log":
        d["g"], gate = x["g"].cuda(), dict(gate_params=None, gate_scale=None)
    else:
        gate_in = in_kernel_gate(d["g"], A_log.cuda(), dt_bias.cuda(), -5.0 if form == "sigmoid" else None)
        gate = dict(gate_params=gate_in.params, gate_scale=gate_in.lower_bound)
    runs = []
    for pipeline in (None, bounds):
        plan = hopper.plan_call(d["q"], d["v"], d["g"], d["beta"], K**-0.5, gate="channel", lengths=[T],
                                initial_state=use_h0, output_final_state=True, varlen=varlen,
                                gate_form=form, pipeline=pipeline)
        assert plan.pipeline == pipeline and plan.split is None
        runs.append(hopper.forward(plan, d["q"], d["k"], d["v"], d["g"], d["beta"], d["initial_state"],
                                   d["cu_seqlens"] if varlen else None, **gate))
    torch.cuda.synchronize()
    (o0, S0), (o1, S1) = runs
    assert torch.equal(o1, o0) and torch.equal(S1, S0)
    if form == "log":
        g = x["g"].double()
    else:
        a, z = A_log.double().exp().view(HV, 1), raw.double() + dt_bias.double().view(HV, K)
        g = -5.0 * torch.sigmoid(a * z) if form == "sigmoid" else -a * F.softplus(z)
    ref_o, ref_S = reference.chunked(x["q"], x["k"], x["v"], g=g, beta=x["beta"], initial_state=h0)
    assert rel_l2(o1, ref_o) < TOL, f"o rel L2 {rel_l2(o1, ref_o):.3e}"
    assert rel_l2(S1, ref_S) < TOL, f"final state rel L2 {rel_l2(S1, ref_S):.3e}"


def test_kda_pipelined_call_captures_in_a_cuda_graph(kernels_only, monkeypatch):
    """chunk_kda on a layout auto_pipeline pipelines (one 32768-token sequence over 8 value heads, the in-kernel
    bounded gate): eagerly the op runs unpipelined, in a CUDA graph's capture pipelined (the passes' stream forked
    and joined inside the capture); the replay on new inputs matches float64 and, bit for bit, the eager call."""
    from tilela.kernels import hopper
    from tilela.kernels.hopper import seq_pipeline
    from tilela.kernels.hopper.plan import auto_pipeline

    pipelined = []
    forward = seq_pipeline.pipeline_forward
    monkeypatch.setattr(seq_pipeline, "pipeline_forward", lambda *a, **kw: pipelined.append(1) or forward(*a, **kw))
    lengths, HV, K = (32768,), 8, 128
    sms = hopper.multiprocessors(torch.device("cuda"))
    assert auto_pipeline(lengths, HV, sms, K, "bfloat16", "sigmoid", 16) is not None
    x = make(lengths, 1, HV, HV, K, torch.bfloat16, seed=31)
    gen = torch.Generator().manual_seed(32)
    A_log = (torch.rand(HV, generator=gen) * 15 + 1).log().cuda()
    dt_bias = torch.full((HV * K,), -4.0).cuda()
    d = {n: t.cuda() for n, t in x.items() if n != "cu_seqlens"}
    d["g"] = torch.randn(d["g"].shape, device="cuda").to(torch.bfloat16)

    def call():
        return tilela.chunk_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"],
                                output_final_state=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                safe_gate=True, lower_bound=-5.0)

    eager_o, _ = call()
    torch.cuda.synchronize()
    assert not pipelined
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, S = call()
    assert pipelined == [1]
    fresh = make(lengths, 1, HV, HV, K, torch.bfloat16, seed=33)
    for n in ("q", "k", "v", "beta", "initial_state"):
        d[n].copy_(fresh[n])
    graph.replay()
    eager_fresh_o, eager_fresh_S = call()
    torch.cuda.synchronize()
    assert pipelined == [1] and torch.equal(o, eager_fresh_o) and torch.equal(S, eager_fresh_S)
    a = A_log.double().cpu().exp().view(HV, 1)
    g = -5.0 * torch.sigmoid(a * (d["g"].double().cpu() + dt_bias.double().cpu().view(HV, K)))
    ref_o, ref_S = reference.chunked(fresh["q"], fresh["k"], fresh["v"], g=g, beta=fresh["beta"],
                                     initial_state=fresh["initial_state"])
    assert rel_l2(o, ref_o) < TOL and rel_l2(S, ref_S) < TOL
    assert rel_l2(eager_o, ref_o) > 1e-1  # the replay ran on the new inputs


def test_kda_split_call_captures_in_a_cuda_graph(kernels_only):
    """chunk_kda on a layout auto_split splits (one 16384-token sequence over 2 value heads, the in-kernel softplus
    gate): the op's plan splits, and a CUDA graph captured on it replays on new inputs."""
    from tilela.kernels.hopper import multiprocessors
    from tilela.kernels.hopper.plan import auto_split

    lengths, HV, K = (16384,), 2, 128
    assert auto_split(lengths, HV, multiprocessors(torch.device("cuda")), K, "channel", True) is not None
    x = make(lengths, 1, HV, HV, K, torch.bfloat16, seed=21)
    gen = torch.Generator().manual_seed(22)
    A_log = (torch.rand(HV, generator=gen) * 15 + 1).log().cuda()
    dt_bias = torch.full((HV * K,), -4.0).cuda()
    d = {n: t.cuda() for n, t in x.items()}
    d["g"] = torch.randn(d["g"].shape, device="cuda").to(torch.bfloat16)

    def call():
        return tilela.chunk_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"],
                                output_final_state=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                cu_seqlens=d["cu_seqlens"], cu_seqlens_cpu=x["cu_seqlens"])

    eager_o, _ = call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, S = call()
    fresh = make(lengths, 1, HV, HV, K, torch.bfloat16, seed=23)
    for n in ("q", "k", "v", "beta", "initial_state"):
        d[n].copy_(fresh[n])
    graph.replay()
    torch.cuda.synchronize()
    g = -A_log.double().cpu().exp().view(HV, 1) * F.softplus(d["g"].double().cpu() + dt_bias.double().cpu().view(HV, K))
    ref_o, ref_S = reference.chunked(fresh["q"], fresh["k"], fresh["v"], g=g, beta=fresh["beta"],
                                     initial_state=fresh["initial_state"], cu_seqlens=x["cu_seqlens"])
    assert rel_l2(o, ref_o) < TOL and rel_l2(S, ref_S) < TOL
    assert rel_l2(eager_o, ref_o) > 1e-1  # the replay ran on the new inputs
