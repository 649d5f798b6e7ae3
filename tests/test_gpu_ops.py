"""GDN on the H200 through the public op (TileLang kernels end to end) against the float64
reference: head dims 64/128/256, bf16/fp16, GVA 1-4, varlen with many (1-token, non-multiple-of-64)
sequences, dense batches, initial/final state, in-kernel q/k l2norm, no-decay to strong-decay gates;
and CUDA-graph capture of the whole op (no host synchronisation on the hot path)."""

import itertools
import math
import zlib

import pytest
import torch
import torch.nn.functional as F

import tilela
from tilela import reference
from tilela.bench import rel_l2

pytestmark = pytest.mark.gpu


def make(lengths, B, h_qk, h_v, dim, dtype, gate, seed, T=300):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths) if lengths else T
    q = F.normalize(torch.randn(B, T, h_qk, dim, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, h_qk, dim, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, h_v, dim, generator=gen).to(dtype)
    if gate == "mixed":  # FlashQLA's benchmark gates: a quarter of the heads never decay
        g = F.logsigmoid(torch.randn(B, T, h_v, generator=gen)) / 16
        g[..., : max(1, h_v // 4)] = 0.0
    else:  # every head decays, some fast
        g = F.logsigmoid(torch.randn(B, T, h_v, generator=gen) + 3)
        g[..., -1] = F.logsigmoid(torch.randn(B, T, generator=gen) - 4)
    beta = torch.randn(B, T, h_v, generator=gen).sigmoid()
    N = len(lengths) if lengths else B
    h0 = torch.randn(N, h_v, dim, dim, generator=gen) * 0.1
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32) if lengths else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu)


CASES = [
    # lengths (varlen) or None (dense), B, h_qk, h_v, dim, dtype, gate
    ((1, 63, 64, 65, 200, 1, 511, 7), 1, 2, 8, 128, torch.bfloat16, "mixed"),
    ((1, 63, 64, 65, 200, 1, 511, 7), 1, 4, 12, 128, torch.float16, "decay"),
    (None, 3, 4, 4, 128, torch.bfloat16, "decay"),
    (None, 2, 2, 8, 64, torch.bfloat16, "mixed"),
    ((129, 1, 250), 1, 2, 6, 256, torch.bfloat16, "mixed"),
    ((700, 3), 1, 1, 2, 256, torch.float16, "decay"),
]


@pytest.mark.parametrize("lengths,B,h_qk,h_v,dim,dtype,gate", CASES)
@pytest.mark.parametrize("l2norm", [False, True])
def test_gdn_against_float64_reference(lengths, B, h_qk, h_v, dim, dtype, gate, l2norm):
    x = make(lengths, B, h_qk, h_v, dim, dtype, gate, seed=zlib.crc32(repr((lengths, B, dim, gate)).encode()) % 1000)
    dev = {n: (t.cuda() if t is not None else None) for n, t in x.items()}
    q, k = (x["q"] * 2, x["k"] * 0.5) if l2norm else (x["q"], x["k"])
    o, S = tilela.chunk_gated_delta_rule(
        q.cuda(), k.cuda(), dev["v"], dev["g"], dev["beta"], initial_state=dev["initial_state"],
        output_final_state=True, cu_seqlens=dev["cu_seqlens"], use_qk_l2norm_in_kernel=l2norm,
    )
    ref_o, ref_S = reference.chunked(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"],
                                     initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])
    assert o.dtype == dtype and S.dtype == torch.float32
    assert rel_l2(o, ref_o) < 1e-2
    assert rel_l2(S, ref_S) < 1e-2


# a layout auto_split splits over 4 value heads for GDN and simple_gla (tests/test_seq_split.py checks it)
SPLIT_LAYOUT = (10000, 1, 190)


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "chunk_simple_gla"])
@pytest.mark.parametrize("lengths,h_v,splits", [((300, 1, 77), 4, False), (SPLIT_LAYOUT, 4, True),
                                                 ((8192,), 4, True)], ids=["varlen", "varlen_split", "dense_split"])
