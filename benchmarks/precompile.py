"""Fill TileLang's on-disk kernel cache on a CPU machine, so a GPU run loads kernels instead of compiling them.

    TILELANG_CACHE_DIR=$PWD/.tl-cache TILELANG_DEFAULT_TARGET='{"kind":"cuda","arch":"sm_90a"}' \\
        python benchmarks/precompile.py [processes] [kinds, e.g. kkt,cumsum (default: all)]
    mkdir -p .devrun && tar cJf .devrun/tlcache.tar.xz -C .tl-cache .

Compiles every kkt_solve / chunk_local_cumsum / gla_factors configuration we ship and the state/output
configurations the GPU tests and benchmarks reach (jobs()). benchmarks/device_run.sh unpacks the tarball on the
device and runs this script there first, 16 processes at once, for whatever the tarball misses.
"""

import itertools
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def compile_one(job):
    kind, cfg = job
    from tilela.kernels.hopper import launch
    from tilela.kernels.hopper.plan import loop_tiles

    t = time.time()
    try:
        if kind == "chunk_fwd":
            K, gate, delta, dtype, beta_dtype, flags = cfg
            launch.compiled(launch.chunk_fwd_kernel, K, K, float(K) ** -0.5, gate, delta, dtype, beta_dtype,
                            *flags, *loop_tiles(K, gate, delta, dtype), warp_specialized=True)
        elif kind == "ws":
            K, V, gate, delta, dtype, beta_dtype, flags, block_DV, store_output = cfg
            launch.compiled(launch.chunk_fwd_ws_kernel, K, V, float(K) ** -0.5, gate, delta, dtype,
                            beta_dtype, *flags, block_DV, store_output, warp_specialized=True)
        else:
            builder = {"kkt": launch.kkt_solve_kernel, "cumsum": launch.chunk_local_cumsum_kernel,
                       "gla": launch.gla_factors_kernel, "combine": launch.seq_combine_kernel}[kind]
            launch.compiled(builder, *cfg)
        return job, time.time() - t, None
    except Exception as e:  # report and go on: a miss only costs a compile on the device
        return job, time.time() - t, repr(e)[:300]


def jobs():
    """kkt / cumsum / gla: every shipped configuration.  State/output passes with the (varlen, initial state, final
    state) switches the GPU tests and benchmarks use: GDN in both passes (and its half-precision beta), the other
    ladder levels in the pass that serves them, the warp-specialised pass at every DV block it is built for
    (plan.dv_blocks) and its sequence-split transitions."""
    from tilela.kernels.hopper import CUMSUM_CONFIGS, GLA_FACTORS_CONFIGS, KKT_CONFIGS, SEQ_COMBINE_CONFIGS
    from tilela.kernels.hopper.plan import dv_blocks, ws_covers

    out = ([("cumsum", c) for c in CUMSUM_CONFIGS] + [("kkt", c) for c in KKT_CONFIGS]
           + [("gla", c) for c in GLA_FACTORS_CONFIGS] + [("combine", c) for c in SEQ_COMBINE_CONFIGS])
    switches = [(True, True, True), (False, False, True), (False, True, True), (True, False, True),
                (False, False, False), (True, True, False)]
    levels = (("scalar", True), ("none", False), ("scalar", False), ("none", True), ("channel", False),
              ("channel", True))
    for (gate, delta), K, dtype, flags in itertools.product(levels, (128, 64, 256), ("bfloat16", "float16"),
                                                            switches):
        betas = ("float32", dtype) if gate == "scalar" and delta else ("float32",)
        for beta_dtype in betas:
            if gate == "channel" or K == 256 or (gate, delta) == ("scalar", True):
                out.append(("chunk_fwd", (K, gate, delta, dtype, beta_dtype, flags)))
            if ws_covers(dtype, K, K, gate, delta):
                out += [("ws", (K, K, gate, delta, dtype, beta_dtype, flags, block_DV, True))
                        for block_DV in dv_blocks(K)]
                if gate != "channel" and flags == (True, delta, True):  # the state pass alone: the sequence
                    # split's transitions (value [V | 0] from [0 | I] with the delta rule, V from zero without), the
                    # state_pass bench's state_only
                    out += [("ws", (K, V, gate, delta, dtype, beta_dtype, flags, block_DV, False))
                            for V in ((K, 2 * K) if delta else (K,)) for block_DV in dv_blocks(K)]
    return out


if __name__ == "__main__":
    t0 = time.time()
    kinds = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    todo = [job for job in jobs() if kinds is None or job[0] in kinds]
    failed = 0
    with ProcessPoolExecutor(int(sys.argv[1]) if len(sys.argv) > 1 else 2) as pool:
        for job, seconds, error in pool.map(compile_one, todo):
            failed += error is not None
            print(f"{job} {seconds:.1f}s {error or ''}", flush=True)
    print(f"{len(todo)} configurations, {failed} failed, {time.time() - t0:.0f}s")
