"""Per-kernel GPU times (torch.profiler) of kdakit and FLA on benchmark rows: where the time goes, and how much of a
row's benchmark time is the kernels themselves (the rest is launch latency or host overhead).

    python3 tools/gpu/kernel_times.py [--kdakit-only] [row name substring] [...]

Forward rows are named as in `kdakit.bench.FORWARD_SHAPES`, training rows (one forward + backward step) as in
`kdakit.bench_train.TRAIN_SHAPES` (e.g. "train B1 T8192 H64"), decode rows as in `kdakit.bench_decode.decode_cases()`
(e.g. "decode T1 N1 H16 fp32"; rows of the batch-vfirst form unless the substring names a form, e.g.
"decode T1 N256 H16 fp32 varlen-kfirst").
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from kdakit import bench, bench_decode, bench_peers, bench_train

REPS = 5


def report(name, label, fn, x, grad=False):
    """Kernel times of fn(x); grad: a training step, run with autograd on."""
    with torch.inference_mode(not grad):
        for _ in range(3):
            fn(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(REPS):
                fn(x)
            torch.cuda.synchronize()
    print(f"== {name}: {label}")
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            rows.setdefault(e.name, []).append(e.device_time)
    total = 0.0
    for k, v in sorted(rows.items(), key=lambda kv: -sum(kv[1])):
        total += sum(v) / REPS
        print(f"  {sum(v) / REPS / 1e3:9.4f} ms/call  {len(v) // REPS:3d}x  {k[:110]}")
    print(f"  {total / 1e3:9.4f} ms/call  kernels in all")


def main(names):
    only = "--kdakit-only" in names  # skip the peers (their first calls compile for a while)
    names = [n for n in names if n != "--kdakit-only"] or ["B1 T8192 H64"]
    train = [s for s in bench_train.TRAIN_SHAPES if any(n in s[0] for n in names)]
    fla_train = None
    if train and not only:
        fla_train = bench_peers.fla_chunk_kda(print)
    for name, B, T, H, HV, lens in train:
        torch.manual_seed(0)
        x, _ = bench.forward_inputs(B, T, H, HV, lens)
        report(name, "kdakit", lambda x: bench_peers.kdakit_train_step(x)(), x, grad=True)
        if fla_train is not None:
            report(name, "FLA", lambda x: bench_peers.fla_train_step(fla_train, x)(), x, grad=True)
    if train and all(n.startswith("train") for n in names):
        return
    fla = None if only else bench.fla_runner()
    for name, B, T, H, HV, lens in bench.FORWARD_SHAPES:
        if any(s in name for s in names):
            x, _ = bench.forward_inputs(B, T, H, HV, lens)
            for label, fn in (("kdakit", bench.run_kdakit), ("FLA", fla)):
                if fn is not None:
                    report(name, label, fn, x)
    fla_decode = None if only else bench_decode.fla_decode_runner()
    for case in bench_decode.select_cases(names):
        x, _ = bench_decode.decode_inputs(case)
        for label, fn in (("kdakit", bench_decode.run_kdakit_decode), ("FLA", fla_decode)):
            if fn is not None:
                report(case.name, label, fn, x)


if __name__ == "__main__":
    main(sys.argv[1:])
