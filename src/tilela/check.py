"""``tilela check``: every public op on this device against the float64 reference on fresh random inputs.

The attention ops are compared with the token recurrence (reference.recurrent, the definition), kkt_solve and
chunk_local_cumsum with reference.kkt_solve and reference.chunk_local_cumsum. Inputs as a prefill sees them:
a packed varlen batch with a 1-token sequence and lengths that are not multiples of the 64-token chunk, GVA (two
value heads per q/k head), l2-normalised q/k, log-sigmoid gates with a quarter of the value heads (at least one)
at g = 0 (no decay), sigmoid beta, an initial state and the final state out. Error: relative L2 of o (kkt_solve:
A, chunk_local_cumsum: its output) and of the final state against the reference.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

# public attention op -> (gate kind as tilela.ops names it, whether the op takes beta)
ATTENTION_OPS = {
    "chunk_gated_delta_rule": ("scalar", True),
    "chunk_kda": ("channel", True),
    "chunk_delta_rule": ("none", True),
    "chunk_linear_attn": ("none", False),
    "chunk_simple_gla": ("scalar", False),
    "chunk_gla": ("channel", False),
}
PRIMITIVES = ("kkt_solve", "chunk_local_cumsum")
CHUNK = 64

# Largest relative L2 error that passes, by input dtype: bf16/fp16 round o (and kkt_solve's A) to 8/11 mantissa
# bits; float32 and float64 inputs are computed in their own precision.
THRESHOLDS = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5, torch.float64: 1e-12}


@dataclasses.dataclass(frozen=True)
class Shape:
    lengths: tuple[int, ...]
    H: int  # q/k heads
    HV: int  # value heads
    K: int
    V: int

    def __str__(self) -> str:
        dims = f"K=V={self.K}" if self.K == self.V else f"K={self.K} V={self.V}"
        return f"T={'+'.join(map(str, self.lengths))} H={self.H} HV={self.HV} {dims}"


QUICK = Shape((1, 63, 130), H=1, HV=2, K=64, V=64)
FULL = {  # device type -> shape: the PyTorch path's per-channel gate is slow on a CPU; a GPU takes long sequences
    "cpu": Shape((1, 63, 200, 333), H=2, HV=4, K=128, V=128),
    "cuda": Shape((1, 63, 777, 4096), H=2, HV=4, K=128, V=128),
}


@dataclasses.dataclass(frozen=True)
class Row:
    op: str
    dtype: torch.dtype
    shape: Shape
    err_out: float
    err_state: float | None
    threshold: float

    @property
    def passed(self) -> bool:
        errors = [self.err_out] + ([] if self.err_state is None else [self.err_state])
        return all(e == e and e <= self.threshold for e in errors)  # a NaN fails


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 on the CPU."""
    ref = ref.double().cpu()
    return float((x.double().cpu() - ref).norm() / ref.norm())


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
                decay: float = 1.0) -> dict[str, torch.Tensor]:
    """q, k, v in dtype; g (scalar gate [1, T, HV]) and g_channel ([1, T, HV, K], floored at -5) =
    logsigmoid(randn) * decay with value heads [0, max(1, HV // 4)) at 0; beta, initial_state, cu_seqlens on device
    (gates, beta and state float32, float64 for float64 inputs) and cu_seqlens_cpu."""
    gen = torch.Generator().manual_seed(seed)
    T, H, HV, K, V = sum(shape.lengths), shape.H, shape.HV, shape.K, shape.V
    randn = lambda *size: torch.randn(*size, generator=gen, dtype=torch.float64)  # noqa: E731
    q = F.normalize(randn(1, T, H, K), dim=-1)
    k = F.normalize(randn(1, T, H, K), dim=-1)
    v = randn(1, T, HV, V)
    g = F.logsigmoid(randn(1, T, HV)) * decay
    g_channel = (F.logsigmoid(randn(1, T, HV, K)) * decay).clamp_min(-5)  # KDA's safe_gate range
    g[:, :, : max(1, HV // 4)] = 0.0
    g_channel[:, :, : max(1, HV // 4)] = 0.0
    beta = randn(1, T, HV).sigmoid()
    h0 = randn(len(shape.lengths), HV, K, V) * 0.1
    cu = torch.tensor([0, *torch.tensor(shape.lengths).cumsum(0).tolist()], dtype=torch.int32)
    side = torch.float64 if dtype == torch.float64 else torch.float32
    out = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.to(side), g_channel=g_channel.to(side),
               beta=beta.to(side), initial_state=h0.to(side), cu_seqlens=cu)
    return {**{name: x.to(device) for name, x in out.items()}, "cu_seqlens_cpu": cu}


def run_op(op: str, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(output, final state or None) of the public op on inputs x (make_inputs)."""
    import tilela

    varlen = dict(cu_seqlens=x["cu_seqlens"], cu_seqlens_cpu=x["cu_seqlens_cpu"])
    if op == "chunk_local_cumsum":
        return tilela.chunk_local_cumsum(x["g"], CHUNK, **varlen), None
    if op == "kkt_solve":
        return tilela.kkt_solve(x["k"], x["beta"], _cumsum_reference(x).to(x["g"].dtype).to(x["g"].device), CHUNK,
                                **varlen), None
    gate, uses_beta = ATTENTION_OPS[op]
    args = [x["q"], x["k"], x["v"]] + ([_gate(x, gate)] if gate != "none" else []) + ([x["beta"]] if uses_beta else [])
    # the recurrence, not FLA's normaliser; KDA's gates lie in [-5, 0), so its kernels run on Hopper
    plain = {"chunk_linear_attn": {"normalize": False}, "chunk_kda": {"safe_gate": True}}.get(op, {})
    return getattr(tilela, op)(*args, initial_state=x["initial_state"], output_final_state=True, **varlen, **plain)


def reference_of(op: str, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float64 reference's (output, final state or None) of run_op(op, x)."""
    from . import reference

    cpu = {name: t.cpu() for name, t in x.items()}
    if op == "chunk_local_cumsum":
        return _cumsum_reference(cpu), None
    if op == "kkt_solve":
        return reference.kkt_solve(cpu["k"], cpu["beta"], _cumsum_reference(cpu), CHUNK, cpu["cu_seqlens"]), None
    gate, uses_beta = ATTENTION_OPS[op]
    return reference.recurrent(cpu["q"], cpu["k"], cpu["v"], g=None if gate == "none" else _gate(cpu, gate),
                               beta=cpu["beta"] if uses_beta else None, initial_state=cpu["initial_state"],
                               cu_seqlens=cpu["cu_seqlens"])


def _gate(x: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
    return x["g_channel"] if kind == "channel" else x["g"]


def _cumsum_reference(x: dict[str, torch.Tensor]) -> torch.Tensor:
    from . import reference

    return reference.chunk_local_cumsum(x["g"].cpu(), CHUNK, x["cu_seqlens"].cpu())


def plan(quick: bool, device: torch.device | str = "cpu") -> list[tuple[str, torch.dtype, Shape]]:
    """(op, input dtype, shape) of every row: each op in bf16 (chunk_local_cumsum: on a float32 gate); without
    quick on the device's larger shape and each op in float32 and float64 as well."""
    ops = [*ATTENTION_OPS, *PRIMITIVES]
    dtype_of = lambda op, dtype: torch.float32 if op == "chunk_local_cumsum" else dtype  # noqa: E731
    if quick:
        return [(op, dtype_of(op, torch.bfloat16), QUICK) for op in ops]
    shape = FULL[torch.device(device).type]
    rows = [(op, dtype_of(op, dtype), shape) for dtype in (torch.bfloat16, torch.float32, torch.float64)
            for op in ops]
    return list(dict.fromkeys(rows))  # chunk_local_cumsum once


def check(device: torch.device | str, quick: bool = False, seed: int = 0, progress=None) -> list[Row]:
    """Run every row of plan(quick, device) on device; progress: a tilela._progress.Progress to report to, or None."""
    rows = []
    for op, dtype, shape in plan(quick, device):
        if progress is not None:
            progress.update(f"{op} {str(dtype).removeprefix('torch.')}")
        x = make_inputs(shape, dtype, device, seed)
        out, state = run_op(op, x)
        ref_out, ref_state = reference_of(op, x)
        rows.append(Row(op, dtype, shape, rel_l2(out, ref_out), None if state is None else rel_l2(state, ref_state),
                        THRESHOLDS[dtype]))
        if progress is not None:
            progress.advance()
    return rows


def table(rows: list[Row]) -> str:
    head = ("op", "dtype", "shape", "rel L2 out", "rel L2 state", "threshold", "result")
    cells = [head] + [(r.op, str(r.dtype).removeprefix("torch."), str(r.shape), f"{r.err_out:.2e}",
                       "-" if r.err_state is None else f"{r.err_state:.2e}", f"{r.threshold:.0e}",
                       "PASS" if r.passed else "FAIL") for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells)


def main(device: str | None = None, quick: bool = False, seed: int | None = None) -> int:
    """Print the table; 0 when every row passes, else 1."""
    from ._progress import Progress

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    seed = torch.seed() % 2**31 if seed is None else seed
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"tilela check on {where}: every op against the float64 reference (seed {seed})")
    with Progress("check", total=len(plan(quick, device))) as bar:
        rows = check(device, quick, seed, bar)
    print(table(rows))
    failed = [r for r in rows if not r.passed]
    print(f"{len(rows) - len(failed)}/{len(rows)} passed")
    return 1 if failed else 0

