"""The Hopper (sm_90a) backend: plan.py decides a call once, launch.py executes the plan; one TileLang builder per
kernel file (docs/hopper.md walks through them).

    plan = hopper.plan_call(q, v, g, beta, scale, ...)     # host facts only: a frozen Plan (plan.py)
    o, S = hopper.forward(plan, q, k, v, g, beta, ...)     # the stages the plan names (launch.py)

Importing this package needs no TileLang (plan.py and the lists below are plain Python); `available` says whether
the kernels can run on given tensors.

The static configurations we ship, each compiled by the tests (tests/test_compile*.py) and by `benchmarks/
precompile.py`; token counts, head counts, K (cumsum, kkt_solve) and varlen layouts are symbolic:
    chunk_local_cumsum_kernel(chunk, g dtype, gate form): "log" at every chunk, FLA's in-kernel gate forms at 64 and
    16 (KDA's short-chunk path)
    kkt_solve_kernel(chunk, method, k dtype, gate kind, value heads per pass, gate_in); "blocked" at chunk 16 is
    the plain forward substitution of the 16x16 block (no coupling level); gate_in None (gc), or at chunk
    64 the raw scalar gate of GDN's forms, summed in the kernel (no cumsum launch)
    gla_factors_kernel(K, q/k dtype, gate_in, whether it writes KDA's Kg and A): gate_in None (gc), or the raw gate
    of GLA's log form or KDA's forms (the log gate, the softplus and the bounded sigmoid)
    seq_combine_kernel(K, V, transition, whether an initial state is read, whether the warm-up table is read): the
    sequence split's step 2; transition: the plain update's gate kind, or "matrix" (the delta rule's [B | M])
    l2norm_kernel(K, q/k dtype): use_qk_l2norm_in_kernel
    the state passes: plan.PassConfig.args for every (K, gate, update rule, dtype, switches, tiles) a plan can hold
"""

from __future__ import annotations

import functools

import torch

from .plan import CHUNK, HALF, L2NORM_DIMS, SHORT_CHUNK, Plan, SegmentPlan, make_plan

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

CUMSUM_CONFIGS = [(C, d, "log") for C in (16, 32, 64) for d in ("float32", *HALF)] + [
    (C, d, form) for C in (SHORT_CHUNK, CHUNK) for form in ("softplus", "sigmoid") for d in ("float32", *HALF)]
KKT_METHODS = [(16, "blocked"), (32, "blocked"), (64, "blocked"), (16, "neumann"), (32, "neumann"), (64, "neumann")]
GATE_DTYPES = ("float32", *HALF)
KDA_FORMS = ("log", "softplus", "sigmoid")
GDN_FORMS = ("log", "softplus")  # the scalar gate's: the log gate and FLA's in-kernel gate (use_gate_in_kernel)
GLA_FACTORS_CONFIGS = [(K, d, gate_in, delta) for K in (64, 128) for d in HALF for delta in (False, True)
                       for gate_in in (None, *((gd, form) for gd in GATE_DTYPES
                                               for form in (KDA_FORMS if delta else ("log",))))]
SEQ_COMBINE_CONFIGS = [(K, K, gate, h0, warm) for K in (64, 128) for h0 in (False, True)
                       for gate, warm in (("none", False), ("scalar", False), ("matrix", False), ("matrix", True))]
L2NORM_CONFIGS = [(K, d) for K in L2NORM_DIMS for d in HALF]
# kkt_solve: A for the loop pass and the public op, and at chunk 64 Ab (scaled) for the warp-specialised pass
KKT_CONFIGS = [
    (C, m, d, gate, pair, gate_in, scaled)
    for C, m in KKT_METHODS
    for d in HALF
    for gate in ("none", "scalar", "channel")
    for pair in ((1,) if gate == "channel" else (1, 2))
    for gate_in in (None, *(((gd, form) for gd in GATE_DTYPES for form in GDN_FORMS)
                            if (C, m, gate) == (CHUNK, "blocked", "scalar") else ()))
    for scaled in ((False, True) if (C, m) == (CHUNK, "blocked") and gate != "channel" else (False,))
]


@functools.lru_cache(maxsize=None)
def _kernels_import() -> bool:
    try:
        from . import launch  # noqa: F401  (imports TileLang and every builder)
    except ImportError:
        return False
    return True


def available(*tensors: torch.Tensor) -> bool:
    """True when every tensor is on a CUDA device of compute capability 9.0 and TileLang imports."""
    if not tensors or not all(t.is_cuda for t in tensors):
        return False
    return all(_hopper(t.device) for t in tensors) and _kernels_import()


@functools.lru_cache(maxsize=None)
def _hopper(device: torch.device) -> bool:
    """Whether a CUDA device has compute capability 9.0 (asked once per device: every call checks its tensors)."""
    return torch.cuda.get_device_capability(device) == (9, 0)


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The SM count of a CUDA device (sizes the sequence split's grid and the DV blocks)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_call(q: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, beta: torch.Tensor | None, scale: float, *,
              gate: str, lengths, initial_state: bool, output_final_state: bool, varlen: bool,
              sms: int | None = None, **options) -> Plan:
    """make_plan from a call's tensors (q, v, g, beta give dtypes and sizes; beta present means the delta rule) and
    host facts: gate kind, host sequence lengths, whether an initial state is read, whether final states are kept,
    whether the call is varlen (cu_seqlens given), whether the current stream is capturing a CUDA graph. sms: v's
    device's SM count unless given. options: make_plan's."""
    delta = beta is not None
    options.setdefault("graph", v.is_cuda and torch.cuda.is_current_stream_capturing())
    dtype = DTYPE_NAMES.get(q.dtype, str(q.dtype))
    return make_plan(
        dtype=dtype, beta_dtype=(dtype if beta.dtype == q.dtype else "float32") if delta else None,
        gate_dtype=None if g is None else DTYPE_NAMES.get(g.dtype, "float32"), gate=gate, delta=delta,
        H=q.shape[2], HV=v.shape[2], K=q.shape[3], V=v.shape[3], lengths=lengths, tokens=q.shape[0] * q.shape[1],
        varlen=varlen, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        sms=multiprocessors(v.device) if sms is None else sms, **options)


def forward(plan: Plan, q, k, v, g, beta, initial_state=None, cu_seqlens=None, *, A=None, gate_params=None,
            gate_scale=None):
    """Run a plan on its call's tensors (launch.forward)."""
    from .launch import forward as run

    return run(plan, q, k, v, g, beta, initial_state, cu_seqlens, A=A, gate_params=gate_params, gate_scale=gate_scale)


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (launch.launch_l2norm) for x the kernel serves (plan.l2norm_covers)."""
    from .launch import launch_l2norm

    return launch_l2norm((x.shape[-1], DTYPE_NAMES[x.dtype]), x, eps)


__all__ = ["Plan", "SegmentPlan", "available", "forward", "l2_normalize", "make_plan", "multiprocessors", "plan_call",
           "CUMSUM_CONFIGS", "KKT_CONFIGS", "GLA_FACTORS_CONFIGS", "SEQ_COMBINE_CONFIGS", "L2NORM_CONFIGS"]
