"""kkt_solve benchmark: A = (I + strictLower(diag(beta) (Gamma ⊙ K K^T)))^-1 per chunk, [B,T,HV,C].

Implementations on identical inputs (l2-normalised bf16 k, sigmoid beta in float32, gc the chunk-local cumsum of
FlashQLA's benchmark gate logsigmoid(randn)/16 with a quarter of the heads at 0, or no gate):
  tilela       ours (method and chunk from the case)
  fla_fused    FLA's fused kkt + solve_tril kernel (chunk 64), as chunk_gated_delta_rule_fwd_intra launches it
  fla_unfused  FLA's chunk_scaled_dot_kkt_fwd (fp32 A) + solve_tril (chunk 16 / 32 / 64)
  flash_qla    FlashQLA's kkt_solve (no gate, K = 128, chunk 64)
FLA's kernels take the gate in log2 units (exp2), so they get gc * log2(e).

Grid: T in {8192, 32768} x HV in {8, 32, 64} with H = HV / 2, K = 128, C = 64, with and without gate; plus the
chunk / method trade-off at T = 32768, HV = 32 (chunk 16 Neumann, 32 and 64 blocked and Neumann) recorded next
to reference.inverse.inverse_cost (FMAs and dependency chain of one C x C inverse).
Floor: k read once per q/k head, beta (and gc) read, A written; FLOPs of K K^T per q/k head plus the inverse.
"""

import math

import torch

from tilela import reference
from tilela.reference.inverse import inverse_cost

from . import Bench, Case, _try_import

LOG2E = 1.0 / math.log(2.0)
K_DIM = 128


def _case(T, HV, C=64, gate="weak", method="blocked"):
    return Case(f"T{T}_HV{HV}_C{C}_{gate}_{method}",
                dict(T=T, H=HV // 2, HV=HV, K=K_DIM, C=C, gate=gate, method=method))


def cases(quick):
    grid = [(T, HV) for T in ((8192,) if quick else (8192, 32768)) for HV in ((8, 64) if quick else (8, 32, 64))]
    out = [_case(T, HV, gate=gate) for T, HV in grid for gate in ("none", "weak")]
    if not quick:
        out += [_case(32768, 32, C, "none", m) for C, m in
                ((16, "neumann"), (32, "blocked"), (32, "neumann"), (64, "neumann"))]
    return out


def make_inputs(case, seed):
    p = case.params
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, H, HV, K, C = p["T"], p["H"], p["HV"], p["K"], p["C"]
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device="cuda", generator=gen), dim=-1)
    beta = torch.sigmoid(torch.randn(1, T, HV, device="cuda", generator=gen))
    inputs = {"k": k.to(torch.bfloat16), "beta": beta}
    if p["gate"] == "weak":
        g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, device="cuda", generator=gen)) / 16
        g[:, :, : HV // 4] = 0
        gc = g.view(1, T // C, C, HV).cumsum(2).view(1, T, HV)
        inputs.update(gc=gc, gc_log2=gc * LOG2E)
    return inputs


def _ours(case, x):
    from tilela import kkt_solve

    p = case.params
    return kkt_solve(x["k"], x["beta"], x.get("gc"), p["C"], None, method=p["method"])


def _fla_fused(case, x):
    fwd = _try_import("fla.ops.gated_delta_rule.chunk_fwd")
    p = case.params
    if fwd is None or p["C"] != 64:
        return None
    k, beta = x["k"], x["beta"]
    B, T, H, K = k.shape
    HV = beta.shape[2]
    A = torch.zeros(B, T, HV, 64, device=k.device, dtype=k.dtype)
    fwd.chunk_gated_delta_rule_fwd_kkt_solve_kernel[(T // 64, B * HV)](
        k=k, g=x.get("gc_log2"), beta=beta, A=A, cu_seqlens=None, chunk_indices=None,
        T=T, H=H, HV=HV, K=K, BT=64, BC=16)
    return A


def _fla_unfused(case, x):
    kkt = _try_import("fla.ops.common.chunk_scaled_dot_kkt")
    tril = _try_import("fla.ops.utils.solve_tril")
    if kkt is None or tril is None:
        return None
    A = kkt.chunk_scaled_dot_kkt_fwd(k=x["k"], g=x.get("gc_log2"), beta=x["beta"], cu_seqlens=None,
                                     chunk_size=case.params["C"], output_dtype=torch.float32)
    return tril.solve_tril(A=A, cu_seqlens=None, output_dtype=x["k"].dtype)


def _flash_qla(case, x):
    qla = _try_import("flash_qla.ops.gated_delta_rule.chunk.hopper.kkt_solve")
    p = case.params
    if qla is None or p["C"] != 64 or p["gate"] != "none" or p["K"] != 128:
        return None
    return qla.kkt_solve(x["k"], x["beta"], chunk_size=64, cu_seqlens=None)


def _reference(case, x):
    return reference.kkt_solve(x["k"], x["beta"], x.get("gc"), case.params["C"], None)


def cost(case):
    p = case.params
    T, H, HV, K, C = p["T"], p["H"], p["HV"], p["K"], p["C"]
    inv = inverse_cost(p["method"], C)
    nbytes = T * H * K * 2 + T * HV * 4 * (2 if p["gate"] != "none" else 1) + T * HV * C * 2
    flops = 2 * T * C * K * H + 2 * inv["fma"] * (T // C) * HV
    return {"bytes": nbytes, "flops": flops, "inverse_fma": inv["fma"], "inverse_chain": inv["chain"]}


BENCH = Bench(
    op="kkt_solve",
    cases=cases,
    check_cases=[_case(2048, 8, gate="none"), _case(2048, 8, gate="weak")],
    make_inputs=make_inputs,
    impls={"tilela": _ours, "fla_fused": _fla_fused, "fla_unfused": _fla_unfused, "flash_qla": _flash_qla},
    reference=_reference,
    cost=cost,
)
