"""Public ops: FLA-compatible signatures, validation at the boundary, then dispatch.

Layout ``[B, T, H, D]``; varlen through ``cu_seqlens`` ``[N+1]`` (B == 1). GVA: v (and g, beta)
carry HV = G*H heads and value head h reads q/k head h // G. States are ``[N, HV, K, V]``
float32 (float64 for float64 inputs). Each attention op returns ``(o, final_state or None)``
with o ``[B, T, HV, V]`` in the input dtype. The state recurrence (S in ``[K, V]`` layout):

    S_t = diag(exp g_t) S_{t-1}                      (gated ops; g scalar or per key channel)
    S_t += k_t (beta_t (v_t - k_t^T S_t))^T           (delta-rule ops)
    S_t += k_t v_t^T                                  (plain ops)
    o_t  = scale q_t^T S_t                            (scale defaults to K ** -0.5)

The attention ops take FLA 0.6's signatures: the same names, order, defaults and options. The options are
input transforms applied before dispatch (l2norm of q and k, beta = sigmoid, the in-kernel gates, the V-first state
layout), so they run on every path unchanged; ``chunk_linear_attn``'s normaliser is an output transform after it.
``cu_seqlens_cpu`` (a host copy of ``cu_seqlens``) spares the one device-to-host copy that validating GPU-resident
boundaries costs. ``check_finite=True`` (every op) raises ValueError at the first NaN/inf input, naming it and its
position (one host sync); otherwise non-finite inputs spread as docs/exactness.md says. Between the transforms each
attention op is one call of the custom op ``tilela::chunk_attention`` (_library.py): it carries autograd (a
recompute on the PyTorch path) and keeps torch.compile graphs whole. An eager call that records no autograd (the
serving case) runs the same implementation without the op's dispatch and its second validation.

On Hopper, long sequences over few heads are split across CTAs (kernels.hopper.seq_split) by a plan made from
the host sequence lengths. A CUDA graph captured on such a call replays correctly for those lengths (as FLA's
tables built from ``cu_seqlens_cpu``); calls that are not split take any layout of the same T and N on replay.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from . import _library
from . import _validation as V
from ._gates import LOG_GATE, InKernelGate, apply_gate
from .torch_path import chunk as torch_path


def _hopper(*tensors):
    """The Hopper backend when every given tensor sits on an sm_90 GPU and TileLang imports, else None (then the
    PyTorch path runs)."""
    present = [t for t in tensors if t is not None]
    if not all(t.is_cuda for t in present):
        return None
    from .kernels import hopper

    return hopper if hopper.available(*present) else None


def safe_gate_bound(lower_bound: float | None) -> bool:
    """Whether FLA's safe_gate takes this lower_bound with the in-kernel gate: -5 <= lower_bound < 0."""
    return lower_bound is not None and -5 <= lower_bound < 0