@pytest.mark.parametrize("table_copied_before", [True, False], ids=["eager_table", "table_node"])
def test_ops_capture_in_a_cuda_graph(op, lengths, h_v, splits, table_copied_before, monkeypatch):
    """The whole op replays from a CUDA graph on new inputs, unsplit and with the sequence split (auto_split
    splits a 10000-token sequence over 4 value heads), varlen and dense (a single sequence without cu_seqlens): GDN
    (the delta rule's combine) and simple_gla (the plain update's combine kernel). The split's segment table is the
    eager call's copy, or (no copy kept from before the capture) a copy node of the graph."""
    from tilela.kernels.hopper import host_tables, multiprocessors
    from tilela.kernels.hopper.plan import auto_split

    delta = op == "chunk_gated_delta_rule"
    plan = auto_split(lengths, h_v, multiprocessors(torch.device("cuda")), 128, "scalar", delta)
    assert (plan is not None) == splits
    dense = len(lengths) == 1
    x = make(None if dense else lengths, 1, 2, h_v, 128, torch.bfloat16, "mixed", seed=3, T=sum(lengths))
    dev = {n: None if t is None else t.cuda() for n, t in x.items()}
    cpu_cu = x["cu_seqlens"]

    def run():
        gates = [dev["g"], dev["beta"]] if delta else [dev["g"]]
        plain = {"normalize": False} if op == "chunk_linear_attn" else {}
        return getattr(tilela, op)(dev["q"], dev["k"], dev["v"], *gates, initial_state=dev["initial_state"],
                                   output_final_state=True, cu_seqlens=dev["cu_seqlens"], cu_seqlens_cpu=cpu_cu,
                                   **plain)

    eager_o, eager_S = run()  # compiles outside the capture
    torch.cuda.synchronize()
    if not table_copied_before:
        monkeypatch.setattr(host_tables, "_EAGER", {})
        monkeypatch.setattr(host_tables, "_GRAPH", {})
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, S = run()
    fresh = make(None if dense else lengths, 1, 2, h_v, 128, torch.bfloat16, "mixed", seed=4, T=sum(lengths))
    for n in ("q", "k", "v", "g", "beta", "initial_state"):
        dev[n].copy_(fresh[n])
    graph.replay()
    torch.cuda.synchronize()
    ref_o, ref_S = reference.chunked(fresh["q"], fresh["k"], fresh["v"], g=fresh["g"],
                                     beta=fresh["beta"] if delta else None, initial_state=fresh["initial_state"],
                                     cu_seqlens=cpu_cu)
    assert rel_l2(o, ref_o) < 1e-2 and rel_l2(S, ref_S) < 1e-2
    assert rel_l2(eager_o, ref_o) > 1e-1  # the replay really ran on the new inputs


@pytest.mark.parametrize("gate", [None, "scalar"])
@pytest.mark.parametrize("with_h0", [False, True])
def test_seq_combine_matches_entering_states(gate, with_h0):
    """The plain update's combine kernel (hopper/seq_combine.py) against its float64 stage: 302 segments in one
    sequence (three blocks of 128 decays), an empty and a one-token sequence, a head without decay."""
    from tilela.kernels.hopper.launch import launch_combine
    from tilela.kernels.hopper.plan import SegmentPlan
    from tilela.kernels.hopper.seq_split import segment_table

    lengths = [64 * 603 + 5, 0, 1, 700]
    plan = SegmentPlan.of(lengths, 2)
    table = segment_table(plan, torch.device("cuda"))
    gen = torch.Generator().manual_seed(7)
    HV, K = 3, 128
    B = torch.randn(plan.num_segments, HV, K, K, generator=gen)
    h0 = torch.randn(len(lengths), HV, K, K, generator=gen) if with_h0 else None
    gc = None
    if gate:
        g = F.logsigmoid(torch.randn(1, sum(lengths), HV, generator=gen)) / 16
        g[..., 0] = 0.0
        gc = reference.chunk_local_cumsum(g, 64, torch.tensor([0, *itertools.accumulate(lengths)])).float()
    S_in, final = launch_combine((K, K, "scalar" if gate else "none", h0 is not None, False), B.cuda(),
                              None if gc is None else gc.cuda(), table.cu_segments, table.first,
                              None if h0 is None else h0.cuda())
    ref_in, ref_final = reference.entering_states(B, gc, table.cu_segments.cpu(), table.first.cpu(), h0)
    assert rel_l2(S_in, ref_in) < 1e-5 and rel_l2(final, ref_final) < 1e-5


