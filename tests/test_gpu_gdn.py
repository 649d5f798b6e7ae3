"""GDN state/output kernels (scalar gate + delta rule) on a Hopper GPU against the float64 reference stack
(layer B, reference.chunked): the warp-specialised pass (chunk_fwd_ws, K <= 128; DV blocks by grid size, 32 on the
smallest grids at K = 128, then 64, 128 from 66 CTAs on; and every block it is built for) and the single-warp-group
pass (chunk_fwd, every K), and the sequence split.

The plan takes the chunk-local cumsum gc (g_input="cumsum") and hopper.forward A = kkt_solve(...) (Ab = A
diag(beta) for the warp-specialised pass: ut_operand) from the reference, rounded to the kernel's input types (gc
fp32, A in q's dtype), so the test isolates the state/output pass.
"""

import pytest
import torch

from tilela import reference
from tilela.bench import rel_l2

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs a Hopper GPU", allow_module_level=True)

from tilela.kernels import hopper  # noqa: E402
from tilela.kernels.hopper.plan import SegmentPlan, dv_blocks  # noqa: E402

TOL = 1e-2


def make_inputs(B, T, H, HV, K, dtype, beta_dtype, gate, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, K, generator=gen).to(dtype)
    if gate == "decay":
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, generator=gen) + 3)
    else:  # FlashQLA's benchmark gate: weak decay, a quarter of the value heads without decay
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, generator=gen)) / 16
        g[:, :, : max(HV // 4, 1)] = 0
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen)).to(beta_dtype)
    h0 = torch.randn(B, HV, K, K, generator=gen) * 0.1
    return q, k, v, g, beta, h0


def ut_operand(plan, k, beta, gc, cu):
    """The UT transform the plan's state pass takes, from the reference: Ab = A diag(beta) for the warp-specialised
    pass (plan.kkt's scaled), A for the loop pass."""
    return reference.kkt_solve(k, beta, g=gc, chunk_size=64, cu_seqlens=cu, beta_columns=plan.kkt[6])


