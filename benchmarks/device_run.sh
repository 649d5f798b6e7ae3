#!/usr/bin/env bash
# One call on the H200: fill the kernel caches, GPU tests of the TileLang path, then benchmarks against FLA and
# FlashQLA.
#   device run, carry [".gpu-bundle", ".devrun"]:
#   . .gpu-bundle/setup.sh && bash benchmarks/device_run.sh [--full] [--no-tests] [op ...]
#   ops: gdn (default), ladder, kkt_solve, chunk_local_cumsum, state_pass; --full runs every case instead of --quick.
#   Time limits (s): PRECOMPILE_TIMEOUT, TEST_TIMEOUT, BENCH_TIMEOUT, or BENCH_TIMEOUT_<op> for one op; DEADLINE
#   (epoch seconds) cuts every benchmark short of it.
# Caches: .devrun/tlcache.tar.xz (optional) holds TileLang's kernel cache and Triton's cache. Build the TileLang
# part on a CPU machine (`python benchmarks/precompile.py`, same TILELANG_CACHE_DIR / TILELANG_DEFAULT_TARGET);
# whatever it misses is compiled here first, 16 processes at once. Triton keeps FLA's autotuning results
# (TRITON_CACHE_AUTOTUNING=1) next to its compiled kernels, and FlashQLA's JIT kernels land in TileLang's cache,
# so the whole cache leaves again as $OUT/tlcache.tar.xz: copy it to .devrun/ and the next call of the session
# neither recompiles nor re-autotunes (the first FLA run of a bare machine spends minutes autotuning).
set -o pipefail
export TILELANG_CACHE_DIR=$PWD/.tl-cache TILELANG_DEFAULT_TARGET='{"kind":"cuda","arch":"sm_90a"}' PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=$PWD/.tl-cache/triton TRITON_CACHE_AUTOTUNING=1
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT" .tl-cache
[ -f .devrun/tlcache.tar.xz ] && tar xJf .devrun/tlcache.tar.xz -C .tl-cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
t0=$(date +%s)
quick=--quick tests=1
while [ $# -gt 0 ]; do
  case $1 in
    --full) quick= ;;
    --no-tests) tests= ;;
    *) break ;;
  esac
  shift
done
timeout "${PRECOMPILE_TIMEOUT:-240}" python benchmarks/precompile.py 16 > "$OUT/precompile.log" 2>&1
tail -1 "$OUT/precompile.log"
echo "precompile: $(( $(date +%s) - t0 )) s"
if [ -n "$tests" ]; then
  timeout "${TEST_TIMEOUT:-240}" python -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_ops.py \
    tests/test_gpu_gdn.py tests/test_gpu_ladder.py tests/test_gpu_kkt.py 2>&1 | grep -v INFO > "$OUT/pytest_gpu.log"
  grep -E "passed|failed|FAILED|Error" "$OUT/pytest_gpu.log" | tail -15
  echo "tests: $(( $(date +%s) - t0 )) s"
fi
for op in "${@:-gdn}"; do
  limit=BENCH_TIMEOUT_$op  # per op, else BENCH_TIMEOUT
  limit=${!limit:-${BENCH_TIMEOUT:-300}}
  # DEADLINE (epoch seconds): leave 30 s for the cache's tarball
  [ -n "$DEADLINE" ] && limit=$(( limit < DEADLINE - $(date +%s) - 30 ? limit : DEADLINE - $(date +%s) - 30 ))
  [ "$limit" -lt 1 ] && limit=1
  timeout "$limit" python -m tilela.cli bench --op "$op" $quick --replays 20 --out "$OUT/$op.json" \
    2>&1 | grep -v INFO > "$OUT/bench_$op.log"
  grep "^|" "$OUT/bench_$op.log"
done
# (nvcc's content-addressed cubins stay behind: the kernels load from their own cache entries)
tar cJf "$OUT/tlcache.tar.xz" --exclude='*/cuda-binaries' -C .tl-cache .
echo "all: $(( $(date +%s) - t0 )) s; cache $(du -h "$OUT/tlcache.tar.xz" | cut -f1)"
