"""The multi-GPU context-parallel checks of tests/python/test_cp_group.py, launched by torchrun.

    torchrun --nproc_per_node 4 tools/gpu/cp_torchrun.py [--device cuda|cpu]

One process per GPU (NCCL; `--device cpu`: gloo on the CPU), every case of the test file (fixed-length sequences,
varlen sequences crossing rank edges, one sequence over every rank, GVA, both gates and a slow decay): each rank's
output and gradients against one-process CPU chunk_kda, then a forward-only pass (the split forward where a rank
holds one sequence). On CUDA, then, the forward-only call and a training step (forward and gradients) captured in
CUDA graphs (NCCL's all-gathers inside) and replayed on new inputs, against eager calls on them, bit for bit. Rank 0
prints one line per case; the exit status is 1 if any rank failed a case.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

import kdakit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "python"))
import test_cp_group as cases  # noqa: E402


def check_graph(rank, train):
    """chunk_kda(cp_context=...) on one sequence over every rank (the split forward, and with train the split
    backward) captured in a CUDA graph and replayed on new inputs copied into the captured ones: the same bits as an
    eager call on those inputs. Forward only: the output in inference mode. train: the output and the gradients of
    (o * w).sum() with respect to q, k, v, g, beta, A_log and dt_bias (torch.autograd.grad, nothing accumulated)."""
    from kdakit import cp

    tensors, opts, w, cu = cases.make_inputs(cases.CASES["one-long"], True, 7)
    dev = torch.device("cuda", torch.cuda.current_device())
    ctx = cp.build_context(cu.to(dev), group=dist.group.WORLD)
    s, e = ctx.token_start, ctx.token_end
    static = [t[:, s:e].to(dev).contiguous().requires_grad_(train) for t in tensors]
    params = {n: (t.to(dev).requires_grad_(train) if isinstance(t, torch.Tensor) else t) for n, t in opts.items()}
    weight = w[:, s:e].to(dev)
    leaves = static + [t for t in params.values() if isinstance(t, torch.Tensor)]

    def step():
        out, _ = kdakit.chunk_kda(*static, cp_context=ctx, **params)
        if not train:
            return [out]
        return [out.detach()] + list(torch.autograd.grad((out * weight).sum(), leaves))

    with torch.enable_grad() if train else torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (allocator, communicator)
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = step()
        fresh = cases.make_inputs(cases.CASES["one-long"], True, 8)[0]
        with torch.no_grad():
            for dst, src in zip(static, fresh):
                dst.copy_(src[:, s:e])
        graph.replay()
        torch.cuda.synchronize()
        want = step()
    names = ["o", "dq", "dk", "dv", "dg", "dbeta"] + [f"d{n}" for n, t in params.items() if isinstance(t, torch.Tensor)]
    for name, a, b in zip(names, got, want):
        if not torch.equal(a, b):
            raise AssertionError(f"rank {rank}: the replayed graph's {name} differs from an eager call's "
                                 f"(max {(a - b).abs().max().item():.3e})")


def run_check(rank, world, device, label, check, catch):
    """One check on every rank: rank 0 prints `label` and whether it passed everywhere, a failing rank its first error
    line. Returns 1 if any rank failed it."""
    error = ""
    try:
        check()
    except catch as e:
        first = str(e).splitlines()[0][:160] if str(e) else ""
        error = first if isinstance(e, AssertionError) else f"{type(e).__name__}: {first}"
    bad = torch.tensor([1 if error else 0], device="cuda" if device == "cuda" else "cpu")
    dist.all_reduce(bad)
    if error:
        print(f"rank {rank}: {label.strip()}: {error}", flush=True)
    if rank == 0:
        print(f"{world} ranks ({device}): {label} "
              f"{'FAILED on ' + str(int(bad.item())) + ' ranks' if bad.item() else 'passed'}", flush=True)
    return int(bad.item() > 0)


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    a = ap.parse_args(argv)
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = 0
    try:
        for name, lengths in cases.CASES.items():
            for use_gate in (False, True, "slow"):
                failed += run_check(rank, world, a.device, f"{name:9s} gate={use_gate!s:5s}",
                                    lambda: cases.check_rank(rank, lengths, use_gate, 1234, a.device), AssertionError)
        if a.device == "cuda":  # a capture NCCL refuses is reported, not raised
            failed += run_check(rank, world, a.device, "forward-only in a CUDA graph",
                                lambda: check_graph(rank, False), Exception)
            failed += run_check(rank, world, a.device, "training step in a CUDA graph",
                                lambda: check_graph(rank, True), Exception)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # past the interpreter's teardown, where a gloo rank has aborted now and then (test_cp_group)
