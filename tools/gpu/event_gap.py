"""Where a short decode row's benchmark time goes beyond its kernel: for kdakit and FLA on the same inputs, under the
benchmark's protocol (`flush.zero_()` before each call, CUDA events around it), the event-timed span, the kernel's own
duration in that state (torch.profiler, same flush before each call) and the host time of one call. span - kernel is
the launch and event overhead each library pays; a difference there between the two libraries is outside the kernels.
With --pre-staged, a small staged kdakit decode (T1 N64 H16 bf16 pool, 2 MB of state) runs after each flush and
before the first event: the SMs then already hold a large shared-memory carveout, and any span difference from the
plain protocol is what switching the carveout after the flush costs the timed call.

    python3 tools/gpu/event_gap.py [--pre-staged] ["decode T1 N1 H16 fp32" ...]
"""
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kdakit import bench

REPS = 30


def spans_us(fn, flush, pre=None):
    fn()
    torch.cuda.synchronize()
    spans, host = [], []
    for _ in range(REPS):
        flush.zero_()
        if pre is not None:
            pre()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        b.record()
        b.synchronize()
        spans.append(a.elapsed_time(b) * 1e3)
    return statistics.median(spans), statistics.median(host)


def kernel_us(fn, flush, name_part):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPS):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    times = [e.device_time for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and name_part in e.name]
    return statistics.median(times) if times else float("nan"), len(times) // REPS


def staged_call():
    """A small call of the staged one-token decode kernel (large shared-memory tiles), on its own pool."""
    x, _ = bench.decode_inputs(64, 1, 16, 16, torch.bfloat16)
    return lambda: bench.run_kdakit_decode(x)


def main(names):
    pre = None
    if "--pre-staged" in names:
        names = [n for n in names if n != "--pre-staged"]
        pre = staged_call()
    names = names or ["decode T1 N1 H16 fp32", "decode T1 N1 H16 bf16"]
    flush = bench.flush_buffer()
    fla = bench.fla_decode_runner()
    print(f"{'row':28s} {'library':8s} {'span us':>8s} {'kernel us':>9s} {'span-kernel':>11s} {'kernels':>7s} "
          f"{'host us':>8s}")
    for name, N, T, H, HV, pool_dtype in bench.decode_shapes():
        if name not in names:
            continue
        x, _ = bench.decode_inputs(N, T, H, HV, pool_dtype)
        with torch.inference_mode():
            for label, fn, kname in (("kdakit", bench.run_kdakit_decode, "decode"),
                                     ("FLA", fla, "fused_recurrent")):
                if fn is None:
                    continue
                span, host = spans_us(lambda: fn(x), flush, pre)
                kern, count = kernel_us(lambda: fn(x), flush, kname)
                print(f"{name:28s} {label:8s} {span:8.2f} {kern:9.2f} {span - kern:11.2f} {count:7d} {host:8.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
