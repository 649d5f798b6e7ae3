"""chunk_local_cumsum benchmark: gc = chunk-local prefix sum of the log gate, float32, scaled by log2(e).

Implementations on identical float32 gates logsigmoid(randn):
  tilela      ours
  fla         FLA's chunk_local_cumsum (scalar and per-channel kernels)
  flash_qla   FlashQLA's chunk_local_cumsum (scalar gate only; it has no scale, so it gets the gate pre-scaled)
Cases: scalar [1, T, HV] (GDN) and per-channel [1, T, HV, 128] (KDA), T in {8192, 32768}, HV in {32, 64}, C = 64.
Floor: the gate read once and gc written once; no FLOPs worth counting.
"""

import math

import torch

from tilela import reference

from . import Bench, Case, _try_import

LOG2E = 1.0 / math.log(2.0)


def _case(T, HV, channels):
    return Case(f"T{T}_HV{HV}_{'K' + str(channels) if channels else 'scalar'}", dict(T=T, HV=HV, channels=channels))


def cases(quick):
    return [_case(T, HV, ch) for T in ((8192,) if quick else (8192, 32768)) for HV in (32, 64) for ch in (None, 128)]


def make_inputs(case, seed):
    p = case.params
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (1, p["T"], p["HV"]) + ((p["channels"],) if p["channels"] else ())
    return {"g": torch.nn.functional.logsigmoid(torch.randn(shape, device="cuda", generator=gen))}


def _ours(case, x):
    from tilela import chunk_local_cumsum

    return chunk_local_cumsum(x["g"], 64, None, scale=LOG2E)


def _fla(case, x):
    cumsum = _try_import("fla.ops.utils.cumsum")
    return None if cumsum is None else cumsum.chunk_local_cumsum(x["g"], 64, scale=LOG2E)


def _flash_qla(case, x):
    cumsum = _try_import("flash_qla.ops.utils.cumsum")
    if cumsum is None or case.params["channels"]:
        return None
    return cumsum.chunk_local_cumsum(x["g"] * LOG2E, chunk_size=64)


def cost(case):
    p = case.params
    return {"bytes": 8 * p["T"] * p["HV"] * (p["channels"] or 1), "flops": 0}


BENCH = Bench(
    op="chunk_local_cumsum",
    cases=cases,
    check_cases=[_case(1000, 4, None), _case(1000, 4, 16)],
    make_inputs=make_inputs,
    impls={"tilela": _ours, "fla": _fla, "flash_qla": _flash_qla},
    reference=lambda case, x: reference.chunk_local_cumsum(x["g"], 64, None, LOG2E),
    cost=cost,
)
