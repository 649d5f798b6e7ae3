"""The sequence split's host side (kernels.hopper.seq_split) on the CPU: segment tables, and split_forward with a
float64 stand-in for the state pass (reference layer B over the segments) and the plain update's combine
(reference.entering_states) against the unsplit reference, so the transitions ([V | 0] value, [0 | I] state with the
delta rule; V from a zero state without), the combines over segments and the final states are checked without a
GPU. The TileLang state pass and combine it drives on the GPU are compile-tested in test_compile_chunk_fwd.py and
test_compile.py; tests/test_gpu_ops.py checks the combine kernel against reference.entering_states."""

from itertools import accumulate

import pytest
import torch
import torch.nn.functional as F

from tilela import reference
from tilela.kernels.hopper.plan import (CHUNK_US, COMBINE_STEP_MS, SPLIT_FIXED_MS,
                                        SegmentPlan, auto_split, modelled_ms)
from tilela.kernels.hopper.seq_split import host_table, segment_table, split_forward

F64 = torch.float64


def test_segment_table_cuts_each_sequence_at_chunk_multiples():
    lengths = [300, 1, 0, 130, 64]
    plan = SegmentPlan.of(lengths, 2)  # 128-token segments
    assert (plan.segment_chunks, plan.num_segments, plan.max_per_sequence) == (2, 8, 3)
    expected = ([0, 128, 256, 300, 301, 301, 429, 431, 495],
                [0, 3, 4, 5, 7, 8],  # each sequence's first segment (and the count at the end)
                [2, 3, 4, 6, 7],  # each sequence's last segment
                [0, 1, 5, 7, 2, 6, 3, 4],  # longest first: 128 tokens (in segment order), 64, 44, 2, 1, 0
                [0, 3],  # the sequences cut into more than one segment
                [1, 2, 4], [3, 4, 7])  # the others, and their segments
    assert host_table(plan) == expected
    table = segment_table(plan, torch.device("cpu"))
    assert [t.tolist() for t in table] == list(expected)
    assert all(t.dtype == torch.int32 for t in table)


def test_segment_table_views_a_cached_table_once(monkeypatch):
    """On a GPU host_tables hands back one cached tensor per plan: its views are made once and found again (by the
    tensor's identity: its == is elementwise), a new tensor gets its own, and only the VIEWS_KEPT latest are kept."""
    from tilela.kernels.hopper import seq_split

    plan = SegmentPlan.of([300, 1, 0, 130, 64], 2)
    cached = torch.tensor(seq_split._flat_table(plan), dtype=torch.int32)
    monkeypatch.setattr(seq_split, "_VIEWS", {})
    monkeypatch.setattr(seq_split, "device_table", lambda host, key, device: cached)
    first = segment_table(plan, torch.device("cpu"))
    assert segment_table(plan, torch.device("cpu")) is first
    monkeypatch.setattr(seq_split, "device_table", lambda host, key, device: cached.clone())
    other = segment_table(plan, torch.device("cpu"))
    assert other is not first and [t.tolist() for t in other] == [t.tolist() for t in first]
    for _ in range(seq_split.VIEWS_KEPT):
        segment_table(plan, torch.device("cpu"))
    assert len(seq_split._VIEWS) == seq_split.VIEWS_KEPT and id(cached) not in seq_split._VIEWS


def test_segment_plan_rejects_empty_segments():
    with pytest.raises(ValueError, match="segment_chunks: expected >= 1, got 0"):
        SegmentPlan.of([100], 0)


