"""Input validation for the public ops, done once at the boundary.

Every check raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape or value)
with a message that names the argument, what was expected and what came. Nothing below the
public ops re-checks; nothing is broadcast or truncated silently.
"""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
STATE_DTYPES = (torch.float32, torch.float64)
CHUNK_SIZES = (16, 32, 64)
KKT_METHODS = ("blocked", "neumann")


@dataclass(frozen=True)
class Dims:
    """Sizes of one call: batch B, length T, q/k heads H, value heads HV, key dim K, value dim V,
    sequence count N (B, or len(cu_seqlens) - 1), and the sequence boundaries on the host."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int
    seq_bounds: tuple[tuple[int, int], ...]


def _shape(x: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in x.shape) + "]"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _expect_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def _expect_dtype(name: str, x: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if x.dtype not in allowed:
        names = ", ".join(_dtype_name(d) for d in allowed)
        raise TypeError(f"{name}: expected dtype in ({names}), got {_dtype_name(x.dtype)}")


def _expect_shape(name: str, x: torch.Tensor, expected: tuple[int, ...], meaning: str) -> None:
    if tuple(x.shape) != expected:
        want = "[" + ", ".join(str(s) for s in expected) + "]"
        raise ValueError(f"{name}: expected shape {meaning} = {want}, got {_shape(x)}")


def _expect_rank(name: str, x: torch.Tensor, rank: int, meaning: str) -> None:
    if x.dim() != rank:
        raise ValueError(f"{name}: expected a {rank}-d tensor {meaning}, got {x.dim()}-d of shape {_shape(x)}")


def _same_device(named: dict[str, torch.Tensor | None]) -> None:
    present = [(n, t) for n, t in named.items() if t is not None]
    first_name, first = present[0]
    for n, t in present[1:]:
        if t.device != first.device:
            raise ValueError(f"{n}: expected device {first.device} (as {first_name}), got {t.device}")


def has_values(t: torch.Tensor) -> bool:
    """Whether t's values can be read: not a meta tensor, nor a fake one (shapes only, as under tracing)."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type != "meta" and not is_fake(t)


def check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B: int, T: int) -> tuple[tuple[int, int], ...]:
    """Validate varlen boundaries and return them as host (bos, eos) pairs.

    The values are read from ``cu_seqlens_cpu`` when given, from ``cu_seqlens`` when it lives on the host, and
    otherwise with one device-to-host copy. When both live on the host they must be equal; a device-resident
    ``cu_seqlens`` is trusted to equal ``cu_seqlens_cpu`` (comparing them would cost the copy it exists to avoid).
    A meta or fake ``cu_seqlens`` has no values, so ``cu_seqlens_cpu`` is required there.
    """
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise ValueError("cu_seqlens_cpu: given without cu_seqlens; pass both or neither")
        return tuple((b * T, (b + 1) * T) for b in range(B))
    for name, t in (("cu_seqlens", cu_seqlens), ("cu_seqlens_cpu", cu_seqlens_cpu)):
        if t is None:
            continue
        _expect_tensor(name, t)
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name}: expected an integer tensor (int32 or int64), got {_dtype_name(t.dtype)}")
        if t.dim() != 1 or t.numel() < 2:
            raise ValueError(f"{name}: expected a 1-d tensor [N+1] with N >= 1, got shape {_shape(t)}")
    if cu_seqlens_cpu is not None and cu_seqlens_cpu.device.type != "cpu":
        raise ValueError(f"cu_seqlens_cpu: expected a host (cpu) tensor, got device {cu_seqlens_cpu.device}")
    if cu_seqlens_cpu is not None and cu_seqlens_cpu.shape != cu_seqlens.shape:
        raise ValueError(f"cu_seqlens_cpu: expected shape {_shape(cu_seqlens)} (as cu_seqlens), "
                         f"got {_shape(cu_seqlens_cpu)}")
    if cu_seqlens_cpu is None and not has_values(cu_seqlens):
        raise ValueError("cu_seqlens: a meta or fake tensor has no values to read the boundaries from; pass their "
                         "host copy as cu_seqlens_cpu")
    if cu_seqlens_cpu is not None and not has_values(cu_seqlens_cpu):
        raise ValueError("cu_seqlens_cpu: expected a host tensor with values, got a fake tensor")
    if B != 1:
        raise ValueError(f"cu_seqlens: varlen inputs are packed along T, so the batch size must be 1; got B = {B}")
    host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    values = [int(x) for x in host.tolist()]
    if cu_seqlens_cpu is not None and cu_seqlens.device.type == "cpu" and has_values(cu_seqlens):
        for i, (a, b) in enumerate(zip(cu_seqlens.tolist(), values)):
            if a != b:
                raise ValueError(f"cu_seqlens, cu_seqlens_cpu: expected equal values (both are on the host), got "
                                 f"cu_seqlens[{i}] = {a} and cu_seqlens_cpu[{i}] = {b}")
    if values[0] != 0:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[0] == 0, got {values[0]}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(f"cu_seqlens: expected non-decreasing values, got cu_seqlens[{i}] = {values[i]} < "
                             f"cu_seqlens[{i - 1}] = {values[i - 1]}")
    if values[-1] != T:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[-1] == T = {T}, got {values[-1]}")
    return tuple(zip(values[:-1], values[1:]))


