#!/usr/bin/env bash
# kdakit's test suite: the C++ tests (GoogleTest, and the C++ package installed and examples/cpp run against it;
# through CTest), then the Python tests (pytest).
# GPU tests skip, with the reason printed, where no GPU or no CUDA kernels are present.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD=${KDAKIT_TEST_BUILD_DIR:-build/cpp-tests}
JOBS=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)

echo "== C++ tests"
# The C++ tests' build compiles the CUDA kernels only where a GPU can run them (KDAKIT_CUDA_KERNELS=ON forces it).
# Elsewhere the install has compiled them already, and the CUDA compiler builds the host-side CUDA tests only.
if [[ -z ${KDAKIT_CUDA_KERNELS:-} ]]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    KDAKIT_CUDA_KERNELS=ON
  else
    KDAKIT_CUDA_KERNELS=OFF
    echo "no GPU (nvidia-smi -L lists none): the C++ tests are built without the CUDA kernels" \
         "(KDAKIT_CUDA_KERNELS=ON compiles them too)"
  fi
fi
cmake -S . -B "$BUILD" -DKDAKIT_BUILD_TESTS=ON -DKDAKIT_CUDA="${KDAKIT_CUDA:-AUTO}" \
      -DKDAKIT_CUDA_KERNELS="$KDAKIT_CUDA_KERNELS" ${KDAKIT_CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD" -j "$JOBS"
ctest --test-dir "$BUILD" --output-on-failure

echo "== Python tests"
"$PYTHON" -m pytest tests/python "$@"