@pytest.mark.parametrize("lengths,heads,gate,delta,segment_chunks", [
    ([32768], 8, "scalar", True, 32),  # GDN: 16 segments, both gate regimes 0.32 (geometric mean) against 0.95 ms
    ([32768], 16, "scalar", True, 64),  # under the warm-up the decaying heads skip the transitions
    ([32768], 32, "scalar", True, 64),  # a quarter of the heads through the transitions: 0.77 against 0.95 ms
    ([8192], 8, "scalar", True, 16),
    ([32768], 16, "scalar", False, 64),  # the plain update's transitions are cheaper: V alone
    ([8192], 16, "none", False, 32),  # ladder level 1: split at 16 heads (K / 2 blocks), not at 32
    ([8192], 16, "scalar", False, 16),  # level 2: K blocks (its Vd writers make K / 2 dearer)
    ([8192], 32, "scalar", False, None),
    ([32768], 16, "none", False, 128),
    ([10000, 1, 190], 4, "scalar", True, 20),  # the layouts the GPU tests split (tests/test_gpu_ops.py)
    ([10000, 1, 190], 4, "scalar", False, 10),  # the sequence cut into 16 segments
    ([30000, 1, 190], 4, "none", True, 30),
    ([10000, 1, 190], 4, "none", True, None),  # delta_rule: K / 8 blocks fill the GPU unsplit
    ([32768], 16, "none", True, None),
    ([8192], 4, "scalar", True, 16),
    ([2048], 8, "scalar", True, None),
    ([28672, 4096], 8, "scalar", True, 32),
    ([16384] + [128] * 63, 16, "scalar", True, 43),  # the warm-up split moves no state: 0.36 against 0.48 ms
    ([16384] + [128] * 63, 32, "scalar", True, None),  # the long chain first; twice the heads fill the GPU
    ([1024] * 8, 8, "scalar", True, None),
])
def test_auto_split_splits_only_long_sequences_on_small_grids(lengths, heads, gate, delta, segment_chunks):
    plan = auto_split(lengths, heads, 132, 128, gate, delta)
    assert (plan and plan.segment_chunks) == segment_chunks
    if plan is not None:
        assert plan == SegmentPlan.of(lengths, segment_chunks)


def test_modelled_split_time_adds_both_passes_and_the_combine():
    plan = SegmentPlan.of([32768], 64)
    # transitions (state alone, V = 2K): the faster of 64 sequence-heads x 4 DV blocks of K / 2 (two waves of 132
    # SMs) and 128 CTAs of K (one wave); outputs: 128 CTAs of K / 2, one wave
    transitions = min(2 * 64 * CHUNK_US[("gdn", 2, False)], 64 * CHUNK_US[("gdn", 1, False)])
    # the combine: 7 steps of 8 small products (the per-step cost)
    expected = ((transitions + 64 * CHUNK_US[("gdn", 2, True)]) * 1e-3 + SPLIT_FIXED_MS[True]
                + 7 * COMBINE_STEP_MS[True])
    assert modelled_ms([32768], 8, 132, plan) == pytest.approx(expected)
    # unsplit: 32 CTAs of K / 4
    assert modelled_ms([32768], 8, 132, None) == pytest.approx(512 * CHUNK_US[("gdn", 4, True)] * 1e-3)


@pytest.mark.parametrize("gate,rule", [("scalar", "vd"), ("none", "plain")])
def test_modelled_split_without_delta_rule_runs_transitions_on_V_alone(gate, rule):
    plan = SegmentPlan.of([32768], 64)
    # transitions: 64 sequence-heads x 2 DV blocks of K / 2 (one wave), outputs likewise, at the periods of the
    # plain update (through Vd with a scalar gate, straight from V without) and its split costs
    expected = (64 * (CHUNK_US[(rule, 2, False)] + CHUNK_US[(rule, 2, True)]) * 1e-3 + SPLIT_FIXED_MS[False]
                + 7 * COMBINE_STEP_MS[False])
    assert modelled_ms([32768], 8, 132, plan, gate=gate, delta=False) == pytest.approx(expected)


