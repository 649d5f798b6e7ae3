"""The Hopper plan (kernels.hopper.plan, pure Python: no TileLang, no GPU): which stages and which state pass serve
a call, the DV block the cost model picks, the split, and the errors for options a pass cannot serve."""

import pytest

from tilela.kernels.hopper import plan as P
from tilela.kernels.hopper.plan import SegmentPlan, make_plan


@pytest.mark.parametrize("K,gate,delta,dtype,covered", [
    (128, "scalar", True, "bfloat16", True), (64, "none", False, "float16", True),
    (256, "scalar", True, "bfloat16", False), (128, "channel", False, "bfloat16", True),
    (128, "channel", True, "bfloat16", True), (128, "scalar", False, "float32", False),
])
def test_ws_covers(K, gate, delta, dtype, covered):
    assert P.ws_covers(dtype, K, K, gate, delta) is covered


@pytest.mark.parametrize("K,V,gate,delta,dtype,covered", [
    (256, 256, "scalar", True, "bfloat16", True), (128, 64, "none", False, "bfloat16", False),
    (256, 256, "channel", False, "float16", False), (128, 128, "channel", True, "bfloat16", True),
    (256, 256, "channel", True, "bfloat16", False),
    (64, 64, "none", True, "float32", False), (32, 32, "none", False, "bfloat16", False),
])
def test_pipeline_covers(K, V, gate, delta, dtype, covered):
    assert P.covers(dtype, K, V, gate, delta) is covered


@pytest.mark.parametrize("K,dtype,covered", [(128, "bfloat16", True), (64, "float16", True), (256, "bfloat16", False),
                                             (128, "float32", False)])
def test_kda_covered_as_gla(K, dtype, covered):
    assert P.covers(dtype, K, K, "channel", True) is covered
    assert P.covers(dtype, K, K, "channel", False) is covered


@pytest.mark.parametrize("K,V,grid,block", [(128, 128, 33, 32), (128, 128, 34, 64), (128, 128, 66, 64),
                                            (128, 128, 67, 128), (128, 128, 512, 128), (64, 64, 8, 32),
                                            (64, 64, 100, 64),
                                            (128, 256, 34, 128), (128, 256, 33, 64)])
def test_ws_block_follows_grid_size(K, V, grid, block):
    assert P.default_block_DV(K, V, grid, 132) == block


@pytest.mark.parametrize("grid,block", [(33, 64), (66, 128), (128, 128), (500, 128)])
def test_ws_block_without_output_group(grid, block):
    """The state pass alone (the split's transitions, V = 2K): K / 2 runs its chain 1.9x faster than K at a full GPU
    (2.2 against 4.2 us), so it wins while its twice the CTAs take fewer than 1.9x the waves of K."""
    assert P.default_block_DV(128, 256, grid, 132, store_output=False) == block


@pytest.mark.parametrize("K,grid,rule,block", [
    (128, 16, "delta", 16), (128, 17, "delta", 32), (128, 16, "gdn", 32),  # K / 8 measured for delta_rule alone
    (64, 8, "delta", 32),  # 16 columns only at K = 128
    (128, 33, "plain", 32), (128, 34, "plain", 64), (128, 66, "plain", 64), (128, 67, "plain", 32),
    (128, 100, "plain", 128), (128, 199, "plain", 32), (128, 199, "vd", 128),
])
def test_ws_block_by_update_rule(K, grid, rule, block):
    """Each update rule at its own chunk periods: the ungated delta rule takes K / 8 blocks up to one wave; the
    plain update from V ("plain") and through Vd ("vd") part where the waves of K / 4 blocks cost less than K's."""
    assert P.default_block_DV(K, K, grid, 132, rule=rule) == block


def _plan(**kw):
    args = dict(dtype="bfloat16", beta_dtype="float32", gate_dtype="float32", gate="scalar", delta=True, H=1, HV=1,
                K=128, V=128, lengths=[64], tokens=64, varlen=False, scale=1.0, initial_state=False,
                output_final_state=True, sms=132)
    return make_plan(**dict(args, **kw))


