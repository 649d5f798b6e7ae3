# Kernel caches for the device scripts (sourced by device_run.sh and device_pair.sh).
# TileLang's kernel cache (ours and FlashQLA's JIT kernels) and Triton's (FLA's kernels and, with
# TRITON_CACHE_AUTOTUNING=1, its autotuning results) live in .tl-cache. cache_in unpacks every .devrun/*.tar.xz
# there (benchmarks/precompile.py's tlcache.tar.xz first, then what earlier calls handed back); cache_out packs what
# this call added as $OUT/newcache-<epoch seconds>.tar.xz (kept under the 16 MiB a returned file may have: nvcc's
# content-addressed cubins stay behind, the kernels load from their own cache entries). Copy it to .devrun/ and the
# session's next calls neither recompile, nor re-autotune FLA, nor re-JIT FlashQLA.
export TILELANG_CACHE_DIR=$PWD/.tl-cache TILELANG_DEFAULT_TARGET='{"kind":"cuda","arch":"sm_90a"}' PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=$PWD/.tl-cache/triton TRITON_CACHE_AUTOTUNING=1

cache_in() {
  [ -f .tl-cache/.stamp ] && return  # unpacked by an earlier script of this call (re-unpacking races its readers)
  mkdir -p .tl-cache
  for f in .devrun/tlcache.tar.xz .devrun/newcache-*.tar.xz; do [ -f "$f" ] && tar xJf "$f" -C .tl-cache; done
  touch .tl-cache/.stamp
}

cache_out() {
  (cd .tl-cache && find . -type f -newer .stamp ! -name .new ! -path '*/cuda-binaries/*' > .new)
  local out="$OUT/newcache-$(date +%s).tar.xz"
  tar cJf "$out" -C .tl-cache -T .tl-cache/.new
  echo "new cache entries: $(wc -l < .tl-cache/.new) files, $(du -h "$out" | cut -f1)"
}