def check_scale(scale) -> float | None:
    """``scale`` as a Python float, or None. Any finite real is accepted (a negative scale negates the output): a
    Python or numpy number, or a 0-d real tensor on the host (reading a device tensor would synchronise)."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        if scale.dim() != 0 or scale.dtype == torch.bool or scale.is_complex():
            raise TypeError(f"scale: expected a real number, got a {scale.dim()}-d {_dtype_name(scale.dtype)} tensor")
        if scale.device.type != "cpu":
            raise ValueError(f"scale: expected a host (cpu) 0-d tensor or a number, got device {scale.device}")
        scale = scale.item()
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a real number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale}")
    return scale


def check_flag(name: str, value) -> bool:
    """A switch as a Python bool: ``bool`` or ``numpy.bool_``, nothing that merely converts to one."""
    numpy = sys.modules.get("numpy")  # a numpy bool can only come from an imported numpy
    if isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_)):
        return bool(value)
    raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


def check_attention(
    *,
    q,
    k,
    v,
    g=None,
    g_kind: str = "none",
    beta=None,
    needs_beta: bool = False,
    initial_state=None,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
) -> Dims:
    """Validate the inputs of one chunked attention op.

    g_kind: "none" (no gate), "scalar" (g [B, T, HV]) or "channel" (g [B, T, HV, K]).
    """
    q = _expect_tensor("q", q)
    k = _expect_tensor("k", k)
    v = _expect_tensor("v", v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _expect_rank(name, t, 4, "[B, T, H, D]")
        _expect_dtype(name, t, FLOAT_DTYPES)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"k, v: expected the dtype of q ({q.dtype}), got k {k.dtype} and v {v.dtype}")
    B, T, H, K = q.shape
    _expect_shape("k", k, (B, T, H, K), "as q [B, T, H, K]")
    if v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"v: expected shape [B, T, HV, V] with B = {B}, T = {T} (as q), got {_shape(v)}")
    HV, V = v.shape[2], v.shape[3]
    if K == 0 or V == 0 or H == 0 or HV == 0:
        raise ValueError(f"q, v: expected non-empty head dims, got q {_shape(q)} and v {_shape(v)}")
    if HV % H != 0:
        raise ValueError(f"v: expected a head count HV that is a multiple of the q/k heads H = {H}, got HV = {HV}")

    if g_kind == "none":
        if g is not None:
            raise ValueError("g: this op takes no gate")
    else:
        g = _expect_tensor("g", g)
        _expect_dtype("g", g, FLOAT_DTYPES)
        if g_kind == "scalar":
            _expect_shape("g", g, (B, T, HV), "[B, T, HV]")
        else:
            _expect_shape("g", g, (B, T, HV, K), "[B, T, HV, K]")
    if needs_beta:
        beta = _expect_tensor("beta", beta)
        _expect_dtype("beta", beta, FLOAT_DTYPES)
        _expect_shape("beta", beta, (B, T, HV), "[B, T, HV]")

    seq_bounds = check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B, T)
    N = len(seq_bounds)
    if initial_state is not None:
        initial_state = _expect_tensor("initial_state", initial_state)
        _expect_dtype("initial_state", initial_state, STATE_DTYPES)
        _expect_shape("initial_state", initial_state, (N, HV, K, V), "[N, HV, K, V]")
    _same_device({"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state,
                  "cu_seqlens": cu_seqlens})
    return Dims(B=B, T=T, H=H, HV=HV, K=K, V=V, N=N, seq_bounds=seq_bounds)


def check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size: expected an int, got {type(chunk_size).__name__}")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {CHUNK_SIZES}, got {chunk_size}")


def check_kkt(k, beta, g, chunk_size, method, cu_seqlens, cu_seqlens_cpu) -> Dims:
    """Validate kkt_solve's inputs: k [B, T, H, K], beta [B, T, HV], g None or [B, T, HV]."""
    k = _expect_tensor("k", k)
    _expect_rank("k", k, 4, "[B, T, H, K]")
    _expect_dtype("k", k, FLOAT_DTYPES)
    beta = _expect_tensor("beta", beta)
    _expect_rank("beta", beta, 3, "[B, T, HV]")
    _expect_dtype("beta", beta, FLOAT_DTYPES)
    B, T, H, K = k.shape
    if beta.shape[0] != B or beta.shape[1] != T:
        raise ValueError(f"beta: expected shape [B, T, HV] with B = {B}, T = {T} (as k), got {_shape(beta)}")
    HV = beta.shape[2]
    if K == 0:
        raise ValueError(f"k: expected a non-empty key dim K, got shape {_shape(k)}")
    if H == 0 or HV == 0 or HV % H != 0:
        raise ValueError(f"beta: expected a head count HV that is a multiple of the k heads H = {H}, got HV = {HV}")
    if g is not None:
        g = _expect_tensor("g", g)
        _expect_dtype("g", g, FLOAT_DTYPES)
        _expect_shape("g", g, (B, T, HV), "[B, T, HV]")
    check_chunk_size(chunk_size)
    if method not in KKT_METHODS:
        raise ValueError(f"method: expected one of {KKT_METHODS}, got {method!r}")
    seq_bounds = check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B, T)
    _same_device({"k": k, "beta": beta, "g": g, "cu_seqlens": cu_seqlens})
    return Dims(B=B, T=T, H=H, HV=HV, K=K, V=0, N=len(seq_bounds), seq_bounds=seq_bounds)


