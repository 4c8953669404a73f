"""Training rows of `kdakit.bench` (names start with "train"; `--only train` runs just them): one training step,
forward and backward, of kdakit's `chunk_kda`, FLA's `fla.ops.kda.chunk_kda` and cuDNN Frontend's Hopper KDA engine,
in one process, from the same raw inputs.

Inputs: `kdakit.bench.forward_inputs` (bf16 q, k, v, g, beta, K = V = 128, fp32 A_log, dt_bias and h0). The loss
is `o.float().sum() + final_state.float().sum()`; gradients flow to q, k, v, g, beta, A_log, dt_bias and h0. What
each library's step includes:

- kdakit and FLA: their chunk_kda with the lower-bound gate (-5, A_log, dt_bias), the q/k L2 norm and the beta
  sigmoid in kernel, its forward and its backward.
- cuDNN: its engine's backward takes no in-kernel fusions, so the step also runs the L2 norm, the gate (to fp32
  log-space g) and the sigmoid (to fp32 beta) as eager torch ops, forward and backward, around its forward and
  backward kernels (`kdakit.bench_peers.cudnn_train_step`). Its backward needs as many q as v heads: GVA rows do not
  run there.

Times are medians of CUDA-event timings of whole steps with the L2 cache flushed before each. Peak extra memory:
`torch.cuda.max_memory_allocated()` during one step (statistics reset first) minus the bytes allocated before it;
it counts the step's outputs, saved tensors, workspaces and gradients. The gradient columns are the largest relative
RMS difference over the eight gradients, kdakit's against FLA's and cuDNN's against kdakit's.
"""
from __future__ import annotations

from typing import Callable

import torch

from kdakit import bench_peers
from kdakit.bench_decode import fmt

TRAIN_SHAPES = [
    # name, B, T, H, HV, cu_seqlens lengths (as kdakit.bench.FORWARD_SHAPES)
    ("train B1 T8192 H64", 1, 8192, 64, 64, None),
    ("train B2 T4096 H32", 2, 4096, 32, 32, None),
    ("train B8 T4096 H32", 8, 4096, 32, 32, None),
    ("train varlen6 H64", 1, None, 64, 64, [1300, 547, 2048, 963, 271, 3063]),
    ("train GVA H16 HV64 T8192", 1, 8192, 16, 64, None),
    ("train B1 T65536 H8", 1, 65536, 8, 8, None),
]
LIBRARIES = ("kdakit", "FLA", "cuDNN")


def train_shapes(only=None) -> list:
    return [s for s in TRAIN_SHAPES if not only or any(o in s[0] for o in only)]


def grad_diff(a: dict, b: dict, rel_diff: Callable) -> float:
    """The largest relative RMS difference of gradient set `a` from `b`, over the gradients both have."""
    return max(rel_diff(a[n], b[n]) for n in bench_peers.GRAD_NAMES)


def measure(step: Callable, *, timer: Callable, reps: int, flush, device="cuda"):
    """(median ms, peak extra MiB, gradients of one step) of a training step."""
    ms = timer(step, reps, flush)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    grads = step()
    torch.cuda.synchronize(device)
    return ms, (torch.cuda.max_memory_allocated(device) - before) / 2 ** 20, grads


def bench_row(shape, x, steps: dict, *, timer: Callable, reps: int, flush, notes: Callable, rel_diff: Callable,
              measure_fn: Callable = measure) -> dict:
    """One training row: `steps` maps a library to its step builder (x -> step) or None where it is missing."""
    name = shape[0]
    row = dict(name=name, **{f"{lib}_ms": None for lib in LIBRARIES}, **{f"{lib}_mib": None for lib in LIBRARIES},
               diff_fla=None, diff_cudnn=None)
    grads = {}
    for lib in LIBRARIES:
        make = steps.get(lib)
        if make is None:
            continue
        try:
            row[f"{lib}_ms"], row[f"{lib}_mib"], grads[lib] = measure_fn(make(x), timer=timer, reps=reps,
                                                                          flush=flush)
        except Exception as e:  # noqa: BLE001
            notes(f"{lib} did not run on {name}: {bench_peers.error_text(e)}")
    if "kdakit" in grads and "FLA" in grads:
        row["diff_fla"] = grad_diff(grads["kdakit"], grads["FLA"], rel_diff)
    if "kdakit" in grads and "cuDNN" in grads:
        row["diff_cudnn"] = grad_diff(grads["cuDNN"], grads["kdakit"], rel_diff)
    return row


