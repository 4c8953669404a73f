"""Same-process A/B of two kdakit builds: did a change alter any output bit or any kernel time?

    tools/gpu/ab_build.sh BASE_TREE CURRENT_TREE PREFIX        (or: tools/gpu/run compare [BASE_TREE] [options])
    PYTHONPATH=PREFIX/site python3 tools/gpu/ab_compare.py [--reps N] [--only SUBSTR ...] [--forms FORM ...]
                                                            [--profile]

Imports the current build as `kdakit` and the base build as `kdakit_base` (built by tools/gpu/ab_build.sh with its
own nanobind domain and renamed self-references) in this one process, and runs benchmark rows (forward rows of
kdakit.bench.FORWARD_SHAPES, decode rows of kdakit.bench_decode.decode_cases(), by default of the batch-vfirst form;
--forms picks others) through both: the current tree's helpers build the inputs and make the calls, passing the base
package as `lib` for the base's calls.

1. Bits: the same inputs (fixed seed per row) through the current and the base call; for decode each on its own
   copy of the state pool (updated in place) and its own zeroed `out`. Every output (forward: o and the final state;
   decode: out and the updated pool) is compared bit for bit (torch.equal on integer views of the same width: NaNs
   of the same bits are equal, -0.0 and 0.0 are not); unequal outputs report the max abs difference and the number
   of differing elements, and the current call is run a second time to tell a nondeterministic kernel from a change.
2. Time: CUDA events around each call with the L2 flushed before it (kdakit.bench.time_ms and flush_buffer), the
   two builds interleaved in blocks (A B B A ...) so both see the same conditions; medians and cur/base.
3. --profile: kernel time of one call (sum of the CUDA device events of the call, torch.profiler, flushed before
   the call, the flush not counted), median of 5 calls per build, and its ratio: kernel time apart from launch and
   host noise.

Prints the files each package was loaded from, a line per row, then a table and the line
`bit-identical: X/Y rows; median ratio ...; max ratio ...`. Writes $OUT/ab_compare.json and $OUT/ab_compare.md
(OUT default /tmp/kdakit-out). Exit status 1 when a row is not bit-identical, 2 when it cannot run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import zlib
from pathlib import Path

import torch

PROFILE_CALLS = 5
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def load_packages():
    """kdakit (current), kdakit_base (base), and the current tree's kdakit.bench and kdakit.bench_decode."""
    try:
        import kdakit
        import kdakit_base
        from kdakit import bench, bench_decode
    except ImportError as e:
        sys.exit(f"ab_compare: {e}; build both trees with tools/gpu/ab_build.sh and run with PYTHONPATH=PREFIX/site")
    return kdakit, kdakit_base, bench, bench_decode


def origin(mod):
    return (f"{mod.__name__:12s} {mod.__version__:8s} {Path(mod.__file__).parent}  "
            f"(extension {Path(mod._C.__file__).name})")


def bits(t):
    return t.view(INT_VIEW[t.element_size()]) if t.is_floating_point() else t


def compare(a, b):
    """Bit equality of two tensors; max abs difference and count of differing elements when unequal."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return dict(equal=False, max_abs_diff=None, n_diff=None, note=f"{tuple(a.shape)} {a.dtype} vs "
                    f"{tuple(b.shape)} {b.dtype}")
    if torch.equal(bits(a), bits(b)):
        return dict(equal=True, max_abs_diff=0.0, n_diff=0)
    n_diff = int((bits(a) != bits(b)).sum().item())
    wide = torch.float64 if a.dtype == torch.float64 else torch.float32
    d = a.to(wide) - b.to(wide)
    max_abs = float(d.abs_().max().item())
    del d
    return dict(equal=False, max_abs_diff=max_abs, n_diff=n_diff, numel=a.numel())


def outputs(res, names):
    """Named output tensors of a call's result (a tensor or a tuple; None entries skipped)."""
    res = res if isinstance(res, (tuple, list)) else (res,)
    out = {}
    for i, t in enumerate(res):
        if isinstance(t, torch.Tensor):
            out[names[i] if i < len(names) else f"output{i}"] = t
    return out


