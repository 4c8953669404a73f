"""Benchmark: kdakit against FLA, NVIDIA cuDNN Frontend's Hopper KDA engine and FlashKDA (each when importable),
timed in one process on the same inputs.

    python -m kdakit.bench [--out DIR] [--reps N] [--only NAME ...] [--forms FORM ...] [--sections SECTION ...]
                           [--recipe fla|zero-bias] [--list]

Forward rows: bf16 inputs, gate (lower_bound -5), L2 norm and beta sigmoid in kernel, float32 initial state in
and final state out, K = V = 128. The gate's inputs follow FLA's test recipe, or with --recipe zero-bias a zero
dt_bias (every key channel then decays fast; RECIPES below says why both matter). Times are medians of CUDA-event
timings with the L2 cache flushed before every run (--reps: 30 forward, 20 decode and training by default). The
floor is the bytes that must move over the copy bandwidth measured in this process. The cuDNN column is
`cudnn.linear_attention.ops.kimi_delta_attention` pinned to its plan "kda_hopper_cuda" (Hopper only; PyPI
`nvidia-cudnn-frontend` with `apache-tvm-ffi`), given the same tensors in its layouts (`kdakit.bench_peers` describes
the call); its output and final state are compared with kdakit's. The FlashKDA column is `flash_kda.fwd` (dense and
varlen batches; it has no GVA) with its v-first h0 copied before the timed calls; its output and final state are
compared with kdakit's too.

Decode rows (names start with "decode"; `--only decode` runs just them, `--forms` picks their forms):
`fused_recurrent_kda_fwd` in place on a state pool, kdakit and FLA in the same form; the forms, the T = 1 and T = 4
(speculative verify) rows and the goal are described in `kdakit.bench_decode`. 288 rows (6 forms x 2 pools x 2 T x
3 head configurations x 4 N); on an H100/H200 the whole matrix takes minutes (FLA compiles a kernel per form, pool,
T and head configuration on its first call).

Training rows (names start with "train"; `--only train` runs just them): one forward and backward step of kdakit,
FLA and cuDNN, with each step's time, peak extra memory and gradient differences; `kdakit.bench_train` says what
each library's step includes.

Gate-dtype rows (`--sections gate-dtype`, not run by default): the forward rows (or those --only names) with g in
float32 beside bf16 g, kdakit alone, against the extra bytes' time; `kdakit.bench_gate` describes them.

A peer that is not importable, or that raises on a row, leaves a dash in its column; the reason is printed once and
listed under the tables. Writes DIR/<device>.md (tables), DIR/bench_table.txt, DIR/<device>.png (forward), and with
decode rows DIR/<device>-decode.json (every row, machine-readable) and DIR/<device>-decode.png. `--list` prints the
selected rows and exits (no GPU needed).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import re
import statistics
import subprocess
from pathlib import Path

import torch

import kdakit
from kdakit import bench_decode, bench_gate, bench_peers, bench_train
from kdakit.bench_peers import fla_runner, flashkda_runner  # noqa: F401  (tools call them through this module)

FORWARD_SHAPES = [
    # name, B, T, H, HV, cu_seqlens lengths
    ("B1 T8192 H64", 1, 8192, 64, 64, None),
    ("B1 T8192 H96", 1, 8192, 96, 96, None),
    ("B2 T16384 H64", 2, 16384, 64, 64, None),
    ("B8 T4096 H32", 8, 4096, 32, 32, None),
    ("varlen6 H64", 1, None, 64, 64, [1300, 547, 2048, 963, 271, 3063]),
    ("varlen 8x1024 H64", 1, None, 64, 64, [1024] * 8),
    ("B1 T65536 H8", 1, 65536, 8, 8, None),
    ("B1 T131072 H4", 1, 131072, 4, 4, None),
    ("B1 T512 H64", 1, 512, 64, 64, None),
    ("GVA H16 HV64 T8192", 1, 8192, 16, 64, None),
    ("B1 T2048 H12", 1, 2048, 12, 12, None),
    ("B32 T512 H16", 32, 512, 16, 16, None),
    ("B1 T1048576 H4", 1, 1048576, 4, 4, None),
]
D = 128


def flush_buffer():
    return torch.empty(512 * 1024 * 1024, dtype=torch.uint8, device="cuda")


def time_ms(fn, reps: int, flush: torch.Tensor) -> float:
    fn()  # warm-up (compilation, autotuning, allocator)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), 10, flush_buffer())
    return 2 * src.numel() / (t * 1e-3)


# The gate's input recipes. "fla": FLA's test recipe (A_log = log U(1, 16), dt_bias ~ N(0, 1) per key channel): some
# channels of most heads barely decay (a large exp(A_log) with a strongly negative bias). "zero-bias": the same with
# dt_bias = 0, where every channel decays within a few tokens. A library that truncates the state history by the
# slowest channel's decay (cuDNN's Hopper forward, docs/perf-notes.md) is fast on the second and serial on the first.
RECIPES = ("fla", "zero-bias")


def gate_params(HV, recipe="fla", device="cuda"):
    """A_log [HV] and dt_bias [HV * D] (float32) of a gate recipe (RECIPES)."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe: expected one of {RECIPES}, got {recipe!r}")
    A_log = torch.log(torch.empty(HV, device=device).uniform_(1, 16))
    dt_bias = torch.randn(HV * D, device=device) if recipe == "fla" else torch.zeros(HV * D, device=device)
    return A_log, dt_bias


