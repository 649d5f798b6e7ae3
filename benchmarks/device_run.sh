#!/usr/bin/env bash
# One call on the H200: fill the kernel caches, the GPU tests (every test marked gpu), then benchmarks against FLA
# and FlashQLA.
#   device run, carry [".gpu-bundle", ".devrun"]:
#   . .gpu-bundle/setup.sh && bash benchmarks/device_run.sh [--full] [--no-tests] [--no-bench] [op ...]
#   ops: gdn (default), kda, ladder, kkt_solve, chunk_local_cumsum, state_pass; --full runs every case instead of
#   --quick.
#   Time limits (s): PRECOMPILE_TIMEOUT (0 skips the precompile), TEST_TIMEOUT, BENCH_TIMEOUT, or
#   BENCH_TIMEOUT_<op> for one op; DEADLINE (epoch seconds) cuts every benchmark short of it. TEST_PROCS: pytest-xdist
#   workers for the GPU tests (default 16: the tests' TileLang compiles then run in parallel on the host's cores),
#   each with nproc / TEST_PROCS torch threads unless OMP_NUM_THREADS is set.
#   BENCH_ARGS: extra arguments for every `tilela bench` (e.g. --cases ...). WARM_PROCS=N: before an op is timed, its
#   cases (WARM_CASES, comma-separated, else the op's --quick or full list) run once in N processes at once with
#   every implementation but FLA, so FlashQLA's TileLang JIT and any kernel the cache misses compile in parallel
#   (FLA stays out: its Triton autotuning times configurations, which N processes on one GPU would skew); a bare
#   machine then times the whole GDN grid against FlashQLA in one call. TESTS: test paths or node ids (default
#   tests; a node id that does not exist, e.g. after a parametrisation changed, makes pytest collect nothing).
# Caches (benchmarks/device_cache.sh): .devrun/*.tar.xz unpacked into the kernel caches first (build the TileLang
# part on a CPU machine: `python benchmarks/precompile.py`, same TILELANG_CACHE_DIR / TILELANG_DEFAULT_TARGET);
# whatever it misses is compiled here first, 16 processes at once; what the call added leaves as
# $OUT/newcache-<time>.tar.xz (copy it to .devrun/ for the next call).
# Output: $OUT/<op>.json (each op's results), the new cache entries and $OUT/logs.tar.xz (the precompile, test,
# warm-up and bench logs, in $LOGS until the end): a call hands back at most 8 files.
set -o pipefail
. benchmarks/device_cache.sh
OUT=${OUT:-$PWD/device-out}
LOGS=${LOGS:-/tmp/device-run-logs}
mkdir -p "$OUT" "$LOGS"
cache_in
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
t0=$(date +%s)
quick=--quick tests=1 bench=1
while [ $# -gt 0 ]; do
  case $1 in
    --full) quick= ;;
    --no-tests) tests= ;;
    --no-bench) bench= ;;
    *) break ;;
  esac
  shift
done
if [ "${PRECOMPILE_TIMEOUT:-240}" -gt 0 ]; then
  timeout "${PRECOMPILE_TIMEOUT:-240}" python benchmarks/precompile.py 16 > "$LOGS/precompile.log" 2>&1
  tail -1 "$LOGS/precompile.log"
  echo "precompile: $(( $(date +%s) - t0 )) s"
