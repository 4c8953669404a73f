"""Order effects in the decode benchmark's timing: for each row, kdakit and FLA timed under the benchmark's protocol
(`flush.zero_()` before each call, CUDA events around it, medians) in three orders within one process: FLA's runs
then kdakit's (the benchmark's order), kdakit's then FLA's, and the two alternating call by call. A ratio that moves
with the order is measurement drift, not the kernels. Two more orders alternate each library with a call on a
second set of inputs of the same shape (kdakit's with kdakit's, kdakit's with FLA's): they tell an effect of the
previous call's kernel from one of its data.

    python3 tools/gpu/decode_order.py [--reps 50] ["decode T1 N1 H16 fp32" ...]   (default: the T1 N1 rows)
"""
import argparse
import statistics

import torch

from kdakit import bench


def span_ms(fn, flush):
    """One call's event-timed span under the benchmark's protocol (no flush where `flush` is None)."""
    if flush is not None:
        flush.zero_()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("rows", nargs="*")
    args = ap.parse_args()
    rows = args.rows or [n for n, *_ in bench.decode_shapes() if n.startswith("decode T1 N1 ")]
    flush, fla = bench.flush_buffer(), bench.fla_decode_runner()
    if fla is None:
        raise SystemExit("FLA is needed")
    print(f"{'row':28s} {'order':13s} {'kdakit us':>9s} {'FLA us':>8s} {'ratio':>6s}   kdakit / FLA p10 p90")
    torch.manual_seed(0)
    for name, N, T, H, HV, pool_dtype in bench.decode_shapes():
        if name not in rows:
            continue
        x, _ = bench.decode_inputs(N, T, H, HV, pool_dtype)
        x2, _ = bench.decode_inputs(N, T, H, HV, pool_dtype)
        ours, theirs = (lambda: bench.run_kdakit_decode(x)), (lambda: fla(x))
        ours2, theirs2 = (lambda: bench.run_kdakit_decode(x2)), (lambda: fla(x2))
        with torch.inference_mode():
            ours(), theirs(), ours2(), theirs2()
            torch.cuda.synchronize()
            for order in ("FLA first", "kdakit first", "alternating", "alt k/k2 f/f2", "alt k/f2 f/k2"):
                t = {"k": [], "f": []}
                if order.startswith("alt "):
                    # kdakit's call after one on the other inputs (kdakit's own, or FLA's), and FLA's likewise
                    before_k, before_f = (ours2, theirs2) if order == "alt k/k2 f/f2" else (theirs2, ours2)
                    for _ in range(args.reps):
                        span_ms(before_k, flush)
                        t["k"].append(span_ms(ours, flush))
                    for _ in range(args.reps):
                        span_ms(before_f, flush)
                        t["f"].append(span_ms(theirs, flush))
                elif order == "alternating":
                    for _ in range(args.reps):
                        t["k"].append(span_ms(ours, flush))
                        t["f"].append(span_ms(theirs, flush))
                else:
                    seq = ("f", "k") if order == "FLA first" else ("k", "f")
                    for key in seq:
                        fn = ours if key == "k" else theirs
                        t[key] = [span_ms(fn, flush) for _ in range(args.reps)]
                k, f = statistics.median(t["k"]) * 1e3, statistics.median(t["f"]) * 1e3
                q = lambda v: statistics.quantiles([x * 1e3 for x in v], n=10)  # deciles
                qk, qf = q(t["k"]), q(t["f"])
                print(f"{name:28s} {order:13s} {k:9.2f} {f:8.2f} {k / f:6.2f}   {qk[0]:.2f} {qk[-1]:.2f} / "
                      f"{qf[0]:.2f} {qf[-1]:.2f}", flush=True)


if __name__ == "__main__":
    main()
