"""Forward rows with the gate input g in float32 beside bf16 (the engines' form: vLLM's and HF's gates are float32
while q, k, v are bf16), for `python -m kdakit.bench --sections gate-dtype`.

Each row's inputs are the forward section's (bf16 q, k, v, beta; gate, L2 norm and beta sigmoid in kernel), once with
bf16 g and once with the same g converted to float32 outside the timed call. The line: the float32-g call is no
slower than the bf16-g call by more than the extra bytes it reads (2 bytes per g element) take at the copy bandwidth.
The two calls are timed in alternating rounds (the median of the rounds' medians), so that drift reaches both alike.
Their outputs and final states are compared bit for bit: bf16 to float32 is exact and the kernels widen g either way,
so any difference is a bug.
"""
from __future__ import annotations

import statistics

import torch

ROUNDS = 3  # alternating timing rounds per dtype

INTRO = ("Gate dtype: the forward rows with g in float32 beside bf16 g (q, k, v and beta bf16; g converted once, "
         "outside the timed call). Meets: the float32-g time exceeds the bf16-g time by no more than the extra "
         "bytes read (2 per g element) at the measured copy bandwidth. Same bits: output and final state "
         "identical between the two calls.")


def gate_dtype_row(name, x, run, timer, reps, bw, flush) -> dict:
    """One row: x holds the forward inputs with bf16 g; run(x) -> (o, final state)."""
    x32 = dict(x, g=x["g"].float())
    extra_bytes = x["g"].numel() * (x32["g"].element_size() - x["g"].element_size())
    t16, t32 = [], []
    with torch.inference_mode():
        for _ in range(ROUNDS):
            t16.append(timer(lambda: run(x), reps, flush))
            t32.append(timer(lambda: run(x32), reps, flush))
        o16, h16 = run(x)
        o32, h32 = run(x32)
        same = bool(torch.equal(o16, o32) and torch.equal(h16, h32))
    return verdict(dict(name=name, bf16=statistics.median(t16), fp32=statistics.median(t32),
                        extra=extra_bytes / bw * 1e3, same_bits=same))


def verdict(row: dict) -> dict:
    """Adds the difference and whether the row meets the line (and kept its bits)."""
    row["diff"] = row["fp32"] - row["bf16"]
    row["meets"] = row["diff"] <= row["extra"] and row["same_bits"]
    return row


def run_rows(shapes, inputs, run, timer, reps, bw, flush, log=print):
    """The rows of `shapes` (the forward section's tuples); inputs(B, T, H, HV, lens) -> (x, floor bytes)."""
    rows = []
    torch.manual_seed(0)
    for name, B, T, H, HV, lens in shapes:
        x, _ = inputs(B, T, H, HV, lens)
        r = gate_dtype_row(name, x, run, timer, reps, bw, flush)
        rows.append(r)
        log(f"{name:22s} bf16 g {r['bf16']:8.3f} ms  fp32 g {r['fp32']:8.3f} ms  extra bytes {r['extra']:6.3f} ms  "
            f"{'meets' if r['meets'] else 'does not meet'}{'' if r['same_bits'] else ' (bits differ)'}")
        del x
        torch.cuda.empty_cache()
    return rows


def table(rows) -> str:
    lines = ["| shape | bf16 g ms | fp32 g ms | fp32 - bf16 ms | extra bytes ms | meets | same bits |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['bf16']:.3f} | {r['fp32']:.3f} | {r['diff']:+.3f} | {r['extra']:.3f} | "
                     f"{'yes' if r['meets'] else 'no'} | {'yes' if r['same_bits'] else 'no'} |")
    met = sum(r["meets"] for r in rows)
    return f"{met} of {len(rows)} rows meet the line.\n\n" + "\n".join(lines)
