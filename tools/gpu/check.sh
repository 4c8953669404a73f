#!/usr/bin/env bash
# One call on the offline GPU machine: build kdakit, run its test suite (C++ and Python, GPU tests included)
# and, when asked, the benchmark; full logs go to $OUT, a short summary is printed last.
#
#   tools/gpu/check.sh [--bench] [--sanitize] [pytest args...]
#
# Brought along in the ignored folder .deps/ (name it in the device tool's `carry`; tools/gpu/prepare_deps.sh fills it):
#   .deps/cutlass/include/  CUTLASS / CuTe headers for the Hopper kernels (exported as KDAKIT_CUTLASS_DIR)
#   .deps/googletest/       GoogleTest sources (e.g. a copy of Debian's /usr/src/googletest)
#   .deps/wheels/           peer wheels for side-by-side tests and benchmarks (flash-linear-attention, fla-core,
#                           nvidia-cudnn-frontend, apache-tvm-ffi)
# KDAKIT_QUICK=1: Python tests only (no C++ tests; arguments go to pytest). KDAKIT_BENCH_ARGS: arguments of the
# benchmark (e.g. "--forms batch-vfirst": the whole decode matrix takes minutes; tools/gpu/run bench runs it alone).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
if [[ -z ${KDAKIT_CUTLASS_DIR:-} && -d .deps/cutlass/include ]]; then
  export KDAKIT_CUTLASS_DIR=$PWD/.deps/cutlass/include
fi
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
OUT=${OUT:-/tmp/kdakit-out}
mkdir -p "$OUT"
BENCH=0; SANITIZE=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bench) BENCH=1; shift ;;
    --sanitize) SANITIZE=1; shift ;;
    *) break ;;
  esac
done
export PYTHONUNBUFFERED=1
declare -A STATUS

step() {  # step NAME LOG CMD...: runs CMD, logs to $OUT/LOG, records pass/fail
  local name=$1 log=$2; shift 2
  echo "== $name"
  local t0=$SECONDS
  if "$@" >"$OUT/$log" 2>&1; then STATUS[$name]="ok ($((SECONDS - t0)) s)"; else STATUS[$name]="FAILED ($((SECONDS - t0)) s, see $log)"; fi
  tail -n 5 "$OUT/$log"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nvcc --version | tail -n 1
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  python3 -c 'import nanobind, scikit_build_core; print("nanobind", nanobind.__version__, "scikit-build-core", scikit_build_core.__version__)'
  echo "KDAKIT_CUTLASS_DIR=${KDAKIT_CUTLASS_DIR:-(unset)}"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if compgen -G ".deps/wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .deps/wheels/*.whl >"$OUT/wheels.log" 2>&1 \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

step build build.log python3 -m pip install -v --no-build-isolation --no-deps .
GTEST_ARGS=""
[[ -d .deps/googletest ]] && GTEST_ARGS="-DKDAKIT_GTEST_SOURCE_DIR=$PWD/.deps/googletest"
if [[ ${KDAKIT_QUICK:-0} == 1 ]]; then  # Python tests only (arguments go to pytest)
  step tests tests.log python3 -m pytest "$@"
else
  step tests tests.log env KDAKIT_CMAKE_ARGS="$GTEST_ARGS" PYTHON=python3 tools/test.sh "$@"
fi
if [[ $SANITIZE == 1 && -f tools/gpu/sanitize.sh ]]; then
  step sanitize sanitize.log tools/gpu/sanitize.sh
fi
if [[ $BENCH == 1 ]]; then
  # shellcheck disable=SC2086  # KDAKIT_BENCH_ARGS is a list of words
  step bench bench.log python3 -m kdakit.bench --out "$OUT" ${KDAKIT_BENCH_ARGS:-}
fi

echo
echo "== summary ($(head -n 1 "$OUT/env.txt"))"
for k in build tests sanitize bench; do [[ -n "${STATUS[$k]:-}" ]] && printf '%-9s %s\n' "$k" "${STATUS[$k]}"; done
grep -E "tests passed|tests failed" "$OUT/tests.log" | tail -n 1
grep -E "^[0-9]+ (passed|failed)|(passed|failed).* in [0-9.]+s" "$OUT/tests.log" | tail -n 1
[[ -f "$OUT/sanitize.log" ]] && grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitize.log"
[[ -f "$OUT/bench_table.txt" ]] && cat "$OUT/bench_table.txt"
for k in "${!STATUS[@]}"; do [[ ${STATUS[$k]} == FAILED* ]] && exit 1; done
exit 0
