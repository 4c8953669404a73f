#!/usr/bin/env bash
# Nsight Compute summary (speed of light, occupancy, warp stall reasons) of kdakit's kernels (forward or decode) on one
# benchmark row. Usage: tools/gpu/ncu.sh [row name substring]
set -uo pipefail
cd "$(dirname "$0")/../.."
row=${1:-B1 T8192 H64}
stalls=""
for r in long_scoreboard short_scoreboard barrier wait math_pipe_throttle mio_throttle lg_throttle not_selected \
         selected dispatch_stall no_instruction tex_throttle imc_miss branch_resolving membar; do
  stalls+="smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio,"
done
ncu --clock-control none -k regex:"prepare|recurrence|decode_kernel" -c 2 \
    --section SpeedOfLight --section Occupancy --metrics "${stalls}smsp__inst_executed.sum" \
    python3 tools/gpu/ncu_case.py "$row" 2>&1 \
  | grep -vE "^==PROF==|^    ---|^$" \
  | grep -E "prepare|recurrence|decode_kernel|Duration|Throughput|Occupancy|Registers|stalled|inst_executed" | head -80
