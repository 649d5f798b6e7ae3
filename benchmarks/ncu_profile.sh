#!/usr/bin/env bash
# Nsight Compute on our kernels of one bench case: the full metric set and the per-instruction source page (each
# SASS instruction with its executions and warp-stall samples), exported as CSV for reading on a machine without ncu.
#   device run, carry [".gpu-bundle", ".devrun"]:
#   . .gpu-bundle/setup.sh && bash benchmarks/ncu_profile.sh OP CASE KERNEL [KERNEL ...]
#   e.g. bash benchmarks/ncu_profile.sh gdn 8192x4_h16-64_decay kkt_solve chunk_fwd_ws
# KERNEL is a regular expression on the kernel's name; the first launch that matches it in `tilela bench --op OP
# --impls tilela --cases CASE` (one replay, no checks) is profiled (ncu replays it, caches flushed, clocks at base).
# Output per KERNEL: $OUT/ncu-<KERNEL>-details.csv (every section's metrics), $OUT/ncu-<KERNEL>-source.csv (the source
# page, SASS), $OUT/ncu-<KERNEL>.log (the bench's and ncu's lines). Time limit per kernel: NCU_TIMEOUT (s, default
# 240). ncu binary: $NCU, else ncu on PATH, else the newest /usr/local/cuda*/bin/ncu.
set -o pipefail
. benchmarks/device_cache.sh
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
[ $# -ge 3 ] || { echo "usage: ncu_profile.sh OP CASE KERNEL [KERNEL ...]" >&2; exit 2; }
cache_in
op=$1 case=$2
shift 2
ncu=${NCU:-$(command -v ncu || ls -d /usr/local/cuda*/bin/ncu 2>/dev/null | sort -V | tail -1)}
[ -n "$ncu" ] && [ -x "$ncu" ] || { echo "ncu not found (set NCU)" >&2; exit 1; }
"$ncu" --version | tail -1
status=0
for kernel in "$@"; do
  t0=$(date +%s)
  report=/tmp/ncu-$kernel
  timeout "${NCU_TIMEOUT:-240}" "$ncu" --set full --import-source yes -k "regex:$kernel" -c 1 -f -o "$report" \
    python -m tilela.cli bench --op "$op" --impls tilela --no-checks --replays 1 --cases "$case" \
    --out "/tmp/ncu-bench-$kernel.json" > "$OUT/ncu-$kernel.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ] || [ ! -f "$report.ncu-rep" ]; then
    echo "$kernel: ncu rc $rc, no report ($(( $(date +%s) - t0 )) s)"; tail -5 "$OUT/ncu-$kernel.log"; status=1; continue
  fi
  "$ncu" -i "$report.ncu-rep" --page details --csv > "$OUT/ncu-$kernel-details.csv" 2>> "$OUT/ncu-$kernel.log"
  "$ncu" -i "$report.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-$kernel-source.csv" \
    2>> "$OUT/ncu-$kernel.log"
  echo "$kernel: $(grep -c . "$OUT/ncu-$kernel-details.csv") metric lines, $(grep -c . "$OUT/ncu-$kernel-source.csv")" \
       "source lines ($(( $(date +%s) - t0 )) s)"
  grep -E '"(Duration|Registers Per Thread|Achieved Occupancy|Issue Slots Busy|Compute \(SM\) Throughput)"' \
    "$OUT/ncu-$kernel-details.csv" | cut -d, -f12- | head -8
done
exit $status
