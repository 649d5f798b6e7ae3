"""Public ops: FLA-compatible signatures, validation once, then dispatch.

Layout ``[B, T, H, D]``; varlen through ``cu_seqlens`` ``[N+1]`` (B == 1). GVA: v (and g, beta)
carry HV = G*H heads and value head h reads q/k head h // G. States are ``[N, HV, K, V]``
float32 (float64 for float64 inputs). Each attention op returns ``(o, final_state or None)``
with o ``[B, T, HV, V]`` in the input dtype. The state recurrence (S in ``[K, V]`` layout):

    S_t = diag(exp g_t) S_{t-1}                      (gated ops; g scalar or per key channel)
    S_t += k_t (beta_t (v_t - k_t^T S_t))^T           (delta-rule ops)
    S_t += k_t v_t^T                                  (plain ops)
    o_t  = scale q_t^T S_t                            (scale defaults to K ** -0.5)

Arguments after ``output_final_state`` are keyword-only, so a call written for FLA's argument
order cannot bind them to the wrong parameter. ``cu_seqlens_cpu`` (a host copy of
``cu_seqlens``) spares the one device-to-host copy that validating GPU-resident boundaries costs.

On Hopper, long sequences over few heads are split across CTAs (kernels.hopper.seq_split) by a plan made from
the host sequence lengths. A CUDA graph captured on such a call replays correctly for those lengths (as FLA's
tables built from ``cu_seqlens_cpu``); calls that are not split take any layout of the same T and N on replay.
"""

from __future__ import annotations

import torch

from . import _validation as V
from .torch_path import chunk as torch_path