def run_case(B, T, H, HV, K, dtype=torch.bfloat16, beta_dtype=torch.float32, gate="mixed", cu_seqlens=None,
             use_h0=True, store_ht=True, seed=0, kernel="auto", segment_chunks=None, block_DV=None, fold=False):
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, K, dtype, beta_dtype, gate, seed)
    h0 = h0[:1].expand(N, -1, -1, -1).contiguous() if use_h0 else None
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32)
    gc = reference.chunk_local_cumsum(g, 64, cu_seqlens=cu)
    scale = K**-0.5
    o_ref, ht_ref = reference.chunked(q, k, v, g=g, beta=beta, scale=scale, initial_state=h0, cu_seqlens=cu)
    lengths = [T] * B if cu_seqlens is None else [e - s for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    qd, kd, vd, gcd, betad = (x.cuda() for x in (q, k, v, gc.float(), beta))
    h0 = None if h0 is None else h0.float().cuda()
    plan = hopper.plan_call(qd, vd, gcd, betad, scale, gate="scalar", lengths=lengths, initial_state=h0 is not None,
                            output_final_state=store_ht, varlen=cu is not None, g_input="cumsum", kernel=kernel,
                            block_DV=block_DV, fold=fold,
                            split=None if segment_chunks is None else SegmentPlan.of(lengths, segment_chunks))
    A = ut_operand(plan, k, beta, gc, cu).to(dtype).cuda()
    o, ht = hopper.forward(plan, qd, kd, vd, gcd, betad, h0, None if cu is None else cu.cuda(), A=A)
    torch.cuda.synchronize()
    assert o.dtype == dtype and o.shape == v.shape
    assert torch.isfinite(o).all()
    err_o = rel_l2(o, o_ref)
    err_s = rel_l2(ht, ht_ref) if store_ht else 0.0
    return err_o, err_s


def test_launch_order_changes_no_result():
    """The unsplit pass over a skewed varlen batch launched longest first (plan.order) and in batch order: the same
    outputs and final states, bit for bit (a CTA's chain is the same whenever it starts)."""
    import dataclasses

    lengths = [64, 1, 3000, 130, 0, 700] * 8
    T, H, HV, K = sum(lengths), 2, 4, 128
    q, k, v, g, beta, h0 = make_inputs(1, T, H, HV, K, torch.bfloat16, torch.float32, "mixed", 5)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    gc = reference.chunk_local_cumsum(g, 64, cu_seqlens=cu).float()
    h0 = h0[:1].expand(len(lengths), -1, -1, -1).contiguous()
    dev = [x.cuda() for x in (q, k, v, gc, beta, h0, cu)]
    plan = hopper.plan_call(dev[0], dev[2], dev[3], dev[4], K**-0.5, gate="scalar", lengths=lengths,
                            initial_state=True, output_final_state=True, varlen=True, g_input="cumsum", split=None)
    dev.append(ut_operand(plan, k, beta, gc, cu).to(torch.bfloat16).cuda())
    assert plan.order is not None and plan.order[0] == 2
    (o1, S1), (o0, S0) = (hopper.forward(p, *dev[:7], A=dev[7]) for p in (plan, dataclasses.replace(plan, order=None)))
    assert torch.equal(o1, o0) and torch.equal(S1, S0)
    o_ref, S_ref = reference.chunked(q, k, v, g=g, beta=beta, scale=K**-0.5, initial_state=h0, cu_seqlens=cu)
    assert rel_l2(o1, o_ref) < TOL and rel_l2(S1, S_ref) < TOL


CASES = {
    "dense_128_gva2": dict(B=2, T=200, H=2, HV=4, K=128),
    "dense_128_gva1_fp16": dict(B=1, T=256, H=3, HV=3, K=128, dtype=torch.float16, beta_dtype=torch.float16),
    "dense_128_gva3_decay": dict(B=1, T=192, H=2, HV=6, K=128, gate="decay"),
    "dense_128_gva4_no_h0": dict(B=3, T=130, H=1, HV=4, K=128, use_h0=False),
    "dense_64": dict(B=2, T=150, H=2, HV=4, K=64),
    "dense_256": dict(B=1, T=140, H=1, HV=2, K=256, gate="decay"),
    "varlen_128": dict(B=1, T=300, H=2, HV=4, K=128, cu_seqlens=[0, 1, 65, 66, 130, 200, 263, 300]),
    "varlen_128_fp16_fp16beta": dict(B=1, T=257, H=2, HV=8, K=128, dtype=torch.float16,
                                     beta_dtype=torch.float16, cu_seqlens=[0, 64, 128, 129, 257]),
    "varlen_64_no_ht": dict(B=1, T=100, H=1, HV=2, K=64, cu_seqlens=[0, 37, 38, 100], store_ht=False),
    "varlen_256": dict(B=1, T=200, H=2, HV=4, K=256, cu_seqlens=[0, 3, 131, 200]),
    # 9 sequences x 8 value heads = 72 CTAs: the warp-specialised pass takes 128-wide DV blocks
    "varlen_128_72ctas": dict(B=1, T=700, H=4, HV=8, K=128, gate="decay",
                              cu_seqlens=[0, 1, 100, 164, 165, 300, 420, 555, 640, 700]),
}
KERNEL_CASES = [(name, kernel) for name in CASES for kernel in ("ws", "loop") if CASES[name]["K"] <= 128 or
                kernel == "loop"]


@pytest.mark.parametrize("name,kernel", KERNEL_CASES, ids=[f"{n}-{k}" for n, k in KERNEL_CASES])
def test_gdn_forward_matches_reference(name, kernel):
    err_o, err_s = run_case(**CASES[name], kernel=kernel)
    assert err_o < TOL, f"o rel L2 {err_o:.3e}"
    assert err_s < TOL, f"final state rel L2 {err_s:.3e}"


BLOCK_CASES = [(name, block) for name in ("varlen_128", "dense_64", "varlen_128_fp16_fp16beta")
               for block in dv_blocks(CASES[name]["K"])]


@pytest.mark.parametrize("name,block_DV", BLOCK_CASES, ids=[f"{n}-DV{b}" for n, b in BLOCK_CASES])
def test_gdn_forward_every_dv_block(name, block_DV):
    err_o, err_s = run_case(**CASES[name], kernel="ws", block_DV=block_DV)
    assert err_o < TOL, f"o rel L2 {err_o:.3e}"
    assert err_s < TOL, f"final state rel L2 {err_s:.3e}"


FOLD_CASES = {name: CASES[name] for name in ("dense_128_gva2", "dense_128_gva1_fp16", "dense_128_gva4_no_h0",
                                             "varlen_128", "varlen_128_fp16_fp16beta", "varlen_128_72ctas")}
FOLD_CASES["dense_128_long_decay"] = dict(B=1, T=1000, H=1, HV=2, K=128, gate="decay")  # 16 chunks: the rings wrap


@pytest.mark.parametrize("name", list(FOLD_CASES))
def test_gdn_forward_folded_matches_reference(name):
    """The pass with the output folded into its two chain groups (make_plan's fold): each chain group forms and
    stores its columns' output, the scores group P, through three input slots."""
    err_o, err_s = run_case(**FOLD_CASES[name], fold=True)
    assert err_o < TOL, f"o rel L2 {err_o:.3e}"
    assert err_s < TOL, f"final state rel L2 {err_s:.3e}"


def test_gdn_forward_new_length_heads_or_layout_reuses_kernel():
    from tilela.kernels.hopper.launch import compiled

    run_case(B=1, T=70, H=1, HV=2, K=128)
    run_case(B=1, T=90, H=1, HV=2, K=128, cu_seqlens=[0, 20, 90])
    misses = compiled.cache_info().misses
    errs = [run_case(B=2, T=333, H=1, HV=2, K=128, seed=1)[0],
            run_case(B=1, T=100, H=2, HV=6, K=128, seed=2)[0],
            run_case(B=1, T=400, H=3, HV=6, K=128, cu_seqlens=[0, 1, 250, 400], seed=3)[0]]
    assert compiled.cache_info().misses == misses
    assert max(errs) < TOL


SPLIT_CASES = {  # the sequence split (kernels.hopper.seq_split): segments of 1-3 chunks, empty and 1-token sequences
    "varlen_128_seg2": dict(B=1, T=700, H=2, HV=4, K=128, cu_seqlens=[0, 1, 300, 300, 364, 700], segment_chunks=2),
    "dense_128_seg1_decay_no_h0": dict(B=2, T=200, H=1, HV=2, K=128, gate="decay", use_h0=False, segment_chunks=1),
    "varlen_64_fp16_seg3": dict(B=1, T=500, H=1, HV=3, K=64, dtype=torch.float16, cu_seqlens=[0, 450, 500],
                                segment_chunks=3),
}


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_gdn_sequence_split_matches_reference(name):
    err_o, err_s = run_case(**SPLIT_CASES[name])
    assert err_o < TOL, f"o rel L2 {err_o:.3e}"
    assert err_s < TOL, f"final state rel L2 {err_s:.3e}"


def _warmup_gate(T, HV, gen):
    """Heads decaying fast (-4 a token), moderately (-0.05: six chunks of warm-up), weakly (-0.002: none within a
    segment) and not at all, in turn."""
    per_token = torch.tensor([-4.0, -0.05, -0.002, 0.0]).repeat(HV)[:HV]
    return per_token * (0.5 + torch.rand(1, T, HV, generator=gen))


@pytest.mark.parametrize("initial", [True, False])
@pytest.mark.parametrize("segment_chunks", [3, 8])
def test_warmup_table_of_the_transitions_matches_reference(segment_chunks, initial):
    """The warm-up table the split's transitions pass forms (warmup.py) against reference.warmup_table, entry for
    entry: varlen with an empty and a 1-token sequence, sequences of up to 47 chunks (several blocks of 16 chunk-end
    loads), every kind of head, with and without initial states; every entry was written (the table starts as
    -99)."""
    from tilela.kernels.hopper.launch import launch_state_pass
    from tilela.kernels.hopper.seq_split import segment_table

    lengths, H, HV, K = [3000, 1, 0, 700, 1500], 4, 8, 128
    T = sum(lengths)
    gen = torch.Generator().manual_seed(segment_chunks)
    g = _warmup_gate(T, HV, gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    gc = reference.chunk_local_cumsum(g, 64, cu).float()
    q, k, v, _, beta, _ = make_inputs(1, T, H, HV, K, torch.bfloat16, torch.float32, "decay", segment_chunks)
    split = SegmentPlan.of(lengths, segment_chunks)
    plan = hopper.plan_call(q.cuda(), v.cuda(), gc.cuda(), beta.cuda(), K**-0.5, gate="scalar", lengths=lengths,
                            initial_state=initial, output_final_state=True, varlen=True, g_input="cumsum",
                            split=split)
    transitions = plan.passes[0]
    assert transitions.warmup and not transitions.store_output
    table = segment_table(split, torch.device("cuda"))
    S = split.num_segments
    warm = torch.full((3, S, HV), -99, dtype=torch.int32, device="cuda")
    A = ut_operand(plan, k, beta, gc, cu).to(torch.bfloat16).cuda()
    launch_state_pass(transitions, q.cuda(), k.cuda(), v.cuda(), gc.cuda(), beta.cuda(), A, None,
                      table.cu_segments, S, warm=warm, order=table.order, first=table.first,
                      max_chunks=segment_chunks, initial=initial)
    ref = reference.warmup_table(gc, table.cu_segments.cpu(), table.first.cpu(), segment_chunks, initial)
    assert torch.equal(warm.cpu().long(), ref)
    assert (ref[0] >= 1).any() and (ref[0] == -1).any() and (ref[1] <= -2).any() == initial


WARMUP_CASES = {  # GDN's split under the warm-up against the unsplit pass on the same inputs
    "varlen_gva2_seg8": dict(lengths=[3000, 1, 0, 700, 1500], H=4, HV=8, segment_chunks=8),
    "dense_seg3_fp16": dict(lengths=[2000, 2000], H=2, HV=4, segment_chunks=3, dtype=torch.float16),
    "long_seg16_no_h0": dict(lengths=[16384], H=2, HV=8, segment_chunks=16, use_h0=False),
    "skewed_seg4_no_h0": dict(lengths=[4000] + [100] * 20 + [1, 0], H=2, HV=8, segment_chunks=4, use_h0=False),
    "skewed_seg4": dict(lengths=[0, 1] + [100] * 20 + [4000], H=2, HV=8, segment_chunks=4),
}


@pytest.mark.parametrize("name", list(WARMUP_CASES))
def test_gdn_split_with_warmup_matches_unsplit(name):
    """The split's outputs and final states (fp32) against the unsplit pass's on the same inputs, and both against
    float64: heads that warm up from a zero state (fast and moderate decay), heads that take the transitions (weak
    and no decay), heads entering from the initial state. The warm-up drops the past at e^-17 of the state: on the
    heads that warm up the split and unsplit states agree to 1e-5 (the same chunk products from the same rounded
    state, but for the dropped past; o, in bf16, to its rounding); the transitions' heads differ by the pass's bf16
    rounding of the [0 | I] state's products, as far from the unsplit pass as either is from float64."""
    case = dict(WARMUP_CASES[name])
    lengths, H, HV, segment_chunks = case["lengths"], case["H"], case["HV"], case["segment_chunks"]
    dtype, K = case.get("dtype", torch.bfloat16), 128
    varlen = len(lengths) > 2 or lengths[0] != lengths[-1]
    B, T = (1, sum(lengths)) if varlen else (len(lengths), lengths[0])
    gen = torch.Generator().manual_seed(len(name))
    q, k, v, _, beta, h0 = make_inputs(B, T, H, HV, K, dtype, torch.float32, "decay", len(name))
    g = _warmup_gate(B * T, HV, gen).reshape(B, T, HV)
    # a different initial state per sequence, so that a segment entering from another sequence's would show
    scales = torch.linspace(0.5, 1.5, len(lengths)).view(-1, 1, 1, 1)
    h0 = (h0[:1] * scales).contiguous() if case.get("use_h0", True) else None
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) if varlen else None
    gc = reference.chunk_local_cumsum(g, 64, cu_seqlens=cu)
    o_ref, ht_ref = reference.chunked(q, k, v, g=g, beta=beta, scale=K**-0.5, initial_state=h0, cu_seqlens=cu)
    dev = [x.cuda() for x in (q, k, v, gc.float(), beta)]
    h0d = None if h0 is None else h0.float().cuda()
    cud = None if cu is None else cu.to(torch.int32).cuda()
    runs = []
    for split in (None, SegmentPlan.of(lengths, segment_chunks)):
        plan = hopper.plan_call(dev[0], dev[2], dev[3], dev[4], K**-0.5, gate="scalar", lengths=lengths,
                                initial_state=h0 is not None, output_final_state=True, varlen=varlen,
                                g_input="cumsum", split=split)
        assert (plan.split is not None and plan.output.warmup) == (split is not None)
        o, ht = hopper.forward(plan, *dev, h0d, cud, A=ut_operand(plan, k, beta, gc, cu).to(dtype).cuda())
        runs.append((o.float(), ht))
    (o0, S0), (o1, S1) = runs
    from tilela.kernels.hopper.seq_split import segment_table

    table = segment_table(SegmentPlan.of(lengths, segment_chunks), torch.device("cpu"))
    warm = reference.warmup_table(gc.float().reshape(1, B * T, HV), table.cu_segments, table.first, segment_chunks,
                                  h0 is not None)
    warmed = (warm[0] >= 0).all(0)  # the heads that warm up in every segment
    assert warmed.any() and not warmed.all()
    assert rel_l2(S1[:, warmed], S0[:, warmed]) < 1e-5 and rel_l2(o1[:, :, warmed], o0[:, :, warmed]) < 1e-3
    assert rel_l2(S1, S0) < TOL and rel_l2(o1, o0) < TOL
    assert rel_l2(o1, o_ref) < TOL and rel_l2(S1, ht_ref) < TOL
