"""Ladder kernels on a Hopper GPU against the float64 reference stack (layer B, reference.chunked): levels 1
linear_attn (sequence in the loop, and the §4 sequence-in-grid kernel), 2 simple_gla, 3 gla (the warp-specialised
pass after gla_factors, and the single-warp-group pass), 4 delta_rule, and the per-channel delta rule (KDA) the same
builder produces, also end to end on our kernels (kda_pipeline: the plan from the raw gate, which its gla_factors
stage sums in its tile); gla_factors alone against reference.chunk_math.gated_factors and reference.kkt.kkt_solve.

The state/output kernel gets the chunk-local cumsum gc (a plan with g_input="cumsum") and, with the delta rule, A =
kkt_solve(...) (Ab = A diag(beta) for the warp-specialised pass) from the reference, rounded to the kernel's input types (gc fp32, A in q's dtype), so each test
isolates the state/output pass; under the per-channel gate gla_factors forms A diag(beta), so KDA runs both
kernels.  Varlen layouts hold
1-token sequences and lengths that are not multiples of 64; states enter and leave; bf16 and fp16, K = 64 and 128.
Every (level, layout) job runs in its own spawned worker process, so the TileLang compiles (one per static
configuration) run in parallel; the tests then check the collected errors.
"""

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from tilela import reference
from tilela._gates import apply_gate
from tilela.bench import rel_l2

# one xdist worker takes the whole module: its fixture already spreads the jobs over a process per core
pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("ladder")]

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs a Hopper GPU", allow_module_level=True)

from tilela.experiments.linear_attn_seq_in_grid import linear_attn_seq_in_grid  # noqa: E402
from tilela.kernels import hopper  # noqa: E402
from tilela.kernels.hopper import launch  # noqa: E402

TOL = 1e-2
LEVELS = {  # name: (gate, delta rule)
    "linear_attn": ("none", False),
    "linear_attn_seq_in_grid": ("none", False),
    "simple_gla": ("scalar", False),
    "gla": ("channel", False),
    "delta_rule": ("none", True),
    "kda": ("channel", True),
    "kda_pipeline": ("channel", True),  # the raw gate in, summed by gla_factors
}
CASES = {  # a varlen and two dense layouts per level
    "varlen_128_bf16": dict(B=1, T=300, H=2, HV=4, K=128, dtype=torch.bfloat16,
                            cu_seqlens=[0, 1, 65, 66, 130, 200, 263, 300]),
    "dense_64_fp16_no_h0": dict(B=2, T=150, H=1, HV=2, K=64, dtype=torch.float16, use_h0=False),
    # two sequence-heads: the warp-specialised pass's smallest DV blocks (K / 4; K / 8 for delta_rule)
    "dense_128_bf16_two_heads": dict(B=1, T=200, H=1, HV=2, K=128, dtype=torch.bfloat16),
}


