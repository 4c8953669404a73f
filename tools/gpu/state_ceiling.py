"""The state traffic on this GPU: what a Triton kernel that only moves a decode row's state bytes reaches.

    python3 tools/gpu/state_ceiling.py [N ...]

For each pool dtype (fp32, bf16), H32 (K = V = 128) and T in {1, 4}: a Triton kernel that reads each sequence's slot
once and writes it to T random slots of a pool ([N, T] ids, as the verify form), no math; the best of a few program
sizes (8, 16 and 32 KB of the slot per program) and warp counts (4, 8), so that neither dtype is held to one launch
shape. Printed as a share of the copy bandwidth that kdakit.bench_decode measures against (read + write bytes of a
2 GiB copy), with the launch shape that reached it, beside a write-only fill of the same bytes (torch's). This is
the Triton kernel's figure, not the memory's: `tools/gpu/write_paths.cu` moves the T = 4 traffic 2-8 points faster.
"""
import sys

import torch
import triton
import triton.language as tl

from kdakit import bench


@triton.jit
def _fan_out(src, dst, ids, S, T: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src + n.to(tl.int64) * S + offs)
    for t in tl.static_range(T):
        slot = tl.load(ids + n * T + t).to(tl.int64)
        tl.store(dst + slot * S + offs, x)


def main(argv):
    ns = [int(a) for a in argv] or [256, 1024]
    bw, flush = bench.copy_bandwidth(), bench.flush_buffer()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    print(f"{'row':28s} {'fan-out us':>10s} {'% copy':>7s} {'shape':>12s} {'fill us':>8s} {'% copy':>7s}")
    HV, D = 32, 128
    for dtype in (torch.float32, torch.bfloat16):
        for T in (1, 4):
            for N in ns:
                S = HV * D * D
                src = torch.randn(N, S, device="cuda", dtype=dtype)
                pool = torch.empty(N * T, S, device="cuda", dtype=dtype)
                ids = torch.randperm(N * T, device="cuda", dtype=torch.int32).reshape(N, T)
                nbytes = N * S * src.element_size() * (1 + T)
                best = None
                for kb in (8, 16, 32):
                    BLOCK = kb * 1024 // src.element_size()
                    for warps in (4, 8):
                        pool.zero_()
                        launch = lambda: _fan_out[(N, S // BLOCK)](src, pool, ids, S, T=T, BLOCK=BLOCK, num_warps=warps)
                        tt = bench.time_ms(launch, 20, flush)
                        assert torch.equal(pool[ids[:, -1].long()], src)
                        if best is None or tt < best[0]:
                            best = (tt, f"{kb} KB x{warps}w")
                t, shape = best
                wbytes = pool.numel() * pool.element_size()
                tf = bench.time_ms(lambda: pool.fill_(1.0), 20, flush)
                name = f"T{T} N{N} H32 {'fp32' if dtype == torch.float32 else 'bf16'}"
                print(f"{name:28s} {t * 1e3:10.1f} {100 * nbytes / (t * 1e-3) / bw:6.1f}% {shape:>12s} {tf * 1e3:8.1f} "
                      f"{100 * wbytes / (tf * 1e-3) / bw:6.1f}%", flush=True)
                del src, pool
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
