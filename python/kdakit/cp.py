"""Context parallelism (spec §7, §7.6), the CPU side: the rank context, the token partition, its validation, and
the exact cross-rank merge of the forward state.

Each of `world_size` ranks holds an equal contiguous share of the packed global token stream; sequences crossing a
share's edge are cut (spec §7.1). A cut piece maps the state it receives affinely, `S_out = M S_in + S_ext`
(spec §7.2); the forward exchange (spec §7.3) gathers every rank's `(S_ext, M)` for its last local sequence and each
rank folds those of the ranks its first sequence spans into that sequence's initial state.

`chunk_kda(..., cp_context=ctx)` runs it over the context's torch.distributed group (`forward`): each rank computes
its last local piece's `(S_ext, M)` with kdakit's own forward (no autograd), one all-gather exchanges them, each rank
folds its incoming state and runs its local batch from it. Ranks holding one sequence piece on CUDA take the split
forward (`_split_forward`: `(S_ext, M)` from the forward's own segment scan, the local tokens read once); the other
ranks' transition costs one more forward over the last local piece, with K value columns. The backward exchanges
state gradients instead (spec §7.4, `LocalRun`): each rank's first piece's initial-state gradient from its own
loss, one all-gather, and each rank folds the gradient of its last piece's final state and runs one backward of its
local batch with it (`cp_exchange.py`). A training rank holding one piece on CUDA runs its local batch as the split forward's second
half, so its forward reads the tokens once there too.
`_simulated_forward` plays a whole group on one device, a list standing for the all-gather.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

from . import _C
from .cp_exchange import LocalRun, LocalRunFunction

InvalidArgumentError = _C.InvalidArgumentError


@dataclass(frozen=True)
class CPContext:
    """One rank's view of the partition. `cu_seqlens`, `cu_seqlens_cpu`, `group`, `is_first_rank`, `is_last_rank`,
    `pre_num_ranks` and `post_num_ranks` mean what they mean in FLA's context, so code written for FLA reads them."""

    rank: int
    world_size: int
    group: Any
    cu_seqlens: torch.Tensor      # local boundaries, int32, on cu_seqlens_global's device; empty sequences dropped
    cu_seqlens_cpu: torch.Tensor  # the same on the CPU
    token_start: int              # this rank's global tokens are [token_start, token_end)
    token_end: int
    seq_ids: Tuple[int, ...]      # the global sequence id of each local sequence
    first_continues_from_previous: bool  # the first local sequence began on an earlier rank
    last_continues_into_next: bool       # the last local sequence goes on onto a later rank
    pre_num_ranks: int            # earlier ranks the first local sequence spans
    post_num_ranks: int           # later ranks the last local sequence spans

    @property
    def first_seq_id(self) -> int:
        return self.seq_ids[0]

    @property
    def last_seq_id(self) -> int:
        return self.seq_ids[-1]

    @property
    def is_first_rank(self) -> bool:
        """FLA's name: this rank starts the chain of its first sequence (it receives no state)."""
        return not self.first_continues_from_previous

    @property
    def is_last_rank(self) -> bool:
        """FLA's name: this rank ends the chain of its last sequence (it sends no state)."""
        return not self.last_continues_into_next

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def is_cp_enabled(self) -> bool:
        return self.group is not None


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name}: expected an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise InvalidArgumentError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def _group_rank_and_size(group, rank, world_size) -> Tuple[int, int]:
    """rank and world_size from a ProcessGroup (its `rank()` and `size()`), checked against explicit ones."""
    if group is None:
        if rank is None or world_size is None:
            raise InvalidArgumentError(
                "group: without a process group pass both rank and world_size, got "
                f"rank={rank!r}, world_size={world_size!r}")
        return rank, world_size
    group_rank, group_size = int(group.rank()), int(group.size())
    if world_size is not None and world_size != group_size:
        raise InvalidArgumentError(f"world_size: {world_size!r} disagrees with the group's size {group_size}")
    if rank is not None and rank != group_rank:
        raise InvalidArgumentError(f"rank: {rank!r} disagrees with the group's rank {group_rank}")
    return group_rank, group_size