@pytest.mark.parametrize("lengths,H,HV,steps", [
    ([512], 2, 8, 1),  # 8 tiles x 2 heads: each pair of value heads in a CTA of its own
    ([1024] * 8, 2, 6, 1),  # 256 CTAs, under two per SM: three groups of one value head side by side
    ([2048], 16, 64, 2),  # 512 CTAs: a q/k head's two pairs in turn, K K^T formed once
    ([8192] * 4, 8, 24, 3),
    ([8192] * 4, 32, 32, 1),  # one value head per q/k head: one group either way
])
def test_kkt_runs_value_head_groups_side_by_side_on_small_grids(lengths, H, HV, steps):
    plan = _plan(H=H, HV=HV, lengths=lengths, tokens=sum(lengths), varlen=len(lengths) > 1)
    assert plan.kkt_steps == steps
    # the plan's key and groups are kkt_plan's (the public kkt_solve's launch takes its own from there too)
    assert P.kkt_plan(64, "blocked", "bfloat16", "scalar", H, HV, lengths, 132, ("float32", "log"),
                      scaled=True) == (plan.kkt, steps)
    assert _plan(H=H, HV=HV, lengths=lengths, tokens=sum(lengths), gate="channel").kkt_steps is None  # gla_factors


def test_gdn_plan_names_its_stages_once():
    plan = _plan(H=2, HV=8, lengths=[2048], tokens=2048)  # kkt_solve sums the gate: no cumsum stage
    # the warp-specialised pass takes Ab = A diag(beta) (scaled), the loop pass A
    assert plan.cumsum is None and plan.kkt == (64, "blocked", "bfloat16", "scalar", 2, ("float32", "log"), True)
    gc_in = _plan(H=2, HV=6, lengths=[2048], tokens=2048, g_input="cumsum")
    assert gc_in.cumsum is None and gc_in.kkt == (64, "blocked", "bfloat16", "scalar", 1, None, True)
    loop = _plan(H=2, HV=6, lengths=[2048], tokens=2048, kernel="loop")
    assert loop.passes[0].kernel == "loop" and loop.kkt == (64, "blocked", "bfloat16", "scalar", 1, ("float32", "log"),
                                                            False)
    simple_gla = _plan(H=2, HV=8, lengths=[2048], tokens=2048, delta=False, beta_dtype=None)
    assert simple_gla.cumsum == (64, "float32", "log") and simple_gla.kkt is None
    assert plan.factors is None and plan.split is None and plan.combine is None
    (cfg,) = plan.passes
    assert cfg.kernel == "ws" and cfg.args == (128, 128, 1.0, "scalar", True, "bfloat16", "float32", False, False,
                                               True, 32, True, False)


def test_gla_plan_sums_the_gate_in_its_factors():
    plan = _plan(gate="channel", delta=False, beta_dtype=None)
    assert plan.cumsum is None and plan.kkt is None and plan.factors == (128, "bfloat16", ("float32", "log"), False)
    assert _plan(gate="channel", delta=False, g_input="cumsum").factors == (128, "bfloat16", None, False)


def test_kda_plan_takes_the_warp_specialised_pass():
    """The per-channel delta rule: "auto" runs gla_factors with Kg and Ab, summing the raw gate in its tiles (no
    cumsum stage, no kkt_solve; the in-kernel gate's form too), then the warp-specialised pass at a DV block below
    K (shared memory); kernel="loop" the cumsum stage, kkt_solve from gc and the single-warp-group pass, which needs
    no factors."""
    loop = _plan(gate="channel", kernel="loop", gate_dtype="bfloat16", gate_form="sigmoid")
    assert loop.passes[0].kernel == "loop" and loop.factors is None
    assert loop.cumsum == (64, "bfloat16", "sigmoid") and loop.kkt == (64, "blocked", "bfloat16", "channel", 1, None,
                                                                        False)
    assert _plan(gate="channel") == _plan(gate="channel", kernel="ws")
    plan = _plan(gate="channel")
    assert plan.cumsum is None and plan.kkt is None
    assert plan.factors == (128, "bfloat16", ("float32", "log"), True) and plan.output.kernel == "ws"
    bounded = _plan(gate="channel", gate_dtype="bfloat16", gate_form="sigmoid")
    assert bounded.kkt is None and bounded.factors[2] == ("bfloat16", "sigmoid") and bounded.cumsum is None
    cumsum_in = _plan(gate="channel", g_input="cumsum")
    assert cumsum_in.kkt is None and cumsum_in.factors[2] is None
    with pytest.raises(ValueError, match="gate_form"):
        _plan(gate="channel", g_input="cumsum", gate_form="sigmoid")
    assert plan.output.block_DV in P.dv_blocks(128, "channel", True) == (64, 32, 16)
    with pytest.raises(ValueError, match="block_DV"):
        _plan(gate="channel", kernel="ws", block_DV=128)


