"""``tilela info``: versions, the device, TileLang's kernel cache, and the path each public op takes here and why.

Which path an op takes comes from tilela.ops' own dispatch rules, evaluated in one place (``hopper_route``) on a
representative input per op: bf16, K = V = 128, on this machine's device.
"""

from __future__ import annotations

import math
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

import torch

from .check import ATTENTION_OPS, PRIMITIVES

REPRESENTATIVE = (torch.bfloat16, 128, 128)  # dtype, K, V
PROBE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
PROBE_DIMS = (16, 32, 64, 128, 192, 256, 512)
SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def hopper_route(device: torch.device, dtype: torch.dtype, gate: str | None = None, delta: bool = False,
                 K: int = 128, V: int = 128) -> tuple[bool, bool]:
    """(whether tilela.ops hands tensors of this dtype on device to the Hopper backend (ops._hopper), whether the
    backend covers an attention call with this gate kind, update rule and K, V (kernels.hopper.plan.covers; False
    for gate None)). The one place this module depends on tilela.ops' dispatch."""
    from . import ops
    from .kernels.hopper import DTYPE_NAMES, plan

    on_hopper = ops._hopper(torch.empty(0, device=device, dtype=dtype)) is not None
    return on_hopper, gate is not None and plan.covers(DTYPE_NAMES.get(dtype), K, V, gate, delta)


def coverage(gate: str, delta: bool) -> str | None:
    """What the Hopper pipeline covers for this gate kind and update rule, e.g. "bf16/fp16, K = V in 64/128/256",
    found by probing hopper_route over dtypes and head dims; None when it covers nothing."""
    cpu = torch.device("cpu")
    covers = lambda dtype, K, V: hopper_route(cpu, dtype, gate, delta, K, V)[1]  # noqa: E731
    pairs = [(K, V) for K in PROBE_DIMS for V in PROBE_DIMS if any(covers(d, K, V) for d in PROBE_DTYPES)]
    if not pairs:
        return None
    dtypes = "/".join(SHORT[d] for d in PROBE_DTYPES if any(covers(d, K, V) for K, V in pairs))
    dims = lambda i: "/".join(str(n) for n in sorted({pair[i] for pair in pairs}))  # noqa: E731
    heads = f"K = V in {dims(0)}" if all(K == V for K, V in pairs) else f"K in {dims(0)}, V in {dims(1)}"
    return f"{dtypes}, {heads}"


def device_info() -> dict[str, Any] | None:
    """name, capability, sms of the current CUDA device, or None without one."""
    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"name": p.name, "capability": (p.major, p.minor), "sms": p.multi_processor_count}


def _tilelang() -> tuple[Any, str | None]:
    """(the tilelang module or None, why it does not import or None)."""
    try:
        import tilelang

        return tilelang, None
    except Exception as exc:  # noqa: BLE001 - any import failure means no kernels; its message is the diagnosis
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def why_not_hopper(device: dict[str, Any] | None, tilelang_error: str | None) -> str:
    """Why tilela.ops does not use the Hopper launchers on this machine's device."""
    if device is None:
        return "no CUDA device"
    major, minor = device["capability"]
    if (major, minor) != (9, 0):
        return f"{device['name']} is sm_{major}{minor}; the kernels are built for sm_90a (Hopper)"
    if tilelang_error is not None:
        return f"TileLang does not import ({tilelang_error})"
    return "tilela.ops does not hand tensors on this device to the Hopper kernels"


