"""GDN state/output pass alone (kernels.hopper.forward on a plan with g_input="cumsum", A given): our passes against
each other, so the chunk chain's cost is measured apart from cumsum and kkt_solve (computed once per input set,
outside the timing).

Implementations on the GDN benchmark's inputs (gdn.make_inputs, with gc and A from our kernels: Ab = A diag(beta)
for the warp-specialised pass, A for the loop pass):
  ws_half    the warp-specialised pass, DV blocks of K / 2
  ws_full    the warp-specialised pass, DV blocks of K
  ws_quarter the warp-specialised pass, DV blocks of K / 4 (twice the CTAs of ws_half, shorter products)
  ws_eighth  the warp-specialised pass, DV blocks of K / 8
  loop       the single-warp-group pass (DV blocks of 32)
  split      the warp-specialised pass with the sequence split (plan.auto_split; cases it leaves unsplit are
             left out)
  state_only the warp-specialised pass without its output warp group (default DV block, o not written): the
             recurrence's chain alone, so the difference to the pass's time is what the output group costs
Each returns the final state (the one output every variant computes), compared with the float64 reference's.
Grid: the GDN head configurations x 1x32768 and 1x8192, mixed gate (the passes' time does not depend on it).
Floor: q, k, v, A, g, beta read once, o written once, the state read and written once; FLOPs of K S, A R, Q S,
Q K^T, P Vnew and K^T Vnew per chunk and value head.
"""

import functools

from tilela import reference

from . import Bench, gdn, hopper_plan

LAYOUTS = ("1x32768", "1x8192")
QUICK = [((16, 32), "1x32768"), ((2, 8), "1x32768"), ((32, 32), "1x8192")]


def cases(quick):
    pairs = QUICK if quick else [(h, lay) for lay in LAYOUTS for h in gdn.HEADS]
    return [gdn._case(h, lay, "mixed", gdn.LAYOUTS[lay]) for h, lay in pairs]


def make_inputs(case, seed):
    from tilela import ops

    from tilela.kernels import hopper
    from tilela.kernels.hopper import launch

    x = gdn.make_inputs(case, seed)
    cu, cu_cpu = x.get("cu_seqlens"), x.get("cu_seqlens_cpu")
    gc = ops.chunk_local_cumsum(x["g"], gdn.CHUNK, cu, cu_seqlens_cpu=cu_cpu)
    # A for the loop pass (the public op's), Ab = A diag(beta) for the warp-specialised pass (the plan's scaled key)
    k, p = x["k"], case.params
    key, steps = hopper.plan.kkt_plan(gdn.CHUNK, "blocked", hopper.DTYPE_NAMES[k.dtype], "scalar", p["H"], p["HV"],
                                      p["lengths"], hopper.multiprocessors(k.device), scaled=True)
    Ab, _ = launch.launch_kkt(key, k, x["beta"], gc, launch.Schedule.of(k, cu), steps)
    x.update(gc=gc, A=ops.kkt_solve(k, x["beta"], gc, gdn.CHUNK, cu, cu_seqlens_cpu=cu_cpu), Ab=Ab)
    return x


def _pass(case, x, **options):
    """The final state of the state pass alone on the plan make_plan gives with these options (None when the plan
    has no split and split="auto" asked for one)."""
    from tilela.kernels import hopper

    plan = hopper_plan(dict(x, g=x["gc"]), case.params["lengths"], case.params["K"], "scalar", g_input="cumsum",
                       **options)
    if options.get("split") == "auto" and plan.split is None:
        return None
    _, ht = hopper.forward(plan, x["q"], x["k"], x["v"], x["gc"], x["beta"], x["initial_state"], x.get("cu_seqlens"),
                           A=x["Ab"] if plan.kkt[6] else x["A"])
    return ht


def _reference(case, x):
    _, ht = reference.chunked(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["initial_state"],
                              cu_seqlens=x.get("cu_seqlens_cpu"))
    return ht


def cost(case):
    p = case.params
    H, HV, K, V, C = p["H"], p["HV"], p["K"], p["V"], gdn.CHUNK
    T, N = sum(p["lengths"]), len(p["lengths"])
    n_chunks = sum(-(-L // C) for L in p["lengths"])
    nbytes = 2 * T * H * K * 2 + 2 * T * HV * V * 2 + T * HV * C * 2 + 2 * T * HV * 4 + 2 * N * HV * K * V * 4
    per_chunk = 2 * C * K * V * 3 + 2 * C * C * (2 * V + K)
    return {"bytes": nbytes, "flops": n_chunks * HV * per_chunk}


BENCH = Bench(
    op="state_pass",
    cases=cases,
    check_cases=gdn.BENCH.check_cases,
    make_inputs=make_inputs,
    impls={
        **{f"ws_{name}": functools.partial(_pass, kernel="ws", block_DV=gdn.DIM // blocks, split=None)
           for name, blocks in (("half", 2), ("full", 1), ("quarter", 4), ("eighth", 8))},
        "loop": functools.partial(_pass, kernel="loop"),
        "split": functools.partial(_pass, split="auto"),
        "state_only": functools.partial(_pass, split=None, outputs=False),
    },
    reference=_reference,
    cost=cost,
)
