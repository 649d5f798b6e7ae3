"""The floor on the log gate that keeps the chunked forms exact where exp underflows.

A log gate g enters the chunked forms only through its chunk-local cumsum gc, as

    exp(gc_i - gc_j) = prod_{j < s <= i} exp(g_s),

and the token recurrence S_t = exp(g_t) S_{t-1} turns a g_t whose exp is 0 into a state reset. Summed as they are,
such gates break the chunked forms: -inf gives gc = -inf and exp(-inf + inf) = NaN from the chunk start on, and a
finite g = -1e7 or -1e30 leaves the small gates next to it no bits in gc (gc_i - gc_j is then their sum rounded at
the scale of 1e7). So every g_s is clamped from below at ``LOG_GATE_FLOOR`` before the cumsum:

  - exp(LOG_GATE_FLOOR) = e^-110 ~ 1.7e-48 is 0 in float32: every value below 2^-150 = e^-103.97 rounds to 0, and the
    margin of 6 covers an exp (torch's or a kernel's exp2 of LOG_GATE_FLOOR * log2(e) = -158.7) that is off by some
    ulps near the subnormal range, where e^-103.9 still gives 2^-149. Any product over a span that contains the
    token then holds the factor e^-110 (the other gates are <= 0 for a decay) and is exactly 0 in float32, as the
    recurrence says; bf16 and fp16 reach 0 far earlier. In float64, the reference stack's dtype, it is a factor
    1.7e-48 instead of 0: below float64's rounding of any sum it enters unless the other terms are 1e-32 times
    smaller.
  - The cumsum stays within C * 110 (7040 for 64-token chunks) per chunk, so a difference of two gc values keeps
    its small gates to about 110 * eps(dtype) per floored token before them (1e-5 in float32 after one), where
    unclamped it kept none.
  - -inf becomes the floor (no NaN); NaN stays NaN (clamp propagates it), so a NaN gate spreads as any NaN input.

Every path that forms a chunk-local cumsum of raw gates applies this floor first, the Hopper kernels included.

FLA's in-kernel gate (GDN's and KDA's ``use_gate_in_kernel``) gives the op the gate's input x instead of the log
gate; ``apply_gate`` forms the log gate from it, per gate column (value head, and key channel for KDA):

    form "softplus":  g = -a softplus(x + b)
    form "sigmoid":   g = lower_bound sigmoid(a (x + b))          (KDA with lower_bound)

with a = exp(A_log) per value head and b = dt_bias per gate column, each or once for all (``param_shapes``; A_log = 0
and b = 0 where not given). They travel as given (A_log, not a), so a call launches no kernel of its own for them:
the Hopper kernels read each column's pair, form a, and apply the gate where they sum it (kernels/hopper/cumsum.py;
gla_factors through common.gate_column; kkt_solve for GDN's scalar gate); every other path, autograd's recompute
included, applies it here first.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

LOG_GATE_FLOOR = -110.0


def floor_log_gate(g: torch.Tensor) -> torch.Tensor:
    """g clamped from below at ``LOG_GATE_FLOOR`` (-inf included; NaN kept)."""
    return g.clamp(min=LOG_GATE_FLOOR)


GATE_FORMS = ("log", "softplus", "sigmoid")  # "log": g is the log gate itself


def param_shapes(columns: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """The shapes A_log and dt_bias may take over a gate's columns (g's shape past [B, T]: (HV,) or (HV, K)): A_log
    per value head, dt_bias per column, each or one value for all (each kernel reads a head's or a column's entry,
    or the one value)."""
    ones = (1,) * (len(columns) - 1)
    return {"A_log": tuple(dict.fromkeys(((columns[0], *ones), (1, *ones)))),
            "dt_bias": tuple(dict.fromkeys((tuple(columns), (1, *ones))))}


class InKernelGate(NamedTuple):
    """How the op's g gives the log gate (``apply_gate``): the form, A_log and dt_bias (of ``param_shapes`` of the
    gate's columns), and the sigmoid form's lower bound; ``LOG_GATE`` when g is the log gate."""

    form: str
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    lower_bound: float | None

    @property
    def params(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A_log, dt_bias) as the Hopper launchers take them, None for the log form."""
        return None if self.form == "log" else (self.A_log, self.dt_bias)


LOG_GATE = InKernelGate("log", None, None, None)


def apply_gate(x: torch.Tensor, form: str, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
               lower_bound: float | None) -> torch.Tensor:
    """The log gate from the op's g (module docstring): x itself for form "log", else from FLA's in-kernel gate
    input x [B, T, HV] or [B, T, HV, K] with A_log and dt_bias broadcast over its columns (float32 out; float64
    stays)."""
    if form == "log":
        return x
    a, b = A_log.exp(), dt_bias
    if form == "softplus":
        return -a * F.softplus(x + b)
    if form == "sigmoid":
        return lower_bound * torch.sigmoid(torch.addcmul(a * b, x, a))  # a x + a b: one pass over x in its dtype
    raise ValueError(f"form: expected one of {GATE_FORMS}, got {form!r}")