def compare_all(cur, base):
    res = {}
    for k in cur.keys() | base.keys():
        if k in cur and k in base:
            res[k] = compare(cur[k], base[k])
        else:
            res[k] = dict(equal=False, max_abs_diff=None, n_diff=None,
                          note="missing in " + ("base" if k in cur else "cur"))
    return dict(sorted(res.items()))


def interleaved_ms(bench, fn_base, fn_cur, reps, block, flush):
    """Median event-timed ms of each (kdakit.bench.time_ms per block of `block` runs), blocks in A B B A order."""
    t = {"base": [], "cur": []}
    fns = {"base": fn_base, "cur": fn_cur}
    for i in range((reps + block - 1) // block):
        for side in (("base", "cur") if i % 2 == 0 else ("cur", "base")):
            t[side].append(bench.time_ms(fns[side], block, flush))
    return statistics.median(t["base"]), statistics.median(t["cur"])


def kernel_us(fn, flush):
    """Median over PROFILE_CALLS calls of the summed CUDA device-event time of one call (us), flushed before it."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(PROFILE_CALLS):
        flush.zero_()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        per_call.append(sum(e.device_time for e in prof.events()
                            if e.device_type == torch.autograd.DeviceType.CUDA))
    return statistics.median(per_call)


def run_row(args, bench, bench_decode, base, flush, row):
    """Bits, times and (--profile) kernel times of one row; frees its inputs before returning."""
    name, kind = row["name"], row["kind"]
    torch.manual_seed(row["seed"])
    res = dict(name=name, kind=kind, seed=row["seed"])
    if kind == "forward":
        x, _ = bench.forward_inputs(*row["shape"])
        names = ["o", "final_state"]
        call_cur = lambda: bench.run_kdakit(x)  # noqa: E731
        call_base = lambda: bench.run_kdakit(x, lib=base)  # noqa: E731
        # (not named `base`: the calls above close over the base package of that name)
        out_cur = outputs(call_cur(), names)
        out_base = outputs(call_base(), names)
        res["outputs"] = compare_all(out_cur, out_base)
        if not all(v["equal"] for v in res["outputs"].values()):
            res["cur_repeatable"] = all(v["equal"] for v in compare_all(out_cur, outputs(call_cur(), names)).values())
        del out_cur, out_base
        fn_cur, fn_base = call_cur, call_base
        xs = [x]
    else:
        x, _ = bench_decode.decode_inputs(row["case"])
        pool0 = x["pool"]
        xc, xb = dict(x), dict(x)
        xc["pool"], xb["pool"] = pool0.clone(), pool0.clone()
        xc["out"], xb["out"] = torch.zeros_like(x["out"]), torch.zeros_like(x["out"])
        bench_decode.run_kdakit_decode(xc)
        bench_decode.run_kdakit_decode(xb, lib=base)
        res["outputs"] = compare_all({"out": xc["out"], "pool": xc["pool"]}, {"out": xb["out"], "pool": xb["pool"]})
        if not all(v["equal"] for v in res["outputs"].values()):
            xb["pool"].copy_(pool0)
            xb["out"].zero_()
            bench_decode.run_kdakit_decode(xb)  # the current build again, from the same state
            res["cur_repeatable"] = all(v["equal"] for v in compare_all(
                {"out": xc["out"], "pool": xc["pool"]}, {"out": xb["out"], "pool": xb["pool"]}).values())
        del pool0
        x.clear()
        fn_cur = lambda: bench_decode.run_kdakit_decode(xc)  # noqa: E731
        fn_base = lambda: bench_decode.run_kdakit_decode(xb, lib=base)  # noqa: E731
        xs = [xc, xb]
    res["equal"] = all(v["equal"] for v in res["outputs"].values())
    res["base_ms"], res["cur_ms"] = interleaved_ms(bench, fn_base, fn_cur, args.reps, args.block, flush)
    res["ratio"] = res["cur_ms"] / res["base_ms"]
    if args.profile:
        res["base_kernel_us"] = kernel_us(fn_base, flush)
        res["cur_kernel_us"] = kernel_us(fn_cur, flush)
        res["kernel_ratio"] = res["cur_kernel_us"] / res["base_kernel_us"] if res["base_kernel_us"] else None
    for d in xs:  # the closures above hold these dicts: emptying them frees the row's tensors
        d.clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return res


def rows_of(bench, bench_decode, only, forms):
    rows = []
    for name, B, T, H, HV, lens in bench.FORWARD_SHAPES:
        rows.append(dict(name=name, kind="forward", shape=(B, T, H, HV, lens)))
    for case in bench_decode.decode_cases(forms):
        rows.append(dict(name=case.name, kind="decode", case=case))
    for r in rows:
        r["seed"] = zlib.crc32(r["name"].encode())  # fixed per row, the same with or without --only
    return [r for r in rows if not only or any(s in r["name"] for s in only)]


def fmt(v, f):
    return "—" if v is None else f.format(v)


def equal_cell(r):
    if r.get("error"):
        return "ERROR"
    if r["equal"]:
        return "yes"
    return "NO" + ("" if r.get("cur_repeatable", True) else " (cur nondet.)")


def table(results, profile):
    head = ["row", "equal", "base ms", "cur ms", "cur/base"]
    if profile:
        head += ["base kern us", "cur kern us", "ratio"]
    lines = [head]
    for r in results:
        cells = [r["name"], equal_cell(r), fmt(r.get("base_ms"), "{:.4f}"), fmt(r.get("cur_ms"), "{:.4f}"),
                 fmt(r.get("ratio"), "{:.3f}")]
        if profile:
            cells += [fmt(r.get("base_kernel_us"), "{:.1f}"), fmt(r.get("cur_kernel_us"), "{:.1f}"),
                      fmt(r.get("kernel_ratio"), "{:.3f}")]
        lines.append(cells)
    return lines


def summary(results, profile):
    ok = sum(1 for r in results if r.get("equal"))
    ratios = [r["ratio"] for r in results if r.get("ratio") is not None]
    s = f"bit-identical: {ok}/{len(results)} rows"
    if ratios:
        s += f"; median ratio {statistics.median(ratios):.3f}; max ratio {max(ratios):.3f}"
    kr = [r["kernel_ratio"] for r in results if r.get("kernel_ratio") is not None]
    if profile and kr:
        s += f"; kernel time: median ratio {statistics.median(kr):.3f}, max ratio {max(kr):.3f}"
    return s


def diff_lines(results):
    out = []
    for r in results:
        for k, v in r.get("outputs", {}).items():
            if not v["equal"]:
                out.append(f"{r['name']}: {k} differs: " + (v.get("note") or
                           f"{v['n_diff']} of {v['numel']} elements, max abs diff {v['max_abs_diff']:.3e}"))
        if r.get("error"):
            out.append(f"{r['name']}: {r['error']}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20, help="timed runs of each build per row (default 20)")
    ap.add_argument("--block", type=int, default=1,
                    help="runs per kdakit.bench.time_ms call; blocks alternate A B B A (default 1: call by call)")
    ap.add_argument("--only", nargs="*", default=None, help="substrings of row names to run (default: all rows)")
    ap.add_argument("--forms", nargs="+", default=None, metavar="FORM",
                    help="decode forms (kdakit.bench_decode.FORM_NAMES; default batch-vfirst)")
    ap.add_argument("--profile", action="store_true", help="also kernel times by torch.profiler")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/kdakit-out"),
                    help="folder for ab_compare.json / ab_compare.md (default $OUT or /tmp/kdakit-out)")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.block < 1:
        ap.error("--reps and --block must be >= 1")

    kdakit, kdakit_base, bench, bench_decode = load_packages()
    forms = args.forms or [bench_decode.DEFAULT_TOOL_FORM]
    for f in forms:
        if f not in bench_decode.FORM_NAMES:
            ap.error(f"--forms: unknown form {f!r}; the forms are {', '.join(bench_decode.FORM_NAMES)}")
    print("loaded:")
    for m in (kdakit, kdakit_base):
        print("  " + origin(m))
    print(f"  bench helpers: {bench.__file__}, {bench_decode.__file__} (base calls pass lib=kdakit_base)")
    if Path(kdakit._C.__file__).resolve() == Path(kdakit_base._C.__file__).resolve():
        print("ab_compare: kdakit and kdakit_base load the same extension file")
        return 2
    if not torch.cuda.is_available() or not kdakit.cuda_available() or not kdakit_base.cuda_available():
        print("ab_compare needs a CUDA device and the CUDA kernels in both builds")
        return 2
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}; torch {torch.__version__}; {args.reps} timed runs per build and row, blocks of {args.block}")

    rows = rows_of(bench, bench_decode, args.only, forms)
    if not rows:
        print(f"no benchmark row matches {args.only}")
        return 2
    flush = bench.flush_buffer()
    results = []
    with torch.inference_mode():
        for row in rows:
            try:
                r = run_row(args, bench, bench_decode, kdakit_base, flush, row)
            except Exception as e:  # noqa: BLE001  (a row that fails is reported, the others still run)
                r = dict(name=row["name"], kind=row["kind"], seed=row["seed"], equal=False, error=repr(e)[:300])
                torch.cuda.empty_cache()
            results.append(r)
            line = (f"{r['name']:42s} {equal_cell(r):6s} base {fmt(r.get('base_ms'), '{:9.4f}')} ms  "
                    f"cur {fmt(r.get('cur_ms'), '{:9.4f}')} ms  cur/base {fmt(r.get('ratio'), '{:.3f}')}")
            if args.profile:
                line += (f"  kernels base {fmt(r.get('base_kernel_us'), '{:9.1f}')} us  cur "
                         f"{fmt(r.get('cur_kernel_us'), '{:9.1f}')} us  {fmt(r.get('kernel_ratio'), '{:.3f}')}")
            print(line, flush=True)
            for d in diff_lines([r]):
                print("    " + d)

    lines = table(results, args.profile)
    widths = [max(len(str(l[i])) for l in lines) for i in range(len(lines[0]))]
    text = "\n".join(" | ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in
                               enumerate(zip(l, widths))) for l in lines)
    last = summary(results, args.profile)
    print()
    print(text)
    diffs = diff_lines(results)
    for d in diffs:
        print(d)
    print(last)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), device=dev,
                torch=torch.__version__, reps=args.reps, block=args.block, profile=args.profile,
                cur=dict(file=kdakit.__file__, extension=kdakit._C.__file__, version=kdakit.__version__),
                base=dict(file=kdakit_base.__file__, extension=kdakit_base._C.__file__,
                          version=kdakit_base.__version__))
    (out / "ab_compare.json").write_text(json.dumps(dict(meta=meta, rows=results, summary=last), indent=1) + "\n")
    md = [f"# kdakit A/B (same process): {dev}", "",
          f"torch {torch.__version__}; {meta['date']}; {args.reps} event-timed runs per build and row (L2 flushed "
          f"before each, builds interleaved in blocks of {args.block}), medians"
          + (f"; kernel times: torch.profiler, median of {PROFILE_CALLS} calls" if args.profile else "") + ".", "",
          f"- cur (`kdakit`): `{kdakit.__file__}`", f"- base (`kdakit_base`): `{kdakit_base.__file__}`", "",
          "| " + " | ".join(lines[0]) + " |", "|" + "---|" * len(lines[0])]
    md += ["| " + " | ".join(str(c) for c in l) + " |" for l in lines[1:]]
    md += [""] + [f"- {d}" for d in diffs] + ([""] if diffs else []) + [f"**{last}**", ""]
    (out / "ab_compare.md").write_text("\n".join(md))
    print(f"wrote {out / 'ab_compare.json'} and {out / 'ab_compare.md'}")
    return 0 if all(r.get("equal") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
