"""Decode (T = 1) bandwidth against the pool's slot pattern: random slot ids (the benchmark's) against sequential
ones, fp32 and bf16 pools, next to an in-place elementwise pass over the same pool (torch `mul_`: the sequential
read-modify-write ceiling). Tells access-pattern limits (page and DRAM locality) from the kernel's own.

    python3 tools/gpu/decode_pattern.py
"""
import torch

from kdakit.bench import copy_bandwidth, decode_inputs, flush_buffer, run_kdakit_decode, time_ms


def main():
    bw, flush = copy_bandwidth(), flush_buffer()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'shape':24s} {'pool':5s} {'random us':>10s} {'%':>5s} {'sequential us':>14s} {'%':>5s} {'mul_ us':>8s} {'%':>5s}")
    torch.manual_seed(0)
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for N, H in ((1024, 16), (256, 32), (1024, 32)):
            x, nbytes = decode_inputs(N, 1, H, H, dtype)
            with torch.inference_mode():
                t_rand = time_ms(lambda: run_kdakit_decode(x), 20, flush)
                x["idx"] = torch.arange(N, device="cuda", dtype=torch.int32)
                t_seq = time_ms(lambda: run_kdakit_decode(x), 20, flush)
                t_mul = time_ms(lambda: x["pool"].mul_(1.0), 20, flush)
            pct = lambda t: 100 * nbytes / (t * 1e-3) / bw  # noqa: E731
            print(f"T1 N{N} H{H:<14d} {name:5s} {t_rand * 1e3:10.1f} {pct(t_rand):5.1f} {t_seq * 1e3:14.1f} "
                  f"{pct(t_seq):5.1f} {t_mul * 1e3:8.1f} {pct(t_mul):5.1f}")
            del x
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