@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("with_h0,with_warm", [(False, False), (True, False), (True, True)])
def test_matrix_combine_matches_transition_entering_states(K, with_h0, with_warm):
    """The delta rule's combine (hopper/seq_combine.py's "matrix" kernel over the sequences cut into segments, 40
    and 6 of them, and the copy of the initial states of the others, an empty and a one-token sequence) against its
    float64 stage: transitions of norm about 1 (as a segment's M with the delta rule: contractions but for g = 0
    heads); under a warm-up table, the (sequence, head)s it warms up (and, as the warm-up's transitions make them,
    every sequence of one segment) need no row (the reference's are NaN, not compared)."""
    from tilela.kernels.hopper.launch import launch_combine
    from tilela.kernels.hopper.plan import SegmentPlan
    from tilela.kernels.hopper.seq_split import segment_table

    lengths = [64 * 79 + 5, 0, 1, 700]
    plan = SegmentPlan.of(lengths, 2)
    table = segment_table(plan, torch.device("cuda"))
    gen = torch.Generator().manual_seed(K)
    HV = 3
    B = torch.randn(plan.num_segments, HV, K, K, generator=gen) * 0.1
    M = torch.linalg.qr(torch.randn(plan.num_segments, HV, K, K, generator=gen))[0] * 0.99
    BM = torch.cat([B, M], dim=-1)
    h0 = torch.randn(len(lengths), HV, K, K, generator=gen) if with_h0 else None
    warm = None
    if with_warm:  # head 1 warms up in every sequence, the others take the transitions
        warm = torch.full((3, plan.num_segments, HV), -1, dtype=torch.int32)
        warm[0, :, 1] = 2
        warm[0, table.single_rows.cpu().long()] = 0  # a sequence of one segment enters from its initial state
    S_in = launch_combine((K, K, "matrix", with_h0, with_warm), BM.cuda(), table,
                          None if h0 is None else h0.cuda(), None if warm is None else warm.cuda())
    ref = reference.transition_entering_states(BM, table.first.cpu(), h0, warm)
    read = ~ref.isnan().any(-1).any(-1)  # the rows the outputs pass reads
    assert rel_l2(S_in.cpu()[read], ref[read]) < 1e-5
    assert read[:, 1].sum() == (0 if with_warm else plan.num_segments)
    if with_warm:  # the transitions' heads of the sequences cut into segments, every row
        assert read[:, 0].sum() == plan.num_segments - len(table.singles)


LADDER = [  # op, gate ("scalar" [B,T,HV] / "channel" [B,T,HV,K] / None), delta rule
    ("chunk_delta_rule", None, True),
    ("chunk_linear_attn", None, False),
    ("chunk_simple_gla", "scalar", False),
    ("chunk_gla", "channel", False),
    ("chunk_kda", "channel", True),
]


@pytest.mark.parametrize("op,gate,delta", LADDER)
@pytest.mark.parametrize("dim,dtype", [(128, torch.bfloat16), (64, torch.float16)])
def test_ladder_ops_against_float64_reference(op, gate, delta, dim, dtype):
    lengths = (1, 130, 64, 7)
    x = make(lengths, 1, 2, 6, dim, dtype, "mixed", seed=zlib.crc32(f"{op}{dim}".encode()) % 1000)
    gen = torch.Generator().manual_seed(5)
    g = {None: None, "scalar": x["g"],
         "channel": torch.nn.functional.logsigmoid(torch.randn(*x["v"].shape[:3], dim, generator=gen)) / 4}[gate]
    o, S = _ladder_op_against_reference(op, x, g, delta)
    assert o.dtype == dtype and S.dtype == torch.float32


def _ladder_op_against_reference(op, x, g, delta):
    """Run tilela.<op> on the GPU (varlen, host boundaries given), assert o and the final states within 1e-2 of
    the float64 reference, return them."""
    args = [t.cuda() for t in (x["q"], x["k"], x["v"])] + ([g.cuda()] if g is not None else [])
    args += [x["beta"].cuda()] if delta else []
    plain = {"chunk_linear_attn": {"normalize": False}, "chunk_kda": {"safe_gate": True}}.get(op, {})
    o, S = getattr(tilela, op)(*args, initial_state=x["initial_state"].cuda(), output_final_state=True,
                               cu_seqlens=x["cu_seqlens"].cuda(), cu_seqlens_cpu=x["cu_seqlens"], **plain)
    ref_o, ref_S = reference.chunked(x["q"], x["k"], x["v"], g=g, beta=x["beta"] if delta else None,
                                     initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])
    assert rel_l2(o, ref_o) < 1e-2 and rel_l2(S, ref_S) < 1e-2
    return o, S


@pytest.mark.parametrize("op,gate,delta", [("chunk_linear_attn", None, False), ("chunk_simple_gla", "scalar", False),
                                           ("chunk_delta_rule", None, True)])
def test_ladder_ops_split_long_sequences(op, gate, delta):
    """Levels 1, 2 and 4 on a layout auto_split splits (a 30000-token sequence over 4 heads): the plain update's
    transitions (B from a zero state) and combine kernel, and the delta rule's ([B | M])."""
    from tilela.kernels.hopper import multiprocessors
    from tilela.kernels.hopper.plan import auto_split

    lengths = (30000, 1, 190)
    assert auto_split(lengths, 4, multiprocessors(torch.device("cuda")), 128, gate or "none", delta) is not None
    x = make(lengths, 1, 4, 4, 128, torch.bfloat16, "mixed", seed=11)
    _ladder_op_against_reference(op, x, x["g"] if gate else None, delta)


