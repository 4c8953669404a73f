"""The floor of a short decode call's benchmark time. Under the benchmark's protocol (`flush.zero_()` before each call,
CUDA events around it), round-robin call by call so that every candidate sees the same process and machine state:
trivial launches (torch, Triton, a CUDA-runtime kernel of ours with a small and a 304-byte argument block), the
decode chain without its math (tools/gpu/launch_probe.cu: slot id -> 16 KB state tile per CTA -> store), and the
T = 1, N = 1 decode rows of kdakit and FLA (--warm: without the flush). Prints span medians and deciles, and the
kernel's own duration after the flush (torch.profiler).

    nvcc -O3 -shared -Xcompiler -fPIC -gencode=arch=compute_90a,code=sm_90a tools/gpu/launch_probe.cu \
        -o /tmp/launch_probe.so
    python3 tools/gpu/launch_floor.py [--reps 200] [--warm] [--probe /tmp/launch_probe.so]
"""
import argparse
import ctypes
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from decode_order import span_ms  # tools/gpu is the script's directory
from kdakit import bench


def span_us(fn, flush):
    return span_ms(fn, flush) * 1e3


def kernel_us(fn, flush, reps=30):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if flush is not None:
                flush.zero_()
            fn()
        torch.cuda.synchronize()
    times = [e.device_time for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and "zero" not in e.name.lower()
             and "fill" not in e.name.lower()]
    return statistics.median(times) if times else float("nan")


def candidates(probe_path):
    out = []
    one = torch.zeros(1, device="cuda")
    out.append(("torch add_ (1 element)", lambda: one.add_(1.0)))
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def store_one(p):
            tl.store(p, 1.0)

        out.append(("triton store (1 element)", lambda: store_one[(1,)](one)))
    except Exception as e:  # noqa: BLE001
        print(f"triton: {e}")
    if probe_path:
        lib = ctypes.CDLL(probe_path)
        stream = lambda: ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        out.append(("cudart empty (8 B args)", lambda: lib.probe_empty(stream())))
        out.append(("cudart empty 64 CTAs (304 B)", lambda: lib.probe_empty_wide(stream())))
        for ctas in (64, 128):
            slots = 4
            pool = torch.randn(slots * ctas * 4096, device="cuda")
            idx = torch.tensor([2], device="cuda", dtype=torch.int32)
            keep = (pool, idx)
            out.append((f"cudart chain {ctas} CTAs ({ctas // 64} MB)",
                        lambda c=ctas, k=keep: lib.probe_chain(stream(), ctypes.c_void_p(k[1].data_ptr()),
                                                               ctypes.c_void_p(k[0].data_ptr()), c)))
            if ctas != 64:
                continue
            ins = [torch.randn(ctas * 128, device="cuda") for _ in range(8)]  # separate allocations
            dst = torch.empty(ctas * 128, device="cuda")
            ptrs = (ctypes.c_void_p * 8)(*[t.data_ptr() for t in ins])
            keep = keep + (ins, dst, ptrs)
            out.append(("cudart chain 64 + 9 small tensors",
                        lambda c=ctas, k=keep: lib.probe_chain_inputs(
                            stream(), ctypes.c_void_p(k[1].data_ptr()), ctypes.c_void_p(k[0].data_ptr()), c, k[4],
                            ctypes.c_void_p(k[3].data_ptr()))))
            out.append(("cudart chain 64 + 1.5k instructions",
                        lambda c=ctas, k=keep: lib.probe_chain_code(stream(), ctypes.c_void_p(k[1].data_ptr()),
                                                                    ctypes.c_void_p(k[0].data_ptr()), c)))
    fla = bench.fla_decode_runner()
    for name, N, T, H, HV, pool_dtype in bench.decode_shapes():
        if name not in ("decode T1 N1 H16 fp32", "decode T1 N1 H8-HV32 fp32"):
            continue
        x, _ = bench.decode_inputs(N, T, H, HV, pool_dtype)
        out.append((f"kdakit {name[7:]}", lambda x=x: bench.run_kdakit_decode(x)))
        if fla is not None:
            out.append((f"FLA {name[7:]}", lambda x=x: fla(x)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--probe", default="")
    ap.add_argument("--warm", action="store_true", help="no flush before the calls (caches warm)")
    args = ap.parse_args()
    flush = None if args.warm else bench.flush_buffer()
    with torch.inference_mode():
        cands = candidates(args.probe)
        for _, fn in cands:
            fn()
        torch.cuda.synchronize()
        spans = {name: [] for name, _ in cands}
        for _ in range(args.reps):
            for name, fn in cands:
                spans[name].append(span_us(fn, flush))
        print(f"{'candidate':34s} {'span us':>8s} {'p10':>6s} {'p90':>6s} {'kernel us':>9s} {'span-kernel':>11s}")
        for name, fn in cands:
            s = spans[name]
            q = statistics.quantiles(s, n=10)
            med, kern = statistics.median(s), kernel_us(fn, flush)
            print(f"{name:34s} {med:8.2f} {q[0]:6.2f} {q[-1]:6.2f} {kern:9.2f} {med - kern:11.2f}", flush=True)


if __name__ == "__main__":
    main()