def test_k256_takes_the_loop_pass():
    (cfg,) = _plan(K=256, V=256).passes
    assert cfg.kernel == "loop" and cfg.tiles == (32, 128, 1, 64)


@pytest.mark.parametrize("form,gate_dtype", [("sigmoid", "bfloat16"), ("log", "float32")])
def test_kda_short_chunk_path_runs_every_stage_at_16(form, gate_dtype):
    """chunk=16: the cumsum (forming the gate), kkt_solve's Neumann inverse and the loop pass at 16, no gla_factors,
    and no split or token-range pipeline even where the chunk-64 plan takes them."""
    long = dict(gate="channel", gate_dtype=gate_dtype, gate_form=form, H=4, HV=4, lengths=[65536], tokens=65536)
    assert _plan(**long).split is not None
    plan = _plan(**long, chunk=16, graph=True)
    assert plan.cumsum == (16, gate_dtype, form) and plan.kkt == (16, "neumann", "bfloat16", "channel", 1, None,
                                                                  False)
    assert plan.factors is None and plan.split is None and plan.pipeline is None and plan.combine is None
    (cfg,) = plan.passes
    assert cfg.kernel == "loop" and cfg.tiles == (32, 64, 2, 16) and cfg.gate == "channel" and cfg.delta


@pytest.mark.parametrize("options", [dict(chunk=32), dict(chunk=16, kernel="ws"), dict(chunk=16, gate="scalar"),
                                     dict(chunk=16, gate="channel", delta=False, beta_dtype=None)])
def test_short_chunk_path_is_kdas_on_the_loop_pass(options):
    with pytest.raises(ValueError, match="chunk"):
        _plan(**dict(dict(gate="channel"), **options))


def test_split_plan_has_transitions_then_outputs():
    delta = _plan(H=2, HV=8, lengths=[32768], tokens=32768, initial_state=True)
    transitions, outputs = delta.passes
    assert delta.split.segment_chunks == 32 and delta.combine == (128, 128, "matrix", True, True)
    assert (transitions.V, transitions.store_output, transitions.use_initial_state) == (256, False, False)
    assert (outputs.V, outputs.store_output, outputs.is_varlen, outputs.store_final_state) == (128, True, True, True)
    assert transitions.warmup and outputs.warmup  # GDN's split: both passes read the warm-up table
    plain = _plan(gate="none", delta=False, HV=16, H=16, lengths=[8192], tokens=8192, output_final_state=False)
    transitions, outputs = plain.passes
    assert plain.combine == (128, 128, "none", False, False) and transitions.V == 128 and not outputs.store_final_state
    assert not transitions.warmup and not outputs.warmup
    ungated = _plan(gate="none", HV=4, H=4, lengths=[30000], tokens=30000)
    assert ungated.split is not None and not ungated.output.warmup  # delta_rule: no decay to bound a warm-up


def test_launch_order_puts_the_longest_sequences_first():
    """Longest first, ties in batch order; none where the batch order already is, or every CTA fits one wave."""
    assert P.launch_order([128, 16384, 64, 128, 16384], ctas=64, sms=132) == (1, 4, 0, 3, 2)
    assert P.launch_order([16384, 128, 128], ctas=64, sms=132) is None
    assert P.launch_order([128, 16384], ctas=64, sms=132) is None
    skewed = _plan(H=4, HV=16, lengths=(128,) * 63 + (16384,), tokens=63 * 128 + 16384, varlen=True, split=None)
    assert skewed.order == (63, *range(63))
    assert _plan(H=4, HV=16, lengths=(16384,) + (128,) * 63, tokens=63 * 128 + 16384, varlen=True,
                 split=None).order is None
    split = _plan(H=2, HV=4, lengths=(190, 1, 10000), tokens=10191, varlen=True)
    assert split.split is not None and split.order is None  # the segment table orders the split's passes