def make_inputs(B, T, H, HV, K, dtype, gate, seed):
    """q, k unit-norm; v normal; log gates <= 0 with per-token values down to -5 (so a channel can decay by e^-100
    and more within a 64-token chunk); beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, K, generator=gen).to(dtype)
    g_shape = {"none": None, "scalar": (B, T, HV), "channel": (B, T, HV, K)}[gate]
    g = None
    if g_shape is not None:
        g = torch.nn.functional.logsigmoid(2 * torch.randn(*g_shape, generator=gen) - 1).clamp_min(-5)
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen))
    h0 = torch.randn(B, HV, K, K, generator=gen) * 0.1
    return q, k, v, g, beta, h0


def run_level(level, B, T, H, HV, K, dtype, cu_seqlens=None, use_h0=True, seed=0, kernel="auto"):
    gate, delta = LEVELS[level]
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, K, dtype, gate, seed)
    beta = beta if delta else None
    h0 = h0[:1].expand(N, -1, -1, -1).contiguous() if use_h0 else None
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32)
    gc = None if g is None else reference.chunk_local_cumsum(g, 64, cu_seqlens=cu)
    scale = K**-0.5
    o_ref, ht_ref = reference.chunked(q, k, v, g=g, beta=beta, scale=scale, initial_state=h0, cu_seqlens=cu)

    def dev(x, dt=None):
        return None if x is None else x.to(dt or x.dtype).cuda()

    state = dict(initial_state=dev(h0, torch.float32), output_final_state=True, cu_seqlens=dev(cu))
    if level == "kda_pipeline":  # the raw gate in: the plan's gla_factors sums it in its tiles
        gc = g
    if level == "linear_attn_seq_in_grid":
        o, ht = linear_attn_seq_in_grid(dev(q), dev(k), dev(v), scale, **state)
    else:
        args = dev(q), dev(k), dev(v), dev(gc, torch.float32), dev(beta)
        plan = hopper.plan_call(args[0], args[2], args[3], args[4], scale, gate=gate,
                                lengths=[T] * B if cu_seqlens is None else [e - s for s, e in zip(cu_seqlens[:-1],
                                                                                                  cu_seqlens[1:])],
                                initial_state=use_h0, output_final_state=True, varlen=cu is not None,
                                g_input="raw" if level == "kda_pipeline" else "cumsum", kernel=kernel, split=None)
        # the UT transform in the plan's form (Ab = A diag(beta) for the warp-specialised pass); KDA's comes from
        # gla_factors or the plan's kkt_solve
        A = reference.kkt_solve(k, beta, g=gc, chunk_size=64, cu_seqlens=cu, beta_columns=plan.kkt[6]) \
            if delta and gate != "channel" else None
        o, ht = hopper.forward(plan, *args, state["initial_state"], state["cu_seqlens"], A=dev(A, dtype))
    torch.cuda.synchronize()
    assert o.dtype == dtype and o.shape == v.shape
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    return rel_l2(o, o_ref), rel_l2(ht, ht_ref)


def kernels(level):
    """The state/output passes a level runs on: both for the warp-specialised levels (every level but KDA)."""
    if level == "linear_attn_seq_in_grid" or LEVELS[level] == ("channel", True):
        return ("auto",)
    return ("ws", "loop")


JOBS = [(level, case, kernel) for level in LEVELS for case in CASES for kernel in kernels(level)]


def run_job(job):
    level, case, kernel = job
    return run_level(level, **CASES[case], kernel=kernel)


@pytest.fixture(scope="module")
def errors():
    """{job: (o rel L2, final state rel L2) or the exception it raised}, all jobs in parallel worker processes."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(len(JOBS), os.cpu_count() or 1), mp_context=spawn) as pool:
        futures = {job: pool.submit(run_job, job) for job in JOBS}
        return {job: future.exception() or future.result() for job, future in futures.items()}


@pytest.mark.parametrize("job", JOBS, ids=["-".join(job) for job in JOBS])
def test_level_matches_reference(errors, job):
    result = errors[job]
    if isinstance(result, BaseException):
        raise result
    err_o, err_s = result
    assert err_o < TOL, f"o rel L2 {err_o:.3e}"
    assert err_s < TOL, f"final state rel L2 {err_s:.3e}"


@pytest.mark.parametrize("gate_in,delta", [(None, False), (("float32", "log"), False), (None, True),
                                           (("bfloat16", "sigmoid"), True), (("float32", "log"), True),
                                           (("bfloat16", "softplus"), True)],
                         ids=["gc-in", "raw-gate", "kda-gc-in", "kda-raw-sigmoid", "kda-raw-log", "kda-raw-softplus"])
