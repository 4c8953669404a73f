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
cmake -S . -B "$BUILD" -DKDAKIT_BUILD_TESTS=ON -DKDAKIT_CUDA="${KDAKIT_CUDA:-AUTO}" ${KDAKIT_CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD" -j "$JOBS"
ctest --test-dir "$BUILD" --output-on-failure

echo "== Python tests"
"$PYTHON" -m pytest tests/python "$@"