def _global_boundaries(cu_seqlens_global) -> torch.Tensor:
    """cu_seqlens_global checked and read to the CPU as int64."""
    name = "cu_seqlens_global"
    if not isinstance(cu_seqlens_global, torch.Tensor):
        raise InvalidArgumentError(f"{name}: expected a 1-D integer tensor, got {type(cu_seqlens_global).__name__}")
    if cu_seqlens_global.dim() != 1:
        raise InvalidArgumentError(
            f"{name}: expected a 1-D integer tensor, got {cu_seqlens_global.dim()}-D of shape "
            f"{tuple(cu_seqlens_global.shape)}")
    if cu_seqlens_global.dtype not in (torch.int32, torch.int64):
        raise InvalidArgumentError(f"{name}: expected dtype int32 or int64, got {cu_seqlens_global.dtype}")
    if cu_seqlens_global.numel() < 2:
        raise InvalidArgumentError(
            f"{name}: expected at least 2 entries (0 and the total), got {cu_seqlens_global.numel()}")
    cu = cu_seqlens_global.detach().to("cpu", torch.int64)
    if cu[0].item() != 0:
        raise InvalidArgumentError(f"{name}: expected to start at 0, got {cu[0].item()}")
    steps = cu[1:] - cu[:-1]
    if (steps < 0).any():
        i = int(torch.nonzero(steps < 0)[0].item())
        raise InvalidArgumentError(
            f"{name}: expected non-decreasing entries, got {cu[i].item()} then {cu[i + 1].item()} at index {i}")
    return cu


def _is_process_group(group) -> bool:
    """A torch.distributed group of an initialised default group (stand-ins that only answer rank() and size() are
    not checked across ranks)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and isinstance(group, dist.ProcessGroup)


def _check_same_on_every_rank(cu: torch.Tensor, group) -> None:
    """Raise on every rank unless all ranks of `group` passed the same boundaries (one small all-gather)."""
    import torch.distributed as dist

    n = cu.numel()
    weights = torch.arange(1, n + 1, dtype=torch.int64)
    mine = torch.stack([torch.tensor(n), cu.sum(), (cu * weights).sum(), (cu * weights * weights).sum()])
    if dist.get_backend(group) == "nccl":
        mine = mine.to(torch.device("cuda", torch.cuda.current_device()))
    seen = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(seen, mine, group=group)
    differ = [r for r, t in enumerate(seen) if not torch.equal(t, seen[0])]
    if differ:
        raise InvalidArgumentError(
            f"cu_seqlens_global: every rank must pass the same boundaries; rank {differ[0]}'s differ from rank 0's "
            f"(entries, sum: {seen[differ[0]][0].item()}, {seen[differ[0]][1].item()} against "
            f"{seen[0][0].item()}, {seen[0][1].item()})")


def build_context(cu_seqlens_global: torch.Tensor, group=None, *, rank: Optional[int] = None,
                  world_size: Optional[int] = None) -> CPContext:
    """This rank's context for the packed batch `cu_seqlens_global` (B = 1), FLA's `build_cp_context` partition.

    With `group` (a torch.distributed ProcessGroup) rank and world_size come from it; explicit ones must agree, and
    every rank must pass the same `cu_seqlens_global` (checked by a collective: every rank of the group calls it).
    """
    rank, world_size = _group_rank_and_size(group, rank, world_size)
    world_size = _check_int("world_size", world_size, 1)
    rank = _check_int("rank", rank, 0)
    if rank >= world_size:
        raise InvalidArgumentError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
    cu = _global_boundaries(cu_seqlens_global)
    if group is not None and _is_process_group(group):
        _check_same_on_every_rank(cu, group)
    total = int(cu[-1].item())
    if total == 0 or total % world_size != 0:
        raise InvalidArgumentError(
            f"cu_seqlens_global: expected a total token count (its last entry) that is a positive multiple of "
            f"world_size={world_size}, got {total}")
    share = total // world_size
    start, end = rank * share, (rank + 1) * share

    seq_starts, seq_ends = cu[:-1], cu[1:]
    # Sequences with at least one token in [start, end); an empty sequence holds none, so none is local anywhere.
    overlap = (seq_starts < end) & (seq_ends > start) & (seq_ends > seq_starts)
    ids = torch.nonzero(overlap).flatten()
    lengths = seq_ends[ids].clamp(max=end) - seq_starts[ids].clamp(min=start)
    local_cpu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
    first, last = int(ids[0].item()), int(ids[-1].item())
    first_start, last_end = int(cu[first].item()), int(cu[last + 1].item())
    pre = rank - first_start // share
    post = (last_end - 1) // share - rank
    return CPContext(
        rank=rank, world_size=world_size, group=group,
        cu_seqlens=local_cpu.to(cu_seqlens_global.device), cu_seqlens_cpu=local_cpu,
        token_start=start, token_end=end, seq_ids=tuple(int(i) for i in ids.tolist()),
        first_continues_from_previous=first_start < start, last_continues_into_next=last_end > end,
        pre_num_ranks=pre, post_num_ranks=post)


def check_local_length(ctx: CPContext, T_local) -> None:
    """Raise unless the local q (a tensor [1, T, ...]) or token count T_local is this rank's share."""
    if isinstance(T_local, torch.Tensor):
        if T_local.dim() < 2 or T_local.shape[0] != 1:
            raise InvalidArgumentError(
                f"q: under context parallelism expected a packed local q of shape [1, T, ...], got "
                f"{tuple(T_local.shape)}")
        T_local = int(T_local.shape[1])
    if T_local != ctx.num_tokens:
        raise InvalidArgumentError(
            f"q: rank {ctx.rank} of {ctx.world_size} holds {ctx.num_tokens} tokens of the global "
            f"{ctx.num_tokens * ctx.world_size} (cu_seqlens_global), got a local q of {T_local} tokens")


