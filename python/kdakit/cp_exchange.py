"""Context-parallel training (spec §7.4, §7.6 step 4): a rank's local run under autograd and its backward exchange of
state gradients. `kdakit.cp.forward` builds the run; this module holds what its backward does: the gradient of each
rank's first piece's initial state from its own loss, one all-gather, the fold of the later ranks' gradients through
their transitions (`fold_outgoing_gradient`), then one backward of the local batch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from . import _C

InvalidArgumentError = _C.InvalidArgumentError


def fold_outgoing_gradient(grads: Sequence[torch.Tensor], transitions: Sequence[Optional[torch.Tensor]], rank: int,
                           post_num_ranks: int) -> torch.Tensor:
    """The gradient of the later ranks' losses with respect to the state that rank `rank`'s last local sequence passes
    on (spec §7.4). The sequence ends on rank e = rank + post_num_ranks and each rank between holds one piece of it:
    dS = E_e, then dS <- E_j + M_j^T dS from e - 1 down to rank + 1. grads[j] ([HV, K, V]) is E_j, the gradient of
    rank j's own loss with respect to its first piece's initial state; transitions[j] ([HV, K, K]) the M_j of rank j's
    last piece (its one piece, for j < e). No host synchronisation: post_num_ranks comes from the context."""
    if not 1 <= post_num_ranks < len(grads) - rank:
        raise InvalidArgumentError(
            f"post_num_ranks: expected 1..{len(grads) - 1 - rank} for rank {rank} of {len(grads)}, got {post_num_ranks}")
    last = rank + post_num_ranks
    dS = grads[last]
    for j in range(last - 1, rank, -1):
        M = transitions[j].to(dS.dtype)
        dS = grads[j] + torch.matmul(M.transpose(-1, -2), dS)
    return dS


@dataclass
class LocalRun:
    """One training rank's local batch from its incoming state (cp.forward builds it), and its backward exchange."""
    group: Any
    rank: int
    world_size: int
    from_previous: bool   # the first local sequence began on an earlier rank
    into_next: bool       # the last local sequence goes on onto a later rank
    post_num_ranks: int   # later ranks that sequence spans (FLA's name)
    first_is_last: bool   # the local batch is one sequence piece
    first_len: int        # tokens of the first local sequence
    cu: Any               # the local cu_seqlens and their host copy
    cu_cpu: Any
    h0: Optional[torch.Tensor]  # [N, HV, K, V] float32 (the first sequence's incoming state), or None
    half: Any             # the split forward whose first half ran (one piece on CUDA going on), or None
    kernel_opts: tuple    # scale, gate mode, lower bound, L2 norm, beta sigmoid, negative eigenvalues, safe, chunk
    chunks: int           # chunks of the local batch where its chunk states are saved (disable_recompute), else -1
    transitions: list     # every rank's M (gathered in the forward)

    def forward(self, q, k, v, g, beta, A_log, dt_bias):
        """The local output, and the float32 chunk states where they are saved (else None)."""
        if self.half is not None:
            o = self.half.finish(self.h0)
            self.half = None  # its workspace (the prepare's tiles) is not kept until the backward
            return o, None
        o, _, h = torch.ops.kdakit.chunk_fwd(q, k, v, g, beta, A_log, dt_bias, self.h0, self.cu, self.cu_cpu,
                                             *self.kernel_opts, False, False, self.chunks, self.chunks >= 0)
        return o, (h if self.chunks >= 0 else None)

    def backward(self, d_out, q, k, v, g, beta, A_log, dt_bias, h):
        """The exchange (collective) and the local batch's gradients (kdakit::chunk_bwd's tuple). A local batch of one
        sequence on CUDA takes the split backward (ops.SplitBackward): its first half is the backward's own work up
        to the reverse scan, and gives E on the way, so no rank computes anything twice and the ranks reach the
        all-gather together. Otherwise E comes from the first piece's initial-state-only backward
        (kdakit::BackwardParams::d_initial_state_only, which the state's value does not enter), then one backward."""
        d_out = d_out.contiguous()
        if d_out.is_cuda and self.first_is_last:
            from .ops import SplitBackward

            split = SplitBackward(q, k, v, g, beta, A_log, dt_bias, self.h0, d_out, h, self.from_previous,
                                  *self.kernel_opts)
            return split.finish(self._exchange(split.d_initial[0] if self.from_previous else None, v, k))
        E = None
        if self.from_previous:
            n = self.first_len
            E = torch.ops.kdakit.chunk_bwd_initial_state(
                q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], A_log, dt_bias, None, None,
                d_out[:, :n].contiguous(), None, *self.kernel_opts, False)[0]
        return torch.ops.kdakit.chunk_bwd(q, k, v, g, beta, A_log, dt_bias, self.h0, self.cu, self.cu_cpu, d_out,
                                          self._exchange(E, v, k), h, *self.kernel_opts, False)

    def _exchange(self, E: Optional[torch.Tensor], v, k) -> Optional[torch.Tensor]:
        """E ([HV, K, V] float32, this rank's gradient of its own loss with respect to its first piece's initial state;
        None: zero), gathered from every rank; then the gradient of the last local sequence's final state from the
        later ranks ([N, HV, K, V] float32, zero but for the last sequence), or None where it ends here."""
        import torch.distributed as dist

        HV, K, V = v.shape[2], k.shape[3], v.shape[3]
        if E is None:
            E = torch.zeros((HV, K, V), dtype=torch.float32, device=v.device)
        mine = E.contiguous()
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine, group=self.group)
        if not self.into_next:
            return None
        N = self.cu_cpu.numel() - 1
        d_final = torch.zeros((N, HV, K, V), dtype=torch.float32, device=v.device)
        d_final[-1] = fold_outgoing_gradient(gathered, self.transitions, self.rank, self.post_num_ranks)
        return d_final


class LocalRunFunction(torch.autograd.Function):
    """The local output (LocalRun.forward); its backward (LocalRun.backward) runs the exchange of spec §7.4 and the
    local batch's backward with the last sequence's final-state gradient from the later ranks."""

    @staticmethod
    def forward(ctx, run, q, k, v, g, beta, A_log, dt_bias):
        o, h = run.forward(q, k, v, g, beta, A_log, dt_bias)
        ctx.run = run
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, h)
        return o

    @staticmethod
    def backward(ctx, d_out):
        from ._torch import PRE_GATED

        q, k, v, g, beta, A_log, dt_bias, h = ctx.saved_tensors
        run = ctx.run
        dq, dk, dv, dg, db, dA, dbias, _ = run.backward(d_out, q, k, v, g, beta, A_log, dt_bias, h)
        in_kernel = run.kernel_opts[1] != PRE_GATED
        return (None, dq, dk, dv, dg, db, dA if (A_log is not None and in_kernel) else None,
                dbias if (dt_bias is not None and in_kernel) else None)
