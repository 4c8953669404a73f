#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck on a small varlen forward with GVA and tails, on a small varlen training
# step (forward and backward), and on decode and verify calls in place on state pools (both layouts and pool dtypes).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
status=0
for case in ${SANITIZE_CASES:-sanitize_case sanitize_backward_case sanitize_decode_case}; do
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool ($case)"
    compute-sanitizer --tool "$tool" --error-exitcode 99 python3 "tools/gpu/$case.py" || status=1
  done
done
exit $status
