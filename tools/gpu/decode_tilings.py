"""Decode time per launch shape (KDAKIT_DECODE_WARPS x KDAKIT_DECODE_PASSES) on benchmark rows, kdakit only, L2
flushed, medians: checks the host's tiling choice (`decode` in src/cuda/backend.cu) row by row.

    python3 tools/gpu/decode_tilings.py ["<row substring>" ...]     (default: T1 N256 / N1024 rows)
"""
import os
import sys

import torch

from kdakit import bench


def main(rows):
    bw, flush = bench.copy_bandwidth(), bench.flush_buffer()
    rows = rows or ["T1 N256 ", "T1 N1024 "]
    shapes = [(w, p) for w in (2, 4) for p in (1, 2, 4)]
    print(f"{'row':28s} {'default':>9s} " + " ".join(f"{f'w{w}p{p}':>8s}" for w, p in shapes) + "  (us)")
    torch.manual_seed(0)
    for name, N, T, H, HV, pool_dtype in bench.decode_shapes():
        if not any(r in name for r in rows):
            continue
        x, nbytes = bench.decode_inputs(N, T, H, HV, pool_dtype)
        times = []
        with torch.inference_mode():
            for w, p in [(None, None)] + shapes:
                for var, val in (("KDAKIT_DECODE_WARPS", w), ("KDAKIT_DECODE_PASSES", p)):
                    if val is None:
                        os.environ.pop(var, None)
                    else:
                        os.environ[var] = str(val)
                times.append(bench.time_ms(lambda: bench.run_kdakit_decode(x), 20, flush) * 1e3)
        best = min(range(len(times)), key=times.__getitem__)
        label = "default" if best == 0 else f"w{shapes[best - 1][0]}p{shapes[best - 1][1]}"
        print(f"{name:28s} " + " ".join(f"{t:8.1f}" + ("*" if i == best else " ") for i, t in enumerate(times))
              + f"  best {label}: {100 * nbytes / (times[best] * 1e-6) / bw:.1f}% of copy bandwidth", flush=True)
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
