#!/usr/bin/env bash
# compute-sanitizer over every shipped Hopper kernel family (benchmarks/sanitize_driver.py), on the H200.
#   device run, carry [".gpu-bundle", ".devrun"]:
#   . .gpu-bundle/setup.sh && bash benchmarks/sanitize.sh [tool ...] [-- driver arguments]
#   tools: memcheck racecheck synccheck (default: all three, in that order); driver arguments e.g.
#   `-- --only ws,split --dtypes bf16` to fit one tool's run into a call.
# 1. The driver once without a sanitizer: compiles what the kernel cache (.devrun, benchmarks/device_cache.sh)
#    misses and checks every call against the float64 reference ($OUT/sanitize-plain.log).
# 2. Each tool over the driver: $OUT/sanitize-<tool>.log (the sanitizer's report) and $OUT/sanitize-<tool>.out
#    (the driver's lines); one summary line per tool here.
# Time limits (s): PLAIN_TIMEOUT (default 300), SANITIZE_TIMEOUT per tool (default 300). Exit status 1 when the
# driver fails a check or a tool reports an error or times out. Sanitizer binary: $COMPUTE_SANITIZER, else
# compute-sanitizer on PATH, else the newest /usr/local/cuda*/bin/compute-sanitizer.
set -o pipefail
. benchmarks/device_cache.sh
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
cache_in

tools=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do tools+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck synccheck)

sanitizer=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || ls -d /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | sort -V | tail -1)}
if [ -z "$sanitizer" ] || [ ! -x "$sanitizer" ]; then
  echo "compute-sanitizer not found (set COMPUTE_SANITIZER)"; exit 1
fi
"$sanitizer" --version | tail -1
status=0

t0=$(date +%s)
timeout "${PLAIN_TIMEOUT:-300}" python benchmarks/sanitize_driver.py "$@" > "$OUT/sanitize-plain.log" 2>&1
rc=$?
grep -E "^FAIL" "$OUT/sanitize-plain.log" | head -20
echo "plain: rc $rc, $(tail -1 "$OUT/sanitize-plain.log"), $(( $(date +%s) - t0 )) s"
[ $rc -ne 0 ] && status=1

for tool in "${tools[@]}"; do
  case $tool in
    # memcheck without the leak check: PyTorch's caching allocator holds its blocks to the process's exit
    # (hundreds of reports per run, none a kernel's); invalid accesses are what memcheck is here for
    memcheck | synccheck) extra=() ;;
    racecheck) extra=(--racecheck-report all) ;;
    *) echo "unknown tool $tool (memcheck, racecheck, synccheck)"; status=1; continue ;;
  esac
  t0=$(date +%s)
  timeout "${SANITIZE_TIMEOUT:-300}" "$sanitizer" --tool "$tool" "${extra[@]}" --target-processes all \
    --error-exitcode 1 --print-limit 200 --launch-timeout 120 --log-file "$OUT/sanitize-$tool.log" \
    python benchmarks/sanitize_driver.py "$@" > "$OUT/sanitize-$tool.out" 2>&1
  rc=$?
  summary=$(grep -hE "ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY" "$OUT/sanitize-$tool.log" | tr -s ' ' | paste -sd ';')
  echo "$tool: rc $rc ($([ $rc -eq 124 ] && echo timed out || echo done)), ${summary:-no summary}," \
       "driver: $(tail -1 "$OUT/sanitize-$tool.out"), $(( $(date +%s) - t0 )) s"
  [ $rc -ne 0 ] && status=1
done
cache_out
exit $status
