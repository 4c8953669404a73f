"""kdakit.cp on the CPU: the rank partition against a token-by-token oracle, every validation error, the exact
transition of a piece, and a whole context-parallel group played on one device against single-device chunk_kda
(spec §7)."""
import pytest
import torch
import torch.nn.functional as F

import kdakit
from conftest import assert_close
from kdakit import cp, cp_exchange

TOL = 1e-5  # float32, simulated group vs one device, relative RMS (spec §6.1)


def cu_of(lengths, dtype=torch.int32):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=dtype)


def expected_partition(cu, rank, world_size):
    """Token by token: the global sequence of each token of the rank's share, run-length encoded."""
    cu = cu.tolist()
    owner = [s for s in range(len(cu) - 1) for _ in range(cu[s + 1] - cu[s])]
    share = len(owner) // world_size
    start, end = rank * share, (rank + 1) * share
    ids, bounds = [], [0]
    for t in range(start, end):
        if ids and ids[-1] == owner[t]:
            bounds[-1] += 1
        else:
            ids.append(owner[t])
            bounds.append(bounds[-1] + 1)
    first, last = ids[0], ids[-1]
    rank_of = [t // share for t in range(len(owner))]
    return dict(ids=tuple(ids), cu=bounds, start=start, end=end,
                from_previous=cu[first] < start, into_next=cu[last + 1] > end,
                pre=rank - rank_of[cu[first]], post=rank_of[cu[last + 1] - 1] - rank)


def check_partition(cu, world_size):
    covered = 0
    for rank in range(world_size):
        ctx = cp.build_context(cu, rank=rank, world_size=world_size)
        want = expected_partition(cu, rank, world_size)
        assert ctx.cu_seqlens.dtype == torch.int32 and ctx.cu_seqlens.device == cu.device
        assert ctx.cu_seqlens.tolist() == want["cu"] == ctx.cu_seqlens_cpu.tolist()
        assert ctx.seq_ids == want["ids"]
        assert (ctx.token_start, ctx.token_end) == (want["start"], want["end"])
        assert ctx.first_continues_from_previous == want["from_previous"] == (not ctx.is_first_rank)
        assert ctx.last_continues_into_next == want["into_next"] == (not ctx.is_last_rank)
        assert (ctx.pre_num_ranks, ctx.post_num_ranks) == (want["pre"], want["post"])
        assert ctx.num_seqs == len(want["ids"]) and ctx.rank == rank and ctx.world_size == world_size
        cp.check_local_length(ctx, ctx.num_tokens)
        covered += ctx.num_tokens
    assert covered == cu[-1].item()


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("B,T", [(4, 8), (2, 16), (1, 32), (8, 4)])
def test_partition_fixed_length(world_size, B, T):
    check_partition(torch.arange(0, B * T + 1, T, dtype=torch.int32), world_size)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("lengths", [
    [5, 0, 55, 1, 89, 0, 42],   # T = 192: crosses one boundary, then two (at world_size 4), empty sequences
    [0, 192, 0],                 # one sequence over every rank, empty ones at both ends
    [48, 0, 48, 48, 0, 48],      # boundaries exactly on the shares' edges
    [1] * 64 + [128],            # many sequences shorter than a share
], ids=["cross-1-and-2", "one-long", "aligned", "short"])
def test_partition_varlen(world_size, lengths):
    check_partition(cu_of(lengths), world_size)
    check_partition(cu_of(lengths, torch.int64), world_size)


def test_partition_random(seed):
    for _ in range(20):
        world_size = int(torch.randint(1, 6, ()).item())
        total = world_size * int(torch.randint(1, 40, ()).item())
        cuts = torch.randint(0, total + 1, (int(torch.randint(0, 8, ()).item()),)).sort().values.tolist()
        cu = torch.tensor([0] + cuts + [total], dtype=torch.int64)
        check_partition(cu, world_size)


def test_partition_names_fla_reads():
    ctx = cp.build_context(cu_of([10, 30]), rank=1, world_size=2)
    assert ctx.cu_seqlens.tolist() == [0, 20] and ctx.first_seq_id == ctx.last_seq_id == 1
    assert not ctx.is_first_rank and ctx.is_last_rank and ctx.pre_num_ranks == 1 and ctx.post_num_ranks == 0
    assert not ctx.is_cp_enabled
    with pytest.raises(Exception):
        ctx.rank = 0  # frozen


class FakeGroup:
    """What build_context reads of a ProcessGroup."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_group_gives_rank_and_world_size():
    group = FakeGroup(2, 4)
    ctx = cp.build_context(cu_of([64]), group)
    assert (ctx.rank, ctx.world_size, ctx.group, ctx.is_cp_enabled) == (2, 4, group, True)
    assert cp.build_context(cu_of([64]), group, rank=2, world_size=4).token_start == 32


@pytest.mark.parametrize("make,match", [
    (lambda: cp.build_context([0, 4], rank=0, world_size=1),
     r"cu_seqlens_global: expected a 1-D integer tensor, got list"),
    (lambda: cp.build_context(torch.zeros(2, 2, dtype=torch.int32), rank=0, world_size=1),
     r"cu_seqlens_global: expected a 1-D integer tensor, got 2-D of shape \(2, 2\)"),
    (lambda: cp.build_context(torch.tensor([0.0, 4.0]), rank=0, world_size=1),
     r"cu_seqlens_global: expected dtype int32 or int64, got torch.float32"),
    (lambda: cp.build_context(torch.tensor([0], dtype=torch.int32), rank=0, world_size=1),
     r"cu_seqlens_global: expected at least 2 entries \(0 and the total\), got 1"),
    (lambda: cp.build_context(torch.tensor([2, 8], dtype=torch.int32), rank=0, world_size=1),
     r"cu_seqlens_global: expected to start at 0, got 2"),
    (lambda: cp.build_context(torch.tensor([0, 6, 4, 8], dtype=torch.int32), rank=0, world_size=1),
     r"cu_seqlens_global: expected non-decreasing entries, got 6 then 4 at index 1"),
    (lambda: cp.build_context(cu_of([4, 6]), rank=0, world_size=3),
     r"cu_seqlens_global: expected a total token count \(its last entry\) that is a positive multiple of "
     r"world_size=3, got 10"),
    (lambda: cp.build_context(cu_of([0]), rank=0, world_size=1),
     r"cu_seqlens_global: expected .* positive multiple of world_size=1, got 0"),
    (lambda: cp.build_context(cu_of([8]), rank=4, world_size=4),
     r"rank: expected 0 <= rank < world_size=4, got 4"),
    (lambda: cp.build_context(cu_of([8]), rank=-1, world_size=4), r"rank: expected an int >= 0, got -1"),
    (lambda: cp.build_context(cu_of([8]), rank=0, world_size=0), r"world_size: expected an int >= 1, got 0"),
    (lambda: cp.build_context(cu_of([8]), rank=0, world_size=2.0), r"world_size: expected an int >= 1, got 2.0"),
    (lambda: cp.build_context(cu_of([8]), rank=0), r"group: without a process group pass both rank and "
                                                   r"world_size, got rank=0, world_size=None"),
    (lambda: cp.build_context(cu_of([8]), FakeGroup(1, 2), rank=0),
     r"rank: 0 disagrees with the group's rank 1"),
    (lambda: cp.build_context(cu_of([8]), FakeGroup(1, 2), world_size=4),
     r"world_size: 4 disagrees with the group's size 2"),
], ids=["list", "2d", "float", "short", "start", "decreasing", "indivisible", "empty", "rank-high", "rank-neg",
        "world-zero", "world-float", "no-group", "group-rank", "group-size"])
def test_build_context_errors(make, match):
    with pytest.raises(kdakit.InvalidArgumentError, match=match):
        make()


def test_check_local_length_errors():
    ctx = cp.build_context(cu_of([10, 30]), rank=1, world_size=2)
    cp.check_local_length(ctx, torch.empty(1, 20, 2, 4))
    with pytest.raises(kdakit.InvalidArgumentError,
                       match=r"q: rank 1 of 2 holds 20 tokens of the global 40 \(cu_seqlens_global\), "
                             r"got a local q of 19 tokens"):
        cp.check_local_length(ctx, torch.empty(1, 19, 2, 4))
    with pytest.raises(kdakit.InvalidArgumentError, match=r"q: .* expected a packed local q of shape \[1, T, \.\.\.\], "
                                                          r"got \(2, 10, 2, 4\)"):
        cp.check_local_length(ctx, torch.empty(2, 10, 2, 4))


def test_fold_errors():
    S, M = torch.zeros(2, 4, 3), torch.eye(4).expand(2, 4, 4)
    with pytest.raises(kdakit.InvalidArgumentError, match=r"states: rank 2's first sequence spans rank 0, which sent "
                                                          r"no contribution"):
        cp.merge_forward_states([None, S, None], [None, M, None], [0, 0, 2])
    with pytest.raises(kdakit.InvalidArgumentError, match=r"pre_num_ranks: expected 0\.\.1 for rank 1, got 2"):
        cp.fold_incoming_state([S, S], [M, M], 1, 2)
    with pytest.raises(kdakit.InvalidArgumentError, match=r"transitions: rank 0's transition must be \[HV, K, K\]"):
        cp.fold_incoming_state([S, S], [torch.zeros(2, 3, 3), M], 1, 1)
    with pytest.raises(kdakit.InvalidArgumentError, match=r"states: expected one entry per rank .* got 2, 2 and 1"):
        cp.merge_forward_states([S, S], [M, M], [0])


# ---- the algebra ----

def inputs(T, H, HV, K, V, *, use_gate=False, l2=False, slow=False):
    """FLA's input recipe (spec §6.1) in float32, packed (B = 1). slow: a pre-gated weak decay (about -0.003 a token),
    so that a long piece's transition M is far from zero and folds across several ranks carry weight."""
    q, k = torch.rand(1, T, H, K), torch.rand(1, T, H, K)
    if not l2:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = torch.rand(1, T, HV, V)
    opts = {}
    if use_gate:
        g = torch.randn(1, T, HV, K)
        opts = dict(use_gate_in_kernel=True, A_log=torch.log(torch.empty(HV).uniform_(1, 16)),
                    dt_bias=torch.randn(HV * K))
    else:
        g = F.logsigmoid(torch.randn(1, T, HV, K) + (6.0 if slow else 0.0))
    beta = torch.sigmoid(torch.randn(1, T, HV))
    return (q, k, v, g, beta), opts


@pytest.mark.parametrize("continues", [(False, False, False, False), (False, True, True, False),
                                       (False, True, False, False), (False, False, True, False)])
def test_fold_outgoing_gradient_is_the_chain_rule(seed, continues):
    """The gradient of the later ranks' losses with respect to rank 0's outgoing state, by autograd through the forward
    fold S_in(j + 1) = M_j S_in(j) + S_ext_j (rank j's loss read as <E_j, S_in(j)>, which is what E_j is), equals
    fold_outgoing_gradient over the ranks the sequence spans (continues[j]: rank j's one piece goes on; the context's
    post_num_ranks counts them); a span past the group is refused, naming post_num_ranks."""
    gen = torch.Generator().manual_seed(seed)
    P, HV, K, V = 4, 2, 5, 3
    E = [torch.randn(HV, K, V, generator=gen, dtype=torch.float64) for _ in range(P)]
    M = [torch.randn(HV, K, K, generator=gen, dtype=torch.float64) for _ in range(P)]
    S_ext = [torch.randn(HV, K, V, generator=gen, dtype=torch.float64) for _ in range(P)]
    out = torch.zeros(HV, K, V, dtype=torch.float64, requires_grad=True)  # the state rank 0 passes on
    S, loss, j = out, 0.0, 1
    while True:
        loss = loss + (E[j] * S).sum()
        if j + 1 >= P or not continues[j]:
            break
        S = torch.matmul(M[j], S) + S_ext[j]
        j += 1
    (want,) = torch.autograd.grad(loss, out)
    got = cp_exchange.fold_outgoing_gradient(E, M, 0, j)  # the sequence ends on rank j
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    for rank, post in ((3, 1), (1, 3), (0, 0)):
        with pytest.raises(kdakit.InvalidArgumentError, match="post_num_ranks"):
            cp_exchange.fold_outgoing_gradient(E, M, rank, post)


@pytest.mark.parametrize("use_gate", [False, True])
def test_transition_is_exact(seed, use_gate):
    """The piece maps S_in to M S_in + S_ext: the float64 reference from a random start state against the fold."""
    T, H, HV, K, V = 37, 1, 2, 8, 5
    (q, k, v, g, beta), opts = inputs(T, H, HV, K, V, use_gate=use_gate)
    S_in = torch.randn(1, HV, K, V, dtype=torch.float64)
    _, want = kdakit.naive_recurrent_kda(q, k, v, g, beta, initial_state=S_in, output_final_state=True, **opts)
    _, S_ext = kdakit.naive_recurrent_kda(q, k, v, g, beta, output_final_state=True, **opts)
    M = cp.segment_transition(k, g, beta, **opts)
    assert M.shape == (HV, K, K) and M.dtype == torch.float64
    got = cp.fold_incoming_state([S_in[0], S_ext[0], None], [torch.eye(K).expand(HV, K, K), M, None], 2, 2)
    assert_close("S_out", want[0], got, 1e-12)


CASES = {
    # name: (global lengths or None for fixed length [B, T], B, T)
    "varlen-cross-1-and-2": ([5, 0, 55, 1, 89, 0, 42], 1, 192),
    "varlen-one-long": ([0, 192, 0], 1, 192),
    "varlen-short": ([3] * 16 + [0, 144], 1, 192),
    "fixed": (None, 2, 96),
}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("gate", ["pre-gated", "in-kernel", "slow"])
def test_simulated_forward_matches_one_device(seed, world_size, case, gate):
    lengths, B, T = CASES[case]
    H, HV, K, V = 2, 4, 16, 8  # GVA: HV = 2H
    (q, k, v, g, beta), opts = inputs(B * T, H, HV, K, V, use_gate=gate == "in-kernel", slow=gate == "slow")
    cu = None if lengths is None else cu_of(lengths)
    if lengths is None:
        q, k, v, g, beta = (t.reshape((B, T) + tuple(t.shape[2:])) for t in (q, k, v, g, beta))
    opts["chunk_size"] = 32
    ref_o, ref_ht = kdakit.chunk_kda(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu, **opts)
    o, ht = cp._simulated_forward(q, k, v, g, beta, cu, world_size, **opts)
    assert o.shape == ref_o.shape and ht.shape == ref_ht.shape
    assert_close("o", ref_o, o, TOL)
    assert_close("final_state", ref_ht, ht, TOL)


def test_simulated_forward_options(seed):
    """q/k normalised in kernel, beta as a logit, the lower-bound gate, a scale: the options reach every piece."""
    (q, k, v, g, beta), opts = inputs(128, 1, 2, 32, 16, use_gate=True, l2=True)
    cu = cu_of([7, 70, 51])
    opts.update(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-3.0, scale=0.3)
    beta = torch.randn(1, 128, 2)
    ref_o, ref_ht = kdakit.chunk_kda(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu, **opts)
    for world_size in (2, 4):
        o, ht = cp._simulated_forward(q, k, v, g, beta, cu, world_size, **opts)
        assert_close("o", ref_o, o, TOL)
        assert_close("final_state", ref_ht, ht, TOL)


def test_simulated_forward_safe_gate(seed):
    """A pre-gated g with safe_gate and its bound (the bound changes nothing in the transition)."""
    (q, k, v, g, beta), opts = inputs(96, 2, 2, 16, 16)
    g = g.clamp(-5, 0)
    cu = cu_of([40, 0, 56])
    opts.update(safe_gate=True, lower_bound=-5.0)
    ref_o, ref_ht = kdakit.chunk_kda(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu, **opts)
    o, ht = cp._simulated_forward(q, k, v, g, beta, cu, 4, **opts)
    assert_close("o", ref_o, o, TOL)
    assert_close("final_state", ref_ht, ht, TOL)


def test_simulated_forward_rejects_what_cp_has_not():
    x = torch.rand(1, 8, 1, 4)
    with pytest.raises(kdakit.InvalidArgumentError, match="initial_state: not taken"):
        cp._simulated_forward(x, x, x, -x, torch.rand(1, 8, 1), cu_of([8]), 2, initial_state=torch.zeros(1, 1, 4, 4))


def test_split_backward_halves_are_cuda_only():
    """The split backward's halves (kdakit::BackwardParams::cp_phase) refuse CPU tensors, naming cp_phase (checked
    before any work); their other rules are tests/cpp/cuda/test_backward_plan.cpp's and, on a GPU,
    tests/python/cuda/test_cp_split_backward.py's."""
    from kdakit import _C
    from kdakit.ops import SplitBackward

    x = torch.rand(1, 64, 1, 16)
    beta = torch.rand(1, 64, 1)
    with pytest.raises(kdakit.InvalidArgumentError, match="cp_phase.*CUDA tensors only"):
        SplitBackward(x, x, x, -x, beta, None, None, None, x, None, True, 0.25, 0, -5.0, False, False, False, False, 64)
    p = _C.BackwardParams()
    _C.set_inputs(p.inputs, x, x, x, -x, beta, None, None, None, None, 0.25, 0, -5.0, False, False, False)
    p.d_out = _C.view(x)
    p.cp_phase = _C.CpPhase.FINISH
    with pytest.raises(kdakit.InvalidArgumentError, match="cp_phase"):
        _C.validate_backward(p)


def test_split_forward_halves_check_their_arguments():
    """The split forward's halves (kdakit::CpPhase) are CUDA-only and take no stray outputs: each refusal names the
    argument (checked before any device work, so on the CPU too)."""
    from kdakit import _C
    from kdakit.ops import SplitForward

    x = torch.rand(1, 64, 1, 16)
    beta = torch.rand(1, 64, 1)
    with pytest.raises(kdakit.InvalidArgumentError, match="cp_phase.*CUDA tensors only"):
        SplitForward(x, x, x, -x, beta, None, None, 0.25, 0, -5.0, False, False, False, False, 64)
    p = _C.ForwardParams()
    _C.set_inputs(p.inputs, x, x, x, -x, beta, None, None, None, None, 0.25, 0, -5.0, False, False, False)
    out = torch.empty(1, 64, 1, 16)
    p.out = _C.view(out)
    p.cp_summary = _C.view(torch.empty(1, 16, 32))
    with pytest.raises(kdakit.InvalidArgumentError, match="cp_summary"):
        _C.validate_forward(p)  # a summary buffer without cp_phase kSummary
    p.cp_summary = _C.view(None)
    p.cp_phase = _C.CpPhase.FINISH
    with pytest.raises(kdakit.InvalidArgumentError, match="cp_phase"):
        _C.validate_forward(p)  # CPU tensors
