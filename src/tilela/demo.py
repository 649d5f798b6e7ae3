"""The main job: GDN forward on a prefill-like input, on the best device here, checked against
the float64 reference and timed.

Input like a Qwen3-Next GDN layer's prefill: packed varlen batch, 4 q/k heads and 8 value heads
(GVA 2), K = V = 128, bf16 l2-normalised q/k, log-sigmoid gates with a quarter of the value heads
at g = 0 (no decay), sigmoid beta, fp32 initial state. On a Hopper GPU the TileLang kernels run;
elsewhere the PyTorch path does. Each stage is shown on a progress line (stderr, on a terminal).
"""

from __future__ import annotations

import statistics
import time

import torch

from . import ops, reference
from ._progress import Progress
from .check import Shape, make_inputs, rel_l2


def main(lengths=(1024, 777, 1, 2048), repeats=5) -> dict:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (PyTorch path)"
    with Progress("demo", total=4) as bar:
        bar.update("building inputs")
        inputs = make_inputs(Shape(tuple(lengths), H=4, HV=8, K=128, V=128), torch.bfloat16, device, decay=1 / 16)
        bar.advance()

        def run():
            return ops.chunk_gated_delta_rule(
                inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                initial_state=inputs["initial_state"], output_final_state=True,
                cu_seqlens=inputs["cu_seqlens"], cu_seqlens_cpu=inputs["cu_seqlens_cpu"],
            )

        first = " (the first call on a GPU compiles its kernels unless TileLang's cache has them)"
        bar.update(f"running chunk_gated_delta_rule on {where}" + (first if device.type == "cuda" else ""))
        o, S = run()
        bar.advance()
        bar.update(f"timing {repeats} runs")
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        bar.advance()
        bar.update("computing the float64 reference")
        cpu = {name: x.cpu() for name, x in inputs.items()}
        ref_o, ref_S = reference.chunked(
            cpu["q"], cpu["k"], cpu["v"], g=cpu["g"], beta=cpu["beta"],
            initial_state=cpu["initial_state"], cu_seqlens=cpu["cu_seqlens"],
        )
        bar.advance()
    result = dict(
        device=where, tokens=sum(lengths), sequences=len(lengths),
        rel_err_o=rel_l2(o, ref_o), rel_err_state=rel_l2(S, ref_S),
        median_ms=statistics.median(times) * 1e3,
    )
    print(f"tilela demo: chunk_gated_delta_rule on {result['device']}")
    print(f"  input   : varlen {list(lengths)} ({result['tokens']} tokens), h_qk/h_v 4/8, K = V = 128, bf16")
    print(f"  error   : rel L2 vs float64 reference  o {result['rel_err_o']:.2e}  "
          f"final state {result['rel_err_state']:.2e}")
    print(f"  time    : median {result['median_ms']:.1f} ms over {repeats} runs")
    return result
