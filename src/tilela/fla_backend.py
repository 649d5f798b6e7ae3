"""tilela as a backend in flash-linear-attention 0.6's registry (``fla.backends``).

FLA dispatches two public entry points through its registry: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``
(the operation registry ``'gated_delta_rule'``) and ``fla.ops.kda.chunk_kda`` (keyed on the function).
``enable()`` registers one backend class into both, after which code that calls FLA's functions (FLA's own layers,
transformers' Qwen3-Next and Kimi Linear) runs tilela's op whenever the verifier accepts the call, and FLA's
default otherwise; FLA re-reads ``FLA_TILELA`` on every call, so ``FLA_TILELA=0`` turns the backend off at runtime.

The verifier accepts a call exactly when tilela runs it and is the better choice:

- FLA's own errors stay FLA's: a call FLA rejects (a removed ``head_first``, ``allow_neg_eigval`` without
  ``use_beta_sigmoid_in_kernel``, the in-kernel gate without ``A_log``, ``safe_gate`` with the in-kernel gate outside
  -5 <= lower_bound < 0, bad shapes) falls back to FLA, which raises;
- unsupported here: ``cp_context`` (context parallelism) and ``return_intermediate_states``;
- on a GPU only what the Hopper kernels serve (``kernels.hopper.plan.covers``: bf16/fp16, K = V in {64, 128, 256};
  chunk_kda with every gate form), and only for inference (with an input that requires grad FLA's Triton backward is
  faster than tilela's recompute on the PyTorch path);
- on the CPU every valid call (FLA's Triton kernels do not run there).
"""

from __future__ import annotations

import inspect

import torch

from . import ops

BACKEND_TYPE = "tilela"
ENV_VAR = "FLA_TILELA"
PRIORITY = 2  # ahead of FlashQLA and FlashKDA (3), behind NPU backends (0)
# FLA entry point -> (tilela gate kind, whether FLA raises on a head_first keyword)
ENTRY_POINTS = {"chunk_gated_delta_rule": ("scalar", True), "chunk_kda": ("channel", False)}


def verify(name: str, *args, **kwargs) -> tuple[bool, str | None]:
    """(accepted, reason) for one call of FLA's ``name`` with these arguments (see the module docstring)."""
    op = getattr(ops, name)
    gate, head_first_raises = ENTRY_POINTS[name]
    try:
        a = inspect.signature(op).bind(*args, **kwargs)
    except TypeError as error:
        return False, str(error)
    a.apply_defaults()
    x, extra = a.arguments, a.arguments["kwargs"]
    if x["cp_context"] is not None:
        return False, "cp_context: context parallelism is not supported"
    if x.get("return_intermediate_states"):
        return False, "return_intermediate_states is not supported"
    if head_first_raises and "head_first" in extra:
        return False, "head_first: FLA raises"
    if "transpose_state_layout" in extra and x["state_v_first"]:
        return False, "transpose_state_layout with state_v_first: FLA raises"
    if x["allow_neg_eigval"] and not x["use_beta_sigmoid_in_kernel"]:
        return False, "allow_neg_eigval without use_beta_sigmoid_in_kernel: FLA raises"
    if x["use_gate_in_kernel"] and x["A_log"] is None and x.get("lower_bound") is None:
        return False, "use_gate_in_kernel without A_log: FLA raises"
    if x["use_gate_in_kernel"] and x.get("safe_gate") and not ops.safe_gate_bound(x.get("lower_bound")):
        return False, "safe_gate with use_gate_in_kernel outside -5 <= lower_bound < 0: FLA raises"
    q, k, v, g, beta, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    if x["state_v_first"] or extra.get("transpose_state_layout"):
        h0 = None if h0 is None else h0.transpose(-1, -2)
    try:
        ops._check(q, k, v, g, gate, beta, True, x["scale"], h0, x["cu_seqlens"], x["cu_seqlens_cpu"])
    except (TypeError, ValueError) as error:
        return False, str(error)
    tensors = [t for t in (q, k, v, g, beta, h0, x["A_log"], x["dt_bias"]) if isinstance(t, torch.Tensor)]
    if q.device.type == "cpu":
        return True, None
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return False, "an input requires grad: FLA's backward is faster than tilela's recompute"
    hopper = ops._hopper(*tensors)
    if hopper is None or not hopper.plan.covers(hopper.DTYPE_NAMES.get(q.dtype), q.shape[-1], v.shape[-1], gate,
                                                True):
        return False, "not served by tilela's Hopper kernels (device, dtype, K, V or gate)"
    return True, None


def _backend_class():
    from fla.backends import BaseBackend

    class TilelaBackend(BaseBackend):
        """FLA backend running tilela's ops (tilela.fla_backend)."""

        backend_type = BACKEND_TYPE
        package_name = "tilela"
        env_var = ENV_VAR
        default_enable = True
        priority = PRIORITY

        def chunk_gated_delta_rule_verifier(self, *args, **kwargs):
            return verify("chunk_gated_delta_rule", *args, **kwargs)

        def chunk_gated_delta_rule(self, *args, **kwargs):
            return ops.chunk_gated_delta_rule(*args, **kwargs)

        def chunk_kda_verifier(self, *args, **kwargs):
            return verify("chunk_kda", *args, **kwargs)

        def chunk_kda(self, *args, **kwargs):
            return ops.chunk_kda(*args, **kwargs)

    return TilelaBackend


def enable() -> None:
    """Register tilela into FLA's registries for chunk_gated_delta_rule and chunk_kda (imports FLA, which must be
    installed). Idempotent: registering again replaces the entry. ``FLA_TILELA=0`` disables it per call."""
    import fla.ops.gated_delta_rule  # noqa: F401  (loads the 'gated_delta_rule' registry and its backends)
    import fla.ops.kda
    from fla.backends import register

    backend = _backend_class()
    register("gated_delta_rule")(backend)
    register(fla.ops.kda.chunk_kda)(backend)