def forward_inputs(B, T, H, HV, lens, recipe="fla"):
    dev = "cuda"
    if lens is not None:
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
        B, T, N = 1, int(cu[-1]), len(lens)
    else:
        cu, N = None, B
    bf = torch.bfloat16
    x = dict(
        q=torch.randn(B, T, H, D, device=dev, dtype=bf), k=torch.randn(B, T, H, D, device=dev, dtype=bf),
        v=torch.randn(B, T, HV, D, device=dev, dtype=bf), g=torch.randn(B, T, HV, D, device=dev, dtype=bf),
        beta=torch.randn(B, T, HV, device=dev, dtype=bf))
    x["A_log"], x["dt_bias"] = gate_params(HV, recipe, dev)
    x["h0"] = torch.randn(N, HV, D, D, device=dev)
    x["cu"] = cu.to(dev) if cu is not None else None
    x["cu_cpu"] = cu
    floor_bytes = T * B * (2 * H * D * 2 + HV * (3 * D * 2 + 2)) + 2 * N * HV * D * D * 4
    return x, floor_bytes


def run_kdakit(x, lib=None):
    """One forward call of kdakit (or of `lib`, another build's package) on a row's inputs."""
    lib = kdakit if lib is None else lib
    return lib.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                         safe_gate=True, lower_bound=-5.0, A_log=x["A_log"], dt_bias=x["dt_bias"],
                         cu_seqlens=x["cu"], cu_seqlens_cpu=x["cu_cpu"])


def rel_diff(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def device_slug() -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name()).strip("-")


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


SECTIONS = ("forward", "decode", "train", "gate-dtype")
DEFAULT_SECTIONS = ("forward", "decode", "train")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed runs per row (default 30 forward, 20 decode and training)")
    ap.add_argument("--only", nargs="*", default=None, help="substrings of row names to run")
    ap.add_argument("--sections", nargs="+", default=list(DEFAULT_SECTIONS), choices=SECTIONS, metavar="SECTION",
                    help=f"sections to run (default {', '.join(DEFAULT_SECTIONS)}): {', '.join(SECTIONS)}")
    ap.add_argument("--forms", nargs="+", default=None, choices=bench_decode.FORM_NAMES, metavar="FORM",
                    help="decode forms to run (default all): " + ", ".join(bench_decode.FORM_NAMES))
    ap.add_argument("--list", action="store_true", help="print the selected rows and exit")
    ap.add_argument("--recipe", default="fla", choices=RECIPES,
                    help="the gate inputs' recipe of the forward, gate-dtype and training rows (default fla: FLA's "
                         "test recipe; zero-bias: dt_bias = 0, every key channel decaying fast)")
    ap.add_argument("--commit", default=None,
                    help="commit named in the table header (a copied tree or an installed package has no git history)")
    args = ap.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    return args


def selected_rows(args):
    """(forward shapes, decode cases, training shapes) that --only and --forms select."""
    on = set(args.sections)
    forward = [s for s in FORWARD_SHAPES if not args.only or any(o in s[0] for o in args.only)]
    return (forward if "forward" in on else [], bench_decode.decode_cases(args.forms, args.only) if "decode" in on else [],
            bench_train.train_shapes(args.only) if "train" in on else [])