def check_cumsum(g, chunk_size, cu_seqlens, cu_seqlens_cpu) -> Dims:
    """Validate chunk_local_cumsum's inputs: g [B, T, H] or [B, T, H, K] (``scale``: ``check_scale``)."""
    g = _expect_tensor("g", g)
    _expect_dtype("g", g, FLOAT_DTYPES)
    if g.dim() not in (3, 4):
        raise ValueError(f"g: expected a 3-d [B, T, H] or 4-d [B, T, H, K] tensor, "
                         f"got {g.dim()}-d of shape {_shape(g)}")
    check_chunk_size(chunk_size)
    B, T, H = g.shape[:3]
    K = g.shape[3] if g.dim() == 4 else 0
    seq_bounds = check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B, T)
    _same_device({"g": g, "cu_seqlens": cu_seqlens})
    return Dims(B=B, T=T, H=H, HV=H, K=K, V=0, N=len(seq_bounds), seq_bounds=seq_bounds)


_AXES = {  # names of the axes of each checked tensor, by argument and rank
    ("q", 4): ("batch", "token", "head", "channel"), ("k", 4): ("batch", "token", "head", "channel"),
    ("v", 4): ("batch", "token", "head", "channel"), ("g", 3): ("batch", "token", "head"),
    ("g", 4): ("batch", "token", "head", "channel"), ("beta", 3): ("batch", "token", "head"),
    ("initial_state", 4): ("sequence", "head", "key", "value"),
}


