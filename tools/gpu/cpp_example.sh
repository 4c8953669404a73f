#!/usr/bin/env bash
# The C++ package on the GPU machine: kdakit built with the CUDA kernels (sm_90a) and installed into a temporary prefix,
# examples/cpp built against the install as its own project and run on the GPU; for the shared library also the check
# of its exported symbols. The example's output is printed (and kept in $OUT/cpp-example-KIND.txt), the build log goes
# to $OUT/cpp-example-KIND.log.
#
#   tools/gpu/cpp_example.sh [shared|static]     (default shared)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
kind=${1:-shared}
case "$kind" in
  shared) shared=ON ;;
  static) shared=OFF ;;
  *) echo "usage: tools/gpu/cpp_example.sh [shared|static]" >&2; exit 2 ;;
esac
if [[ -z ${KDAKIT_CUTLASS_DIR:-} && -d .deps/cutlass/include ]]; then
  export KDAKIT_CUTLASS_DIR=$PWD/.deps/cutlass/include
fi
OUT=${OUT:-/tmp/kdakit-out}
mkdir -p "$OUT"
work=/tmp/kdakit-cpp-example/$kind
log=$OUT/cpp-example-$kind.log
: >"$log"

step() {  # step CMD...: runs CMD into the log; on failure prints the log's tail and stops
  echo "\$ $*" >>"$log"
  if ! "$@" >>"$log" 2>&1; then
    echo "failed: $*"
    tail -n 30 "$log"
    exit 1
  fi
}

echo "== kdakit with CUDA (sm_90a), BUILD_SHARED_LIBS=$shared, installed into $work/prefix (log: $log)"
t0=$SECONDS
step cmake -S . -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DKDAKIT_CUDA=ON \
  "-DKDAKIT_CUDA_GENCODE=-gencode=arch=compute_90a,code=sm_90a" -DBUILD_SHARED_LIBS=$shared \
  -DCMAKE_INSTALL_PREFIX="$work/prefix" -DCMAKE_INSTALL_LIBDIR=lib
step cmake --build "$work/build" -j "$(nproc)"
rm -rf "$work/prefix"
step cmake --install "$work/build"
step cmake -S examples/cpp -B "$work/example" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$work/prefix"
step cmake --build "$work/example" -j "$(nproc)"
echo "built in $((SECONDS - t0)) s"
if [[ $kind == shared ]]; then
  step cmake -DNM=nm -DLIBRARY="$work/prefix/lib/libkdakit.so" -P tests/cpp/package/check_exports.cmake
  grep -- "exported symbols" "$log" | tail -n 1
fi
echo "== examples/cpp: prefill_decode"
"$work/example/prefill_decode" 2>&1 | tee "$OUT/cpp-example-$kind.txt"
exit "${PIPESTATUS[0]}"
