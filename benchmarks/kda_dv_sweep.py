"""The KDA warp-specialised pass at each DV block it is built for, on the bench's bounded-gate cases (H200 only).

    python benchmarks/kda_dv_sweep.py 1x8192_h8-8_bounded,1x65536_h4-16_bounded,...

Per case and DV block (the op's own marked *): the op through kernels.hopper.forward, median of 30 CUDA-graph
replays (inputs not rotated), and the profiled gla_factors and ws kernel times over five eager calls; the output's
relative L2 against the largest block's. The KDA chunk periods of kernels/hopper/plan.py's cost model
(CHUNK_US["kda", ...]) are the ws times over the chunks of a one-wave grid (benchmarks/NOTES.md, "The KDA pass's
DV blocks on small grids")."""

import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from tilela.bench import hopper_plan, kda
from tilela.kernels import hopper
from tilela.kernels.hopper.plan import dv_blocks
from tilela.ops import in_kernel_gate

names = sys.argv[1].split(",")
for case in [c for c in kda.cases(False) if c.name in names]:
    p = case.params
    x = kda.make_inputs(case, 0)
    gate_in = in_kernel_gate(x["g"], x["A_log"], x["dt_bias"], kda.LOWER_BOUND)
    lengths = list(p["lengths"]) * p["B"]
    default = hopper_plan(x, lengths, p["K"], "channel", gate_form=gate_in.form)
    ref = None
    for bd in dv_blocks(p["K"], "channel", True):
        plan = hopper_plan(x, lengths, p["K"], "channel", gate_form=gate_in.form, block_DV=bd)
        f = lambda: hopper.forward(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"],
                                   x.get("cu_seqlens"), gate_params=gate_in.params, gate_scale=gate_in.lower_bound)[0]
        o = f(); torch.cuda.synchronize()
        ref = o if ref is None else ref
        err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            f()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            f()
        ts = []
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                f()
            torch.cuda.synchronize()
        ws = sum(e.device_time_total for e in prof.key_averages() if "chunk_fwd_ws" in e.key) / 5
        gla = sum(e.device_time_total for e in prof.key_averages() if "gla_factors" in e.key) / 5
        mark = "*" if bd == default.passes[0].tiles[0] else " "
        print(f"{case.name:28s} DV {bd:3d}{mark} op {statistics.median(ts) * 1e3:8.1f} us  ws {ws:8.1f} us  "
              f"gla {gla:7.1f} us  vs DV{dv_blocks(p['K'], 'channel', True)[0]} {err:.1e}", flush=True)
