#!/usr/bin/env bash
# Nsight Compute summary (speed of light, occupancy, warp stall reasons) of kdakit's forward kernels on one
# benchmark row. Usage: tools/gpu/ncu.sh [row name substring]
set -uo pipefail
cd "$(dirname "$0")/../.."
row=${1:-B1 T8192 H64}
cat > /tmp/kdakit_ncu_case.py <<PY
import torch
from kdakit import bench
for name, B, T, H, HV, lens in bench.FORWARD_SHAPES:
    if "$row" in name:
        x, _ = bench.forward_inputs(B, T, H, HV, lens)
        with torch.inference_mode():
            bench.run_kdakit(x)
            torch.cuda.synchronize()
PY
ncu --clock-control none -k regex:"prepare|recurrence" -c 2 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis python3 /tmp/kdakit_ncu_case.py 2>&1 \
  | grep -vE "^==PROF==|^    ---|^$" | grep -E "prepare|recurrence|Duration|Throughput|Occupancy|Registers|Shared Memory|Block Size|Stall|Warp Cycles|Issued|Eligible|Active Warps|Waves|L1|L2|DRAM|Mem" | head -120