def test_entering_states_decay_by_the_gate_summed_over_each_segment():
    """reference.entering_states (the combine kernel's stage) against a direct sum of the raw gate per segment."""
    lengths = [300, 1, 0, 130]
    plan = SegmentPlan.of(lengths, 2)
    table = segment_table(plan, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    g = F.logsigmoid(torch.randn(1, sum(lengths), 3, generator=gen, dtype=F64))
    cu = torch.tensor([0, *accumulate(lengths)])
    B = torch.randn(plan.num_segments, 3, 4, 5, generator=gen, dtype=F64)
    h0 = torch.randn(len(lengths), 3, 4, 5, generator=gen, dtype=F64)
    S_in, final = reference.entering_states(B, reference.chunk_local_cumsum(g, 64, cu), table.cu_segments,
                                            table.first, h0)
    bounds, first = table.cu_segments.tolist(), table.first.tolist()
    for n in range(len(lengths)):
        S = h0[n]
        for j in range(first[n], first[n + 1]):
            torch.testing.assert_close(S_in[j], S)
            S = g[0, bounds[j] : bounds[j + 1]].sum(0).exp()[:, None, None] * S + B[j]
        torch.testing.assert_close(final[n], S)


def _problem(gate, delta, lengths, B=1, T=None, H=1, G=2, K=8, V=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = T or sum(lengths)
    N = B if lengths is None else len(lengths)
    HV = H * G
    g = None
    if gate == "channel":  # KDA's: a head without decay, a head with half its channels calm
        g = F.logsigmoid(torch.randn(B, T, HV, K, generator=gen, dtype=F64))
        g[:, :, 0] = 0.0
        g[:, :, 1, : K // 2] = 0.0
    elif gate:
        g = F.logsigmoid(torch.randn(B, T, HV, generator=gen, dtype=F64))
        g[:, :, 0] = 0.0  # a head without decay: its transition M never fades
    return dict(
        q=torch.randn(B, T, H, K, generator=gen, dtype=F64),
        k=F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=F64), dim=-1),
        v=torch.randn(B, T, HV, V, generator=gen, dtype=F64),
        g=g,
        beta=torch.rand(B, T, HV, generator=gen, dtype=F64) if delta else None,
        initial_state=torch.randn(N, HV, K, V, generator=gen, dtype=F64),
        cu_seqlens=None if lengths is None else torch.tensor([0, *accumulate(lengths)]),
    )


def _extending(state_pass):
    """The delta rule's transitions as split_forward calls them: h0 None, the pass forms the value [v | 0] and the
    entering state [0 | I] itself (chunk_fwd_ws.py at V = 2K)."""
    def transitions(q, k, v, g_cumsum, beta, A, h0, cu_seqlens, order, *warm):
        assert h0 is None
        K, V = k.shape[-1], v.shape[-1]
        h_ext = torch.zeros(cu_seqlens.numel() - 1, v.shape[2], K, V + K, dtype=F64)
        h_ext[..., V:].diagonal(dim1=-2, dim2=-1).fill_(1.0)
        return state_pass(q, k, torch.cat([v, v.new_zeros(*v.shape[:-1], K)], -1), g_cumsum, beta, A, h_ext,
                          cu_seqlens, order)
    return transitions


def _warming(transitions, tables=None):
    """The transitions under the warm-up as split_forward calls them: the warm-up table (reference.warmup_table, kept
    in tables where given) and [B | M] of the transitions' pass, NaN at the (segment, head)s the warm-up takes, so
    that reading one would show."""
    def warming(q, k, v, g_cumsum, beta, A, h0, cu_seqlens, order, first, max_chunks, initial):
        warm = reference.warmup_table(g_cumsum, cu_seqlens, first, max_chunks, initial)
        if tables is not None:
            tables.append(warm)
        _, BM = transitions(q, k, v, g_cumsum, beta, A, h0, cu_seqlens, order)
        BM[warm[0] >= 0] = float("nan")
        return warm, BM
    return warming


def _delta_combine(BM, table, h0, warm):
    """The delta rule's combine as split_forward calls it, on its float64 stage."""
    return reference.transition_entering_states(BM, table.first, h0, warm)


def _stand_in(g_raw, scale):
    """A float64 state pass with the contract split_forward drives (varlen layout): reference layer B over the
    segments, from the raw gate (segments start at chunk boundaries, so its chunk-local cumsum is the one given)."""
    def state_pass(q, k, v, g_cumsum, beta, A, h0, cu_seqlens, order):
        g1 = None if g_raw is None else g_raw.reshape(1, -1, *g_raw.shape[2:])
        return reference.chunked(q, k, v, g=g1, beta=beta, scale=scale, initial_state=h0,
                                 cu_seqlens=cu_seqlens.long())
    return state_pass


@pytest.mark.parametrize("segment_chunks", [1, 2, 3])
@pytest.mark.parametrize("gate,delta", [(True, True), ("channel", True), (False, True), (True, False), (False, False)],
                         ids=["gdn", "kda", "delta_rule", "simple_gla", "linear_attn"])
@pytest.mark.parametrize("layout", ["varlen", "dense", "single"])
def test_split_forward_matches_unsplit(gate, delta, segment_chunks, layout):
    """layout: varlen, a dense batch of two, one sequence (its last segment's state is the final one, no gather)."""
    lengths = [300, 1, 0, 130, 64] if layout == "varlen" else None
    p = _problem(gate, delta, lengths, B=1 if lengths or layout == "single" else 2, T=None if lengths else 200)
    o_ref, S_ref = reference.chunked(**p)
    B, T = p["v"].shape[:2]
    plan = SegmentPlan.of(lengths or [T] * B, segment_chunks)
    gc = None if p["g"] is None else reference.chunk_local_cumsum(p["g"], 64, p["cu_seqlens"])
    for h0 in (p["initial_state"], None):
        # the delta rule is told by A; the stand-in forms its own A from beta, so any [B, T, HV, 64] tensor will do
        A = None if p["beta"] is None else torch.zeros(*p["v"].shape[:3], 64, dtype=F64)
        state_pass = _stand_in(p["g"], 8 ** -0.5)
        transitions = _extending(state_pass) if delta else state_pass
        combine = _delta_combine if delta else reference.entering_states
        o, S = split_forward(transitions, state_pass, combine, p["q"], p["k"], p["v"], gc, p["beta"], A, h0, True,
                             plan)
        if h0 is None:
            o_ref, S_ref = reference.chunked(**dict(p, initial_state=None))
        torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=1e-9)
        torch.testing.assert_close(S.double(), S_ref, rtol=0, atol=1e-9)


