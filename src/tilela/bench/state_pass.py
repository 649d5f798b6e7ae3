"""GDN state/output pass alone (kernels.hopper.chunk_fwd.chunk_forward): our passes against each other, so the
chunk chain's cost is measured apart from cumsum and kkt_solve (computed once per input set, outside the timing).

Implementations on the GDN benchmark's inputs (gdn.make_inputs, with gc and A from our kernels):
  ws_half    the warp-specialised pass, DV blocks of K / 2
  ws_full    the warp-specialised pass, DV blocks of K
  ws_quarter the warp-specialised pass, DV blocks of K / 4 (twice the CTAs of ws_half, shorter products)
  ws_eighth  the warp-specialised pass, DV blocks of K / 8
  loop       the single-warp-group pass (DV blocks of 32)
  split      the warp-specialised pass with the sequence split (seq_split.auto_plan; cases it leaves unsplit are
             left out)
  state_only the warp-specialised pass without its output warp group (default DV block, o not written): the
             recurrence's chain alone, so the difference to the pass's time is what the output group costs
Each returns the final state (the one output every variant computes), compared with the float64 reference's.
Grid: the GDN head configurations x 1x32768 and 1x8192, mixed gate (the passes' time does not depend on it).
Floor: q, k, v, A, g, beta read once, o written once, the state read and written once; FLOPs of K S, A R, Q S,
Q K^T, P Vnew and K^T Vnew per chunk and value head.
"""

import torch

from tilela import reference

from . import Bench, gdn, split_plan

LAYOUTS = ("1x32768", "1x8192")
QUICK = [((16, 32), "1x32768"), ((2, 8), "1x32768"), ((32, 32), "1x8192")]


def cases(quick):
    pairs = QUICK if quick else [(h, lay) for lay in LAYOUTS for h in gdn.HEADS]
    return [gdn._case(h, lay, "mixed", gdn.LAYOUTS[lay]) for h, lay in pairs]


def make_inputs(case, seed):
    from tilela.kernels.hopper import chunk_local_cumsum, kkt_solve

    x = gdn.make_inputs(case, seed)
    gc = chunk_local_cumsum(x["g"], gdn.CHUNK, x.get("cu_seqlens"))
    x.update(gc=gc, A=kkt_solve(x["k"], x["beta"], gc, gdn.CHUNK, x.get("cu_seqlens")))
    return x


def _pass(x, **options):
    from tilela.kernels.hopper.chunk_fwd import chunk_forward

    _, ht = chunk_forward(x["q"], x["k"], x["v"], x["gc"], x["beta"], x["A"], x["q"].shape[3] ** -0.5,
                          x["initial_state"], True, x.get("cu_seqlens"), **options)
    return ht


def _state_only(case, x):
    from tilela.kernels.hopper.chunk_fwd import _ws_state_pass

    cu = x.get("cu_seqlens")
    if cu is None:  # built on the device, so a CUDA graph can capture it
        cu = torch.arange(2, dtype=torch.int32, device=x["v"].device) * x["v"].shape[1]
    _, ht = _ws_state_pass(x["q"], x["k"], x["v"], x["gc"], x["beta"], x["A"], x["q"].shape[3] ** -0.5,
                           x["initial_state"], cu, False, True)
    return ht


def _reference(case, x):
    _, ht = reference.chunked(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["initial_state"],
                              cu_seqlens=x.get("cu_seqlens_cpu"))
    return ht


def _split(case, x):
    plan = split_plan(case.params["lengths"], x["v"], case.params["K"])
    return None if plan is None else _pass(x, segments=plan)


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
        "ws_half": lambda case, x: _pass(x, kernel="ws", block_DV=case.params["K"] // 2),
        "ws_full": lambda case, x: _pass(x, kernel="ws", block_DV=case.params["K"]),
        "ws_quarter": lambda case, x: _pass(x, kernel="ws", block_DV=case.params["K"] // 4),
        "ws_eighth": lambda case, x: _pass(x, kernel="ws", block_DV=case.params["K"] // 8),
        "loop": lambda case, x: _pass(x, kernel="loop"),
        "split": _split,
        "state_only": _state_only,
    },
    reference=_reference,
    cost=cost,
)