def test_unknown_kernel_is_rejected():
    with pytest.raises(ValueError, match="kernel: expected 'auto', 'ws' or 'loop', got 'fast'"):
        _plan(kernel="fast")


def test_ws_outside_its_coverage_is_rejected():
    with pytest.raises(ValueError, match="K=256"):
        _plan(K=256, V=256, kernel="ws")


def test_sequence_split_needs_the_ws_pass():
    with pytest.raises(ValueError, match="split: the sequence split runs on the warp-specialised pass"):
        _plan(K=256, V=256, split=SegmentPlan.of([64], 1))
    with pytest.raises(ValueError, match="split: the sequence split runs on the warp-specialised pass"):
        _plan(kernel="loop", split=SegmentPlan.of([64], 1))


def test_sequence_split_takes_no_per_channel_gate_without_the_delta_rule():
    with pytest.raises(ValueError, match="split: the sequence split takes no per-channel gate without the delta"):
        _plan(gate="channel", delta=False, beta_dtype=None, split=SegmentPlan.of([64], 1))
    assert _plan(gate="channel", delta=False, beta_dtype=None, lengths=[65536], tokens=65536).split is None


def test_kda_splits_long_sequences_on_few_heads():
    """KDA (the per-channel delta rule): the split where the model says it pays (a tensor-parallel shard of 4 value
    heads at 65536 tokens, not 16 heads): gla_factors as unsplit, transitions on [V | 0] at one of KDA's DV blocks,
    the delta rule's combine, no warm-up (a per-channel decay bounds no warm-up: its calmest channel decides)."""
    kda = dict(gate="channel", gate_dtype="bfloat16", gate_form="softplus", lengths=[65536], tokens=65536)
    plan = _plan(H=4, HV=4, **kda)
    transitions, outputs = plan.passes
    assert plan.split is not None and plan.factors == (128, "bfloat16", ("bfloat16", "softplus"), True)
    assert plan.kkt is None and plan.cumsum is None and plan.combine == (128, 128, "matrix", False, False)
    assert (transitions.V, transitions.store_output, transitions.warmup) == (256, False, False)
    assert transitions.block_DV in P.dv_blocks(128, "channel", True) and outputs.block_DV in (64, 32, 16)
    assert _plan(H=16, HV=16, **kda).split is None
    assert not P.warms("channel", True) and P.splits("channel", True)


def test_split_must_be_of_the_call_lengths():
    with pytest.raises(ValueError, match="split: a SegmentPlan of the call's lengths"):
        _plan(split=SegmentPlan.of([128], 1))


def test_unknown_g_input_is_rejected():
    with pytest.raises(ValueError, match="g_input: expected 'raw' or 'cumsum', got 'gc'"):
        _plan(g_input="gc")


@pytest.mark.parametrize("kwargs", [dict(block_DV=8), dict(block_DV=64, kernel="loop"),
                                    dict(block_DV=128, split=SegmentPlan.of([64], 1))])
def test_block_DV_is_for_the_unsplit_ws_pass(kwargs):
    with pytest.raises(ValueError, match=r"block_DV: the unsplit warp-specialised pass takes one of "
                                         r"\(128, 64, 32, 16\)"):
        _plan(**kwargs)


def test_state_alone_is_for_the_ws_pass():
    (cfg,) = _plan(outputs=False).passes
    assert cfg.store_output is False
    with pytest.raises(ValueError, match="outputs=False: the warp-specialised pass alone"):
        _plan(outputs=False, kernel="loop")


@pytest.mark.parametrize("gate,delta,rule", [("scalar", True, "gdn"), ("none", True, "delta"),
                                             ("scalar", False, "vd"), ("none", False, "plain"),
                                             ("channel", False, "plain")])
