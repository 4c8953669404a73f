"""One call of kdakit on the benchmark rows whose names contain the argument (forward rows as in
kdakit.bench.FORWARD_SHAPES, decode rows as in kdakit.bench.decode_shapes()): the workload the ncu scripts profile.

    python3 tools/gpu/ncu_case.py "<row name substring>"
"""
import sys

import torch

from kdakit import bench


def main(row):
    ran = 0
    with torch.inference_mode():
        for name, B, T, H, HV, lens in bench.FORWARD_SHAPES:
            if row in name:
                x, _ = bench.forward_inputs(B, T, H, HV, lens)
                bench.run_kdakit(x)
                ran += 1
        for name, N, T, H, HV, pool_dtype in bench.decode_shapes():
            if row in name:
                x, _ = bench.decode_inputs(N, T, H, HV, pool_dtype)
                bench.run_kdakit_decode(x)
                ran += 1
        torch.cuda.synchronize()
    if ran == 0:
        sys.exit(f"no benchmark row matches {row!r}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "B1 T8192 H64")
