"""The main job: GDN forward on a prefill-like input, on the best device here, checked against
the float64 reference and timed.

Input like a Qwen3-Next GDN layer's prefill: packed varlen batch, 4 q/k heads and 8 value heads
(GVA 2), K = V = 128, bf16 l2-normalised q/k, log-sigmoid gates with a quarter of the value heads
at g = 0 (no decay), sigmoid beta, fp32 initial state. On a Hopper GPU the TileLang kernels run;
elsewhere the PyTorch path does.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from . import ops, reference


def make_gdn_inputs(lengths, h_qk, h_v, dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = F.normalize(torch.randn(1, T, h_qk, dim, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, h_qk, dim, generator=gen), dim=-1)
    v = torch.randn(1, T, h_v, dim, generator=gen)
    g = F.logsigmoid(torch.randn(1, T, h_v, generator=gen)) / 16
    g[..., : h_v // 4] = 0.0
    beta = torch.randn(1, T, h_v, generator=gen).sigmoid()
    h0 = torch.randn(len(lengths), h_v, dim, dim, generator=gen) * 0.1
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    move = dict(device=device)
    return dict(
        q=q.to(dtype=dtype, **move), k=k.to(dtype=dtype, **move), v=v.to(dtype=dtype, **move),
        g=g.to(**move), beta=beta.to(**move), initial_state=h0.to(**move),
        cu_seqlens=cu.to(**move), cu_seqlens_cpu=cu,
    )


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double().cpu() - ref).norm() / ref.norm())


def main(lengths=(1024, 777, 1, 2048), repeats=5) -> dict:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    inputs = make_gdn_inputs(lengths, h_qk=4, h_v=8, dim=128, dtype=torch.bfloat16, device=device)

    def run():
        return ops.chunk_gated_delta_rule(
            inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
            initial_state=inputs["initial_state"], output_final_state=True,
            cu_seqlens=inputs["cu_seqlens"], cu_seqlens_cpu=inputs["cu_seqlens_cpu"],
        )

    o, S = run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)

    cpu = {name: (x.cpu() if isinstance(x, torch.Tensor) else x) for name, x in inputs.items()}
    ref_o, ref_S = reference.chunked(
        cpu["q"], cpu["k"], cpu["v"], g=cpu["g"], beta=cpu["beta"],
        initial_state=cpu["initial_state"], cu_seqlens=cpu["cu_seqlens"],
    )
    result = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (PyTorch path)",
        tokens=sum(lengths), sequences=len(lengths),
        rel_err_o=rel_l2(o, ref_o), rel_err_state=rel_l2(S, ref_S),
        median_ms=statistics.median(times) * 1e3,
    )
    print(f"tilela demo: chunk_gated_delta_rule on {result['device']}")
    print(f"  input   : varlen {list(lengths)} ({result['tokens']} tokens), h_qk/h_v 4/8, K = V = 128, bf16")
    print(f"  error   : rel L2 vs float64 reference  o {result['rel_err_o']:.2e}  final state {result['rel_err_state']:.2e}")
    print(f"  time    : median {result['median_ms']:.1f} ms over {repeats} runs")
    return result
