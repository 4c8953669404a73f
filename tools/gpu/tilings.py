"""kdakit's launch shapes on benchmark rows, kdakit only, in one process: checks the host's tiling choices row by row.

    python3 tools/gpu/tilings.py forward ["<row substring>" ...] [--bv 64,128]   (default: the many-head rows)
    python3 tools/gpu/tilings.py decode ["<row substring>" ...]                  (default: T1 N256 / N1024 rows)

forward: kernel times (torch.profiler, per call, summed by kernel name) per recurrence tile width
(KDAKIT_FORWARD_BV; the default first, then each width of --bv): checks `plan_forward_launch` (src/cuda/forward/plan.cpp)
and splits each row's time into its kernels.

decode: time per launch shape (KDAKIT_DECODE_WARPS x KDAKIT_DECODE_PASSES: the default, then warps 2/4 x passes
1/2/4), L2 flushed, medians of 20 CUDA-event timings (kdakit.bench.time_ms), and the best shape's share of the copy
bandwidth: checks `plan_decode_launch` (src/cuda/decode/plan.cpp).

Forward rows are named as in kdakit.bench.FORWARD_SHAPES, decode rows as in kdakit.bench_decode.decode_cases() (of
the batch-vfirst form unless a substring names another form, e.g. "T1 N256 H16 fp32 varlen-kfirst").
"""
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

REPS = 5
bench = bench_decode = None  # kdakit.bench and kdakit.bench_decode, imported in main (the usage text needs no build)


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


def forward(argv):
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
            kdakit._C.reload_overrides()  # the overrides are read once per process
            t = kernel_times(lambda: bench.run_kdakit(x))
            parts = "  ".join(f"{k} {v:.3f}" for k, v in sorted(t.items(), key=lambda kv: -kv[1]) if v >= 0.001)
            print(f"{name:22s} BV={bv or 'default':7s} {sum(t.values()):7.3f} ms  | {parts}", flush=True)
        os.environ.pop("KDAKIT_FORWARD_BV", None)
        kdakit._C.reload_overrides()
        del x
        torch.cuda.empty_cache()


def decode(rows):
    bw, flush = bench.copy_bandwidth(), bench.flush_buffer()
    rows = rows or ["T1 N256 ", "T1 N1024 "]
    shapes = [(w, p) for w in (2, 4) for p in (1, 2, 4)]
    print(f"{'row':42s} {'default':>9s} " + " ".join(f"{f'w{w}p{p}':>8s}" for w, p in shapes) + "  (us)")
    torch.manual_seed(0)
    for case in bench_decode.select_cases(rows):
        name = case.name
        x, nbytes = bench_decode.decode_inputs(case)
        times = []
        with torch.inference_mode():
            for w, p in [(None, None)] + shapes:
                for var, val in (("KDAKIT_DECODE_WARPS", w), ("KDAKIT_DECODE_PASSES", p)):
                    if val is None:
                        os.environ.pop(var, None)
                    else:
                        os.environ[var] = str(val)
                kdakit._C.reload_overrides()  # the overrides are read once per process
                times.append(bench.time_ms(lambda: bench_decode.run_kdakit_decode(x), 20, flush) * 1e3)
        for var in ("KDAKIT_DECODE_WARPS", "KDAKIT_DECODE_PASSES"):
            os.environ.pop(var, None)
        kdakit._C.reload_overrides()
        best = min(range(len(times)), key=times.__getitem__)
        label = "default" if best == 0 else f"w{shapes[best - 1][0]}p{shapes[best - 1][1]}"
        print(f"{name:42s} " + " ".join(f"{t:8.1f}" + ("*" if i == best else " ") for i, t in enumerate(times))
              + f"  best {label}: {100 * nbytes / (times[best] * 1e-6) / bw:.1f}% of copy bandwidth", flush=True)
        del x
        torch.cuda.empty_cache()


def main(argv):
    global bench, bench_decode, kdakit
    if not argv or argv[0] not in ("forward", "decode"):
        print(__doc__)
        return 2
    import kdakit
    from kdakit import bench, bench_decode
    (forward if argv[0] == "forward" else decode)(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
