"""Does a launch's argument-block size set the level of a short call's event-timed span? Under the benchmark's
protocol (`flush.zero_()` before each call, CUDA events around it), empty 64-CTA kernels with argument blocks of
8 ... 4096 bytes (tools/gpu/launch_probe.cu, probe_args) and, where kdakit's CUDA build and FLA are importable, the
T1 N1 H16 fp32 decode of both, round-robin call by call. Each block of runs first issues `shift` extra tiny launches
per call (a 1-element add), which moves where every later launch lands in the driver's command stream; a span
level that changes with the shift follows the command stream, not the kernel.

    nvcc -O3 -shared -Xcompiler -fPIC -gencode=arch=compute_90a,code=sm_90a tools/gpu/launch_probe.cu \\
        -o /tmp/launch_probe.so
    python3 tools/gpu/launch_args.py [--reps 100] [--shifts 0 1 2 3] [--probe /tmp/launch_probe.so]
"""
import argparse
import ctypes
import statistics

import torch

SIZES = (8, 64, 128, 160, 192, 224, 256, 304, 384, 512, 1024, 4096)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--shifts", type=int, nargs="*", default=[0, 1, 2, 3])
    ap.add_argument("--probe", default="/tmp/launch_probe.so")
    ap.add_argument("--sizes", type=int, nargs="*", default=list(SIZES))
    args = ap.parse_args()
    lib = ctypes.CDLL(args.probe)
    flush = torch.empty(512 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    tiny = torch.zeros(1, device="cuda")
    stream = lambda: ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    cands = [(f"empty, {b} B args", lambda b=b: lib.probe_args(stream(), b)) for b in args.sizes]
    try:
        import kdakit
        from kdakit import bench
        if kdakit.cuda_available():
            x, _ = bench.decode_inputs(1, 1, 16, 16, torch.float32)
            cands.append(("kdakit decode T1 N1 H16 fp32", lambda: bench.run_kdakit_decode(x)))
            fla = bench.fla_decode_runner()
            if fla is not None:
                cands.append(("FLA decode T1 N1 H16 fp32", lambda: fla(x)))
    except ImportError as e:
        print(f"kdakit: {e}")
    with torch.inference_mode():
        for name, fn in cands:
            if fn() not in (None, 0) and isinstance(fn(), int):
                raise SystemExit(f"{name}: launch failed")
        torch.cuda.synchronize()
        med = {name: [] for name, _ in cands}
        for shift in args.shifts:
            spans = {name: [] for name, _ in cands}
            for _ in range(args.reps):
                for name, fn in cands:
                    flush.zero_()
                    for _ in range(shift):
                        tiny.add_(1.0)
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    fn()
                    b.record()
                    b.synchronize()
                    spans[name].append(a.elapsed_time(b) * 1e3)
            for name in spans:
                med[name].append(statistics.median(spans[name]))
    print(f"span medians (us) by shift; {args.reps} runs each")
    print(f"{'candidate':30s}" + "".join(f" {'shift ' + str(s):>8s}" for s in args.shifts))
    for name, _ in cands:
        lo = min(med[name])
        high = sum(m > lo + 0.3 for m in med[name])
        print(f"{name:30s}" + "".join(f" {m:8.2f}" for m in med[name]) + f"   {high} of {len(med[name])} > min + 0.3")


if __name__ == "__main__":
    main()