def test_warmup_table_takes_the_fewest_chunks_that_bound_the_past():
    """reference.warmup_table (the stage the warm-up's transitions form) on heads decaying by -20, -10, -6 and 0 per
    chunk, two-chunk segments: one chunk of warm-up, two, none within max_chunks (the sequence's initial state where
    it is at most two chunks back, else the transitions for the whole (sequence, head)), none at all."""
    lengths = [640, 1, 300]
    plan = SegmentPlan.of(lengths, 2)  # segments 0-4, 5, 6-8
    table = segment_table(plan, torch.device("cpu"))
    per_token = torch.tensor([-20.0, -10.0, -6.0, 0.0]) / 64
    g = per_token.expand(1, sum(lengths), 4).clone()
    gc = reference.chunk_local_cumsum(g, 64, torch.tensor([0, *accumulate(lengths)])).float()
    warm = reference.warmup_table(gc, table.cu_segments, table.first, max_chunks=2, initial=True)
    assert warm[0].T.tolist() == [[0, 1, 1, 1, 1, 0, 0, 1, 1],
                                  [0, 2, 2, 2, 2, 0, 0, 2, 2],
                                  [-1, -1, -1, -1, 0, 0, -1, -1, 0],  # a sequence's last transition is never read
                                  [-1, -1, -1, -1, 0, 0, -1, -1, 0]]
    # a sequence's start is its initial state, h0[n] (initial_row(n) = -2 - n); the transitions' heads enter every
    # segment of a split sequence from its row of the entering states
    assert warm[1].T.tolist() == [[-2, -1, -1, -1, -1, -3, -4, -1, -1],
                                  [-2, -1, -1, -1, -1, -3, -4, -1, -1],
                                  [0, 1, 2, 3, 4, -3, 6, 7, 8],
                                  [0, 1, 2, 3, 4, -3, 6, 7, 8]]
    assert [reference.initial_row(n) for n in range(3)] == [-2, -3, -4]
    # each sequence's final state: its last segment's; the others' go to one row past the three sequences'
    assert warm[2].T.tolist() == [[3, 3, 3, 3, 0, 1, 3, 3, 2]] * 4
    without = reference.warmup_table(gc, table.cu_segments, table.first, max_chunks=2, initial=False)
    assert without[1].T.tolist()[0] == [-1, -1, -1, -1, -1, -1, -1, -1, -1]  # zero states instead
    assert torch.equal(without[0], warm[0]) and torch.equal(without[2], warm[2])
    # within reach of the sequence start, a head too weak to bound the warm-up enters from the initial state
    short = reference.warmup_table(gc[:, :640], table.cu_segments[:3], torch.tensor([0, 2]), max_chunks=2,
                                   initial=True)
    assert short[:, :, 2].tolist() == [[0, 2], [-2, -2], [1, 0]]


