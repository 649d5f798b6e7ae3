"""The attention ops as torch.library custom ops, with fake (meta) implementations and autograd.

``tilela::chunk_attention`` is the one op behind the six public attention ops (their options are input transforms
in plain PyTorch before it, so torch.compile traces them and autograd differentiates them); an eager call that
records no autograd runs the op's body directly (ops._attention). Its fake
implementation gives the output shapes from the input shapes alone, so ``torch.compile(fullgraph=True)`` keeps it
in the graph as one opaque node and no value of ``cu_seqlens`` (or ``cu_seqlens_cpu``) becomes a guard: a new varlen
layout with the same shapes reuses the compiled graph.

Autograd recomputes: the backward (``tilela::chunk_attention_backward``, itself a custom op) runs the forward again
on the differentiable PyTorch path (``tilela.torch_path``) under ``torch.enable_grad`` and backpropagates through
it. A training step therefore costs one extra forward on the PyTorch path plus its backward, and holds that path's
activations (about the chunked q, k, v, gate and per-chunk states in float32) during the backward; the forward
itself (the Hopper kernels or the PyTorch path) stores only its inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._gates import InKernelGate, apply_gate
from .torch_path import chunk as torch_path


def _autograd_on():
    """Record autograd again inside a custom op's body (the dispatcher excludes the autograd keys there), with
    grad mode on: the backward's recompute differentiates through the PyTorch path."""
    keys = torch._C.DispatchKey
    autograd = torch._C.DispatchKeySet(keys.AutogradFunctionality)
    for key in (keys.ADInplaceOrView, keys.AutogradOther, keys.AutogradNestedTensor):
        autograd = autograd | torch._C.DispatchKeySet(key)
    exclude = torch._C._dispatch_tls_local_exclude_set() - autograd
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def _state_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("tilela::chunk_attention", mutates_args=())
def chunk_attention(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor | None,
                    initial_state: Tensor | None, cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
                    gate: str, delta: bool, scale: float | None, output_final_state: bool,
                    check_finite: bool = False, gate_form: str = "log", A_log: Tensor | None = None,
                    dt_bias: Tensor | None = None, lower_bound: float | None = None) -> tuple[Tensor, Tensor]:
    """(o, final state); the state is an empty tensor unless output_final_state. Validates, then dispatches
    (gate_form other than "log": g is FLA's in-kernel gate input, with A_log, dt_bias and lower_bound,
    tilela._gates)."""
    from . import _validation as V
    from .ops import _dispatch

    V.check_gate_input(gate_form, A_log, dt_bias, lower_bound, g)
    o, S = _dispatch(q, k, v, g, gate, beta, delta, scale, initial_state, output_final_state, cu_seqlens,
                     cu_seqlens_cpu, check_finite, InKernelGate(gate_form, A_log, dt_bias, lower_bound))
    return o, (S if S is not None else q.new_empty(0, dtype=_state_dtype(q)))


@chunk_attention.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, gate, delta, scale, output_final_state,
      check_finite=False, gate_form="log", A_log=None, dt_bias=None, lower_bound=None):
    B, T, HV, Vd = v.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state = (N, HV, q.shape[3], Vd) if output_final_state else (0,)
    return v.new_empty(B, T, HV, Vd, dtype=q.dtype), q.new_empty(state, dtype=_state_dtype(q))


@torch.library.custom_op("tilela::chunk_attention_backward", mutates_args=())
def chunk_attention_backward(do: Tensor, dS: Tensor | None, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None,
                             beta: Tensor | None, initial_state: Tensor | None, cu_seqlens: Tensor | None,
                             cu_seqlens_cpu: Tensor | None, gate: str, scale: float | None, gate_form: str,
                             A_log: Tensor | None, dt_bias: Tensor | None, lower_bound: float | None,
                             needs: list[bool]) -> list[Tensor]:
    """Gradients of (q, k, v, g, beta, initial_state, A_log, dt_bias) by recomputing the forward on the PyTorch path
    (the in-kernel gate formed from g first); an entry whose ``needs`` is False (or whose input is None) is an empty
    tensor."""
    from .ops import _check

    inputs = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    dims, _ = _check(q, k, v, g, gate, beta, beta is not None, scale, initial_state, cu_seqlens, cu_seqlens_cpu)
    with _autograd_on(), torch.enable_grad():
        leaves = [None if x is None else x.detach().requires_grad_(need) for x, need in zip(inputs, needs)]
        q_, k_, v_, g_, beta_, h0_, log_a_, b_ = leaves
        o, S = torch_path.chunk_attention(q_, k_, v_, apply_gate(g_, gate_form, log_a_, b_, lower_bound), beta_,
                                          dims.K ** -0.5 if scale is None else scale, h0_, dS is not None, dims)
        wanted = [x for x, need in zip(leaves, needs) if need and x is not None]
        outputs, grads_out = ([o, S], [do, dS]) if dS is not None else ([o], [do])
        grads = iter(torch.autograd.grad(outputs, wanted, grads_out, allow_unused=True))
    result = []
    for x, need in zip(leaves, needs):
        grad = next(grads) if need and x is not None else None
        if grad is None:
            grad = torch.zeros_like(x) if need and x is not None else q.new_empty(0)
        result.append(grad)
    return result


@chunk_attention_backward.register_fake
def _(do, dS, q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, gate, scale, gate_form, A_log, dt_bias,
      lower_bound, needs):
    return [torch.empty_like(x) if need and x is not None else q.new_empty(0)
            for x, need in zip((q, k, v, g, beta, initial_state, A_log, dt_bias), needs)]


# chunk_attention's inputs that carry gradients, by position: q, k, v, g, beta, initial_state, A_log and dt_bias
_DIFFERENTIABLE = (0, 1, 2, 3, 4, 5, 14, 15)


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, gate, _, scale, output_final_state, _,
     gate_form, A_log, dt_bias, lower_bound) = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, A_log, dt_bias)
    ctx.options = (gate, scale, output_final_state, gate_form, lower_bound)


def _backward(ctx, do, dS):
    gate, scale, output_final_state, gate_form, lower_bound = ctx.options
    *tensors, A_log, dt_bias = ctx.saved_tensors
    flags = ctx.needs_input_grad  # one per argument passed, trailing defaults left out
    needs = [i < len(flags) and flags[i] for i in _DIFFERENTIABLE]
    grads = chunk_attention_backward(do, dS if output_final_state else None, *tensors, gate, scale, gate_form,
                                     A_log, dt_bias, lower_bound, needs)
    result = [None] * len(flags)
    for i, grad, need in zip(_DIFFERENTIABLE, grads, needs):
        if need:
            result[i] = grad
    return tuple(result)


chunk_attention.register_autograd(_backward, setup_context=_setup_context)
