"""Benchmark: kdakit against FLA (and FlashKDA when importable), timed in one process on the same inputs.

    python -m kdakit.bench [--out DIR] [--reps 30] [--only NAME ...]

Forward rows: bf16 inputs, gate (lower_bound -5), L2 norm and beta sigmoid in kernel, float32 initial state in
and final state out, K = V = 128. Times are medians of CUDA-event timings with the L2 cache flushed before
every run. The floor is the bytes that must move over the copy bandwidth measured in this process.

Decode rows (names start with "decode"; `--only decode` runs just them): `fused_recurrent_kda_fwd` in place on a
v-first state pool ([slots,HV,V,K], float32 or bfloat16) through random slot ids, bf16 inputs, gate (lower_bound
-5), L2 norm and beta sigmoid in kernel, K = V = 128, caller-provided `out`. T = 1: one token per sequence, a pool
of N slots, [N] indices (state read once, written once). T = 4: the speculative-decoding commit of the engines,
[N,4] indices into a pool of 4N slots with random num_accepted_tokens (state read once, written after every token).
The bandwidth column is those state bytes over the time, as a share of the measured copy bandwidth.
Writes DIR/<device>.md, DIR/<device>.png (DIR/<device>-decode.png) and DIR/bench_table.txt.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
from pathlib import Path

import torch

import kdakit

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


def forward_inputs(B, T, H, HV, lens):
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
        beta=torch.randn(B, T, HV, device=dev, dtype=bf),
        A_log=torch.log(torch.empty(HV, device=dev).uniform_(1, 16)), dt_bias=torch.randn(HV * D, device=dev),
        h0=torch.randn(N, HV, D, D, device=dev))
    x["cu"] = cu.to(dev) if cu is not None else None
    x["cu_cpu"] = cu
    floor_bytes = T * B * (2 * H * D * 2 + HV * (3 * D * 2 + 2)) + 2 * N * HV * D * D * 4
    return x, floor_bytes


def run_kdakit(x):
    return kdakit.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                            safe_gate=True, lower_bound=-5.0, A_log=x["A_log"], dt_bias=x["dt_bias"],
                            cu_seqlens=x["cu"], cu_seqlens_cpu=x["cu_cpu"])


def fla_runner():
    try:
        os.environ.setdefault("FLA_FLASH_KDA", "0")  # FLA's own Triton kernels; FlashKDA is timed on its own
        from fla.ops.kda import chunk_kda
    except Exception as e:  # noqa: BLE001
        print(f"FLA not importable: {e}")
        return None

    def run(x):
        return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                         safe_gate=True, lower_bound=-5.0, A_log=x["A_log"], dt_bias=x["dt_bias"],
                         cu_seqlens=None if x["cu"] is None else x["cu"].long(), cu_seqlens_cpu=None
                         if x["cu_cpu"] is None else x["cu_cpu"].long())
    return run


def flashkda_runner():
    try:
        import flash_kda  # noqa: F401
    except Exception:  # noqa: BLE001
        return None

    def run(x):
        B, T, H, _ = x["q"].shape
        out = torch.empty_like(x["v"])
        final = torch.empty_like(x["h0"])
        flash_kda.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], D ** -0.5, out, A_log=x["A_log"],
                      dt_bias=x["dt_bias"].view(H, D), lower_bound=-5.0,
                      initial_state=x["h0"].transpose(-1, -2).contiguous(), final_state=final,
                      cu_seqlens=None if x["cu"] is None else x["cu"].long())
        return out, final
    return run


# ---- decode -------------------------------------------------------------------------------------------------

DECODE_NS = [1, 8, 32, 256, 1024]
DECODE_HEADS = [(16, 16), (32, 32), (8, 32)]  # (H, HV)
DECODE_TS = [1, 4]
DECODE_POOLS = [("fp32", torch.float32), ("bf16", torch.bfloat16)]


def decode_shapes():
    for pool_name, pool_dtype in DECODE_POOLS:
        for T in DECODE_TS:
            for H, HV in DECODE_HEADS:
                for N in DECODE_NS:
                    heads = f"H{H}" if H == HV else f"H{H}-HV{HV}"
                    yield f"decode T{T} N{N} {heads} {pool_name}", N, T, H, HV, pool_dtype


def decode_inputs(N, T, H, HV, pool_dtype):
    dev, bf = "cuda", torch.bfloat16
    x = dict(
        q=torch.randn(N, T, H, D, device=dev, dtype=bf), k=torch.randn(N, T, H, D, device=dev, dtype=bf),
        v=torch.randn(N, T, HV, D, device=dev, dtype=bf), g=torch.randn(N, T, HV, D, device=dev, dtype=bf),
        beta=torch.randn(N, T, HV, device=dev, dtype=bf),
        A_log=torch.log(torch.empty(HV, device=dev).uniform_(1, 16)), dt_bias=torch.randn(HV * D, device=dev))
    slots = N * T
    x["pool"] = torch.randn(slots, HV, D, D, device=dev).to(pool_dtype)  # v-first [slots,HV,V,K]; V = K here
    perm = torch.randperm(slots, device=dev).to(torch.int32)
    x["idx"] = perm if T == 1 else perm.reshape(N, T)
    x["acc"] = None if T == 1 else torch.randint(1, T + 1, (N,), device=dev, dtype=torch.int32)
    x["out"] = torch.empty(N, T, HV, D, device=dev, dtype=bf)
    state_bytes = N * HV * D * D * x["pool"].element_size() * (1 + T)  # read once; written once per token
    return x, state_bytes


def decode_kwargs(x):
    return dict(inplace_final_state=True, state_v_first=True, ssm_state_indices=x["idx"],
                num_accepted_tokens=x["acc"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, out=x["out"])


def run_kdakit_decode(x):
    return kdakit.fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
                                          x["pool"], None, **decode_kwargs(x))


def fla_decode_runner():
    try:
        import inspect

        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception as e:  # noqa: BLE001
        print(f"FLA decode not importable: {e}")
        return None
    if "state_v_first" not in inspect.signature(fused_recurrent_kda_fwd).parameters:
        print("FLA's fused_recurrent_kda_fwd has no state_v_first; decode rows run without FLA")
        return None

    def run(x):
        return fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
                                       initial_state=x["pool"], scale=None, **decode_kwargs(x))
    return run


def bench_decode(args, bw, flush, only):
    fla = fla_decode_runner()
    rows = []
    torch.manual_seed(0)
    for name, N, T, H, HV, pool_dtype in decode_shapes():
        if only and not any(s in name for s in only):
            continue
        x, state_bytes = decode_inputs(N, T, H, HV, pool_dtype)
        with torch.inference_mode():
            diff = t_fla = None
            if fla is not None:  # both from the same pool once, for the difference of the outputs
                start = x["pool"].clone()
                run_kdakit_decode(x)
                ours = x["out"].clone()
                x["pool"].copy_(start)
                fla(x)
                diff = rel_diff(ours, x["out"])
                del start, ours
                t_fla = time_ms(lambda: fla(x), args.reps, flush)
            t_ours = time_ms(lambda: run_kdakit_decode(x), args.reps, flush)
        share = lambda t: None if t is None else state_bytes / (t * 1e-3) / bw
        rows.append(dict(name=name, mb=state_bytes / 1e6, ours=t_ours, fla=t_fla, bw=share(t_ours), fla_bw=share(t_fla),
                         diff=diff))
        print(f"{name:28s} kdakit {t_ours * 1e3:8.1f} us  FLA {t_fla * 1e3 if t_fla else float('nan'):8.1f} us  "
              f"state {state_bytes / 1e6:9.1f} MB  {100 * share(t_ours):5.1f}% of copy bandwidth", flush=True)
        del x
        torch.cuda.empty_cache()
    return rows


def decode_table(rows):
    fmt = lambda v, f: "—" if v is None else f.format(v)
    lines = ["| shape | state MB (read + write) | kdakit µs | FLA µs | kdakit/FLA | kdakit % copy BW | FLA % copy BW | "
             "rel. diff vs FLA |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["ours"] / r["fla"] if r["fla"] else None
        lines.append("| " + " | ".join([
            r["name"], f"{r['mb']:.1f}", f"{r['ours'] * 1e3:.1f}", fmt(r["fla"] and r["fla"] * 1e3, "{:.1f}"),
            fmt(ratio, "{:.2f}"), f"{100 * r['bw']:.0f}%", fmt(r["fla_bw"] and 100 * r["fla_bw"], "{:.0f}%"),
            fmt(r["diff"], "{:.1e}")]) + " |")
    return "\n".join(lines)


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--only", nargs="*", default=None, help="substrings of row names to run")
    ap.add_argument("--commit", default=None,
                    help="commit named in the table header (a copied tree or an installed package has no git history)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not kdakit.cuda_available():
        print("kdakit.bench needs a CUDA device and kdakit's CUDA kernels")
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth()
    flush = flush_buffer()
    fla, fkda = fla_runner(), flashkda_runner()
    rows = []
    torch.manual_seed(0)
    for name, B, T, H, HV, lens in FORWARD_SHAPES:
        if args.only and not any(s in name for s in args.only):
            continue
        x, floor_bytes = forward_inputs(B, T, H, HV, lens)
        floor = floor_bytes / bw * 1e3
        with torch.inference_mode():
            t_ours = time_ms(lambda: run_kdakit(x), args.reps, flush)
            o, ht = run_kdakit(x)
            t_fla = diff = None
            if fla is not None:
                t_fla = time_ms(lambda: fla(x), args.reps, flush)
                fo, fht = fla(x)
                diff = rel_diff(o, fo)
            t_fk = None
            if fkda is not None and lens is None:
                try:
                    t_fk = time_ms(lambda: fkda(x), args.reps, flush)
                except Exception as e:  # noqa: BLE001
                    print(f"FlashKDA failed on {name}: {e}")
        rows.append(dict(name=name, floor=floor, ours=t_ours, fla=t_fla, fk=t_fk, diff=diff))
        print(f"{name:22s} kdakit {t_ours:8.3f} ms  FLA {t_fla if t_fla else float('nan'):8.3f} ms  "
              f"floor {floor:6.3f} ms  diff vs FLA {diff if diff is not None else float('nan'):.1e}", flush=True)
        del x
        torch.cuda.empty_cache()
    decode_rows = bench_decode(args, bw, flush, args.only)

    dev = torch.cuda.get_device_name()
    head = (f"| shape | floor ms | kdakit ms | FLA ms | kdakit/FLA | kdakit/floor |"
            f"{' FlashKDA ms |' if fkda else ''} rel. diff vs FLA |")
    sep = "|---" * (7 if fkda else 6) + "|---|"
    lines = [head, sep]
    fmt = lambda v, f="{:.3f}": "—" if v is None else f.format(v)
    for r in rows:
        ratio = r["ours"] / r["fla"] if r["fla"] else None
        cells = [r["name"], fmt(r["floor"]), fmt(r["ours"]), fmt(r["fla"]), fmt(ratio, "{:.2f}"),
                 fmt(r["ours"] / r["floor"], "{:.1f}")]
        if fkda:
            cells.append(fmt(r["fk"]))
        cells.append(fmt(r["diff"], "{:.1e}"))
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    meta = (f"{dev}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs; torch {torch.__version__}; "
            f"kdakit {kdakit.__version__} ({args.commit or git_commit()}); {stamp}; measured copy bandwidth "
            f"{bw / 1e12:.2f} TB/s (read + write); median of {args.reps} runs, L2 flushed before each.")
    md = f"# kdakit benchmark: {dev}\n\n{meta}\n"
    text = meta + "\n"
    if rows:
        md += (f"\nForward: bf16 inputs, gate (lower_bound -5), L2 norm and beta sigmoid in kernel, float32 initial state "
               f"in and final state out, K = V = 128.\n\n{table}\n")
        text += table + "\n"
    if decode_rows:
        dtable = decode_table(decode_rows)
        md += (f"\nDecode (`fused_recurrent_kda_fwd`, in place on a v-first pool through random slot ids): bf16 inputs, "
               f"gate (lower_bound -5), L2 norm and beta sigmoid in kernel, K = V = 128, caller `out`. T1: [N] indices, "
               f"state read and written once. T4: [N,4] indices with num_accepted_tokens (speculative commit), state read "
               f"once and written after every token. Bandwidth: those state bytes over the time, as a share of the "
               f"measured copy bandwidth.\n\n{dtable}\n")
        text += dtable + "\n"
    (out / f"{device_slug()}.md").write_text(md)
    (out / "bench_table.txt").write_text(text)
    if decode_rows:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(max(10, 0.22 * len(decode_rows)), 4.5))
            xs = range(len(decode_rows))
            ax.bar([i - 0.2 for i in xs], [100 * r["bw"] for r in decode_rows], 0.4, label="kdakit")
            ax.bar([i + 0.2 for i in xs], [100 * (r["fla_bw"] or 0) for r in decode_rows], 0.4, label="FLA")
            ax.set_xticks(list(xs))
            ax.set_xticklabels([r["name"][len("decode "):] for r in decode_rows], rotation=90, fontsize=6)
            ax.set_ylabel("state bytes / time, % of copy bandwidth")
            ax.set_title(f"KDA decode, {dev}")
            ax.legend()
            fig.tight_layout()
            fig.savefig(out / f"{device_slug()}-decode.png", dpi=110)
        except Exception as e:  # noqa: BLE001
            print(f"decode plot skipped: {e}")
    if not rows:
        print()
        print(meta)
        if decode_rows:
            print(decode_table(decode_rows))
        return 0
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 4.5))
        names = [r["name"] for r in rows]
        xs = range(len(rows))
        w = 0.27
        ax.bar([i - w for i in xs], [r["floor"] for r in rows], w, label="floor")
        ax.bar(list(xs), [r["ours"] for r in rows], w, label="kdakit")
        ax.bar([i + w for i in xs], [r["fla"] or 0 for r in rows], w, label="FLA")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.set_title(f"KDA forward, {dev}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{device_slug()}.png", dpi=110)
    except Exception as e:  # noqa: BLE001
        print(f"plot skipped: {e}")
    print()
    print(meta)
    print(table)
    if decode_rows:
        print(decode_table(decode_rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
