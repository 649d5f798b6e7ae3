"""Context-parallel GDN forward (tilela.distributed) across the ranks of torchrun: time per call, the all_gather's
share, and the one-process time of the same inputs for the ratio; each rank's outputs and the final states are
checked against one process's call.

    torchrun --nproc-per-node 8 benchmarks/cp_bench.py --tokens 1048576 --heads 16/64 --out cp-8.json
    torchrun --nproc-per-node 2 benchmarks/cp_bench.py --tokens 4096 --heads 2/4 --dim 32 --device cpu   # gloo

Inputs as src/tilela/bench/gdn.py: l2-normalised q/k and v in bf16 (float32 on the CPU), sigmoid beta and the log
gate in float32, one sequence; gate regimes as there: mixed (default) g = logsigmoid(randn) / 16 with a quarter of
the value heads at g = 0 (the state never forgets, so the exchange matters), decay g = logsigmoid(randn + 3).
Every rank builds the whole problem from one seed and keeps its share (the one-process call and the check need it
all; each rank times the one-process call on its own device). all_gather_ms times the exchange alone, one piece's
[1, HV, K, 2K] summary per rank. Rank 0 prints the JSON and writes it to --out.
"""

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tilela
from tilela.distributed import build_cp_context


def timed(fn, device, reps: int) -> float:
    """Median seconds of fn() over reps calls after one warm-up, every rank in step."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--heads", default="16/64", help="h_qk/h_v")
    ap.add_argument("--dim", type=int, default=128, help="K = V")
    ap.add_argument("--gate", default="mixed", choices=["mixed", "decay"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(a.device, rank % max(torch.cuda.device_count(), 1)) if a.device == "cuda" else \
        torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    H, HV = (int(x) for x in a.heads.split("/"))
    T, D = a.tokens, a.dim
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    q, k = F.normalize(rnd(1, T, H, D), dim=-1).to(dtype), F.normalize(rnd(1, T, H, D), dim=-1).to(dtype)
    v, beta = rnd(1, T, HV, D).to(dtype), torch.sigmoid(rnd(1, T, HV))
    if a.gate == "decay":
        g = F.logsigmoid(rnd(1, T, HV) + 3)
    else:
        g = F.logsigmoid(rnd(1, T, HV)) / 16
        g[..., : HV // 4] = 0
    cu = torch.tensor([0, T], device=device)
    ctx = build_cp_context(cu, cu_seqlens_cpu=cu.cpu())
    lo, hi = ctx.bounds[rank], ctx.bounds[rank + 1]
    local = [x[:, lo:hi] for x in (q, k, v, g, beta)]

    with torch.no_grad():
        cp_call = lambda: tilela.chunk_gated_delta_rule(*local, output_final_state=True, cp_context=ctx)  # noqa: E731
        one_call = lambda: tilela.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)  # noqa: E731
        o_cp, S_cp = cp_call()
        o_one, S_one = one_call()
        rel = lambda a_, b_: ((a_.double() - b_.double()).norm() / b_.double().norm()).item()  # noqa: E731
        errors = torch.tensor([rel(o_cp, o_one[:, lo:hi]), rel(S_cp, S_one)], device=device)
        dist.all_reduce(errors, op=dist.ReduceOp.MAX)
        summary = torch.zeros(1, HV, D, 2 * D, device=device)
        gathered = [torch.empty_like(summary) for _ in range(world)]
        t_cp = timed(cp_call, device, a.reps)
        t_gather = timed(lambda: dist.all_gather(gathered, summary), device, a.reps)
        t_one = timed(one_call, device, a.reps)  # every rank its own device; rank 0 reports
    if rank == 0:
        result = dict(world=world, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      tokens=T, heads=a.heads, dim=D, gate=a.gate, dtype=str(dtype), cp_ms=t_cp * 1e3,
                      one_ms=t_one * 1e3,
                      all_gather_ms=t_gather * 1e3, speedup=t_one / t_cp, efficiency=t_one / t_cp / world,
                      rel_l2_o=errors[0].item(), rel_l2_final=errors[1].item())
        print(json.dumps(result))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
