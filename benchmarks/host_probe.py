"""The host's Python time of our GDN op on the CPU, the kernels left out: what a call costs the host before and
between its launches (validation, the plan, the launchers' allocations and arguments), without a GPU.

    python benchmarks/host_probe.py CASE[,CASE...] [--profile] [--device]

For each case name of `tilela bench --op gdn` it builds the case's inputs on the CPU (random values of the right
shapes and dtypes; cu_seqlens with its host copy, as the bench passes them) and calls tilela.chunk_gated_delta_rule
(with the case's use_qk_l2norm_in_kernel) with the Hopper backend forced and every compiled kernel replaced by a
recorder, so the call runs our whole host path and launches nothing. Printed per case: the median microseconds of
the public call and of its parts (the boundary's validation, plan_call, kernels.hopper.forward on a made plan) and
the kernels the call would launch, in order.
--profile adds cProfile's top functions by own time over 200 calls.

--device (on a GPU): the same calls with the kernels, on the device's tensors. Printed per case: the median host
time of the public call (the device idle at each call's start) with every launch through TileLang's JITKernel
call and with every launch straight into its compiled executable's main function (blocks of calls alternating
between the two), and the launches' count.

What it leaves out is the GPU's share of the host time: the per-launch argument conversion (TVM FFI's) and the launch
itself, CUDA allocations (here CPU ones, which for a large layout's outputs map fresh pages every call: those cases
read high). `tilela bench` records the host time of a whole call on the device (host_ms); the difference is what
the launches cost there.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import statistics
import time

import torch

import tilela
from tilela import ops
from tilela.bench import gdn
from tilela.kernels import hopper
from tilela.kernels.hopper import launch, seq_split
from tilela.ops import LOG_GATE, _check

SMS = 132  # the H100's and H200's SM count: the plans a GPU call makes


def no_kernels(launched: list[str]) -> None:
    """Force the Hopper backend on CPU tensors with every compiled kernel a recorder appending its builder's name to
    launched (so nothing compiles or runs), and keep the device tables (segment tables, launch orders) per key, as
    host_tables keeps a GPU's."""
    def compiled(builder, *static, warp_specialized=False):
        return lambda *args: launched.append(builder.__name__)

    tables = {}

    def device_table(host, key, device):
        if (host, key) not in tables:
            tables[host, key] = torch.tensor(host(key), dtype=torch.int32)
        return tables[host, key]

    launch.compiled = compiled
    launch.device_table = seq_split.device_table = device_table
    ops._hopper = lambda *tensors: hopper
    hopper.multiprocessors = lambda device: SMS


def case_inputs(case) -> dict:
    """Random CPU inputs of a GDN bench case's shapes and dtypes (bf16 q, k, v; fp32 gate and beta)."""
    p = case.params
    lengths = p["lengths"]
    B, Tn = (1, sum(lengths)) if p["varlen"] else (len(lengths), lengths[0])
    H, HV, K, V = p["H"], p["HV"], p["K"], p["V"]
    x = dict(q=torch.randn(B, Tn, H, K, dtype=torch.bfloat16), k=torch.randn(B, Tn, H, K, dtype=torch.bfloat16),
             v=torch.randn(B, Tn, HV, V, dtype=torch.bfloat16), g=-torch.rand(B, Tn, HV), beta=torch.rand(B, Tn, HV))
    if p["varlen"]:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        x.update(cu_seqlens=cu, cu_seqlens_cpu=cu.long())
    return x


def median_us(fn, calls: int = 300, warmup: int = 100) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1e6)
    return statistics.median(times)


def probe(case, launched: list[str], profile: bool) -> None:
    x = case_inputs(case)
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    cu, cu_cpu = x.get("cu_seqlens"), x.get("cu_seqlens_cpu")

    def call():
        return tilela.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                                             output_final_state=True,
                                             use_qk_l2norm_in_kernel=case.params["l2norm"])

    dims, _ = _check(q, k, v, g, "scalar", beta, True, None, None, cu, cu_cpu)
    lengths = [e - s for s, e in dims.seq_bounds]

    def plan():
        return hopper.plan_call(q, v, g, beta, dims.K ** -0.5, gate="scalar", lengths=lengths, initial_state=False,
                                output_final_state=True, varlen=cu is not None, gate_form=LOG_GATE.form)

    made = plan()
    parts = {"call": median_us(call),
             "validation": median_us(lambda: _check(q, k, v, g, "scalar", beta, True, None, None, cu, cu_cpu)),
             "plan_call": median_us(plan),
             "forward": median_us(lambda: hopper.forward(made, q, k, v, g, beta, None, cu))}
    launched.clear()
    call()
    print(f"{case.name:34s} " + "  ".join(f"{name} {us:6.1f}" for name, us in parts.items())
          + f" us; launches {len(launched)}: {', '.join(launched)}")
    if profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(200):
            call()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


def device_probe(case, blocks: int = 6, calls: int = 100) -> None:
    """The public call's host time on the GPU with launches through JITKernel and straight into main, alternating."""
    x = {name: t.cuda() if name != "cu_seqlens_cpu" else t for name, t in case_inputs(case).items()}
    x["q"], x["k"] = (torch.nn.functional.normalize(x[n].float(), dim=-1).bfloat16() for n in ("q", "k"))
    x["g"] = torch.nn.functional.logsigmoid(x["g"] * 8 + 2)

    def call():
        return tilela.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                             cu_seqlens=x.get("cu_seqlens"), cu_seqlens_cpu=x.get("cu_seqlens_cpu"),
                                             output_final_state=True, use_qk_l2norm_in_kernel=case.params["l2norm"])

    direct_compiled, launched = launch.compiled, []
    wrapped = functools.lru_cache(maxsize=None)(launch.jit_kernel)

    def counting(builder, *static, **kw):
        launched.append(builder.__name__)
        return wrapped(builder, *static, **kw)

    launch.compiled = counting
    call()
    torch.cuda.synchronize()
    times = {"jitkernel": [], "main": []}
    for block in range(2 * blocks):
        mode = ("jitkernel", "main")[block % 2]
        launch.compiled = wrapped if mode == "jitkernel" else direct_compiled
        for i in range(calls + 10):
            torch.cuda.synchronize()
            began = time.perf_counter()
            call()
            if i >= 10:
                times[mode].append((time.perf_counter() - began) * 1e6)
    launch.compiled = direct_compiled
    torch.cuda.synchronize()
    med = {mode: statistics.median(t) for mode, t in times.items()}
    print(f"{case.name:34s} host us: through JITKernel {med['jitkernel']:7.1f}, into main {med['main']:7.1f} "
          f"({med['jitkernel'] - med['main']:+.1f}); launches {len(launched)}: {', '.join(launched)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", help="case names of `tilela bench --op gdn`, comma-separated")
    parser.add_argument("--profile", action="store_true", help="cProfile's top functions per case")
    parser.add_argument("--device", action="store_true", help="on the GPU, with the kernels (see above)")
    args = parser.parse_args()
    known = {case.name: case for case in gdn.cases(False)}
    names = args.cases.split(",")
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"cases: expected names of `tilela bench --op gdn`, got {unknown}")
    if args.device:
        for name in names:
            device_probe(known[name])
        return
    launched: list[str] = []
    no_kernels(launched)
    for name in names:
        probe(known[name], launched, args.profile)


if __name__ == "__main__":
    main()