def test_update_rule_keys_the_chunk_periods(gate, delta, rule):
    """The plain update without a scalar gate adds K^T V from the input slots (no Vd): its own periods."""
    assert P.update_rule(gate, delta) == rule




def test_kda_pipelines_one_long_sequence_on_few_heads():
    """KDA's token-range pipeline where the model says it pays, in a CUDA graph's capture: one long sequence whose
    pass leaves SMs to gla_factors (8 value heads at K / 8 blocks: 64 CTAs); not eagerly, not 32 heads (the pass
    fills the GPU), not a batch of sequences, not 2048 tokens (the ranges' own costs). Its passes are dense, the first
    range's from the call's initial state, the others' from the state handed over, every range storing its final
    state; both are shipped configurations."""
    from tilela.precompile import jobs

    kda = dict(gate="channel", gate_dtype="bfloat16", gate_form="sigmoid", H=8, HV=8, initial_state=False, graph=True)
    plan = _plan(lengths=[32768], tokens=32768, **kda)
    bounds = plan.pipeline
    assert plan.split is None and bounds[0] == 0 and bounds[-1] == 32768
    assert all(b % 64 == 0 for b in bounds[1:-1]) and list(bounds) == sorted(set(bounds)) and len(bounds) >= 3
    first, rest = plan.passes
    assert (first.is_varlen, first.use_initial_state, first.store_final_state) == (False, False, True)
    assert (rest.is_varlen, rest.use_initial_state, rest.store_final_state) == (False, True, True)
    shipped = {job.config for job in jobs() if job.kind == "ws"}
    for cfg in plan.passes:
        flags = (cfg.is_varlen, cfg.use_initial_state, cfg.store_final_state)
        assert (128, 128, "channel", True, "bfloat16", "float32", flags, *cfg.tiles) in shipped
    long = dict(lengths=[32768], tokens=32768)
    assert _plan(**long, **dict(kda, graph=False)).pipeline is None
    assert _plan(**long, **dict(kda, H=32, HV=32)).pipeline is None
    assert _plan(lengths=[16384, 16384], tokens=32768, varlen=True, **kda).pipeline is None
    assert _plan(lengths=[2048], tokens=2048, **kda).pipeline is None
    assert _plan(**long, pipeline=None, **kda).pipeline is None
    assert _plan(**long, gate="scalar", H=8, HV=8, graph=True).pipeline is None  # no gla_factors


def test_pipeline_model_waits_for_the_factors_on_the_free_sms():
    """pipeline_us: the first range's factors on the whole GPU in waves of FACTORS_PER_SM CTAs an SM, each started
    wave paid whole; then each pass after its range's factors, which run on the SMs the pass leaves at
    FACTORS_BESIDE_PASS of their speed; each range past the first costs PIPELINE_RANGE_US."""
    extra, beside = P.PIPELINE_RANGE_US, P.FACTORS_BESIDE_PASS
    assert P.factors_us(7, 2, 10.0, 3) == 20.0 and P.factors_us(6, 2, 10.0, 3) == 10.0
    # 2 heads x 4 chunks on 4 SMs of 1 CTA: 2 waves; the second range's 8 CTAs on 2 free SMs (1.6 at 0.8): 5 waves
    assert P.pipeline_us([4, 4], 2, 4, 2, 1.0, 1, 0.5) == pytest.approx(2 + 5 + 2 + extra)
    assert 8 / (2 * beside) > 4  # (the 5 waves above)
    # a slow pass: the factors are ready before it needs them
    assert P.pipeline_us([4, 4], 2, 4, 2, 1.0, 1, 10.0) == pytest.approx(2 + 40 + 40 + extra)
    assert P.pipeline_bounds(128, 32, 3, 8150) == (0, 2048, 4096, 6144, 8150)


