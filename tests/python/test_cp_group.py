"""chunk_kda(..., cp_context=...) over a real torch.distributed group: ranks as processes, on the CPU (gloo) or one
GPU each (NCCL, where the machine has enough GPUs), each holding its share of one packed batch, against CPU chunk_kda
on the whole batch in one process: outputs, and the gradients of q, k, v, g, beta (the rank's tokens) and of A_log,
dt_bias (summed over ranks) through the backward exchange of state gradients (spec §7.6)."""
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kdakit
from conftest import assert_close
from kdakit import cp

# Relative RMS against CPU chunk_kda on the whole batch (fp32 chunked forward, float64 backward; spec §3.3, §6.1).
TOL = {"cpu": dict(o=1e-5, grad=1e-4), "cuda": dict(o=1e-4, grad=1e-4)}  # float32 inputs

CASES = {  # name: sequence lengths (packed, B = 1); totals divisible by 2 and 4
    "fixed": [32, 32, 32, 32],
    "crossing": [70, 3, 41, 14],    # sequences over rank edges, one shorter than a rank's share
    "one-long": [128],              # one sequence over every rank
}


def make_inputs(lengths, use_gate, seed):
    gen = torch.Generator().manual_seed(seed)
    T, H, HV, K, V = sum(lengths), 2, 4, 16, 8  # GVA: HV = 2H
    rand = lambda *s: torch.rand(*s, generator=gen)  # noqa: E731
    q, k = torch.nn.functional.normalize(rand(1, T, H, K), dim=-1), torch.nn.functional.normalize(rand(1, T, H, K), dim=-1)
    v = rand(1, T, HV, V)
    opts = dict(chunk_size=32)
    if use_gate is True:
        g = torch.randn(1, T, HV, K, generator=gen)
        opts.update(use_gate_in_kernel=True, A_log=torch.log(1 + 15 * rand(HV)), dt_bias=torch.randn(HV * K, generator=gen))
    else:  # "slow": a weak decay (about -0.003 a token), so that a whole rank's transition M is far from zero and
        # the folds across several ranks (forward states, backward state gradients) carry weight
        shift = 6.0 if use_gate == "slow" else 0.0
        g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, K, generator=gen) + shift)
    beta = torch.sigmoid(torch.randn(1, T, HV, generator=gen))
    w = torch.randn(1, T, HV, V, generator=gen)  # the loss's weights
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return (q, k, v, g, beta), opts, w, cu


def grads_of(tensors, opts, fn):
    """fn(leaves, params) -> loss; the gradients of the leaves and of A_log / dt_bias."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    params = {n: opts[n].detach().clone().requires_grad_(True) for n in ("A_log", "dt_bias") if n in opts}
    out = fn(leaves, {**opts, **params})
    out[1].backward()
    return out[0].detach(), [t.grad for t in leaves], {n: p.grad for n, p in params.items()}


def run_rank(rank, world_size, init_file, lengths, use_gate, seed, device, disable_recompute=False):
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}", rank=rank,
                           world_size=world_size)
    try:
        check_rank(rank, lengths, use_gate, seed, device, disable_recompute)
        dist.barrier()  # no rank tears the group down while another's last collective is in flight
    finally:
        dist.destroy_process_group()
    # A rank that passed leaves without the interpreter's teardown: now and then a gloo rank aborted in it after
    # passing ('terminate called without an active exception', SIGABRT), which failed the case. A failure above
    # still raises (the spawn wrapper reports it); only the exit after success is shortened.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check_rank(rank, lengths, use_gate, seed, device, disable_recompute=False):
    """One rank's checks of one case in an initialised default group (also run under torchrun by
    tools/gpu/cp_torchrun.py): the forward and gradients against one-process CPU chunk_kda, then a forward-only pass."""
    torch.set_num_threads(1)  # ranks share the machine's cores
    kdakit._C.set_cpu_threads(1)
    tensors, opts, w, cu = make_inputs(lengths, use_gate, seed)
    tol = TOL[device]
    ref_o, ref_g, ref_p = grads_of(tensors, opts, lambda x, o: (
        lambda out: (out, (out * w).sum()))(kdakit.chunk_kda(*x, cu_seqlens=cu, **o)[0]))
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    ctx = cp.build_context(cu.to(dev), group=dist.group.WORLD)
    s, e = ctx.token_start, ctx.token_end
    local = [t[:, s:e].to(dev) for t in tensors]
    local_opts = {n: (t.to(dev) if isinstance(t, torch.Tensor) else t) for n, t in opts.items()}
    local_opts["disable_recompute"] = disable_recompute
    w_local = w[:, s:e].to(dev)

    def local_loss(x, o):
        out, final = kdakit.chunk_kda(*x, cp_context=ctx, **o)
        assert final is None
        return out, (out * w_local).sum()

    o, g, p = grads_of(local, local_opts, local_loss)
    assert_close(f"rank {rank}: o", ref_o[:, s:e], o.cpu(), tol["o"])
    for name, want, got in zip(("dq", "dk", "dv", "dg", "dbeta"), ref_g, g):
        assert_close(f"rank {rank}: {name}", want[:, s:e], got.cpu(), tol["grad"])
    with torch.inference_mode():  # forward-only: a rank holding one sequence takes the split forward on CUDA
        o_fwd, _ = kdakit.chunk_kda(*local, cp_context=ctx, **local_opts)
    assert_close(f"rank {rank}: o (forward-only)", ref_o[:, s:e], o_fwd.cpu(), tol["o"])
    for name, got in p.items():  # parameters shared by every token: the ranks' parts summed
        dist.all_reduce(got, group=dist.group.WORLD)
        assert_close(f"rank {rank}: d{name}", ref_p[name], got.cpu(), tol["grad"])


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("use_gate", [False, True, "slow"])
def test_group_matches_one_process(device, world_size, case, use_gate):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    if device == "cuda":
        if not (torch.cuda.is_available() and kdakit.cuda_available() and dist.is_nccl_available()):
            pytest.skip("no CUDA device, NCCL, or kdakit CUDA kernels")
        if torch.cuda.device_count() < world_size:
            pytest.skip(f"{world_size} ranks need {world_size} GPUs, this machine has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(run_rank, args=(world_size, os.path.join(d, "init"), CASES[case], use_gate, 1234, device),
                 nprocs=world_size, join=True)


@pytest.mark.parametrize("case", ["crossing", "one-long"])
def test_group_with_saved_chunk_states(case):
    """disable_recompute=True under context parallelism (the local forward saves its chunk states for the local
    backward): the same checks, on the CPU with gloo."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(run_rank, args=(2, os.path.join(d, "init"), CASES[case], "slow", 1234, "cpu", True), nprocs=2,
                 join=True)


