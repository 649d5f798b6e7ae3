"""Fill TileLang's on-disk kernel cache on a CPU machine, so a GPU run loads kernels instead of compiling them.

    TILELANG_CACHE_DIR=$PWD/.tl-cache TILELANG_DEFAULT_TARGET='{"kind":"cuda","arch":"sm_90a"}' \\
        python benchmarks/precompile.py [processes] [kinds, e.g. kkt,cumsum (default: all)]
    mkdir -p .devrun && tar cJf .devrun/tlcache.tar.xz -C .tl-cache .

With `cases=name,name` in place of the kinds: the kernels the GDN bench's op runs for those cases of `tilela bench
--op gdn` (tilela.bench.gdn.op_plan, tilela.precompile.plan_jobs), as this tree plans them: a candidate's, before an
A/B call (benchmarks/candidates/README.md).

Compiles tilela.precompile.jobs() (every shipped kkt_solve / chunk_local_cumsum / gla_factors / seq_combine
configuration and the state/output configurations the GPU tests and benchmarks reach), one line per kernel.
benchmarks/device_run.sh unpacks the tarball on the device and runs this script there first, 16 processes at once,
for whatever the tarball misses. `tilela precompile` does the same for chosen ops, with a progress line.
"""

import sys
import time

from tilela.precompile import compile_jobs, jobs, plan_jobs


def case_jobs(names: list[str]) -> list:
    """plan_jobs of the GDN bench's plans for these case names (ValueError naming any the bench has not)."""
    from tilela.bench import gdn

    known = {case.name: case for case in gdn.cases(False)}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"cases: expected names of `tilela bench --op gdn`, got {unknown}")
    return list(dict.fromkeys(job for name in names for job in plan_jobs(gdn.op_plan(known[name]))))


if __name__ == "__main__":
    t0 = time.time()
    selection = sys.argv[2] if len(sys.argv) > 2 else None
    if selection is not None and selection.startswith("cases="):
        todo = case_jobs(selection.removeprefix("cases=").split(","))
    else:
        kinds = selection.split(",") if selection else None
        todo = [job for job in jobs() if kinds is None or job.kind in kinds]
    failed = 0
    for job, seconds, error in compile_jobs(todo, int(sys.argv[1]) if len(sys.argv) > 1 else 2):
        failed += error is not None
        print(f"{(job.kind, job.config)} {seconds:.1f}s {error or ''}", flush=True)
    print(f"{len(todo)} configurations, {failed} failed, {time.time() - t0:.0f}s")