def run_rows(shapes, *, inputs: Callable, timer: Callable, reps: int, flush, notes: Callable, rel_diff: Callable,
             log=print) -> list:
    """Every training row, with the peers that import; `inputs` is kdakit.bench.forward_inputs."""
    steps = {"kdakit": bench_peers.kdakit_train_step}
    fla = bench_peers.fla_chunk_kda(notes)
    if fla is not None:
        steps["FLA"] = lambda x: bench_peers.fla_train_step(fla, x)
    cudnn = bench_peers.cudnn_kda(notes)
    if cudnn is not None:
        steps["cuDNN"] = lambda x: bench_peers.cudnn_train_step(cudnn, x)
    rows = []
    for shape in shapes:
        torch.manual_seed(0)
        x, _ = inputs(*shape[1:])
        row = bench_row(shape, x, steps, timer=timer, reps=reps, flush=flush, notes=notes, rel_diff=rel_diff)
        rows.append(row)
        log("  ".join([f"{row['name']:26s}"] + [f"{lib} {fmt(row[lib + '_ms'], '{:8.3f}')} ms" for lib in LIBRARIES]
                      + [f"grad diff vs FLA {fmt(row['diff_fla'], '{:.1e}')}"]))
        del x
        torch.cuda.empty_cache()
    return rows


INTRO = ("Training (one step: forward, then backward of `o.float().sum() + final_state.float().sum()` into q, k, v, "
         "g, beta, A_log, dt_bias and h0): bf16 inputs, K = V = 128, float32 initial state, lower-bound gate (-5, "
         "A_log, dt_bias), q/k L2 norm and beta sigmoid. kdakit and FLA: `chunk_kda` with all three in kernel. "
         "cuDNN: its Hopper engine (plan kda_hopper_cuda), whose backward takes no fusions, so its step also runs "
         "the L2 norm, the gate (fp32 log-space g) and the sigmoid (fp32 beta) as eager torch ops, forward and "
         "backward; its backward needs equal q and v head counts (no GVA). Peak MiB: most memory allocated during "
         "one step above what was allocated before it. Grad diff: largest relative RMS difference over the eight "
         "gradients, kdakit vs FLA and cuDNN vs kdakit.")


def train_table(rows) -> str:
    head = ("| row | kdakit ms | FLA ms | cuDNN ms | kdakit/FLA | kdakit/cuDNN | kdakit peak MiB | FLA peak MiB | "
            "cuDNN peak MiB | grad diff vs FLA | cuDNN grad diff |")
    lines = [head, "|---" * 11 + "|"]
    for r in rows:
        def ratio(peer):
            return r["kdakit_ms"] / r[peer] if r["kdakit_ms"] and r[peer] else None
        cells = [r["name"]] + [fmt(r[f"{lib}_ms"], "{:.3f}") for lib in LIBRARIES]
        cells += [fmt(ratio("FLA_ms"), "{:.2f}"), fmt(ratio("cuDNN_ms"), "{:.2f}")]
        cells += [fmt(r[f"{lib}_mib"], "{:.0f}") for lib in LIBRARIES]
        cells += [fmt(r["diff_fla"], "{:.1e}"), fmt(r["diff_cudnn"], "{:.1e}")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows, path, title: str) -> None:
    """Step time and peak extra memory per row and library (bars; a library that did not run leaves a gap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ms, ax_mib) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = range(len(rows))
    w = 0.27
    for i, lib in enumerate(LIBRARIES):
        at = [x + (i - 1) * w for x in xs]
        ax_ms.bar(at, [r[f"{lib}_ms"] or 0 for r in rows], w, label=lib)
        ax_mib.bar(at, [r[f"{lib}_mib"] or 0 for r in rows], w, label=lib)
    for ax, unit in ((ax_ms, "ms per step"), (ax_mib, "peak extra MiB")):
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["name"] for r in rows], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(unit)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
