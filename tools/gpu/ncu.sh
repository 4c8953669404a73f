#!/usr/bin/env bash
# Nsight Compute on kdakit's kernels (forward or decode) on one benchmark row (workload: tools/gpu/ncu.py case).
#
#   tools/gpu/ncu.sh [summary] [ROW]                  speed of light, occupancy, warp stall reasons, instructions
#                                                     of the prepare / recurrence / decode kernels (printed)
#   tools/gpu/ncu.sh source [KERNEL] [ROW] [LINES]    per-source-line hot spots (instructions executed, warp stall
#                                                     samples) of one kernel (regex, default prepare); the report and
#                                                     SASS / CUDA+SASS CSV exports go to $OUT/ncu_KERNEL*
#
# ROW: a substring of a benchmark row name (default "B1 T8192 H64"), e.g. "decode T1 N1024 H16 bf16".
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
mode=summary
if [[ ${1:-} == summary || ${1:-} == source ]]; then
  mode=$1
  shift
elif [[ ${1:-} == -h || ${1:-} == --help || ${1:-} == help ]]; then
  sed -n '2,10p' "$0"
  exit 0
fi

if [[ $mode == summary ]]; then
  row=${1:-B1 T8192 H64}
  stalls=""
  for r in long_scoreboard short_scoreboard barrier wait math_pipe_throttle mio_throttle lg_throttle not_selected \
           selected dispatch_stall no_instruction tex_throttle imc_miss branch_resolving membar; do
    stalls+="smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio,"
  done
  ncu --clock-control none -k regex:"prepare|recurrence|decode_(one_)?kernel" -c 2 \
      --section SpeedOfLight --section Occupancy --metrics "${stalls}smsp__inst_executed.sum" \
      python3 tools/gpu/ncu.py case "$row" 2>&1 \
    | grep -vE "^==PROF==|^    ---|^$" \
    | grep -E "prepare|recurrence|decode_(one_)?kernel|Duration|Throughput|Occupancy|Registers|stalled|inst_executed" | head -80
  exit 0
fi

kernel=${1:-prepare}
row=${2:-B1 T8192 H64}
lines=${3:-40}
OUT=${OUT:-/tmp/kdakit-out}
mkdir -p "$OUT"
rep="$OUT/ncu_${kernel}"
ncu --clock-control none -k regex:"$kernel" -c 1 --section SourceCounters --section WarpStateStats \
    --import-source yes -f -o "$rep" python3 tools/gpu/ncu.py case "$row" >"$OUT/ncu_${kernel}.log" 2>&1 \
  || tail -5 "$OUT/ncu_${kernel}.log"
# SASS with per-instruction metrics, and the same interleaved with the CUDA source lines (for mapping offline).
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu_${kernel}_sass.csv" 2>&1
ncu -i "$rep.ncu-rep" --page source --csv --print-source cuda,sass >"$OUT/ncu_${kernel}_cuda_sass.csv" 2>&1
python3 tools/gpu/ncu.py lines "$OUT/ncu_${kernel}_cuda_sass.csv" "$lines" || head -5 "$OUT/ncu_${kernel}_sass.csv"