@pytest.mark.parametrize("case", list(CASES))
def test_gla_factors_match_reference(case, gate_in, delta):
    """Qg, Kd, P and D of every chunk (chunks from each sequence start) against the float64 gated factors, from gc
    or from the raw gate summed in the kernel (GLA's log gate; KDA's log, bounded sigmoid and softplus forms, their
    inputs in bf16), and KDA's Kg = K ⊙ exp(gc) and Ab = A diag(beta) (reference.kkt_solve); make_inputs' gates
    (about e^-100 over a tile) with a third of the channels twice as steep give calm channels, which decay by at
    most e^-160 over a tile (one product), beside wild ones (term by term); the softplus form's (about -13 per
    token on every other 16 tokens) makes every channel wild."""
    c = CASES[case]
    B, T, HV, K, dtype = c["B"], c["T"], c["HV"], c["K"], c["dtype"]
    q, k, _, g, beta, _ = make_inputs(B, T, c["H"], HV, K, dtype, "channel", seed=1)
    g[..., ::3] *= 2
    cu = c.get("cu_seqlens")
    g_in, params, lower = g.float(), None, None
    if gate_in is not None and gate_in[1] != "log":  # FLA's in-kernel gate from its input
        gen = torch.Generator().manual_seed(2)
        g_in = 4 * torch.randn(B, T, HV, K, generator=gen)
        if gate_in[1] == "sigmoid":
            params = ((torch.rand(HV, 1, generator=gen) + 0.5).log(), torch.randn(HV, K, generator=gen))
            lower = -5.0
        else:
            g_in[:, torch.arange(T) // 16 % 2 == 0] -= 16  # softplus(~-16) ~ 0: these tokens barely decay
            params = ((torch.rand(HV, 1, generator=gen) * 15 + 1).log(), torch.randn(HV, K, generator=gen))
        g_in = g_in.to(torch.bfloat16)
        g = apply_gate(g_in.double(), gate_in[1], *(p.double() for p in params), lower)
    gc = reference.chunk_local_cumsum(g, 64, cu_seqlens=None if cu is None else torch.tensor(cu))
    scale = K**-0.5
    q_d = q.cuda()
    sched = launch.Schedule.of(q_d, None if cu is None else torch.tensor(cu, dtype=torch.int32).cuda())
    Qg, Kd, Kg, P, Ab, D = launch.launch_factors((K, hopper.DTYPE_NAMES[dtype], gate_in, delta), q_d, k.cuda(),
                                                (gc.float() if gate_in is None else g_in).cuda(),
                                                beta.cuda() if delta else None, scale, sched,
                                                None if params is None else tuple(p.cuda() for p in params), lower)
    G = HV // c["H"]
    qv, kv = (x.double().repeat_interleave(G, dim=2) for x in (q, k))  # value head h reads q/k head h // G
    ref = [torch.zeros(B, T, HV, n, dtype=torch.float64) for n in (K, K, 64)]
    slots, ref_D = [], []  # the tile slots chunks occupy (common.locate_tile; the others are never written)
    bounds = [(b, b * -(-T // 64), 0, T) for b in range(B)] if cu is None else \
        [(0, s // 64 + n, s, e) for n, (s, e) in enumerate(zip(cu[:-1], cu[1:]))]
    for b, slot0, s, e in bounds:
        for t0 in range(s, e, 64):
            rows = slice(t0, min(t0 + 64, e))
            chunk = [x[b, rows].transpose(0, 1) for x in (qv, kv, gc.double())]  # [HV, L, K]
            for out, f in zip(ref, reference.chunk_math.gated_factors(*chunk, scale)):
                out[b, rows, :, :f.shape[-1]] = f.transpose(0, 1)
            slots.append(slot0 + (t0 - s) // 64)
            ref_D.append(chunk[2][:, -1, :].exp())
    for name, x, r in zip(("Qg", "Kd", "P", "D"), (Qg, Kd, P, D[slots]), (*ref, torch.stack(ref_D))):
        err = rel_l2(x.cpu(), r)
        assert err < TOL, f"{name} rel L2 {err:.3e}"
    assert (Kg is None) is not delta and (Ab is None) is not delta
    if delta:  # gc is chunk-local, so K ⊙ exp(gc) needs no chunking
        assert rel_l2(Kg.cpu(), kv * gc.double().exp()) < TOL
        ref_Ab = reference.kkt_solve(k, beta, gc, 64, None if cu is None else torch.tensor(cu), beta_columns=True)
        assert rel_l2(Ab.cpu().double(), ref_Ab) < TOL
