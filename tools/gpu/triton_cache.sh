# FLA's Triton autotuning results, carried from one GPU machine to the next (sourced by tools/gpu/run).
#
# FLA caches its autotuning (Triton's `cache_results`) as small `*.autotune.json` files in the Triton cache, which
# is lost with the machine; its first run at every new shape then autotunes again for minutes. The results are kept
# per GPU model in .deps/triton-autotune/<GPU name>/ (a Triton cache holding only those files), so that one model's
# tuning never stands in for another's:
#   triton_cache_seed      TRITON_CACHE_DIR (default /tmp/kdakit-triton) seeded with this GPU model's results
#   triton_cache_collect   every autotune result of TRITON_CACHE_DIR into $OUT/triton-autotune.tar (<GPU name>/...):
#                          one file, since the cache's nested hash folders do not all come back from the machine
# On the networked machine, `tools/gpu/run triton-cache merge DIR` adds a run's collected results (DIR: the run's
# files folder holding triton-autotune.tar, the tar itself, or a triton-autotune/ folder) to .deps/triton-autotune/.

triton_gpu_name() {
  command -v nvidia-smi >/dev/null 2>&1 || return 1
  local name
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | tr -c 'A-Za-z0-9._\n-' '_')
  [[ -n $name ]] && echo "$name"
}

triton_cache_seed() {
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kdakit-triton}
  mkdir -p "$TRITON_CACHE_DIR"
  local gpu
  gpu=$(triton_gpu_name) || return 0
  if [[ -d .deps/triton-autotune/$gpu ]]; then
    cp -rn ".deps/triton-autotune/$gpu/." "$TRITON_CACHE_DIR/"
    echo "triton-cache: $(find ".deps/triton-autotune/$gpu" -name '*.autotune.json' | wc -l) autotune results for $gpu" >&2
  fi
  return 0
}

triton_cache_collect() {
  local gpu stage
  gpu=$(triton_gpu_name) || return 0
  [[ -d ${TRITON_CACHE_DIR:-} ]] || return 0
  stage=$(mktemp -d)
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -print0) | while IFS= read -r -d '' f; do
    mkdir -p "$stage/$gpu/$(dirname "$f")"
    cp "$TRITON_CACHE_DIR/$f" "$stage/$gpu/$f"
  done
  [[ -d $stage/$gpu ]] && tar cf "$OUT/triton-autotune.tar" -C "$stage" "$gpu"
  rm -rf "$stage"
  return 0
}

# Runs a command with the seeded cache, then collects the results; its exit status is the command's.
with_triton_cache() {
  triton_cache_seed
  "$@"
  local rc=$?
  triton_cache_collect
  return $rc
}

# merge DIR: DIR's triton-autotune/<GPU name>/ results (or DIR's own <GPU name>/ folders) into .deps/triton-autotune/.
triton_cache_merge() {
  local from=${1:?usage: tools/gpu/run triton-cache merge DIR}
  [[ -f $from/triton-autotune.tar ]] && from=$from/triton-autotune.tar
  if [[ -f $from ]]; then
    local unpacked
    unpacked=$(mktemp -d)
    tar xf "$from" -C "$unpacked" || return 2
    from=$unpacked
  fi
  [[ -d $from/triton-autotune ]] && from=$from/triton-autotune
  [[ -d $from ]] || { echo "triton-cache merge: no folder $from" >&2; return 2; }
  mkdir -p .deps/triton-autotune
  local n
  n=$(cd "$from" && find . -name '*.autotune.json' | wc -l)
  cp -rn "$from/." .deps/triton-autotune/
  echo "triton-cache merge: $n autotune results from $from into .deps/triton-autotune/"
}