# ---- the transition of a piece and the forward merge (spec §7.2, §7.3) ----

_TRANSITION_OPTIONS = ("A_log", "dt_bias", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                       "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "lower_bound")


def segment_transition(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, **opts) -> torch.Tensor:
    """The transition M ([HV, K, K], float64, CPU) that one sequence piece applies to its incoming [K, V] state.

    k [1, T, H, K], g [1, T, HV, K], beta [1, T, HV], with chunk_kda's gate, beta and normalisation options. Each
    token maps S to (I - beta k k^T) Diag(exp g) S + beta k v^T (spec §1.4); with v = 0 the piece maps S to M S,
    so running the float64 reference from S = I (a [K, K] state, V = K) yields M itself.
    """
    from .reference import naive_recurrent_kda

    unknown = set(opts) - set(_TRANSITION_OPTIONS)
    if unknown:
        raise TypeError(f"segment_transition() got unexpected keyword arguments: {sorted(unknown)}")
    if opts.get("lower_bound") is not None and not opts.get("use_gate_in_kernel", False):
        opts = dict(opts, lower_bound=None)  # a pre-gated g's bound states a fact; it changes nothing
    HV, K = g.shape[2], k.shape[3]
    v0 = torch.zeros(k.shape[:2] + (HV, K), dtype=torch.float64)
    identity = torch.eye(K, dtype=torch.float64).expand(1, HV, K, K).contiguous()
    _, M = naive_recurrent_kda(k, k, v0, g, beta, initial_state=identity, output_final_state=True, **opts)
    return M[0]


def fold_incoming_state(states: Sequence[Optional[torch.Tensor]], transitions: Sequence[Optional[torch.Tensor]],
                        rank: int, pre_num_ranks: int) -> Optional[torch.Tensor]:
    """The initial state of rank `rank`'s first local sequence, from the gathered contributions (spec §7.3).

    states[j] ([HV, K, V]) and transitions[j] ([HV, K, K]) are rank j's last local sequence's end state from a zero
    start and its transition, None where rank j sends nothing. The sequence began on rank `rank - pre_num_ranks`
    from a zero state; S <- M_j S + S_ext_j over the ranks it spans. Computed in float64 if any input is, else
    float32, on the inputs' device. None when pre_num_ranks is 0 (the sequence starts here).
    """
    if pre_num_ranks < 0 or pre_num_ranks > rank:
        raise InvalidArgumentError(f"pre_num_ranks: expected 0..{rank} for rank {rank}, got {pre_num_ranks}")
    if pre_num_ranks == 0:
        return None
    spanned = range(rank - pre_num_ranks, rank)
    for j in spanned:
        if states[j] is None or transitions[j] is None:
            raise InvalidArgumentError(
                f"states: rank {rank}'s first sequence spans rank {j}, which sent no contribution")
    dtype = torch.float64 if any(states[j].dtype == torch.float64 or transitions[j].dtype == torch.float64
                                 for j in spanned) else torch.float32
    S = None
    for j in spanned:
        S_ext, M = states[j].to(dtype), transitions[j].to(dtype)
        if M.dim() != 3 or S_ext.dim() != 3 or M.shape != (S_ext.shape[0], S_ext.shape[1], S_ext.shape[1]):
            raise InvalidArgumentError(
                f"transitions: rank {j}'s transition must be [HV, K, K] beside its state [HV, K, V] "
                f"{tuple(S_ext.shape)}, got {tuple(M.shape)}")
        S = S_ext if S is None else torch.matmul(M, S) + S_ext
    return S


def merge_forward_states(states: Sequence[Optional[torch.Tensor]], transitions: Sequence[Optional[torch.Tensor]],
                         pre_num_ranks: Sequence[int]) -> List[Optional[torch.Tensor]]:
    """Every rank's incoming state (`fold_incoming_state` for each rank), given the whole gathered list."""
    if not (len(states) == len(transitions) == len(pre_num_ranks)):
        raise InvalidArgumentError(
            f"states: expected one entry per rank in states, transitions and pre_num_ranks, got "
            f"{len(states)}, {len(transitions)} and {len(pre_num_ranks)}")
    return [fold_incoming_state(states, transitions, r, p) for r, p in enumerate(pre_num_ranks)]


# ---- the run over a process group ----

_PIECE_OPTIONS = _TRANSITION_OPTIONS + ("safe_gate", "scale", "chunk_size", "disable_recompute")


def _context_view(ctx) -> Tuple[int, int, bool, bool, int, int]:
    """(rank, world_size, first continues, last continues, pre_num_ranks, post_num_ranks) of kdakit's context or
    FLA's."""
    group = getattr(ctx, "group", None)
    if group is None:
        raise InvalidArgumentError("cp_context: its group must be set (a torch.distributed process group)")
    names = ("cu_seqlens", "is_first_rank", "is_last_rank", "pre_num_ranks", "post_num_ranks")
    missing = [n for n in names if getattr(ctx, n, None) is None]
    if missing:
        raise InvalidArgumentError(f"cp_context: expected kdakit's or FLA's context, it has no {', '.join(missing)}")
    import torch.distributed as dist

    return (dist.get_rank(group), dist.get_world_size(group), not bool(ctx.is_first_rank),
            not bool(ctx.is_last_rank), int(ctx.pre_num_ranks), int(ctx.post_num_ranks))


def _check_group_device(group, q) -> None:
    """An NCCL group exchanges CUDA tensors: CPU inputs under one would fail inside the collective."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and not q.is_cuda:
        raise InvalidArgumentError(
            f"cp_context: its group runs {backend}, which exchanges CUDA tensors; q is on {q.device}")


def forward(q, k, v, g, beta, ctx, **opts):
    """chunk_kda over the context's group: this rank's output for its local packed batch (q [1, T_local, H, K]).

    opts: chunk_kda's gate, beta, normalisation, scale and chunk options. Collective: every rank of the group calls
    it, with the same options.
    """
    import torch.distributed as dist
    from .chunk import chunk_kda

    bad = sorted(set(opts) - set(_PIECE_OPTIONS))
    if bad:
        raise InvalidArgumentError(f"{bad[0]}: not taken with cp_context (context parallelism)")
    rank, world_size, from_previous, into_next, pre, post = _context_view(ctx)
    _check_group_device(ctx.group, q)
    if isinstance(ctx, CPContext):
        check_local_length(ctx, q)
    elif q.dim() < 2 or q.shape[0] != 1:
        raise InvalidArgumentError(
            f"q: under context parallelism expected a packed local q of shape [1, T, ...], got {tuple(q.shape)}")
    cu = ctx.cu_seqlens
    cu_cpu = getattr(ctx, "cu_seqlens_cpu", None)
    cu_cpu = cu.detach().to("cpu") if cu_cpu is None else cu_cpu
    HV, K, V = v.shape[2], k.shape[3], v.shape[3]
    transition_opts = {n: opts[n] for n in _TRANSITION_OPTIONS + ("safe_gate", "chunk_size") if n in opts}

    tracked = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, g, beta, opts.get("A_log"), opts.get("dt_bias")))
    one_piece = cu_cpu.numel() == 2 and int(cu_cpu[0]) == 0 and int(cu_cpu[1]) == q.shape[1]
    split = SPLIT_FORWARD and q.is_cuda and one_piece
    if split and not tracked:
        return _split_forward(q, k, v, g, beta, ctx, rank, world_size, from_previous, into_next, pre, opts)

    # This rank's contribution, [S_ext | M] ([HV, K, V + K]): its last local piece's end state from a zero state and
    # the piece's transition M. No gradient flows through it (the backward exchanges state gradients instead).
    half = None
    with torch.no_grad():
        if not into_next:
            mine = torch.zeros((HV, K, V + K), dtype=torch.float32, device=q.device)
        elif split:  # the split forward's first half; a training rank runs its second half below
            half = _split_half(q, k, v, g, beta, opts)
            mine = half.summary
        else:  # the piece from zero, then the same forward with v = 0 and K value columns from the identity
            lo = int(cu_cpu[-2].item())
            piece = [t[:, lo:] for t in (q, k, v, g, beta)]
            _, S_ext = chunk_kda(*piece, output_final_state=True, **opts)
            eye = torch.eye(K, dtype=torch.float32, device=q.device).expand(1, HV, K, K).contiguous()
            zeros_v = torch.zeros(piece[1].shape[:2] + (HV, K), dtype=v.dtype, device=v.device)
            _, M = chunk_kda(piece[1], piece[1], zeros_v, piece[3], piece[4], initial_state=eye,
                             output_final_state=True, **transition_opts)
            mine = torch.cat([S_ext[0], M[0]], dim=-1)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine.contiguous(), group=ctx.group)
    transitions = [t[..., V:] for t in gathered]
    S_in = fold_incoming_state([t[..., :V] for t in gathered], transitions, rank, pre) if from_previous else None

    N = cu_cpu.numel() - 1
    h0 = None
    if S_in is not None:
        rest = torch.zeros((N - 1, HV, K, V), dtype=torch.float32, device=q.device)
        h0 = torch.cat([S_in[None].to(torch.float32), rest], dim=0)
    if not tracked:
        o, _ = chunk_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, **opts)
        return o
    from ._torch import dense, host_cu_seqlens, num_chunks, unit_last_stride
    from .chunk import kernel_options

    chunk_size = opts.get("chunk_size", 64)
    scale, gate, lb = kernel_options(q, opts.get("scale"), bool(opts.get("use_gate_in_kernel", False)),
                                     opts.get("lower_bound"), bool(opts.get("safe_gate", False)), chunk_size)
    save = bool(opts.get("disable_recompute", False)) and half is None
    run = LocalRun(
        group=ctx.group, rank=rank, world_size=world_size, from_previous=from_previous, into_next=into_next,
        post_num_ranks=post, first_is_last=N == 1, first_len=int(cu_cpu[1]), cu=cu, cu_cpu=cu_cpu, h0=h0, half=half,
        kernel_opts=(scale, gate, lb, bool(opts.get("use_qk_l2norm_in_kernel", False)),
                     bool(opts.get("use_beta_sigmoid_in_kernel", False)), bool(opts.get("allow_neg_eigval", False)),
                     bool(opts.get("safe_gate", False)), chunk_size),
        chunks=num_chunks(q.shape[1], 1, host_cu_seqlens(cu, cu_cpu), chunk_size) if save else -1,
        transitions=transitions)
    q, k, v, g = unit_last_stride(q, k, v, g)
    A_log, dt_bias = dense(opts.get("A_log"), opts.get("dt_bias"))
    return LocalRunFunction.apply(run, q, k, v, g, beta, A_log, dt_bias)


# Runs of one local sequence on CUDA take the split forward (kdakit::CpPhase: the contribution from the forward's own
# segment scan, the outputs after the exchange, one pass over the inputs): forward-only ones both halves, training
# ones the first half and, where the piece goes on, the second under the exchange's autograd; False: the general
# path (tests compare the two).
SPLIT_FORWARD = True


def _split_forward(q, k, v, g, beta, ctx, rank, world_size, from_previous, into_next, pre, opts):
    """cp.forward for a rank whose local batch is one sequence, forward-only, on CUDA: the first half of the forward
    (its segment scan gives [S_ext | M]), the all-gather, the fold, then the second half from the incoming state."""
    import torch.distributed as dist

    HV, K, V = v.shape[2], k.shape[3], v.shape[3]
    half = _split_half(q, k, v, g, beta, opts)
    mine = half.summary if into_next else torch.zeros((HV, K, V + K), dtype=torch.float32, device=q.device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=ctx.group)
    S_in = None
    if from_previous:
        S_in = fold_incoming_state([t[..., :V] for t in gathered], [t[..., V:] for t in gathered], rank, pre)
    h0 = S_in[None].to(torch.float32).contiguous() if S_in is not None else None
    return half.finish(h0)


def _split_half(q, k, v, g, beta, opts):
    """kdakit.ops.SplitForward over one local sequence with chunk_kda's options (its first half run)."""
    from ._torch import dense, unit_last_stride
    from .chunk import kernel_options
    from .ops import SplitForward

    scale, gate, lb = kernel_options(q, opts.get("scale"), bool(opts.get("use_gate_in_kernel", False)),
                                     opts.get("lower_bound"), bool(opts.get("safe_gate", False)),
                                     opts.get("chunk_size", 64))
    q, k, v, g = unit_last_stride(q, k, v, g)
    A_log, dt_bias = dense(opts.get("A_log"), opts.get("dt_bias"))
    return SplitForward(q, k, v, g, beta, A_log, dt_bias, scale, gate, lb,
                        bool(opts.get("use_qk_l2norm_in_kernel", False)),
                        bool(opts.get("use_beta_sigmoid_in_kernel", False)), bool(opts.get("allow_neg_eigval", False)),
                        bool(opts.get("safe_gate", False)), opts.get("chunk_size", 64))


# ---- a whole group played on one device ----

_NOT_UNDER_CP = ("initial_state", "output_final_state", "cu_seqlens", "cu_seqlens_cpu", "cp_context",
                 "state_v_first", "transpose_state_layout", "return_intermediate_states")


def _simulated_forward(q, k, v, g, beta, cu_seqlens_global, world_size: int, **opts):
    """chunk_kda over a context-parallel group of `world_size` ranks, played rank by rank on one device.

    q, k [1, T, H, K], v [1, T, HV, V], g, beta as chunk_kda takes them, packed by `cu_seqlens_global`; or, with
    `cu_seqlens_global=None`, a fixed-length batch [B, T, ...] (packed here as B sequences of T). opts: chunk_kda's
    gate, beta, scale and chunk options. Returns `(o, final_state)` shaped as chunk_kda's on the whole batch.
    """
    from .chunk import chunk_kda

    bad = sorted(set(opts) & set(_NOT_UNDER_CP))
    if bad:
        raise InvalidArgumentError(f"{bad[0]}: not taken by the simulated context-parallel forward")
    B, T = q.shape[:2]
    fixed = cu_seqlens_global is None
    if fixed:
        q, k, v, g, beta = (t.reshape((1, B * T) + tuple(t.shape[2:])) for t in (q, k, v, g, beta))
        cu_seqlens_global = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=q.device)
    elif B != 1:
        raise InvalidArgumentError(f"q: with cu_seqlens_global expected a packed batch of B = 1, got B = {B}")
    contexts = [build_context(cu_seqlens_global, rank=r, world_size=world_size) for r in range(world_size)]
    HV, K, V = v.shape[2], k.shape[3], v.shape[3]
    transition_opts = {name: opts[name] for name in _TRANSITION_OPTIONS if name in opts}

    def local(t, ctx, lo=0, hi=None):
        hi = ctx.num_tokens if hi is None else hi
        return t[:, ctx.token_start + lo: ctx.token_start + hi]

    # Each rank's contribution: its last local sequence's piece, from a zero state, and that piece's transition.
    states: List[Optional[torch.Tensor]] = []
    transitions: List[Optional[torch.Tensor]] = []
    for ctx in contexts:
        check_local_length(ctx, local(q, ctx))
        if not ctx.last_continues_into_next:
            states.append(None)
            transitions.append(None)
            continue
        lo = int(ctx.cu_seqlens_cpu[-2].item())
        piece = [local(t, ctx, lo) for t in (q, k, v, g, beta)]
        _, S_ext = chunk_kda(*piece, output_final_state=True, **opts)
        states.append(S_ext[0])
        transitions.append(segment_transition(piece[1], piece[3], piece[4], **transition_opts).to(S_ext.device))

    incoming = merge_forward_states(states, transitions, [ctx.pre_num_ranks for ctx in contexts])

    # Each rank's run from its incoming state; a sequence's final state is that of the rank holding its last token.
    outputs = []
    N = len(cu_seqlens_global) - 1
    final = torch.zeros((N, HV, K, V), dtype=torch.float32, device=q.device)
    for ctx, S_in in zip(contexts, incoming):
        h0 = torch.zeros((ctx.num_seqs, HV, K, V), dtype=torch.float32, device=q.device)
        if S_in is not None:
            h0[0] = S_in.to(torch.float32)
        o, ht = chunk_kda(*(local(t, ctx) for t in (q, k, v, g, beta)), initial_state=h0, output_final_state=True,
                          cu_seqlens=ctx.cu_seqlens, **opts)
        outputs.append(o)
        ends_here = ctx.seq_ids[:-1] if ctx.last_continues_into_next else ctx.seq_ids
        for i, sid in enumerate(ends_here):
            final[sid] = ht[i]
    o = torch.cat(outputs, dim=1)
    if fixed:
        o = o.reshape((B, T) + tuple(o.shape[2:]))
    return o, final