def _check(q, k, v, g, g_kind, beta, needs_beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu):
    """(dims, scale as a float or None) of a validated call."""
    dims = V.check_attention(q=q, k=k, v=v, g=g, g_kind=g_kind, beta=beta, needs_beta=needs_beta,
                             initial_state=initial_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    return dims, V.check_scale(scale)


def _dispatch(q, k, v, g, g_kind, beta, needs_beta, scale, initial_state, output_final_state, cu_seqlens,
              cu_seqlens_cpu, check_finite=False, gate_in=LOG_GATE):
    """Validate and run one call on the Hopper kernels or the PyTorch path (the body of tilela::chunk_attention);
    gate_in: how g gives the log gate (tilela._gates.InKernelGate)."""
    dims, scale = _check(q, k, v, g, g_kind, beta, needs_beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu)
    return _run(dims, scale, q, k, v, g, g_kind, beta, needs_beta, initial_state, output_final_state, cu_seqlens,
                check_finite, gate_in)


def _run(dims, scale, q, k, v, g, g_kind, beta, needs_beta, initial_state, output_final_state, cu_seqlens,
         check_finite, gate_in):
    """One validated call (dims and scale from _check) on the Hopper kernels (the in-kernel gate formed where they
    sum the gate) or the PyTorch path (the gate formed first). check_finite reads the in-kernel gate as formed: its raw
    input may be ±inf (g = -inf, a reset, or 0), and non-finite A_log or dt_bias show up in it."""
    V.check_finite(check_finite, dict(q=q, k=k, v=v, g=apply_gate(g, *gate_in) if check_finite else g, beta=beta,
                                      initial_state=initial_state), dims.seq_bounds)
    scale = dims.K ** -0.5 if scale is None else scale
    hopper = _hopper(q, k, v, g, beta, initial_state, cu_seqlens)
    if hopper is not None and hopper.plan.covers(hopper.DTYPE_NAMES.get(q.dtype), dims.K, dims.V, g_kind, needs_beta):
        plan = hopper.plan_call(q, v, g, beta, scale, gate=g_kind, lengths=[e - s for s, e in dims.seq_bounds],
                                initial_state=initial_state is not None, output_final_state=output_final_state,
                                varlen=cu_seqlens is not None, gate_form=gate_in.form)
        return hopper.forward(plan, q, k, v, g, beta, initial_state, cu_seqlens, gate_params=gate_in.params,
                              gate_scale=gate_in.lower_bound)
    return torch_path.chunk_attention(q, k, v, apply_gate(g, *gate_in), beta, scale, initial_state,
                                      output_final_state, dims)


def _attention(q, k, v, g, g_kind, beta, needs_beta, scale, initial_state, output_final_state, cu_seqlens,
               cu_seqlens_cpu, check_finite=False, gate_in=LOG_GATE):
    """Validate eagerly; then an eager call on plain tensors that records no autograd runs directly (_run: no custom
    op dispatch, no second validation; the serving case), and every other call goes through the custom op
    tilela::chunk_attention (autograd, fake tensors and other tensor subclasses, functorch transforms, tracing,
    torch.compile; _library.py). Under torch.compile the op validates when it runs, so no value becomes a guard.
    Eagerly the boundaries read once here travel on as the host copy, so the op reads no device memory again."""
    output_final_state = V.check_flag("output_final_state", output_final_state)
    check_finite = V.check_flag("check_finite", check_finite)
    if not torch.compiler.is_compiling():
        dims, scale = _check(q, k, v, g, g_kind, beta, needs_beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu)
        # A_log and dt_bias may carry gradients alone
        tensors = [t for t in (q, k, v, g, beta, initial_state, cu_seqlens, gate_in.A_log, gate_in.dt_bias)
                   if t is not None]
        plain = all(type(t) is torch.Tensor for t in tensors) and V.has_values(q)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        if plain and not grad and not torch._C._are_functorch_transforms_active() and not torch.jit.is_tracing():
            return _run(dims, scale, q, k, v, g, g_kind, beta, needs_beta, initial_state, output_final_state,
                        cu_seqlens, check_finite, gate_in)
        if cu_seqlens is not None and cu_seqlens_cpu is None:
            cu_seqlens_cpu = torch.tensor([0, *(e for _, e in dims.seq_bounds)], dtype=torch.int64)
    o, S = _library.chunk_attention(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, g_kind, needs_beta,
                                    None if scale is None else float(scale), output_final_state, check_finite,
                                    *gate_in)
    return o, (S if output_final_state else None)


# FLA's options, applied as input transforms before dispatch (so they run on every path unchanged).

def _tensor(name: str, x, layout: str | None = None) -> torch.Tensor:
    """x, checked to be a tensor (of layout's rank, e.g. "[B, T, H, K]", when given)."""
    V._expect_tensor(name, x)
    if layout is not None:
        V._expect_rank(name, x, layout.count(",") + 1, layout)
    return x


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, computed in float32 (float64 stays), stored in x's dtype. Without
    autograd: eagerly on Hopper one kernel (kernels.hopper.l2norm: one read, one write); under torch.compile (whose
    tracer cannot enter the kernel's launch) and elsewhere two passes over x (a float32 reduction reading x in its
    dtype, and one product into x's dtype through out=, which autograd does not record, so a call that needs
    gradients takes the float32 copy)."""
    if torch.is_grad_enabled() and x.requires_grad:
        xf = x.float() if x.dtype != torch.float64 else x
        return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
    hopper = None if torch.compiler.is_compiling() else _hopper(x)
    if hopper is not None and hopper.plan.l2norm_covers(hopper.DTYPE_NAMES.get(x.dtype), x.shape[-1]):
        return hopper.l2_normalize(x, eps)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    inverse = torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=dtype).square() + eps)
    return torch.mul(x, inverse, out=torch.empty_like(x))


def _float(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def _chunk_size(value, allowed: tuple[int, ...] | None) -> None:
    """FLA's chunk_size check (allowed None: any power of two). The result does not depend on it: it only picks
    FLA's tiling, so it is validated and otherwise unused."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"chunk_size: expected an int, got {type(value).__name__}")
    ok = value in allowed if allowed is not None else value > 0 and value & (value - 1) == 0
    if not ok:
        raise ValueError(f"chunk_size: expected {'one of ' + str(allowed) if allowed else 'a power of two'}, "
                         f"got {value}")


def _fla_kwargs(kwargs: dict, state_v_first: bool, *, head_first_raises: bool, layout_alias: bool) -> bool:
    """FLA's handling of the options it reads from ``**kwargs`` (every other key is ignored, as FLA does); returns
    the effective ``state_v_first``."""
    if head_first_raises and "head_first" in kwargs:
        raise ValueError("head_first: removed in FLA 0.6; inputs are [B, T, H, D]")
    if layout_alias and "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("transpose_state_layout: deprecated alias of state_v_first; pass only state_v_first")
        warnings.warn("transpose_state_layout is deprecated; use state_v_first", DeprecationWarning, stacklevel=3)
        return V.check_flag("transpose_state_layout", kwargs["transpose_state_layout"])
    return V.check_flag("state_v_first", state_v_first)


def _cp_attention(cp_context, q, k, v, g, g_kind, beta, scale, initial_state, output_final_state, check_finite):
    """A delta-rule call context-parallel over ``cp_context`` (tilela.distributed.build_cp_context): this rank's
    tokens in, its outputs and every sequence's final state out. The context's rank-local boundaries replace the
    call's ``cu_seqlens``, as FLA's; unlike FLA, ``initial_state`` (all sequences, the same on every rank) and
    ``output_final_state`` are honoured."""
    from . import distributed

    def local(v_, h0, final):
        return _attention(q, k, v_, g, g_kind, beta, True, scale, h0, final, cp_context.cu_seqlens,
                          cp_context.cu_seqlens_cpu, check_finite)

    return distributed.context_parallel(local, cp_context, v, _tensor("k", k).shape[-1], initial_state,
                                        V.check_flag("output_final_state", output_final_state), delta=True,
                                        inputs=dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state))


