"""Developer overrides side by side on decode benchmark rows, in one process.

    python3 tools/gpu/overrides_ab.py '[{}, {"KDAKIT_DECODE_VT_INNER": 0}]' "T4 N256 H16 bf16 batch-kfirst" ...

The first argument is a JSON list of override sets (environment variables, src/cuda/tuning.h); each row (a decode row
name substring, as in tilings.py) gets fresh inputs, one call per set from the same pool (outputs and pool compared
bit for bit with the first set's: "=" or "DIFF"), then ROUNDS (default 5) interleaved rounds of 10 event-timed runs
per set, L2 flushed before each. Printed: the median of the round medians per set and its share of the copy
bandwidth. Interleaving matters: a set timed in one block can land in a slow phase of the GPU that the others miss.
"""
import json
import os
import statistics
import sys

import torch

import kdakit
from kdakit import bench, bench_decode


def apply(overrides):
    for k in [k for k in os.environ if k.startswith("KDAKIT_DECODE")]:
        del os.environ[k]
    for k, v in overrides.items():
        os.environ[k] = str(v)
    kdakit._C.reload_overrides()  # the overrides are read once per process


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    sets, rows = json.loads(argv[0]), argv[1:]
    rounds = int(os.environ.get("ROUNDS", "5"))
    bw, flush = bench.copy_bandwidth(), bench.flush_buffer()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; sets: " + " | ".join(f"s{i}={c}" for i, c in enumerate(sets)))
    for case in bench_decode.select_cases(rows):
        torch.manual_seed(0)
        x, nbytes = bench_decode.decode_inputs(case)
        pool0 = x["pool"].clone()
        run = lambda: bench_decode.run_kdakit_decode(x)  # noqa: E731
        same, ref = [], None
        times = [[] for _ in sets]
        with torch.inference_mode():
            for c in sets:
                apply(c)
                x["pool"].copy_(pool0)
                x["out"].fill_(float("nan"))  # poisoned: an output a set does not write is not the last set's
                run()
                got = (x["out"].clone(), x["pool"].clone())
                same.append("" if ref is None else ("=" if all(torch.equal(a, b) for a, b in zip(ref, got)) else "DIFF"))
                ref = ref or got
            for _ in range(rounds):
                for i, c in enumerate(sets):
                    apply(c)
                    times[i].append(bench.time_ms(run, 10, flush) * 1e3)
        cells = []
        for i in range(len(sets)):
            t = statistics.median(times[i])
            cells.append(f"{t:8.1f} us {100 * nbytes / (t * 1e-6) / bw:5.1f}%{same[i]}")
        print(f"{case.name:44s} " + " | ".join(cells), flush=True)
        del x, pool0, ref
        torch.cuda.empty_cache()
    apply({})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