def disagree_rank(rank, world_size, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        cu = torch.tensor([0, 10, 30] if rank != 1 else [0, 12, 30], dtype=torch.int32)
        with pytest.raises(kdakit.InvalidArgumentError, match="cu_seqlens_global: every rank must pass the same"):
            cp.build_context(cu, group=dist.group.WORLD)
        same = cp.build_context(torch.tensor([0, 10, 30], dtype=torch.int32), group=dist.group.WORLD)
        assert same.rank == rank and same.world_size == world_size
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ranks_that_disagree_on_the_boundaries_are_refused():
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(disagree_rank, args=(2, os.path.join(d, "init")), nprocs=2, join=True)


def test_context_without_group_is_refused():
    ctx = cp.build_context(torch.tensor([0, 10, 30], dtype=torch.int32), rank=1, world_size=2)
    x = torch.rand(1, 20, 1, 8)
    with pytest.raises(kdakit.InvalidArgumentError, match="cp_context: its group must be set"):
        kdakit.chunk_kda(x, x, x, -x, torch.rand(1, 20, 1), cp_context=ctx)


def test_cpu_inputs_under_an_nccl_group_are_refused(monkeypatch):
    """A group on another device: NCCL exchanges CUDA tensors, so CPU inputs are refused before any collective."""
    import dataclasses

    ctx = cp.build_context(torch.tensor([0, 10, 30], dtype=torch.int32), rank=1, world_size=2)
    ctx = dataclasses.replace(ctx, group=object())  # stands for an NCCL group (no collective is reached)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    x = torch.rand(1, 20, 1, 8)
    with pytest.raises(kdakit.InvalidArgumentError, match="cp_context: its group runs nccl, which exchanges CUDA"):
        kdakit.chunk_kda(x, x, x, -x, torch.rand(1, 20, 1), cp_context=ctx)


def test_context_without_rank_spans_is_refused():
    """A context object with FLA's fields but no post_num_ranks (the span the backward's fold reads) is refused by
    name before any collective."""
    from types import SimpleNamespace

    cu = torch.tensor([0, 20], dtype=torch.int32)
    ctx = SimpleNamespace(group=object(), cu_seqlens=cu, cu_seqlens_cpu=cu, is_first_rank=False, is_last_rank=True,
                          pre_num_ranks=1, post_num_ranks=None)
    x = torch.rand(1, 20, 1, 8)
    with pytest.raises(kdakit.InvalidArgumentError, match="cp_context: expected kdakit's or FLA's context, it has no "
                                                          "post_num_ranks"):
        kdakit.chunk_kda(x, x, x, -x, torch.rand(1, 20, 1), cp_context=ctx)


@pytest.mark.parametrize("extra,match", [
    (dict(cu_seqlens=torch.tensor([0, 20], dtype=torch.int32)), "cu_seqlens: must be None with cp_context"),
    (dict(return_intermediate_states=True), "return_intermediate_states: not taken with cp_context"),
    (dict(state_v_first=True), "state_v_first: not taken with cp_context"),
    (dict(out=torch.empty(1, 20, 1, 8)), "out: not taken with cp_context"),
])
def test_cp_refuses_what_it_cannot_take(extra, match):
    ctx = cp.build_context(torch.tensor([0, 10, 30], dtype=torch.int32), rank=1, world_size=2)
    x = torch.rand(1, 20, 1, 8)
    with pytest.raises(kdakit.InvalidArgumentError, match=match):
        kdakit.chunk_kda(x, x, x, -x, torch.rand(1, 20, 1), cp_context=ctx, **extra)
