#!/usr/bin/env bash
# One call on a two-GPU machine (nvidia-h200-x2): one benchmark's full grid split over both GPUs by case, each
# GPU's process timing every implementation of its cases (ratios stay within one process and one GPU).
#   device run, kind nvidia-h200-x2, carry [".gpu-bundle", ".devrun"]:
#   . .gpu-bundle/setup.sh && bash benchmarks/device_pair.sh OP 'PREDICATE_A' 'PREDICATE_B'
# PREDICATE_*: a Python expression over a case's params p, e.g. 'p["HV"] <= 24'. The first process runs the
# float64 check cases; the second first runs the GPU tests named in $TESTS (pytest arguments), if any. DEADLINE
# (epoch seconds, default 520 s from now, leaving time for cache_out) stops both benchmarks; each keeps the cases
# it finished in $OUT/OP_a.json and $OUT/OP_b.json (one table of both: `tilela bench --report OP_a.json OP_b.json`).
# Caches: benchmarks/device_cache.sh (.devrun/*.tar.xz in, $OUT/newcache-<time>.tar.xz out).
set -o pipefail
op=$1
. benchmarks/device_cache.sh
OUT=${OUT:-$PWD/device-out}
t0=$(date +%s)
DEADLINE=${DEADLINE:-$(( t0 + 520 ))}
mkdir -p "$OUT"
cache_in
names() {
  python -c "import importlib, sys; from tilela.bench import OPS
bench = importlib.import_module(OPS[sys.argv[1]]).BENCH
print(','.join(c.name for c in bench.cases(False) if eval(sys.argv[2], {}, {'p': c.params})))" "$op" "$1"
}
cases_a=$(names "$2") cases_b=$(names "$3")
bench() {  # gpu, cases, tag, extra args
  left=$(( DEADLINE - $(date +%s) ))
  CUDA_VISIBLE_DEVICES=$1 timeout $(( left > 1 ? left : 1 )) python -m tilela.cli bench --op "$op" --replays 20 \
    --cases "$2" --out "$OUT/${op}_$3.json" "${@:4}" 2>&1 | grep -v INFO > "$OUT/bench_${op}_$3.log"
}
bench 0 "$cases_a" a &
(
  if [ -n "$TESTS" ]; then
    CUDA_VISIBLE_DEVICES=1 timeout 150 python -m pytest -q -p no:cacheprovider --tb=short $TESTS 2>&1 \
      | grep -v INFO > "$OUT/pytest_gpu.log"
  fi
  bench 1 "$cases_b" b --no-checks
) &
wait
[ -n "$TESTS" ] && grep -E "passed|failed|FAILED|Error" "$OUT/pytest_gpu.log" | tail -8
for tag in a b; do grep -E "failed|ms  vs" "$OUT/bench_${op}_$tag.log" | tail -4; done
cache_out
echo "done in $(( $(date +%s) - t0 )) s"
