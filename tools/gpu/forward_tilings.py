"""Forward kernel times (torch.profiler) per recurrence tile width (KDAKIT_FORWARD_BV) on benchmark rows, kdakit
only, in one process: checks the host's tile choice (`plan_forward_cuda` in src/cuda/backend.cu) row by row and
splits each row's time into its kernels.

    python3 tools/gpu/forward_tilings.py ["<row substring>" ...] [--bv 64,128]   (default: the many-head rows)
"""
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from kdakit import bench

REPS = 5


def kernel_times(fn):
    """Per-kernel-name GPU time per call (ms), summed over the launches of one call."""
    with torch.inference_mode():
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(REPS):
                fn()
            torch.cuda.synchronize()
    times = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            key = e.name.split("<")[0].split("(")[0].replace("void ", "").replace("kdakit::cuda::", "")
            times[key] = times.get(key, 0.0) + e.device_time / REPS / 1e3
    return times


def main(argv):
    widths = [None, "64", "128"]
    if "--bv" in argv:
        i = argv.index("--bv")
        widths = [None] + argv[i + 1].split(",")
        argv = argv[:i] + argv[i + 2:]
    rows = argv or ["B1 T8192 H64", "B1 T8192 H96", "B2 T16384", "B8 T4096", "varlen"]
    for name, B, T, H, HV, lens in bench.FORWARD_SHAPES:
        if not any(r in name for r in rows):
            continue
        x, _ = bench.forward_inputs(B, T, H, HV, lens)
        for bv in widths:
            if bv is None:
                os.environ.pop("KDAKIT_FORWARD_BV", None)
            else:
                os.environ["KDAKIT_FORWARD_BV"] = bv
            t = kernel_times(lambda: bench.run_kdakit(x))
            parts = "  ".join(f"{k} {v:.3f}" for k, v in sorted(t.items(), key=lambda kv: -kv[1]) if v >= 0.001)
            print(f"{name:22s} BV={bv or 'default':7s} {sum(t.values()):7.3f} ms  | {parts}", flush=True)
        os.environ.pop("KDAKIT_FORWARD_BV", None)
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
