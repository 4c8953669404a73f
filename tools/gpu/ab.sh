#!/usr/bin/env bash
# A/B in one call on the GPU machine: builds two source trees side by side and runs the same command against each
# build, so a change is measured against its base in the same process environment and on the same device.
#
#   tools/gpu/ab.sh TREE_A TREE_B COMMAND...
#
# COMMAND runs in this checkout with PYTHONPATH pointing at the tree's build (e.g. tools/gpu/kernel_times.py ROWS, or
# python3 -m pytest tests/python/...: the tests of this checkout against each build). The GPU machine has no git
# history, so export the other tree first into an ignored folder and carry it, e.g.
#   mkdir -p .deps/ab/branch && git archive wip/some-branch | tar -x -C .deps/ab/branch
#   tools/gpu/ab.sh . .deps/ab/branch python3 tools/gpu/kernel_times.py "decode T1 N1 H16 fp32"
set -uo pipefail
if [[ $# -lt 3 ]]; then
  sed -n '2,12p' "$0"
  exit 2
fi
OUT=${OUT:-/tmp/kdakit-out}
mkdir -p "$OUT"
trees=("$1" "$2")
shift 2
labels=(A B)
for i in 0 1; do
  prefix=/tmp/kdakit-ab-${labels[$i]}
  rm -rf "$prefix"
  log="$OUT/ab-build-${labels[$i]}.log"
  echo "== build ${labels[$i]}: ${trees[$i]}"
  if ! (cd "${trees[$i]}" && python3 -m pip install -q --no-build-isolation --no-deps --target "$prefix" .) >"$log" 2>&1; then
    tail -n 30 "$log"
    exit 1
  fi
done
status=0
for i in 0 1; do
  echo "== ${labels[$i]}: ${trees[$i]}"
  PYTHONPATH=/tmp/kdakit-ab-${labels[$i]}${PYTHONPATH:+:$PYTHONPATH} "$@" || status=1
done
exit $status