def _qk_beta(q, k, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval):
    """l2norm of q and k, then beta = (2 if allow_neg_eigval else 1) * sigmoid(beta) in float32, as FLA."""
    q, k = _tensor("q", q), _tensor("k", k)
    if V.check_flag("allow_neg_eigval", allow_neg_eigval) and not V.check_flag("use_beta_sigmoid_in_kernel",
                                                                  use_beta_sigmoid_in_kernel):
        raise ValueError("allow_neg_eigval: requires use_beta_sigmoid_in_kernel=True (beta = 2 sigmoid(beta))")
    if V.check_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel):
        q, k = _l2norm(q), _l2norm(k)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(_float(_tensor("beta", beta))) * (2.0 if allow_neg_eigval else 1.0)
    return q, k, beta


def _heads_param(name: str, x, shape: tuple[int, ...], meaning: str) -> torch.Tensor:
    """A per-head parameter given with prod(shape) elements, viewed as ``shape`` in float32 (float64 stays)."""
    x = _tensor(name, x)
    V._expect_dtype(name, x, V.FLOAT_DTYPES)
    n = math.prod(shape)
    if x.numel() != n:
        raise ValueError(f"{name}: expected {n} elements ({meaning}), got shape {V._shape(x)}")
    return _float(x).reshape(shape)


def _gate_shape(g, v, per_channel: bool, K: int) -> torch.Tensor:
    g, v = _tensor("g", g), _tensor("v", v, "[B, T, HV, V]")
    want = (*v.shape[:3], K) if per_channel else tuple(v.shape[:3])
    V._expect_shape("g", g, want, "[B, T, HV, K]" if per_channel else "[B, T, HV]")
    return g


def _state_in(initial_state, state_v_first: bool):
    """A [N, HV, V, K] initial state (state_v_first) as the [N, HV, K, V] the kernels take."""
    if initial_state is None or not state_v_first:
        return initial_state
    return _tensor("initial_state", initial_state, "[N, HV, V, K]").transpose(-1, -2).contiguous()


