"""How the benchmark's L2 flush shapes short memory-bound timings. `kdakit.bench` flushes with `flush.zero_()` (512 MB
written): the L2 is then full of dirty lines, and the timed kernel's first misses write them back to DRAM (up to the
L2's size of extra traffic in the timed region). This times decode rows and a device copy after three flushes: the
benchmark's (zero_, dirty), a read-only one (sum, clean lines) and none (the previous run's data warm in L2).
The benchmark itself is unchanged; this explains its short rows.

    python3 tools/gpu/flush_effect.py ["<row substring>" ...]
"""
import statistics
import sys

import torch

from kdakit import bench


def time_us(fn, flush_fn, reps=20):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        flush_fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return statistics.median(out)


def main(rows):
    rows = rows or ["T1 N256 H16 ", "T1 N1024 H16 ", "T1 N32 H16 "]
    buf = bench.flush_buffer()
    flushes = {"zero_ (dirty)": lambda: buf.zero_(), "sum (clean)": lambda: buf.sum(), "none": lambda: None}
    src = torch.empty(256 * 1024 ** 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    print(f"{'case':28s} {'MB':>8s} " + " ".join(f"{k:>20s}" for k in flushes) + "   (us, GB/s)")
    cases = [("copy 256 MB", 2 * src.numel(), lambda: dst.copy_(src))]
    for name, N, T, H, HV, pool_dtype in bench.decode_shapes():
        if any(r in name for r in rows):
            x, nbytes = bench.decode_inputs(N, T, H, HV, pool_dtype)
            cases.append((name, nbytes, (lambda x=x: bench.run_kdakit_decode(x))))
    with torch.inference_mode():
        for name, nbytes, fn in cases:
            cells = []
            for f in flushes.values():
                t = time_us(fn, f)
                cells.append(f"{t:9.1f} {nbytes / (t * 1e-6) / 1e9:9.0f}")
            print(f"{name:28s} {nbytes / 1e6:8.1f} " + " ".join(f"{c:>20s}" for c in cells), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
