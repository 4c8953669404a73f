"""Helpers of tools/gpu/ncu.sh (Nsight Compute on kdakit's benchmark rows).

    python3 tools/gpu/ncu.py case "<row name substring>"      one call of kdakit on the matching rows (the workload)
    python3 tools/gpu/ncu.py lines FILE.csv [lines]            hottest CUDA source lines of a source-page export

case: one call of kdakit on the benchmark rows whose names contain the argument (forward rows as in
kdakit.bench.FORWARD_SHAPES, decode rows as in kdakit.bench_decode.decode_cases(), of the batch-vfirst form unless the
argument names a form; training rows, one forward + backward step, as in kdakit.bench_train.TRAIN_SHAPES): the
workload the ncu runs profile.

lines: sums Nsight Compute's per-SASS-instruction metrics (instructions executed, warp stall samples) by CUDA source
line, from `ncu -i REP --page source --csv --print-source cuda,sass`, and prints the hottest lines (needs neither
torch nor a GPU).
"""
import collections
import csv
import sys


def case(row):
    import torch

    from kdakit import bench, bench_decode, bench_peers, bench_train

    ran = 0
    for name, B, T, H, HV, lens in bench_train.TRAIN_SHAPES:
        if row in name:
            x, _ = bench.forward_inputs(B, T, H, HV, lens)
            bench_peers.kdakit_train_step(x)()
            ran += 1
    with torch.inference_mode():
        for name, B, T, H, HV, lens in bench.FORWARD_SHAPES:
            if row in name:
                x, _ = bench.forward_inputs(B, T, H, HV, lens)
                bench.run_kdakit(x)
                ran += 1
        for c in bench_decode.select_cases([row]):
            x, _ = bench_decode.decode_inputs(c)
            bench_decode.run_kdakit_decode(x)
            ran += 1
        torch.cuda.synchronize()
    if ran == 0:
        sys.exit(f"no benchmark row matches {row!r}")


def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def lines(path, n):
    inst, stall, text = collections.Counter(), collections.Counter(), {}
    fname, hdr, cur = "?", None, None
    for r in csv.reader(open(path, errors="replace")):
        if not r:
            continue
        if r[0] == "File Path":
            fname, hdr = r[1].split("/")[-1], None
            continue
        if r[0] == "Line No":
            hdr = r
            ci = hdr.index("Instructions Executed")
            cs = hdr.index("Warp Stall Sampling (All Samples)")
            continue
        if hdr is None or len(r) < 4:
            continue
        if r[0]:  # a source line; the SASS rows after it belong to it
            cur = (fname, int(r[0]) if r[0].isdigit() else 0)
            text[cur] = r[1].strip()
        elif cur is not None and len(r) == len(hdr):
            inst[cur] += num(r[ci])
            stall[cur] += num(r[cs])
    ti, ts = sum(inst.values()), sum(stall.values())
    print(f"total warp instructions {ti:.3e}, stall samples {ts:.3e}")
    for key, label in ((inst, "instructions"), (stall, "stall samples")):
        print(f"-- top lines by {label}")
        for k, _ in key.most_common(n):
            print(f"{100 * inst[k] / max(ti, 1):5.1f}% inst {100 * stall[k] / max(ts, 1):5.1f}% stall  "
                  f"{k[0]}:{k[1]}: {text.get(k, '')[:100]}")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "case":
        case(sys.argv[2] if len(sys.argv) > 2 else "B1 T8192 H64")
    elif len(sys.argv) >= 3 and sys.argv[1] == "lines":
        lines(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 40)
    else:
        sys.exit(__doc__)