fi
if [ -n "$tests" ]; then
  workers=(-n "${TEST_PROCS:-16}" --dist loadgroup)
  python -c "import xdist" 2>/dev/null || workers=()
  # each worker's torch gets its share of the cores: with all of them each, the workers' CPU float64 references
  # (autograd checks) oversubscribe the host (an autograd check then took 335 s instead of 7 s)
  threads=$(( $(nproc) / ${TEST_PROCS:-16} )); [ "$threads" -lt 1 ] && threads=1
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}
  # -v: a run the time limit cuts still shows what passed, what failed and what was in flight; SIGINT at the limit
  # lets pytest print its summary and the slowest durations before it stops
  # shellcheck disable=SC2086  # TESTS is a list of paths or node ids
  timeout -s INT -k 30 "${TEST_TIMEOUT:-240}" python -m pytest -v -p no:cacheprovider --tb=short -rfE --durations=20 \
    "${workers[@]}" -m gpu ${TESTS:-tests} 2>&1 | grep -v -E "INFO|PytestBenchmarkWarning|warner\(" \
    > "$LOGS/pytest_gpu.log"
  log="$LOGS/pytest_gpu.log"
  echo "gpu tests: $(grep -oE '\[[0-9]+ items?\]' "$log" | head -1) $(grep -c ' PASSED' "$log") passed," \
       "$(grep -c ' FAILED' "$log") failed, $(grep -c ' SKIPPED' "$log") skipped"
  grep -E "^(FAILED|ERROR)|^E  " "$log" | head -30
  # started: "nodeid" lines (xdist -v); finished: "[gwN] [ n%] STATUS nodeid" (xdist) or "nodeid STATUS [ n%]"
  status="PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS"
  comm -23 <(grep -oE '^tests/[^ ]+::[^ ]+ *$' "$log" | sed 's/ *$//' | sort -u) \
           <( (grep -oE "($status) tests/[^ ]+::[^ ]+" "$log" | sed -E "s/^($status) //"
               grep -oE "^tests/[^ ]+::[^ ]+ ($status)" "$log" | sed -E "s/ ($status)$//") | sort -u) \
    | sed 's/^/unfinished: /' | head -40
  echo "tests: $(( $(date +%s) - t0 )) s"
fi
warm() {  # op: its cases once, one replay, no checks, in WARM_PROCS processes (their results dropped)
  local listing impls cases p i sub
  listing=$(python - "$1" "$quick" <<'PY'
import importlib, sys
from tilela.bench import OPS
bench = importlib.import_module(OPS[sys.argv[1]]).BENCH
print(",".join(impl for impl in bench.impls if impl != "fla"))
print(" ".join(case.name for case in bench.cases(sys.argv[2] == "--quick")))
PY
)
  impls=${listing%%$'\n'*}
  read -ra cases <<< "${listing#*$'\n'}"
  [ -n "$WARM_CASES" ] && IFS=, read -ra cases <<< "$WARM_CASES"
  for ((p = 0; p < WARM_PROCS; p++)); do
    sub=""
    for ((i = p; i < ${#cases[@]}; i += WARM_PROCS)); do sub+="${cases[$i]},"; done
    [ -z "$sub" ] && continue
    timeout "${WARM_TIMEOUT:-200}" python -m tilela.cli bench --op "$1" --impls "$impls" --no-checks --replays 1 \
      --cases "${sub%,}" --out "/tmp/warm-$1-$p.json" > "$LOGS/warm_$1_$p.log" 2>&1 &
  done
  wait
  echo "warm-up of $1 (${#cases[@]} cases, $WARM_PROCS processes): $(( $(date +%s) - t0 )) s"
}
for op in ${bench:+"${@:-gdn}"}; do
  [ "${WARM_PROCS:-0}" -gt 0 ] && warm "$op"
  limit=BENCH_TIMEOUT_$op  # per op, else BENCH_TIMEOUT
  limit=${!limit:-${BENCH_TIMEOUT:-300}}
  # DEADLINE (epoch seconds): leave 30 s for the cache's tarball
  [ -n "$DEADLINE" ] && limit=$(( limit < DEADLINE - $(date +%s) - 30 ? limit : DEADLINE - $(date +%s) - 30 ))
  [ "$limit" -lt 1 ] && limit=1
  timeout "$limit" python -m tilela.cli bench --op "$op" $quick --replays 20 --out "$OUT/$op.json" $BENCH_ARGS \
    2>&1 | grep -v INFO > "$LOGS/bench_$op.log"
  grep "^|" "$LOGS/bench_$op.log"
done
cache_out
tar cJf "$OUT/logs.tar.xz" -C "$LOGS" .
echo "all: $(( $(date +%s) - t0 )) s"
