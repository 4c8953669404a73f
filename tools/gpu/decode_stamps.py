"""Where a decode CTA's time goes, phase by phase (latency analysis of the small-N rows).

Needs a build with -DKDAKIT_DECODE_STAMPS (thread 0 of every 16th CTA prints its SM clock at each phase, see
src/cuda/decode/kernels.cuh), e.g. on the GPU machine:

    CUDAFLAGS=-DKDAKIT_DECODE_STAMPS python3 -m pip install -q --no-build-isolation --no-deps \\
        --config-settings=build-dir=/tmp/build-stamps --target /tmp/kdk-stamps .
    PYTHONPATH=/tmp/kdk-stamps:$PYTHONPATH python3 tools/gpu/decode_stamps.py "decode T1 N1 H16 fp32" > stamps.log
    python3 tools/gpu/decode_stamps.py --parse stamps.log

Each row runs three times: warm (inputs in L2), after an L2 flush (as the benchmark times it), warm again
(`--flushed N` first: N flushed calls in the middle, to see how a row's flushed calls vary). The table gives, per
call, the SM clock (cycles per ns over each CTA's own span), the median over the printed CTAs of each phase's end
(microseconds after the CTA started), the spread of the CTAs' start times and the span from the first start to the
last end.
"""
import statistics
import sys

PHASES = ["setup", "scalars issued", "own tensor staged", "inputs issued", "state issued", "inputs landed", "prepared",
          "state landed", "pass 0 done", "end"]
# The one-token form (printed with 0 passes): its own phases.
PHASES_ONE = ["scalars issued", "inputs issued", "state issued", "inputs landed", "norms", "prepared", "state landed",
              "math done", "stored", "end"]


def run(names, flushed=1):
    import torch

    from kdakit import bench

    flush = bench.flush_buffer()
    for name, N, T, H, HV, pool_dtype in bench.decode_shapes():
        if not any(s == name for s in names):
            continue
        x, _ = bench.decode_inputs(N, T, H, HV, pool_dtype)
        for label in ["warm"] + ["flushed"] * flushed + ["warm"]:
            if label == "flushed":
                flush.zero_()
            torch.cuda.synchronize()
            print(f"ROW {name} | {label}", flush=True)
            bench.run_kdakit_decode(x)
            torch.cuda.synchronize()
            sys.stdout.flush()


def parse(path):
    calls, cur = [], None
    for line in open(path):
        if line.startswith("ROW "):
            cur = {"name": line[4:].strip(), "blocks": []}
            calls.append(cur)
        elif line.startswith("STAMP") and cur is not None:
            f = line.split()
            gt0, gt1 = int(f[10]), int(f[11])
            clk = [int(v) for v in f[13:13 + len(PHASES)]]
            cur["blocks"].append((gt0, gt1, clk, int(f[6]), int(f[8])))
    header = None
    for c in calls:
        b = c["blocks"]
        if not b:
            continue
        names = PHASES_ONE if b[0][4] == 0 else PHASES
        if names is not header:
            header = names
            print(f"| row | call | CTAs | tile | GHz | start spread | span | " + " | ".join(names) + " |")
            print("|---" * (7 + len(names)) + "|")
        start = min(x[0] for x in b)
        # cycles -> ns from each block's own span (its clock over its globaltimer interval)
        rate = statistics.median(x[2][-1] / max(1, x[1] - x[0]) for x in b)  # cycles per ns
        ph = [statistics.median(x[2][i] for x in b) / rate / 1e3 for i in range(len(PHASES))]
        spread = (max(x[0] for x in b) - start) / 1e3
        span = (max(x[1] for x in b) - start) / 1e3
        tile = f"{b[0][3]}w x {b[0][4]}p" if b[0][4] else f"{b[0][3]}w, one token"
        print(f"| {c['name']} | {len(b)} | {tile} | {rate:.2f} | {spread:.2f} | {span:.2f} | "
              + " | ".join(f"{v:.2f}" for v in ph) + " |")
    print("(CTAs: the printed ones, every 16th; times in us; clock rate from each CTA's own span)")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--parse":
        parse(sys.argv[2])
    elif len(sys.argv) > 2 and sys.argv[1] == "--flushed":
        run(sys.argv[3:], int(sys.argv[2]))
    else:
        run(sys.argv[1:])