@pytest.mark.parametrize("chunk_size,method", [(16, "neumann"), (32, "blocked"), (64, "blocked"), (64, "neumann")])
def test_chunk_primitives_through_public_ops(chunk_size, method):
    x = make((1, 130, 64, 7), 1, 2, 6, 128, torch.bfloat16, "decay", seed=chunk_size)
    cu = x["cu_seqlens"]
    g_cum = tilela.chunk_local_cumsum(x["g"].cuda(), chunk_size, cu.cuda(), cu_seqlens_cpu=cu)
    assert rel_l2(g_cum, reference.chunk_local_cumsum(x["g"], chunk_size, cu)) < 1e-6
    A = tilela.kkt_solve(x["k"].cuda(), x["beta"].cuda(), g_cum, chunk_size, cu.cuda(), method=method,
                         cu_seqlens_cpu=cu)
    ref_A = reference.kkt_solve(x["k"], x["beta"], reference.chunk_local_cumsum(x["g"], chunk_size, cu), chunk_size, cu)
    assert A.dtype == torch.bfloat16 and rel_l2(A, ref_A) < 1e-2


@pytest.mark.parametrize("form,columns", [("softplus", (6,)), ("softplus", (4, 64)), ("sigmoid", (4, 64))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cumsum_stage_forms_the_in_kernel_gate(form, columns, dtype):
    """FLA's in-kernel gate formed in the cumsum stage (kernels/hopper/cumsum.py) against the float64 cumsum of
    tilela._gates.apply_gate, per element: gates of FLA's layer scale (dt_bias = softplus^-1(dt), dt log-uniform in
    [1e-3, 0.1], so softplus values near 1e-3, each kept to float32's relative precision), raw inputs far into
    softplus's linear range and sigmoid's tails, GDN's ([HV]) and KDA's ([HV, K]) gate columns, varlen with 1-token
    sequences. Every term of a cumsum has one sign, so each gc keeps the terms' relative error."""
    from tilela._gates import apply_gate
    from tilela.kernels.hopper import launch

    gen = torch.Generator().manual_seed(len(columns) + (form == "sigmoid"))
    cu = torch.tensor([0, 1, 64, 65, 195, 196, 203], dtype=torch.int32)
    raw = torch.randn(1, int(cu[-1]), *columns, generator=gen)
    raw[0, 70:80] = torch.tensor([-300.0, -40.0, -10.0, 0.0, 10.0, 40.0, 300.0, 1e4, -1e4, 0.5]).view(
        10, *(1,) * len(columns))
    raw = raw.to(dtype)
    a = torch.empty(columns[0]).uniform_(1, 16, generator=gen).view(-1, *(1,) * (len(columns) - 1)).expand(columns)
    dt = torch.empty(columns).uniform_(math.log(1e-3), math.log(0.1), generator=gen).exp()
    params, lower = torch.stack((a.log(), dt + torch.log(-torch.expm1(-dt)))), (-5.0 if form == "sigmoid" else None)
    sched = launch.Schedule.of(raw.cuda(), cu.cuda())
    gc = launch.launch_cumsum((64, {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype], form), raw.cuda(),
                              sched, lower, params.cuda())
    ref = reference.chunk_local_cumsum(apply_gate(raw.double(), form, *params.double(), lower), 64, cu)
    assert torch.isfinite(gc).all()
    torch.testing.assert_close(gc.double().cpu(), ref, rtol=5e-5, atol=1e-30)  # float32 exp of |args| ~ 100


@pytest.mark.parametrize("K", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_l2norm_kernel_against_float64(K, dtype):
    """use_qk_l2norm_in_kernel's kernel (kernels/hopper/l2norm.py), through the op's dispatch (tilela.ops._l2norm),
    per element against float64: rows of every scale, a zero row (y = 0), a row count no tile divides, a strided
    view (a q slice of a fused projection); within half an ulp of the output dtype plus float32's error."""
    from tilela.kernels import hopper
    from tilela.ops import _l2norm

    gen = torch.Generator().manual_seed(K)
    fused = torch.randn(2, 77, 3, 2 * K, generator=gen) * torch.logspace(-3, 3, 77).view(1, 77, 1, 1)
    fused[0, 5, 1] = 0
    x = fused.to(dtype).cuda()[..., :K]  # strided
    y = _l2norm(x)
    xd = x.double().cpu()
    ref = xd / torch.sqrt(xd.pow(2).sum(-1, keepdim=True) + 1e-6)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert torch.equal(y, hopper.l2_normalize(x, 1e-6))  # the op's dispatch takes the kernel
    half_ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11  # relative, at the bottom of a binade
    torch.testing.assert_close(y.double().cpu(), ref, rtol=half_ulp + 1e-6, atol=1e-7)
    assert not y[0, 5, 1].any()
