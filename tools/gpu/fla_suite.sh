#!/usr/bin/env bash
# FLA's KDA test file (tests/ops/test_kda.py) as kdakit's peer test suite: its imports of chunk_kda,
# fused_recurrent_kda and fused_recurrent_kda_fwd rewritten to kdakit's (tools/gpu/fla_suite.py), run with pytest.
#
#   tools/gpu/fla_suite.sh [--fla-src] [--build] [--cpu] [pytest args...]
#
# Needs .deps/peers/fla_tests/ (FLA_GIT=... tools/gpu/run prepare-deps fills it), kdakit installed (tools/gpu/run
# check does that; --build installs this tree first), and FLA's package for the file's other imports: by default the
# wheels of .deps/wheels (installed into /tmp/site when FLA is not importable), with --fla-src FLA's source at the
# test file's commit (.deps/peers/fla_src). FLA's FlashKDA and Triton-Ascend backend tests are left out (reasons in
# fla_suite.py). --cpu: FLA's device set to "cpu" (the file against kdakit's CPU path, where no GPU is; slow).
# pytest args pass through; a -k EXPR is combined with the exclusions. KDAKIT_FLA_SUITE_TIMEOUT: seconds for pytest
# (default 480, so that a 10-minute machine call still gets its summary).
# Writes to $OUT: fla_suite.diff (the rewrite, also printed), fla_suite_test_kda.py, fla_suite.log (pytest -v),
# fla_suite.xml (JUnit), fla_suite.md / .json (summary, printed last). Exit status 0 when no test that calls kdakit
# fails (FLA-only tests aside), 1 otherwise, 2 when it cannot run.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-/tmp/kdakit-out}
PYTHON=${PYTHON:-python3}
peers=${KDAKIT_PEERS:-.deps/peers}
work=${KDAKIT_FLA_SUITE_DIR:-/tmp/kdakit-fla-suite}
fla=wheel
build=0
cpu=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --fla-src) fla=src; shift ;;
    --build) build=1; shift ;;
    --cpu) cpu=(-p fla_suite_cpu); shift ;;
    -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
    *) break ;;
  esac
done
mkdir -p "$OUT"
if [[ ! -f $peers/fla_tests/test_kda.py ]]; then
  echo "fla_suite: no $peers/fla_tests/test_kda.py (fill it on a networked machine: FLA_GIT=<git dir>" \
    "tools/gpu/run prepare-deps)" >&2
  exit 2
fi

if [[ $build == 1 ]]; then
  if [[ -z ${KDAKIT_CUTLASS_DIR:-} && -d .deps/cutlass/include ]]; then
    export KDAKIT_CUTLASS_DIR=$PWD/.deps/cutlass/include
  fi
  echo "== build (log: $OUT/build.log)"
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    "$PYTHON" -m pip install -v --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1 \
    || { tail -n 20 "$OUT/build.log"; exit 2; }
fi
if ! "$PYTHON" -c 'import kdakit' 2>/dev/null; then
  echo "fla_suite: kdakit is not importable; run tools/gpu/run check first, or pass --build" >&2
  exit 2
fi
if ! "$PYTHON" -c 'import sys, kdakit; sys.exit(0 if kdakit.cuda_available() else 1)' 2>/dev/null; then
  echo "fla_suite: kdakit has no CUDA kernels here or no GPU is visible: most tests will fail or skip"
fi

# FLA's package, for the test file's other imports (references, gate references, assert_close, device).
if [[ $fla == src ]]; then
  [[ -d $peers/fla_src/fla ]] || { echo "fla_suite: no $peers/fla_src/fla for --fla-src" >&2; exit 2; }
  export PYTHONPATH=$PWD/$peers/fla_src${PYTHONPATH:+:$PYTHONPATH}
else
  site=${FLA_SITE:-/tmp/site}
  if ! "$PYTHON" -c 'import fla' 2>/dev/null && [[ ! -d $site/fla ]] && compgen -G ".deps/wheels/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --target "$site" .deps/wheels/*.whl >"$OUT/wheels.log" 2>&1
  fi
  [[ -d $site/fla ]] && export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
export FLA_FLASH_KDA=0  # FLA's own kernels wherever the file still calls FLA

echo "== rewrite (diff: $OUT/fla_suite.diff)"
"$PYTHON" tools/gpu/fla_suite.py prepare "$peers/fla_tests" "$work" "$OUT" || exit 2
echo "== imports"
"$PYTHON" tools/gpu/fla_suite.py imports "$work/tests/ops/test_kda.py" 2>&1 | tail -n 8
[[ ${PIPESTATUS[0]} == 0 ]] || { echo "fla_suite: the rewritten file does not import kdakit's ops" >&2; exit 2; }

echo "== pytest (log: $OUT/fla_suite.log)"
deselect=$("$PYTHON" tools/gpu/fla_suite.py deselect)
args=()
while [[ $# -gt 0 ]]; do  # a -k of the caller narrows the run further; the exclusions stay
  if [[ $1 == -k && $# -gt 1 ]]; then
    deselect="($deselect) and ($2)"
    shift 2
  else
    args+=("$1")
    shift
  fi
done
rm -f "$OUT/fla_suite.xml"
limit=${KDAKIT_FLA_SUITE_TIMEOUT:-480}
(cd "$work" && PYTHONPATH=$work${PYTHONPATH:+:$PYTHONPATH} timeout -k 10 "$limit" \
   "$PYTHON" -m pytest tests/ops/test_kda.py -c pytest.ini --rootdir . -p no:cacheprovider ${cpu[@]+"${cpu[@]}"} \
   -v -rfE --junitxml "$OUT/fla_suite.xml" -k "$deselect" ${args[@]+"${args[@]}"}) >"$OUT/fla_suite.log" 2>&1
rc=$?
[[ $rc == 124 || $rc == 137 ]] && echo "fla_suite: pytest ran past $limit s and was stopped"
tail -n 3 "$OUT/fla_suite.log"
commit=$(cat "$peers/fla.commit" 2>/dev/null || true)
echo
"$PYTHON" tools/gpu/fla_suite.py summary "$OUT/fla_suite.xml" "$OUT/fla_suite.log" "$OUT" "${commit:0:12}"
