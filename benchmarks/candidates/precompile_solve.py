"""Compile into TILELANG_CACHE_DIR the state passes that candidates 2 and 3 (applied to the tree) reach in the bench's
eight layouts of the README's call 1 (tilela_solve and tilela_solve64) and in tests/test_gpu_gdn.py's solve tests
(DV 64 and folded at 128), in N processes, so the device call compiles none of them:

    python benchmarks/candidates/precompile_solve.py [N]      (from the repository root)
"""

import sys

import torch

sys.path[:0] = ["src"]
from tilela.bench.gdn import _serving_mix  # noqa: E402
from tilela.kernels import hopper  # noqa: E402
from tilela.precompile import Job, compile_jobs  # noqa: E402

BENCH = [((8192,), 16, 64), ((8192,) * 4, 32, 32), ((8192,) * 4, 16, 64), ((1024,) * 8, 32, 32),
         (tuple(_serving_mix()), 16, 32), ((28672, 4096), 8, 24), ((32768,), 32, 32), ((512,), 16, 32)]
# tests/test_gpu_gdn.py's solve cases (CASES of SOLVE_CASES, and the gate-floor test's layout)
TESTS = [dict(B=2, T=200, H=2, HV=4), dict(B=1, T=256, H=3, HV=3, dtype=torch.float16, beta_dtype=torch.float16),
         dict(B=1, T=192, H=2, HV=6), dict(B=3, T=130, H=1, HV=4, h0=False),
         dict(B=1, T=300, H=2, HV=4, cu=[0, 1, 65, 66, 130, 200, 263, 300]),
         dict(B=1, T=257, H=2, HV=8, dtype=torch.float16, beta_dtype=torch.float16, cu=[0, 64, 128, 129, 257]),
         dict(B=1, T=700, H=4, HV=8, cu=[0, 1, 100, 164, 165, 300, 420, 555, 640, 700]),
         dict(B=1, T=270, H=2, HV=4, cu=[0, 200, 270])]


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def solve_plan(lengths, H, HV, dtype=torch.bfloat16, beta_dtype=torch.float32, h0=True, varlen=True, **options):
    T = sum(lengths)
    return hopper.plan_call(meta(1, T, H, 128, dtype=dtype), meta(1, T, HV, 128, dtype=dtype),
                            meta(1, T, HV, dtype=torch.float32), meta(1, T, HV, dtype=beta_dtype), 128**-0.5,
                            gate="scalar", lengths=lengths, initial_state=h0, output_final_state=True, varlen=varlen,
                            sms=132, solve=True, **options)


def configurations():
    found = set()
    for lengths, H, HV in BENCH:
        plan = solve_plan(lengths, H, HV, varlen=len(lengths) > 1)
        found.update(plan.passes)
        if plan.split is None:
            found.update(solve_plan(lengths, H, HV, varlen=len(lengths) > 1, block_DV=64).passes)
    for case in TESTS:
        case = dict(case)
        cu, B, T = case.pop("cu", None), case.pop("B"), case.pop("T")
        lengths = [T] * B if cu is None else [e - s for s, e in zip(cu[:-1], cu[1:])]
        for block in (64, 128):
            found.update(solve_plan(lengths, varlen=cu is not None, block_DV=block, split=None, **case).passes)
    return sorted(found, key=str)


def job(cfg):
    """tilela.precompile's job of a ws PassConfig (its compile_one takes the tiles after the switches)."""
    return Job("ws", (cfg.K, cfg.V, cfg.gate, cfg.delta, cfg.dtype, cfg.beta_dtype,
                      (cfg.is_varlen, cfg.use_initial_state, cfg.store_final_state), *cfg.tiles),
               frozenset({"chunk_gated_delta_rule"}), cfg.dtype, cfg.K)


if __name__ == "__main__":
    todo = [job(cfg) for cfg in configurations()]
    print(len(todo), "configurations")
    for result in compile_jobs(todo, int(sys.argv[1]) if len(sys.argv) > 1 else 2):
        print(result.job.config, f"{result.seconds:.0f}s", result.error or "", flush=True)
