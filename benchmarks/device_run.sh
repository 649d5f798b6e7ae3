#!/usr/bin/env bash
# One call on the H200: GPU tests of the TileLang path, then benchmarks against FLA (and FlashQLA).
#   device run, carry [".gpu-bundle", ".devrun"]:
#   . .gpu-bundle/setup.sh && bash benchmarks/device_run.sh [--full] [op ...]     (ops: gdn (default), ladder,
#   kkt_solve, chunk_local_cumsum; --full runs every case instead of --quick). Budget several minutes per op
#   for FLA's first-call Triton autotuning.
# .devrun/tlcache.tar.xz (optional) is TileLang's kernel cache built on a CPU machine by
# `python benchmarks/precompile.py` with the same TILELANG_CACHE_DIR / TILELANG_DEFAULT_TARGET: the kernels
# then load instead of compiling (same tilelang version; python and torch versions may differ).
set -o pipefail
export TILELANG_CACHE_DIR=$PWD/.tl-cache TILELANG_DEFAULT_TARGET='{"kind":"cuda","arch":"sm_90a"}' PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT" .tl-cache
[ -f .devrun/tlcache.tar.xz ] && tar xJf .devrun/tlcache.tar.xz -C .tl-cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
t0=$(date +%s)
timeout 150 python -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_ops.py tests/test_gpu_gdn.py \
  tests/test_gpu_ladder.py 2>&1 | grep -v INFO > "$OUT/pytest_gpu.log"
tail -25 "$OUT/pytest_gpu.log" | grep -E "passed|failed|FAILED|Error" | tail -15
echo "tests: $(( $(date +%s) - t0 )) s"
quick=--quick; [ "${1:-}" = "--full" ] && { quick=; shift; }
for op in "${@:-gdn}"; do
  timeout "${BENCH_TIMEOUT:-300}" python -m tilela.cli bench --op "$op" $quick --replays 20 --out "$OUT/$op.json" \
    2>&1 | grep -v INFO > "$OUT/bench_$op.log"
  grep "^|" "$OUT/bench_$op.log"
done
echo "all: $(( $(date +%s) - t0 )) s"