@pytest.mark.parametrize("segment_chunks", [1, 2, 3])
def test_split_forward_with_warmup_matches_unsplit(segment_chunks):
    """GDN's split under the warm-up with float64 stand-ins: the transitions' pass (whose (segment, head)s the warm-up
    takes are set to NaN, so reading one would show) and reference.warmup_outputs, on heads decaying fast (one chunk
    of warm-up), moderately (two) and not at all (the transitions). Equal to the unsplit reference up to the past
    the warm-up drops, e^-17 of the state."""
    lengths = [700, 1, 0, 130, 64]
    p = _problem(True, True, lengths, G=3)
    gen = torch.Generator().manual_seed(1)
    p["g"][..., 1] = F.logsigmoid(torch.randn(1, sum(lengths), generator=gen, dtype=F64) - 1)  # ~ -1.3 a token
    p["g"][..., 2] = -10.0 / 64  # -10 a chunk
    plan = SegmentPlan.of(lengths, segment_chunks)
    gc = reference.chunk_local_cumsum(p["g"], 64, p["cu_seqlens"])
    A = torch.zeros(*p["v"].shape[:3], 64, dtype=F64)
    scale = 8 ** -0.5
    tables = []
    transitions = _warming(_extending(_stand_in(p["g"], scale)), tables)

    def outputs(q, k, v, g_cumsum, beta, A, S_in, cu, order, warm, h0):
        return reference.warmup_outputs(q, k, v, p["g"].reshape(1, -1, 3), beta, scale, S_in, cu, warm, h0,
                                        len(lengths))

    for h0 in (p["initial_state"], None):
        o_ref, S_ref = reference.chunked(**dict(p, initial_state=h0), scale=scale)
        o, S = split_forward(transitions, outputs, _delta_combine, p["q"], p["k"], p["v"], gc,
                             p["beta"], A, h0, True, plan, warmup=True)
        torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(S, S_ref, rtol=0, atol=1e-6)
    warm = tables[0]  # every path taken: warm-ups from a zero state and from the initial state, the transitions
    assert ((warm[0] >= 1) & (warm[1] == -1)).any() and (warm[0] == -1).any() and (warm[1] <= -2).any()


def test_split_with_warmup_does_not_depend_on_the_head_sharding():
    """Tensor-parallel shards hold some of the value heads, and their plans may cut the sequences differently: the
    warm-up table of a head depends on that head's gate alone, so the heads of a shard split as they do in the
    whole call, and a different segment size changes them by the dropped past only (e^-17 of the state)."""
    lengths = [700, 1, 130]
    p = _problem(True, True, lengths, G=4)  # H = 1, HV = 4: head 0 without decay, the others decaying
    scale = 8 ** -0.5
    gc = reference.chunk_local_cumsum(p["g"], 64, p["cu_seqlens"])
    A = torch.zeros(*p["v"].shape[:3], 64, dtype=F64)

    def run(heads, segment_chunks):
        x = {name: p[name][:, :, heads] for name in ("v", "g", "beta")}  # q and k: one head, shared by all
        x.update(q=p["q"], k=p["k"])
        h0 = p["initial_state"][:, heads]
        g_raw = x["g"].reshape(1, -1, len(heads))

        def outputs(q, k, v, g_cumsum, beta, A, S_in, cu, order, warm, h0):
            return reference.warmup_outputs(q, k, v, g_raw, beta, scale, S_in, cu, warm, h0, len(lengths))

        return split_forward(_warming(_extending(_stand_in(x["g"], scale))), outputs, _delta_combine,
                             x["q"], x["k"], x["v"],
                             gc[:, :, heads], x["beta"], A[:, :, heads], h0, True,
                             SegmentPlan.of(lengths, segment_chunks), warmup=True)

    o, S = run([0, 1, 2, 3], 2)
    for shard in ([0, 1], [2, 3]):
        o_shard, S_shard = run(shard, 2)
        torch.testing.assert_close(o_shard, o[:, :, shard], rtol=0, atol=0)
        torch.testing.assert_close(S_shard, S[:, shard], rtol=0, atol=0)
        o_other, S_other = run(shard, 3)  # a shard's plan may cut the sequences into other segments
        torch.testing.assert_close(o_other, o[:, :, shard], rtol=0, atol=1e-6)
        torch.testing.assert_close(S_other, S[:, shard], rtol=0, atol=1e-6)