def _state_out(result, state_v_first: bool):
    o, state = result
    if state is None or not state_v_first:
        return o, state
    return o, state.transpose(-1, -2).contiguous()


def in_kernel_gate(g: torch.Tensor, A_log, dt_bias, lower_bound: float | None) -> InKernelGate:
    """FLA's in-kernel gate on g [B, T, HV] (GDN) or [B, T, HV, K] (KDA): -exp(A_log) softplus(g + dt_bias), or with
    lower_bound lower_bound sigmoid(exp(A_log) (g + dt_bias)) (A_log optional there). A_log [HV], dt_bias [HV] or
    [HV * K] (optional); both viewed over the gate's columns (tilela._gates.param_shapes) in float32 (float64 stays),
    one-element zeros where not given."""
    columns = tuple(g.shape[2:])
    meaning = "[HV]" if len(columns) == 1 else "[HV * K]"
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if isinstance(x, torch.Tensor) and x.device != g.device:
            raise ValueError(f"{name}: expected g's device {g.device}, got {x.device}")
    ones = (1,) * (len(columns) - 1)
    log_a = None if A_log is None else _heads_param("A_log", A_log, (columns[0], *ones), "[HV]")
    b = None if dt_bias is None else _heads_param("dt_bias", dt_bias, columns, meaning)
    like = log_a if log_a is not None else b
    dtype = torch.float32 if like is None else like.dtype
    log_a = g.new_zeros((1, *ones), dtype=dtype) if log_a is None else log_a
    b = g.new_zeros((1, *ones), dtype=dtype) if b is None else b
    return InKernelGate("softplus" if lower_bound is None else "sigmoid", log_a, b, lower_bound)