def op_paths(device: dict[str, Any] | None, tilelang_error: str | None,
             where: torch.device | None = None) -> dict[str, str]:
    """Public op -> the path it takes for the representative input on device (device_info()), and why. where: the
    torch device of the representative tensors (default: the current CUDA device, or the CPU without one)."""
    where = where or torch.device("cuda" if device is not None else "cpu")
    dtype, K, V = REPRESENTATIVE
    paths = {}
    for op, (gate, delta) in ATTENTION_OPS.items():
        on_hopper, covered = hopper_route(where, dtype, gate, delta, K, V)
        scope = coverage(gate, delta)
        if on_hopper and covered:
            paths[op] = f"Hopper kernels ({scope})"
        elif on_hopper:
            paths[op] = (f"PyTorch path on Hopper: {op} is not routed to the kernels yet" if scope is None else
                         f"PyTorch path on Hopper for {SHORT[dtype]} K={K} V={V}: the kernels cover {scope}")
        else:
            later = "not routed to the kernels yet" if scope is None else f"kernels for {scope}"
            paths[op] = f"PyTorch path: {why_not_hopper(device, tilelang_error)} (on Hopper: {later})"
    for op in PRIMITIVES:
        on_hopper, _ = hopper_route(where, dtype)
        paths[op] = "Hopper kernel" if on_hopper else f"PyTorch path: {why_not_hopper(device, tilelang_error)}"
    return paths


def kernel_cache() -> dict[str, Any]:
    """TileLang's on-disk kernel cache: path (TileLang's own setting: TILELANG_CACHE_DIR, else its default), whether
    it comes from the variable, and its size in bytes (None while it does not exist)."""
    from tilelang.env import env

    path = Path(env.TILELANG_CACHE_DIR)
    size = None
    if path.is_dir():
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    return {"path": str(path), "from_env": "TILELANG_CACHE_DIR" in os.environ, "bytes": size}


def nvcc_version() -> str | None:
    """The release of the nvcc TileLang compiles with (its CUDA_HOME), or None when there is none."""
    from tilelang.env import env

    nvcc = Path(env.CUDA_HOME or "") / "bin" / "nvcc"
    if not env.CUDA_HOME or not nvcc.exists():
        return None
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release ([\d.]+)", out)
    return f"{found.group(1) if found else 'unknown release'} ({nvcc})"


def _size(n: int) -> str:
    """n bytes in B, KiB, MiB or GiB."""
    step = min(int(math.log(max(n, 1), 1024)), 3)
    return f"{n} B" if step == 0 else f"{n / 1024**step:.1f} {('KiB', 'MiB', 'GiB')[step - 1]}"


def report() -> str:
    import tilela

    tilelang, tilelang_error = _tilelang()
    device = device_info()
    rows = [("tilela", tilela.__version__), ("python", platform.python_version()),
            ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none: a CPU-only build'})")]
    if tilelang is None:
        rows += [("tilelang", f"does not import: {tilelang_error}")]
    else:
        rows += [("tilelang", tilelang.__version__),
                 ("nvcc", nvcc_version() or "not found (TileLang cannot compile kernels here)")]
    if device is None:
        rows.append(("device", "no CUDA device"))
    else:
        major, minor = device["capability"]
        rows.append(("device", f"{device['name']}, compute capability {major}.{minor}, {device['sms']} SMs"))
    if tilelang is not None:
        cache = kernel_cache()
        size = "not created yet" if cache["bytes"] is None else _size(cache["bytes"])
        origin = "from TILELANG_CACHE_DIR" if cache["from_env"] else "TileLang's default; TILELANG_CACHE_DIR moves it"
        rows.append(("kernel cache", f"{cache['path']}, {size} ({origin})"))
    dtype, K, V = REPRESENTATIVE
    rows.append(("ops", f"the path each op takes here for {SHORT[dtype]} inputs, K = {K}, V = {V}"))
    width = max(len(label) for label, _ in rows)
    lines = [f"{label.ljust(width)}  {text}" for label, text in rows]
    ops_width = max(map(len, [*ATTENTION_OPS, *PRIMITIVES]))
    lines += [f"  {op.ljust(ops_width)}  {path}" for op, path in op_paths(device, tilelang_error).items()]
    return "\n".join(lines)


def main() -> int:
    print(report())
    return 0