def _hopper(*tensors):
    """The Hopper backend when every given tensor sits on an sm_90 GPU and TileLang imports, else None (then the
    PyTorch path runs)."""
    present = [t for t in tensors if t is not None]
    if not all(t.is_cuda for t in present):
        return None
    from .kernels import hopper

    return hopper if hopper.available(*present) else None


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float() if x.dtype != torch.float64 else x
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _attention(q, k, v, g, g_kind, beta, needs_beta, scale, initial_state, output_final_state, cu_seqlens,
               cu_seqlens_cpu, use_qk_l2norm_in_kernel=False, check_finite=False):
    dims = V.check_attention(
        q=q, k=k, v=v, g=g, g_kind=g_kind, beta=beta, needs_beta=needs_beta,
        initial_state=initial_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
    )
    V.check_finite(check_finite, dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state), dims.seq_bounds)
    scale = dims.K ** -0.5 if scale is None else V.check_scale(scale)
    output_final_state = V.check_flag("output_final_state", output_final_state)
    if V.check_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel):
        q, k = _l2norm(q), _l2norm(k)
    hopper = _hopper(q, k, v, g, beta, initial_state, cu_seqlens)
    if hopper is not None and hopper.plan.covers(hopper.DTYPE_NAMES.get(q.dtype), dims.K, dims.V, g_kind, needs_beta):
        plan = hopper.plan_call(q, v, g, beta, scale, gate=g_kind, lengths=[e - s for s, e in dims.seq_bounds],
                                initial_state=initial_state is not None, output_final_state=output_final_state,
                                varlen=cu_seqlens is not None)
        return hopper.forward(plan, q, k, v, g, beta, initial_state, cu_seqlens)
    return torch_path.chunk_attention(q, k, v, g, beta, scale, initial_state, output_final_state, dims)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens_cpu: torch.Tensor | None = None,
    check_finite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet. g: per-token log gate [B, T, HV] (raw, not cumsum'd; -inf resets the state); beta [B, T, HV]
    in (0, 1).

    ``check_finite=True`` raises ValueError at the first NaN/inf input, naming it and its position (one host sync);
    otherwise non-finite inputs spread as docs/exactness.md says."""
    return _attention(q, k, v, g, "scalar", beta, True, scale, initial_state, output_final_state, cu_seqlens,
                      cu_seqlens_cpu, use_qk_l2norm_in_kernel, check_finite)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens_cpu: torch.Tensor | None = None,
    check_finite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention: as GDN with the log gate per key channel, g [B, T, HV, K].

    On Hopper the intra-chunk scores use 16-token sub-chunks: exact while no key channel decays by more
    than e^-80 within 16 tokens (mean log gate >= -5 per token, KDA's lower bound).

    ``check_finite=True`` raises ValueError at the first NaN/inf input, naming it and its position (one host sync);
    otherwise non-finite inputs spread as docs/exactness.md says."""
    return _attention(q, k, v, g, "channel", beta, True, scale, initial_state, output_final_state, cu_seqlens,
                      cu_seqlens_cpu, use_qk_l2norm_in_kernel, check_finite)


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens_cpu: torch.Tensor | None = None,
    check_finite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DeltaNet (ladder level 4): the delta rule with no gate.

    ``check_finite=True`` raises ValueError at the first NaN/inf input, naming it and its position (one host sync);
    otherwise non-finite inputs spread as docs/exactness.md says."""
    return _attention(q, k, v, None, "none", beta, True, scale, initial_state, output_final_state, cu_seqlens,
                      cu_seqlens_cpu, use_qk_l2norm_in_kernel, check_finite)


def chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    check_finite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain causal linear attention (ladder level 1), unnormalised (FLA's ``normalize=False``).

    ``check_finite=True`` raises ValueError at the first NaN/inf input, naming it and its position (one host sync);
    otherwise non-finite inputs spread as docs/exactness.md says."""
    return _attention(q, k, v, None, "none", None, False, scale, initial_state, output_final_state, cu_seqlens,
                      cu_seqlens_cpu, check_finite=check_finite)


def chunk_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    check_finite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scalar-gated linear attention (ladder level 2-3): g [B, T, HV] per-token log gate; a
    constant g is level 2's fixed decay.

    ``check_finite=True`` raises ValueError at the first NaN/inf input, naming it and its position (one host sync);
    otherwise non-finite inputs spread as docs/exactness.md says."""
    return _attention(q, k, v, g, "scalar", None, False, scale, initial_state, output_final_state, cu_seqlens,
                      cu_seqlens_cpu, check_finite=check_finite)


def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    check_finite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated linear attention (ladder level 3): g [B, T, HV, K] per-token, per-key-channel log gate, <= 0 (a decay).

    On Hopper a 64-token chunk's intra-chunk scores come from one product while no key channel decays by more than
    e^-80 over it, else from 16-token sub-chunks: exact while no key channel decays by more than e^-80 within 16
    tokens (mean log gate >= -5 per token). A bf16/fp16 gate is converted to fp32 first (one pass over it).

    ``check_finite=True`` raises ValueError at the first NaN/inf input, naming it and its position (one host sync);
    otherwise non-finite inputs spread as docs/exactness.md says."""
    return _attention(q, k, v, g, "channel", None, False, scale, initial_state, output_final_state, cu_seqlens,
                      cu_seqlens_cpu, check_finite=check_finite)


def kkt_solve(
    k: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    *,
    method: str = "blocked",
    cu_seqlens_cpu: torch.Tensor | None = None,
    check_finite: bool = False,
) -> torch.Tensor:
    """Per chunk A = (I + strictLower(diag(beta) (Gamma ⊙ K K^T)))^-1, returned as [B, T, HV, C]
    in k's dtype: row t holds row i of its chunk's A (i = t's index in the chunk).

    k [B, T, H, K]; beta [B, T, HV]; g None or the chunk-local cumsum of the log gate [B, T, HV]
    (what ``chunk_local_cumsum`` returns), Gamma_ij = exp(g_i - g_j). ``method`` picks the Hopper
    kernel's inverse: "blocked" (recursive 16x16 blocks) or "neumann" (16x16 Neumann products);
    both compute the same matrix. ``check_finite=True`` raises ValueError at the first NaN/inf (-inf allowed
    in g) of k, beta and g, naming it and its position (one host sync).
    """
    dims = V.check_kkt(k, beta, g, chunk_size, method, cu_seqlens, cu_seqlens_cpu)
    V.check_finite(check_finite, dict(k=k, beta=beta, g=g), dims.seq_bounds)
    hopper = _hopper(k, beta, g)
    if hopper is not None and k.dtype in (torch.bfloat16, torch.float16) and dims.K % 64 == 0:
        from .kernels.hopper import launch

        gate = "none" if g is None else ("scalar" if g.dim() == 3 else "channel")
        key = hopper.plan.kkt_key(chunk_size, method, hopper.DTYPE_NAMES[k.dtype], gate, dims.HV // dims.H)
        return launch.launch_kkt(key, k.contiguous(), beta.contiguous(), None if g is None else g.float().contiguous(),
                                launch.Schedule.of(k, cu_seqlens))
    return torch_path.kkt_solve(k, beta, g, chunk_size, dims)


def chunk_local_cumsum(
    g: torch.Tensor,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    check_finite: bool = False,
) -> torch.Tensor:
    """Inclusive prefix sum of g [B, T, H] or [B, T, H, K] inside each chunk of each sequence,
    in float32 (float64 for float64 input); ``scale`` multiplies it (log2(e) feeds exp2). Each gate is first
    clamped from below at tilela._gates.LOG_GATE_FLOOR (exp(gc_i - gc_j) stays exact where exp underflows).
    ``check_finite=True`` raises ValueError at the first NaN/+inf of g, naming its position (one host sync)."""
    dims = V.check_cumsum(g, chunk_size, cu_seqlens, cu_seqlens_cpu)
    scale = V.check_scale(scale)
    V.check_finite(check_finite, dict(g=g), dims.seq_bounds)
    hopper = _hopper(g)
    if hopper is not None and g.dtype != torch.float64:
        from .kernels.hopper import launch

        return launch.launch_cumsum((chunk_size, hopper.DTYPE_NAMES[g.dtype]), g.contiguous(),
                                         launch.Schedule.of(g, cu_seqlens), scale)
    return torch_path.chunk_local_cumsum(g, chunk_size, scale, dims)
