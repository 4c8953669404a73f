#!/usr/bin/env bash
# Per-source-line hot spots (instructions executed, warp stall samples) of one kdakit kernel on one benchmark row.
# Usage: tools/gpu/ncu_source.sh <kernel regex> [row name substring] [lines]
set -uo pipefail
cd "$(dirname "$0")/../.."
kernel=${1:-prepare}
row=${2:-B1 T8192 H64}
lines=${3:-40}
OUT=${OUT:-/tmp/kdakit-out}
mkdir -p "$OUT"
rep="$OUT/ncu_${kernel}"
ncu --clock-control none -k regex:"$kernel" -c 1 --section SourceCounters --section WarpStateStats \
    --import-source yes -f -o "$rep" python3 tools/gpu/ncu_case.py "$row" >"$OUT/ncu_${kernel}.log" 2>&1 || tail -5 "$OUT/ncu_${kernel}.log"
# SASS with per-instruction metrics, and the same interleaved with the CUDA source lines (for mapping offline).
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu_${kernel}_sass.csv" 2>&1
ncu -i "$rep.ncu-rep" --page source --csv --print-source cuda,sass >"$OUT/ncu_${kernel}_cuda_sass.csv" 2>&1
python3 tools/gpu/ncu_lines.py "$OUT/ncu_${kernel}_cuda_sass.csv" "$lines" || head -5 "$OUT/ncu_${kernel}_sass.csv"
