"""Sums Nsight Compute's per-SASS-instruction metrics (instructions executed, warp stall samples) by CUDA source
line, from `ncu -i REP --page source --csv --print-source cuda,sass`, and prints the hottest lines.
Usage: python3 ncu_lines.py FILE.csv [lines]"""
import collections
import csv
import sys


def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def main(path, n):
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
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
