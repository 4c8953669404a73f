#!/usr/bin/env bash
# A/B in one call on the GPU machine: builds two source trees side by side and runs the same command against each
# build, so a change is measured against its base in the same process environment and on the same device.
#
#   tools/gpu/ab.sh TREE_A TREE_B COMMAND...
#
# COMMAND runs in this checkout with PYTHONPATH pointing at the tree's build (e.g. tools/gpu/kernel_times.py ROWS, or
# python3 -m pytest tests/python/...: the tests of this checkout against each build), once per build (A, then B),
# each in its own process. The GPU machine has no git history, so export the other tree first into an ignored folder
# and carry it, e.g.
#   mkdir -p .deps/ab/branch && git archive wip/some-branch | tar -x -C .deps/ab/branch
#   tools/gpu/ab.sh . .deps/ab/branch python3 tools/gpu/kernel_times.py "decode T1 N1 H16 fp32"
# The builds (in parallel, by tools/gpu/ab_build.sh without its nanobind-domain patch): A in /tmp/kdakit-ab-pair/base
# (from a copy of TREE_A), B in /tmp/kdakit-ab-pair/cur (TREE_B built in place); logs $OUT/ab-build-{base,cur}.log.
# For bits and times of both builds in one process, see tools/gpu/ab_compare.py (tools/gpu/run compare).
set -uo pipefail
if [[ $# -lt 3 ]]; then
  sed -n '2,15p' "$0"
  exit 2
fi
prefix=/tmp/kdakit-ab-pair
trees=("$1" "$2")
shift 2
KDAKIT_AB_PLAIN=1 "$(dirname "$0")/ab_build.sh" "${trees[0]}" "${trees[1]}" "$prefix" || exit 1
labels=(A B)
dirs=("$prefix/base" "$prefix/cur")
status=0
for i in 0 1; do
  echo "== ${labels[$i]}: ${trees[$i]}"
  PYTHONPATH=${dirs[$i]}${PYTHONPATH:+:$PYTHONPATH} "$@" || status=1
done
exit $status