def non_finite(name: str, x: torch.Tensor) -> torch.Tensor:
    """The entries of ``x`` that are not admissible values: NaN and ±inf, except that a log gate ``g`` may be -inf
    (a state reset; docs/exactness.md)."""
    if name == "g":
        return torch.isnan(x) | (x == float("inf"))
    return ~torch.isfinite(x)


def check_finite(enabled, named: dict[str, torch.Tensor | None], seq_bounds: tuple[tuple[int, int], ...]) -> None:
    """The ``check_finite`` switch (a bool); when on, raise ValueError naming the first tensor (in ``named``'s order)
    that holds a non-finite value (``non_finite``) and the position of its first one: (batch, token, head[,
    channel]), and for varlen inputs the sequence and the token within it. One device-to-host copy for all tensors
    together (so it is opt-in); meta and fake tensors hold no values and pass."""
    if not check_flag("check_finite", enabled):
        return
    present = {n: t for n, t in named.items() if t is not None and has_values(t) and t.numel()}
    if not present:
        return
    found = []
    for name, t in present.items():
        bad = non_finite(name, t).flatten()
        found += [bad.any(), bad.to(torch.uint8).argmax()]
    flags = torch.stack([f.to(torch.int64) for f in found]).tolist()
    for (name, t), any_bad, flat in zip(present.items(), flags[::2], flags[1::2]):
        if not any_bad:
            continue
        position = list(torch.unravel_index(torch.tensor(flat), t.shape))
        axes = _AXES[name, t.dim()]
        where = "[" + ", ".join(f"{a} {int(i)}" for a, i in zip(axes, position)) + "]"
        if axes[0] == "batch" and len(seq_bounds) > 1 and t.shape[0] == 1:
            token = int(position[1])
            n = next(n for n, (bos, eos) in enumerate(seq_bounds) if bos <= token < eos)
            where += f" (sequence {n}, its token {token - seq_bounds[n][0]})"
        value = t.flatten()[flat].item()
        raise ValueError(f"{name}: expected finite values (check_finite=True), got {value} at {where}")


def check_gate_input(form, A_log, dt_bias, lower_bound, g) -> None:
    """tilela::chunk_attention's in-kernel gate arguments (tilela._gates): the form; for "log" none of A_log,
    dt_bias and a lower bound; else A_log and dt_bias of a float dtype on g's device, of the shapes
    tilela._gates.param_shapes gives g's gate columns, and a finite lower bound exactly for the sigmoid form."""
    from ._gates import GATE_FORMS, param_shapes

    if form not in GATE_FORMS:
        raise ValueError(f"gate_form: expected one of {GATE_FORMS}, got {form!r}")
    if form == "log":
        if A_log is not None or dt_bias is not None or lower_bound is not None:
            shape = lambda x: "None" if x is None else _shape(x)  # noqa: E731
            raise ValueError(f"A_log, dt_bias, lower_bound: only with an in-kernel gate form, got gate_form 'log' "
                             f"with A_log {shape(A_log)}, dt_bias {shape(dt_bias)} and lower_bound {lower_bound!r}")
        return
    shapes = param_shapes(tuple(g.shape[2:]))
    for name, x, per in (("A_log", A_log, "per value head"), ("dt_bias", dt_bias, "per gate column")):
        _expect_tensor(name, x)
        _expect_dtype(name, x, FLOAT_DTYPES)
        if tuple(x.shape) not in shapes[name]:
            raise ValueError(f"{name}: expected one of the shapes {[list(s) for s in shapes[name]]} ({per} of g "
                             f"{_shape(g)}, or one value), got {_shape(x)}")
        if x.device != g.device:
            raise ValueError(f"{name}: expected g's device {g.device}, got {x.device}")
    if (form == "sigmoid") != (lower_bound is not None):
        raise ValueError(f"lower_bound: the sigmoid form takes one and the softplus form none, got {lower_bound!r} "
                         f"with gate_form {form!r}")
    if lower_bound is not None and not math.isfinite(lower_bound):
        raise ValueError(f"lower_bound: expected a finite float, got {lower_bound!r}")
