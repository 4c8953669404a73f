#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck on a small varlen forward with GVA and tails.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
status=0
for tool in memcheck racecheck; do
  echo "== compute-sanitizer --tool $tool"
  compute-sanitizer --tool "$tool" --error-exitcode 99 python3 tools/gpu/sanitize_case.py \
    || status=1
done
exit $status