def selected_gate_rows(args):
    """The forward shapes of the gate-dtype section that --only selects (none unless the section is asked for)."""
    if "gate-dtype" not in args.sections:
        return []
    return [s for s in FORWARD_SHAPES if not args.only or any(o in s[0] for o in args.only)]


def forward_table(rows, with_flashkda: bool) -> str:
    head = (f"| shape | floor ms | kdakit ms | FLA ms | kdakit/FLA | kdakit/floor |"
            f"{' FlashKDA ms | kdakit/FlashKDA |' if with_flashkda else ''} cuDNN ms | kdakit/cuDNN |"
            f" rel. diff vs FLA |{' FlashKDA rel. diff |' if with_flashkda else ''} cuDNN rel. diff |")
    sep = "|---" * (13 if with_flashkda else 10) + "|"
    lines = [head, sep]
    fmt = bench_decode.fmt
    for r in rows:
        ratio = r["ours"] / r["fla"] if r["fla"] else None
        cells = [r["name"], fmt(r["floor"], "{:.3f}"), fmt(r["ours"], "{:.3f}"), fmt(r["fla"], "{:.3f}"),
                 fmt(ratio, "{:.2f}"), fmt(r["ours"] / r["floor"], "{:.1f}")]
        if with_flashkda:
            cells += [fmt(r["fk"], "{:.3f}"), fmt(r["ours"] / r["fk"] if r["fk"] else None, "{:.2f}")]
        cells += [fmt(r["cudnn"], "{:.3f}"), fmt(r["ours"] / r["cudnn"] if r["cudnn"] else None, "{:.2f}"),
                  fmt(r["diff"], "{:.1e}")]
        if with_flashkda:
            cells.append(fmt(r.get("fk_diff"), "{:.1e}"))
        cells.append(fmt(r["cudnn_diff"], "{:.1e}"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench_forward(shapes, reps, bw, flush, fla, fkda, cudnn, notes, recipe="fla"):
    """Forward rows; `cudnn` is cuDNN's `kimi_delta_attention` or None, `notes` records why a peer did not run."""
    rows = []
    torch.manual_seed(0)
    for name, B, T, H, HV, lens in shapes:
        x, floor_bytes = forward_inputs(B, T, H, HV, lens, recipe)
        floor = floor_bytes / bw * 1e3
        with torch.inference_mode():
            t_ours = time_ms(lambda: run_kdakit(x), reps, flush)
            o, ht = run_kdakit(x)
            t_fla = diff = None
            if fla is not None:
                t_fla = time_ms(lambda: fla(x), reps, flush)
                fo, fht = fla(x)
                diff = rel_diff(o, fo)
                del fo, fht
            t_fk = fk_diff = None
            if fkda is not None and x["v"].shape[2] != x["q"].shape[2]:
                notes(f"FlashKDA did not run on {name}: it has no GVA (its q, k and v share one head count)")
            elif fkda is not None:
                try:
                    call = fkda(x)
                    t_fk = time_ms(call, reps, flush)
                    fo, fht = call()  # its final state is v-first
                    fk_diff = max(rel_diff(fo, o), rel_diff(fht.transpose(-1, -2), ht))
                    del call, fo, fht
                except Exception as e:  # noqa: BLE001
                    notes(f"FlashKDA did not run on {name}: {bench_peers.error_text(e)}")
            t_cd = cd_diff = None
            if cudnn is not None:
                try:
                    call = bench_peers.cudnn_forward_call(cudnn, x)
                    t_cd = time_ms(call, reps, flush)
                    co, cht = call()
                    cd_diff = max(rel_diff(co, o), rel_diff(cht, ht))
                    del call, co, cht
                except Exception as e:  # noqa: BLE001
                    notes(f"cuDNN did not run on {name}: {bench_peers.error_text(e)}")
        rows.append(dict(name=name, floor=floor, ours=t_ours, fla=t_fla, fk=t_fk, fk_diff=fk_diff, cudnn=t_cd,
                         diff=diff, cudnn_diff=cd_diff))
        fmt = bench_decode.fmt
        print(f"{name:22s} kdakit {t_ours:8.3f} ms  FLA {fmt(t_fla, '{:8.3f}')} ms  cuDNN {fmt(t_cd, '{:8.3f}')} ms  "
              f"floor {floor:6.3f} ms  diff vs FLA {fmt(diff, '{:.1e}')}", flush=True)
        del x, o, ht
        torch.cuda.empty_cache()
    return rows


def plot_forward(rows, path, dev) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    xs = range(len(rows))
    # one bar per series that has a time on some row; a missing time leaves its slot empty
    series = [("floor", "floor"), ("kdakit", "ours"), ("FLA", "fla"), ("FlashKDA", "fk"), ("cuDNN", "cudnn")]
    series = [(label, key) for label, key in series if any(r.get(key) for r in rows)]
    w = 0.8 / len(series)
    for j, (label, key) in enumerate(series):
        off = (j - (len(series) - 1) / 2) * w
        ax.bar([i + off for i in xs], [r.get(key) or 0 for r in rows], w, label=label)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["name"] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.set_title(f"KDA forward, {dev}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


DECODE_INTRO = ("Decode (`fused_recurrent_kda_fwd` in place on a state pool; kdakit and FLA in the same form, same "
                "inputs): bf16 q/k/v, K = V = 128, L2 norm in kernel, caller `out`; gate (lower_bound -5) and beta "
                "sigmoid in kernel except in pregated-fp32. Forms: batch-vfirst / batch-kfirst ([N,T] inputs, pool "
                "[slots,HV,V,K] / [slots,HV,K,V]); varlen-vfirst / varlen-kfirst ([1,N*T] inputs, int32 cu_seqlens); "
                "spare-slots (batch-vfirst, pool of 4x the touched slots up to 16 GiB, random int64 slot ids); "
                "pregated-fp32 (varlen-vfirst with fp32 pre-gated g and fp32 post-sigmoid beta). T1: [N] slot ids, "
                "state read and written once; T4: [N,4] slot ids with random num_accepted_tokens (speculative "
                "verify), state read once and written after every token. Bandwidth: those state bytes over the "
                "time, as a share of the measured copy bandwidth. Meets: faster than FLA and, from N = "
                f"{bench_decode.GOAL_MIN_N}, at least {100 * bench_decode.BANDWIDTH_GOAL:.0f}% of copy bandwidth, "
                f"with outputs and updated slots within {bench_decode.DIFF_FLAG:.0e} (relative RMS) of FLA's.")


FORWARD_INTRO = ("Forward: bf16 inputs, gate (lower_bound -5), L2 norm and beta sigmoid in kernel, float32 initial "
                 "state in and final state out, K = V = 128. cuDNN: NVIDIA cuDNN Frontend's Hopper engine (plan "
                 "kda_hopper_cuda) on the same tensors as THD views, with int32 cu_seqlens, a v-first copy of h0 and "
                 "fp32 copies of g and beta (its kernel's input dtype) made before the timed calls. rel. diff vs "
                 "FLA: kdakit's output against FLA's; cuDNN rel. diff: the larger of its output's and final state's "
                 "against kdakit's (relative RMS).")


def notes_list(lines) -> str:
    return "\n".join(f"- {line}" for line in lines)


def list_rows(shapes, cases, train, gate=()) -> None:
    for s in shapes:
        print(s[0])
    for c in cases:
        print(f"{c.name}  (pool slots {c.pool_slots}, state {c.state_bytes / 1e6:.1f} MB)")
    for s in train:
        print(s[0])
    for s in gate:
        print(f"gate-dtype {s[0]}")
    print(f"{len(shapes)} forward rows, {len(cases)} decode rows, {len(train)} training rows"
          + (f", {len(gate)} gate-dtype rows" if gate else ""))


def main(argv=None) -> int:
    args = parse_args(argv)
    shapes, cases, train = selected_rows(args)
    gate = selected_gate_rows(args)
    if args.list:
        list_rows(shapes, cases, train, gate)
        return 0
    if not torch.cuda.is_available() or not kdakit.cuda_available():
        print("kdakit.bench needs a CUDA device and kdakit's CUDA kernels")
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth()
    flush = flush_buffer()
    notes = bench_peers.Notes(lambda s: print(s, flush=True))
    inputs = functools.partial(forward_inputs, recipe=args.recipe)
    rows = []
    fkda = None
    if shapes:
        fla, fkda = fla_runner(notes), flashkda_runner(notes)
        rows = bench_forward(shapes, args.reps or 30, bw, flush, fla, fkda, bench_peers.cudnn_kda(notes), notes,
                             args.recipe)
    decode_rows = []
    if cases:
        fla_decode = bench_decode.fla_decode_runner()
        print(f"{len(cases)} decode rows")
        decode_rows = bench_decode.run_rows(cases, timer=time_ms, reps=args.reps or 20, bw=bw, flush=flush,
                                            fla=fla_decode, log=lambda s: print(s, flush=True))
    gate_rows = []
    if gate:
        print(f"{len(gate)} gate-dtype rows")
        gate_rows = bench_gate.run_rows(gate, inputs=inputs, run=run_kdakit, timer=time_ms,
                                        reps=args.reps or 30, bw=bw, flush=flush, log=lambda s: print(s, flush=True))
    train_rows = []
    if train:
        print(f"{len(train)} training rows")
        train_rows = bench_train.run_rows(train, inputs=inputs, timer=time_ms, reps=args.reps or 20,
                                          flush=flush, notes=notes, rel_diff=rel_diff,
                                          log=lambda s: print(s, flush=True))

    dev = torch.cuda.get_device_name()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    reps = ", ".join(f"{n} runs ({what})" for n, what, on in ((args.reps or 30, "forward", rows),
                                                              (args.reps or 30, "gate dtype, 3 rounds", gate_rows),
                                                              (args.reps or 20, "decode", decode_rows),
                                                              (args.reps or 20, "training", train_rows)) if on)
    meta = (f"{dev}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs; torch {torch.__version__}; "
            f"kdakit {kdakit.__version__} ({args.commit or git_commit()}); {stamp}; measured copy bandwidth "
            f"{bw / 1e12:.2f} TB/s (read + write); median of {reps or 'no runs'}, L2 flushed before each; gate "
            f"recipe {args.recipe}.")
    md = f"# kdakit benchmark: {dev}\n\n{meta}\n"
    text = meta + "\n"
    if rows:
        table = forward_table(rows, fkda is not None)
        md += f"\n{FORWARD_INTRO}\n\n{table}\n"
        text += table + "\n"
        try:
            plot_forward(rows, out / f"{device_slug()}.png", dev)
        except Exception as e:  # noqa: BLE001
            print(f"plot skipped: {e}")
    if decode_rows:
        summary, dtable = bench_decode.form_summary(decode_rows), bench_decode.decode_table(decode_rows)
        errors = bench_decode.errors_list(decode_rows)
        md += f"\n{DECODE_INTRO}\n\n{summary}\n\n{dtable}\n" + (f"\nErrors:\n\n{errors}\n" if errors else "")
        text += f"{summary}\n{dtable}\n" + (f"{errors}\n" if errors else "")
        record = dict(device=dev, sms=torch.cuda.get_device_properties(0).multi_processor_count,
                      torch=torch.__version__, kdakit=kdakit.__version__, commit=args.commit or git_commit(),
                      date=stamp, copy_bandwidth=bw, reps=args.reps or 20, goal=dict(
                          bandwidth=bench_decode.BANDWIDTH_GOAL, from_n=bench_decode.GOAL_MIN_N,
                          diff=bench_decode.DIFF_FLAG), rows=decode_rows)
        (out / f"{device_slug()}-decode.json").write_text(json.dumps(record, indent=1) + "\n")
        try:
            bench_decode.plot(decode_rows, out / f"{device_slug()}-decode.png", f"KDA decode, {dev}")
        except Exception as e:  # noqa: BLE001
            print(f"decode plot skipped: {e}")
    if gate_rows:
        gtable = bench_gate.table(gate_rows)
        md += f"\n{bench_gate.INTRO}\n\n{gtable}\n"
        text += gtable + "\n"
    if train_rows:
        ttable = bench_train.train_table(train_rows)
        md += f"\n{bench_train.INTRO}\n\n{ttable}\n"
        text += ttable + "\n"
        try:
            bench_train.plot(train_rows, out / f"{device_slug()}-train.png", f"KDA training step, {dev}")
        except Exception as e:  # noqa: BLE001
            print(f"training plot skipped: {e}")
    if notes.lines:
        md += f"\nPeers and rows not run (a dash in the tables):\n\n{notes_list(notes.lines)}\n"
        text += notes_list(notes.lines) + "\n"
    (out / f"{device_slug()}.md").write_text(md)
    (out / "bench_table.txt").write_text(text)
    print()
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
