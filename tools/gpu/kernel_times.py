"""Per-kernel GPU times (torch.profiler) of kdakit and FLA on one benchmark row: where the time goes.

    python3 tools/gpu/kernel_times.py [row name substring] [...]
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from kdakit import bench

names = sys.argv[1:] or ["B1 T8192 H64"]
fla = bench.fla_runner()
for name, B, T, H, HV, lens in bench.FORWARD_SHAPES:
    if not any(s in name for s in names):
        continue
    x, _ = bench.forward_inputs(B, T, H, HV, lens)
    for label, fn in (("kdakit", bench.run_kdakit), ("FLA", fla)):
        if fn is None:
            continue
        with torch.inference_mode():
            for _ in range(3):
                fn(x)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn(x)
                torch.cuda.synchronize()
        print(f"== {name}: {label}")
        rows = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                rows.setdefault(e.name, []).append(e.device_time)
        for k, v in sorted(rows.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {sum(v) / 5 / 1e3:8.3f} ms/call  {len(v) // 5:3d}x  {k[:110]}")
