"""Context-parallel scaling: one sequence of T tokens over 1, 2 or 4 GPUs (NCCL), kdakit and FLA's CP.

    python3 tools/gpu/cp_scaling.py [--tokens 1048576] [--heads 8] [--worlds 1,2,4] [--reps 5] [--libs kdakit,FLA]
                                    [--train] [--profile]

bf16 q/k/v, K = V = 128, gate (lower_bound -5), L2 norm and beta sigmoid in kernel, no initial state (issue rows of
the scaling goal). World size 1 is chunk_kda on the whole sequence without a context; W > 1 runs W processes, one
GPU each, each with its share of the sequence (random inputs of its own: timing only; correctness is
tests/python/test_cp_group.py), calling chunk_kda(cp_context=...) in inference mode, or with --train a training
step: the forward, then the gradients of o.float().sum() with respect to q, k, v, g, beta, A_log and dt_bias
(torch.autograd.grad, nothing accumulated). A run's time is the slowest
rank's (CUDA events around the call, ranks aligned by a barrier first); printed: medians of --reps runs after one
warm-up, and the ratio to world size 1. FLA: fla.ops.kda.chunk_kda with fla.ops.cp.build_cp_context, the same
inputs; skipped where FLA is missing. --libs picks the libraries (FLA's first run at a new length autotunes for
minutes).
--profile: after the timing, one more call of each library under torch.profiler on every rank; each rank prints its
kernels by total GPU time (NCCL kernels include their wait for the other ranks).
"""
import argparse
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPTS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
            lower_bound=-5.0)


def inputs(T, H, device, seed, train=False):
    gen = torch.Generator(device=device).manual_seed(seed)
    bf = torch.bfloat16
    r = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=bf)  # noqa: E731
    x = [r(1, T, H, 128), r(1, T, H, 128), r(1, T, H, 128), r(1, T, H, 128), r(1, T, H)]
    params = dict(A_log=torch.zeros(H, device=device), dt_bias=torch.zeros(H * 128, device=device))
    for t in x + list(params.values()):
        t.requires_grad_(train)
    return x, params


def timed(fn, reps, group=None):
    fn()  # warm-up (FLA: autotuning)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if group is not None:
            dist.barrier(group=group)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        t = torch.tensor([s.elapsed_time(e)], device="cuda")
        if group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        times.append(t.item())
    return statistics.median(times)


def runners(x, params, ctx_kdakit=None, ctx_fla=None, fla=True, ours=True, train=False):
    """name -> a call: the forward, or with train the forward and the gradients of every input."""
    import kdakit

    def run(forward):
        if not train:
            return forward
        leaves = list(x) + list(params.values())

        def step():
            o = forward()[0]
            return torch.autograd.grad(o.float().sum(), leaves)
        return step

    out = {}
    if ours:
        out["kdakit"] = run(lambda: kdakit.chunk_kda(*x, cp_context=ctx_kdakit, **OPTS, **params))
    if fla:
        try:
            from fla.ops.kda import chunk_kda as fla_chunk_kda
            out["FLA"] = run(lambda: fla_chunk_kda(*x, cp_context=ctx_fla, **OPTS, **params))
        except Exception as e:  # noqa: BLE001
            print(f"FLA not importable: {e}", flush=True)
    return out