def _gated_delta(q, k, v, g, gate, beta, scale, initial_state, output_final_state, state_v_first, cu_seqlens,
                 cu_seqlens_cpu, cp_context, check_finite, gate_in=LOG_GATE):
    """GDN and KDA after their input transforms: one process, or the ranks of cp_context (tilela.distributed); the
    state in FLA's layout either way. gate_in: g is the in-kernel gate's input (the context-parallel path forms the
    gate first)."""
    initial_state = _state_in(initial_state, state_v_first)
    if cp_context is not None:
        g = apply_gate(g, *gate_in)
        result = _cp_attention(cp_context, q, k, v, g, gate, beta, scale, initial_state, output_final_state,
                               check_finite)
    else:
        result = _attention(q, k, v, g, gate, beta, True, scale, initial_state, output_final_state, cu_seqlens,
                            cu_seqlens_cpu, check_finite, gate_in)
    return _state_out(result, state_v_first)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    cp_context: object | None = None,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
    check_finite: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet with FLA 0.6's signature: g per-token log gate [B, T, HV] (raw, not cumsum'd), beta
    [B, T, HV] in (0, 1). The options (l2norm, beta sigmoid, in-kernel gate, V-first state) are input transforms
    applied before dispatch. ``chunk_indices`` is derived from ``cu_seqlens`` and unused; other keyword arguments
    are ignored, as FLA does."""
    state_v_first = _fla_kwargs(kwargs, state_v_first, head_first_raises=True, layout_alias=True)
    _chunk_size(chunk_size, (16, 32, 64))
    q, k, beta = _qk_beta(q, k, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    gate_in = LOG_GATE
    if V.check_flag("use_gate_in_kernel", use_gate_in_kernel):
        g = _gate_shape(g, v, False, 0)
        if A_log is None:
            raise ValueError("A_log: required when use_gate_in_kernel=True")
        gate_in = in_kernel_gate(g, A_log, dt_bias, None)
    return _gated_delta(q, k, v, g, "scalar", beta, scale, initial_state, output_final_state, state_v_first,
                        cu_seqlens, cu_seqlens_cpu, cp_context, check_finite, gate_in=gate_in)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    cp_context: object | None = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
    check_finite: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention with FLA 0.6's signature: as GDN with the log gate per key channel, g [B, T, HV, K].

    With ``use_gate_in_kernel`` g is the raw gate input: g = -exp(A_log) softplus(g + dt_bias), or with
    ``lower_bound`` g = lower_bound sigmoid(exp(A_log) (g + dt_bias)) (A_log [HV] optional there, dt_bias
    [HV * K] optional); without it A_log and dt_bias are ignored, as FLA does. ``safe_gate`` requires
    -5 <= lower_bound < 0 with the in-kernel gate, as FLA's; it selects nothing here: the Hopper kernels and the
    PyTorch path are exact for any gate (docs/exactness.md). ``disable_recompute``, ``use_graph`` and
    ``max_num_seqs`` only tune FLA's own kernels and are unused; other keyword arguments are ignored, as FLA does."""
    state_v_first = _fla_kwargs(kwargs, state_v_first, head_first_raises=False, layout_alias=True)
    _chunk_size(chunk_size, (32, 64))
    if V.check_flag("return_intermediate_states", return_intermediate_states):
        raise ValueError("return_intermediate_states: the per-chunk states are not returned; pass False")
    safe_gate = V.check_flag("safe_gate", safe_gate)
    for name, flag in (("disable_recompute", disable_recompute), ("use_graph", use_graph)):
        V.check_flag(name, flag)
    if lower_bound is not None and (isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float))):
        raise TypeError(f"lower_bound: expected a float or None, got {type(lower_bound).__name__}")
    q, k, beta = _qk_beta(q, k, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    gate_in = LOG_GATE
    if V.check_flag("use_gate_in_kernel", use_gate_in_kernel):
        if A_log is None and lower_bound is None:
            raise ValueError("A_log: required when use_gate_in_kernel=True and lower_bound is not set")
        if safe_gate and not safe_gate_bound(lower_bound):
            raise ValueError(f"lower_bound: safe_gate with use_gate_in_kernel needs -5 <= lower_bound < 0, "
                             f"got {lower_bound}")
        g = _gate_shape(g, v, True, q.shape[-1])
        gate_in = in_kernel_gate(g, A_log, dt_bias, lower_bound)
    return _gated_delta(q, k, v, g, "channel", beta, scale, initial_state, output_final_state, state_v_first,
                        cu_seqlens, cu_seqlens_cpu, cp_context, check_finite, gate_in)


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    *,
    chunk_size: int = 64,
    check_finite: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DeltaNet (ladder level 4) with FLA 0.6's signature: the delta rule with no gate. Other keyword arguments
    are ignored, as FLA does (which also takes float32 here)."""
    _fla_kwargs(kwargs, False, head_first_raises=True, layout_alias=False)
    _chunk_size(chunk_size, (16, 32, 64))
    q, k, beta = _qk_beta(q, k, beta, use_qk_l2norm_in_kernel, False, False)
    return _attention(q, k, v, None, "none", beta, True, scale, initial_state, output_final_state, cu_seqlens,
                      cu_seqlens_cpu, check_finite)


def _normalize(o, q, k, scale: float, z_init, cu_seqlens):
    """FLA's linear-attention normaliser: o / (scale q_t . (z_init + sum_{s <= t} k_s) + 1e-10) per sequence, and
    the running key sum z [N, 1, H, K] in k's dtype. Computed in float32 (float64 stays), without host reads."""
    qf, kf = _float(q), _float(k)
    B, T, H, K = k.shape
    if cu_seqlens is None:
        k_cum = kf.cumsum(1)
        if z_init is not None:
            k_cum = k_cum + _float(z_init)
        z = k_cum[:, -1:] if T else (kf.new_zeros(B, 1, H, K) if z_init is None else _float(z_init))
    else:
        prefix = F.pad(kf[0].cumsum(0), (0, 0, 0, 0, 1, 0))  # [T + 1, H, K], prefix[t] = sum of tokens < t
        cu = cu_seqlens.long()
        seq = torch.searchsorted(cu[1:], torch.arange(T, device=k.device), right=True)
        k_cum = prefix[1:] - prefix[cu[seq]]
        z = prefix[cu[1:]] - prefix[cu[:-1]]
        if z_init is not None:
            k_cum, z = k_cum + _float(z_init)[seq, 0], z + _float(z_init)[:, 0]
        k_cum, z = k_cum[None], z[:, None]
    denom = (qf * scale * k_cum).sum(-1, keepdim=True) + 1e-10
    return (_float(o) / denom.repeat_interleave(o.shape[2] // H, dim=2)).to(o.dtype), z.to(k.dtype)


def chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | tuple | None = None,
    output_final_state: bool = False,
    normalize: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    *,
    cu_seqlens_cpu: torch.Tensor | None = None,
    check_finite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | tuple | None]:
    """Plain causal linear attention (ladder level 1) with FLA 0.6's signature.

    ``normalize=True`` (FLA's default) divides o_t by scale q_t . (z_0 + sum_{s <= t} k_s) + 1e-10 and returns
    ``(o, (final_state or None, z))`` with z [N, 1, H, K] the running key sum in k's dtype; ``initial_state`` may
    then be the pair ``(S_0, z_0)``. The normaliser is an output transform in PyTorch after the unchanged kernels.
    ``normalize=False`` returns ``(o, final_state or None)``."""
    q, k = _tensor("q", q), _tensor("k", k, "[B, T, H, K]")
    z_init = None
    if V.check_flag("normalize", normalize) and isinstance(initial_state, tuple):
        if len(initial_state) != 2:
            raise ValueError(f"initial_state: expected a pair (S_0, z_0), got {len(initial_state)} items")
        initial_state, z_init = initial_state
    result = _attention(q, k, v, None, "none", None, False, scale, initial_state, output_final_state, cu_seqlens,
                        cu_seqlens_cpu, check_finite)
    if not normalize:
        return result
    B, T, H, K = k.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if z_init is not None:
        V._expect_shape("initial_state", _tensor("initial_state", z_init), (N, 1, H, K), "z_0 [N, 1, H, K]")
    o, z = _normalize(result[0], q, k, K ** -0.5 if scale is None else V.check_scale(scale), z_init, cu_seqlens)
    return o, (result[1], z)


def chunk_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
    check_finite: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scalar-gated linear attention (ladder level 2-3) with FLA 0.6's signature: g [B, T, HV] per-token log gate
    and/or g_gamma [HV] a constant log decay per head; both add in log space, neither gives plain linear attention.
    Other keyword arguments are ignored, as FLA does."""
    state_v_first = _fla_kwargs(kwargs, state_v_first, head_first_raises=True, layout_alias=False)
    if chunk_size is not None:
        _chunk_size(chunk_size, None)
    if g_gamma is not None:
        v = _tensor("v", v, "[B, T, HV, V]")
        gamma = _heads_param("g_gamma", g_gamma, (v.shape[2],), "[HV]").expand(*v.shape[:3]).contiguous()
        g = gamma if g is None else _float(_gate_shape(g, v, False, 0)) + gamma
    gate = "none" if g is None else "scalar"
    return _state_out(_attention(q, k, v, g, gate, None, False, scale, _state_in(initial_state, state_v_first),
                                 output_final_state, cu_seqlens, cu_seqlens_cpu, check_finite), state_v_first)


def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    *,
    check_finite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated linear attention (ladder level 3) with FLA 0.6's signature: g [B, T, HV, K] per-token, per-key-channel
    log gate, <= 0 (a decay).

    On Hopper a 64-token chunk's intra-chunk scores come from one product over the key channels that decay by at
    most e^-160 over it, and term by term over the others: exact for any gate. The kernels read the gate in its own
    dtype and sum it in their tiles."""
    V.check_flag("state_v_first", state_v_first)
    return _state_out(_attention(q, k, v, g, "channel", None, False, scale, _state_in(initial_state, state_v_first),
                                 output_final_state, cu_seqlens, cu_seqlens_cpu, check_finite), state_v_first)


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
        key, steps = hopper.plan.kkt_plan(chunk_size, method, hopper.DTYPE_NAMES[k.dtype], gate, dims.H, dims.HV,
                                          [e - s for s, e in dims.seq_bounds], hopper.multiprocessors(k.device))
        A, _ = launch.launch_kkt(key, k.contiguous(), beta.contiguous(), None if g is None else g.float().contiguous(),
                                 launch.Schedule.of(k, cu_seqlens), steps)
        return A
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

        return launch.launch_cumsum((chunk_size, hopper.DTYPE_NAMES[g.dtype], "log"), g.contiguous(),
                                         launch.Schedule.of(g, cu_seqlens), scale)
    return torch_path.chunk_local_cumsum(g, chunk_size, scale, dims)