def test_pipeline_model_picks_the_measured_cuts():
    """The refitted model's choices on the layouts it was fitted to (benchmarks/NOTES.md, "The token-range pipeline
    refitted"): 8 value heads, one sequence of 8192 tokens (softplus: three quarters, then the rest; sigmoid: two
    thirds) and of 32768 (softplus: half, then two quarters; sigmoid: a third, then two thirds); none over 32 heads
    at the pass's own DV block (its 256 CTAs fill the GPU), though the model takes one at DV 64 where asked."""
    cut = lambda T, form, heads=8, block=16: P.auto_pipeline([T], heads, 132, 128, "bfloat16", form, block)  # noqa
    assert cut(8192, "softplus") == (0, 6144, 8192)
    assert cut(8192, "sigmoid") == (0, 5440, 8192)
    assert cut(32768, "softplus") == (0, 16384, 24576, 32768)
    assert cut(32768, "sigmoid") == (0, 10944, 21824, 32768)
    assert cut(8192, "softplus", heads=32) is None and cut(8192, "softplus", heads=32, block=64) is not None
    assert cut(2048, "sigmoid") is None


@pytest.mark.parametrize("pipeline,match", [
    ((0, 4000, 8192), "inner ones multiples of 64"), ((0, 4096), "from 0 to the sequence's 8192 tokens"),
    ((0, 4096, 4096, 8192), "increasing"), ((0, 8192, 0), "increasing")])
def test_given_pipeline_is_checked(pipeline, match):
    kda = dict(gate="channel", gate_dtype="bfloat16", H=8, HV=8, lengths=[8192], tokens=8192)
    with pytest.raises(ValueError, match=f"pipeline: .*{match}"):
        _plan(pipeline=pipeline, **kda)


def test_pipeline_needs_gla_factors_and_one_sequence():
    with pytest.raises(ValueError, match="pipeline: the token-range pipeline runs gla_factors' plans"):
        _plan(pipeline=(0, 64, 128), lengths=[128], tokens=128)
    with pytest.raises(ValueError, match="got 2 sequences"):
        _plan(pipeline=(0, 64, 128), gate="channel", gate_dtype="bfloat16", lengths=[64, 64], tokens=128,
              varlen=True)


def test_fold_takes_the_unsplit_pass_at_dv_128():
    """fold: GDN's pass at DV block 128 with the output folded into its chain groups (a fourth tile, True), unsplit
    where the split would cut (one long sequence on few heads), kkt_solve before it as in the shipped plan."""
    long = dict(H=2, HV=8, lengths=[32768], tokens=32768)
    assert _plan(**long).split is not None
    plan = _plan(**long, fold=True)
    (cfg,) = plan.passes
    assert plan.split is None and cfg.tiles == (128, True, False, True) and cfg.block_DV == 128
    assert cfg.args[-4:] == (128, True, False, True) and plan.kkt == _plan(**long).kkt


@pytest.mark.parametrize("H,HV,lengths,folded", [
    (16, 64, [8192] * 4, True),  # a full GPU at DV 128, four value heads a q/k head
    (4, 16, [1024] * 8, True),
    (32, 32, [8192] * 4, False),  # one value head a q/k head: the output group apart measured faster
    (16, 64, [8192], False),  # one sequence: DV 64
    (2, 8, [32768], False),  # split
])
def test_fold_by_default_where_q_k_heads_are_shared_at_dv_128(H, HV, lengths, folded):
    """fold None (the default): the output folded into the chain groups where the unsplit pass runs at DV block 128
    and HV > H; fold=False never."""
    call = dict(H=H, HV=HV, lengths=lengths, tokens=sum(lengths), varlen=len(lengths) > 1)
    cfg = _plan(**call).passes[-1]
    assert cfg.folded == folded and cfg.tiles[3:] == (True,) * folded
    assert not _plan(**call, fold=False).passes[-1].folded
    if folded:
        assert _plan(**call, fold=True) == _plan(**call)


@pytest.mark.parametrize("kwargs", [dict(gate="none"), dict(kernel="loop"), dict(block_DV=64),
                                    dict(outputs=False), dict(split=SegmentPlan.of([64], 1)), dict(K=64, V=64)])
def test_fold_is_for_gdns_unsplit_pass_at_dv_128(kwargs):
    with pytest.raises(ValueError, match="fold: the output folds into the chain groups of GDN's unsplit"):
        _plan(**kwargs, fold=True)
