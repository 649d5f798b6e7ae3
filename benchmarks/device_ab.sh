#!/usr/bin/env bash
# One call on the H200: a change's kernels against a base revision's. The same cases are timed in alternating rounds
# (base, head, base, head, ...) by two processes on one GPU, this tree's src/ and the base tree's, each timing the
# anchor implementations too, so that `tilela bench --compare` reads the change's effect both across the runs and
# against the anchor within each (the drift between processes cancels there). The GPU tests of this tree run while
# the kernels compile. More variants time in the same rounds as sides of their own (SIDES), each against the base.
#   here, first: rm -rf .devrun/base && mkdir -p .devrun/base && git archive BASE src | tar x -C .devrun/base
#   device run, carry [".gpu-bundle", ".devrun"]:
#   . .gpu-bundle/setup.sh && CASES=name,name OP=gdn bash benchmarks/device_ab.sh
# Env: CASES (comma-separated case names of OP; required), OP (default gdn), IMPLS (default tilela,flash_qla: the first
# is the one compared, the others its anchors), ROUNDS (default 2), TESTS (pytest paths or node ids of this tree's
# GPU tests; none by default), TEST_PROCS (xdist workers, default 8), WARM_TIMEOUT, TEST_TIMEOUT, BENCH_TIMEOUT (s),
# DEADLINE (epoch seconds, default 540 s from the start: no round starts after it less 60 s), SIDES (default
# "base head": the trees timed in each round, in order; a side other than head is the tree in .devrun/<side>/src, and
# every side after the base is compared with it). Before the rounds every case runs once per tree in a process of
# its own (no timing) so that TileLang and FlashQLA compile in parallel, at most WARM_PROCS (default 10) at once:
# they share the GPU's memory and the host's cores with the GPU tests.
# Output: $OUT/<op>_<side>_<round>.json (records with --profile's kernels), their --compare tables on stdout,
# the new kernel-cache entries (benchmarks/device_cache.sh) and $OUT/logs.tar.xz (bench, warm-up and test logs, in
# $LOGS until the end): a call hands back at most 8 files.
set -o pipefail
. benchmarks/device_cache.sh
OUT=${OUT:-$PWD/device-out}
LOGS=${LOGS:-/tmp/device-ab-logs}
mkdir -p "$OUT" "$LOGS"
t0=$(date +%s)
DEADLINE=${DEADLINE:-$(( t0 + 540 ))}
op=${OP:-gdn} impls=${IMPLS:-tilela,flash_qla}
[ -n "$CASES" ] || { echo "device_ab.sh: CASES (comma-separated case names of $op) is required" >&2; exit 2; }
cache_in
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
read -ra sides <<< "${SIDES:-base head}"
declare -A tree
for side in "${sides[@]}"; do
  tree[$side]="/tmp/site:$PWD/.devrun/$side/src"
  [ "$side" = head ] && tree[$side]="/tmp/site:$PWD/src"
  [ -d "${tree[$side]#/tmp/site:}/tilela" ] || { echo "device_ab.sh: no tree for side $side in" \
                                                  "${tree[$side]#/tmp/site:} (see the header)" >&2; exit 2; }
done
IFS=, read -ra cases <<< "$CASES"
if [ -n "$TESTS" ]; then
  # shellcheck disable=SC2086  # TESTS is a list of paths or node ids
  OMP_NUM_THREADS=1 timeout -s INT -k 20 "${TEST_TIMEOUT:-300}" python -m pytest -v -p no:cacheprovider --tb=short \
    -rfE -n "${TEST_PROCS:-8}" --dist loadgroup -m gpu $TESTS 2>&1 | grep -v -E "INFO|warner\(" \
    > "$LOGS/pytest_gpu.log" &
  tests=$!
fi
warm=()
running() { local n=0 pid; for pid in "${warm[@]}"; do kill -0 "$pid" 2>/dev/null && n=$((n + 1)); done; echo "$n"; }
for side in "${sides[@]}"; do
  for case in "${cases[@]}"; do
    while [ "$(running)" -ge "${WARM_PROCS:-10}" ]; do sleep 1; done
    PYTHONPATH=${tree[$side]} timeout "${WARM_TIMEOUT:-240}" python -m tilela.cli bench --op "$op" --impls "$impls" \
      --no-checks --replays 1 --cases "$case" --out "/tmp/warm-$side-$case.json" > "$LOGS/warm_${side}_$case.log" 2>&1 &
    warm+=($!)
  done
done
wait "${warm[@]}"
echo "warm-up: $(( $(date +%s) - t0 )) s"
grep -h -E "Error|failed" "$LOGS"/warm_*.log | sort | uniq -c | head -10
if [ -n "$TESTS" ]; then
  wait "$tests"
  log="$LOGS/pytest_gpu.log"
  echo "gpu tests: $(grep -c ' PASSED' "$log") passed, $(grep -c ' FAILED' "$log") failed," \
       "$(grep -c ' ERROR' "$log") errors ($(( $(date +%s) - t0 )) s)"
  grep -E "^(FAILED|ERROR)|^E  " "$log" | head -20
fi
for ((round = 1; round <= ${ROUNDS:-2}; round++)); do
  [ $(( DEADLINE - $(date +%s) )) -lt 60 ] && { echo "round $round not started: the deadline is near"; break; }
  for side in "${sides[@]}"; do
    left=$(( DEADLINE - $(date +%s) - 20 ))
    limit=${BENCH_TIMEOUT:-200}; [ "$left" -lt "$limit" ] && limit=$left; [ "$limit" -lt 1 ] && limit=1
    PYTHONPATH=${tree[$side]} timeout "$limit" python -m tilela.cli bench --op "$op" --impls "$impls" --replays 20 \
      --profile --no-checks --cases "$CASES" --out "$OUT/${op}_${side}_$round.json" 2>&1 | grep -v INFO \
      > "$LOGS/bench_${side}_$round.log"
  done
  echo "== round $round ($(( $(date +%s) - t0 )) s)"
  for side in "${sides[@]:1}"; do
    echo "-- $side against ${sides[0]}"
    python -m tilela.cli bench --compare "$OUT/${op}_${sides[0]}_$round.json" "$OUT/${op}_${side}_$round.json"
  done
done
cache_out
tar cJf "$OUT/logs.tar.xz" -C "$LOGS" .
echo "all: $(( $(date +%s) - t0 )) s"