def profile_table(fn, label, top=14, group=None):
    """One call of fn under torch.profiler: the kernels by total GPU time, as lines headed by label. group: the ranks
    meet in a barrier inside the profiled region first, so that no rank's profiler start-up counts as another's wait."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        if group is not None:
            dist.barrier(group=group)
            torch.cuda.synchronize()
        fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows) / 1e3
    lines = [f"-- {label}: kernels {total:.2f} ms in all"]
    for e in rows[:top]:
        lines.append(f"   {e.device_time_total / 1e3:9.3f} ms  x{e.count:<4d} {e.key[:100]}")
    return "\n".join(lines)


def grad_mode(train):
    """Inference mode for forward-only timing; autograd on (inputs requiring grad) for training steps."""
    return torch.enable_grad() if train else torch.inference_mode()


def rank_main(rank, world, init_file, T, H, reps, fla, ours, train, result_file, prof=False):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from kdakit import cp
        share = T // world
        x, params = inputs(share, H, "cuda", 1000 + rank, train)
        cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
        ctx = cp.build_context(cu, group=dist.group.WORLD)
        ctx_fla = None
        if fla:
            try:
                from fla.ops.cp import build_cp_context
                ctx_fla = build_cp_context(cu.long(), group=dist.group.WORLD, cu_seqlens_cpu=cu.long().cpu())
            except Exception as e:  # noqa: BLE001
                if rank == 0:
                    print(f"FLA CP not available: {e}", flush=True)
                fla = False
        res = {}
        with grad_mode(train):
            for name, fn in runners(x, params, ctx, ctx_fla, fla, ours, train).items():
                try:
                    res[name] = timed(fn, reps, dist.group.WORLD)
                except Exception as e:  # noqa: BLE001
                    res[name] = f"error: {type(e).__name__}: {str(e)[:200]}"
                if prof and isinstance(res[name], float):
                    table = profile_table(fn, f"{name} W={world} rank {rank}", group=dist.group.WORLD)
                    for r in range(world):  # one rank's table at a time
                        if r == rank:
                            print(table, flush=True)
                        dist.barrier()
        if rank == 0:
            with open(result_file, "w") as f:
                f.write(repr(res))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past the interpreter's teardown, where a rank has aborted now and then (test_cp_group)


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--libs", default="kdakit,FLA")
    ap.add_argument("--train", action="store_true", help="time training steps (forward + backward)")
    ap.add_argument("--profile", action="store_true", help="print each rank's kernels of one more call")
    a = ap.parse_args(argv)
    worlds = [int(w) for w in a.worlds.split(",") if int(w) <= max(1, torch.cuda.device_count())]
    T, H = a.tokens, a.heads
    libs = a.libs.split(",")
    fla, ours = "FLA" in libs, "kdakit" in libs
    print(f"{torch.cuda.get_device_name()} x {torch.cuda.device_count()}; T {T}, H{H}, bf16, K = V = 128; "
          f"{'training step' if a.train else 'forward'}; median of {a.reps}", flush=True)
    rows = {}
    for w in worlds:
        if w == 1:
            x, params = inputs(T, H, "cuda", 1000, a.train)
            with grad_mode(a.train):
                calls = runners(x, params, fla=fla, ours=ours, train=a.train)
                rows[1] = {n: timed(fn, a.reps) for n, fn in calls.items()}
                if a.profile:
                    for n, fn in calls.items():
                        print(profile_table(fn, f"{n} W=1"), flush=True)
            del x
            torch.cuda.empty_cache()
        else:
            with tempfile.TemporaryDirectory() as d:
                rf = os.path.join(d, "result")
                mp.spawn(rank_main, args=(w, os.path.join(d, "init"), T, H, a.reps, fla, ours, a.train, rf, a.profile),
                         nprocs=w, join=True)
                rows[w] = eval(open(rf).read())  # noqa: S307  (written by rank 0 above)
        print(f"W={w}: {rows[w]}", flush=True)
    names = list(rows[worlds[0]])
    print("| GPUs | " + " | ".join(f"{n} ms | {n} / 1 GPU" for n in names) + " |")
    print("|---|" + "---|---|" * len(names))
    for w in worlds:
        cells = []
        for n in names:
            t, t1 = rows[w].get(n), rows[1].get(n) if 1 in rows else None
            ok = isinstance(t, float)
            cells.append(f"{t:.2f}" if ok else str(t))
            cells.append(f"{t / t1:.2f}" if ok and isinstance(t1, float) else "-")
        print(f"| {w} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
