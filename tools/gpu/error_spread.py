"""Spread of the forward's output error over many random draws of one test case, for kdakit and (when installed) FLA,
both against the float64 CPU reference: tells a tail event from a regression when a tolerance check fails once.

    python3 tools/gpu/error_spread.py [draws] [B T H HV K] [dtype]
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "python"))
import test_cuda_forward as tf  # noqa: E402
from conftest import rel_rms  # noqa: E402


def main(argv):
    draws = int(argv[0]) if argv else 200
    B, T, H, HV, K = (int(v) for v in argv[1:6]) if len(argv) >= 6 else (2, 1, 2, 4, 128)
    dtype = getattr(torch, argv[6]) if len(argv) >= 7 else torch.bfloat16
    tol = tf.TOL[dtype]
    errs = {"kdakit": [], "FLA": []}
    for _ in range(draws):
        x = tf.make(B, T, H, HV, K, dtype=dtype)
        ro, _ = tf.reference(x)
        o, _ = tf.run(x)
        errs["kdakit"].append(rel_rms(o, ro))
        if tf.fla_chunk_kda is not None:
            kw = dict(x["opts"], A_log=x["A_log"], dt_bias=x["dt_bias"])
            with torch.inference_mode():
                fo, _ = tf.fla_chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                         output_final_state=True, **kw)
            errs["FLA"].append(rel_rms(fo, ro))
    print(f"B{B} T{T} H{H} HV{HV} K{K} {dtype}, {draws} draws, tolerance {tol:.0e}")
    for name, e in errs.items():
        if not e:
            continue
        t = torch.tensor(e)
        q = torch.quantile(t, torch.tensor([0.5, 0.9, 0.99]))
        print(f"  {name:7s} median {q[0]:.2e}  p90 {q[1]:.2e}  p99 {q[2]:.2e}  max {t.max():.2e}  "
              f"over tolerance {(t > tol).sum().item()}/{len(e)}")


if __name__ == "__main__":
    main(sys.argv[1:])
