"""SGLang's KDA kernels with SGLang's exact signatures and defaults, computed by kdakit.

Follows `python/sglang/kernels/ops/attention/fla/kda.py` (`chunk_kda`, 2cd7fddd; earlier
`python/sglang/srt/layers/attention/fla/kda.py`) and
`python/sglang/kernels/ops/attention/fla/fused_sigmoid_gating_recurrent.py` (7e1816db) as
`python/sglang/srt/layers/attention/linear/kernels/kda_triton.py` (007d1d93; older 70310f05) calls them from
`.../linear/kda_backend.py` (5c39fd02): extend through `chunk_kda`, decode and target verify through
`fused_sigmoid_gating_delta_rule_update(is_kda=True)`.

SGLang's conventions, fixed here:

- The state pool `[P,HV,V,K]` is v-first and is read and written in place through slot indices; a negative slot
  (`-1`, CUDA-graph padding) reads and writes nothing. kdakit's padded sequences output zeros (SGLang computes
  them from a zero state; engines discard those rows).
- `chunk_kda` returns `o` only (and `(o, h)` with `output_intermediate_states`, `h` `[B,NT,HV,V,K]` in k's dtype).
  It takes the raw gate when `A_log` is given (softplus gate, or the bounded gate with `lower_bound`) and a pre-gated
  g otherwise; `beta_is_raw=True` applies the sigmoid in kernel.
- Decode takes raw `a` (`[T,HV*K]`, `[B,T,HV*K]` or `[B,T,HV,K]`) and `b` (`[T,HV]` or `[B,T,HV]`):
  `g = -exp(A_log) * softplus(a + dt_bias)`, `beta = sigmoid(b)`; kdakit's softplus is SGLang's with beta 1 and
  threshold 20, the only values SGLang passes.

To use it, import `chunk_kda` and `fused_sigmoid_gating_delta_rule_update` from this module instead of from
`sglang.kernels.ops.attention.fla.kda` / `.fused_sigmoid_gating_recurrent`.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..chunk import chunk_kda as _chunk_kda
from ..fused_recurrent import fused_recurrent_kda_fwd as _recurrent_fwd
from ._common import InvalidArgumentError, float_state, num_sequences, reject_kwargs

__all__ = ["chunk_kda", "fused_sigmoid_gating_delta_rule_update"]


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float = None,
    initial_state: torch.Tensor = None,
    initial_state_indices: torch.Tensor = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    lower_bound: Optional[float] = None,
    output_intermediate_states: bool = False,
    beta_is_raw: bool = False,
    **kwargs,
):
    """SGLang's extend: prefill against the pool `initial_state` `[P,HV,V,K]`, sequence n reading and updating slot
    `initial_state_indices[n]` in place. Returns `o`, or `(o, h)` with `output_intermediate_states` (h: the state
    at the start of every chunk, `[1,NT,HV,V,K]` for varlen)."""
    if "track_state" in kwargs or "track_chunk_idx" in kwargs:
        raise NotImplementedError(
            "track_state/track_chunk_idx: fp32 snapshots at one chunk boundary per sequence are not served by "
            "kdakit's chunk_kda; use output_intermediate_states (chunk-start states in k's dtype)")
    reject_kwargs("chunk_kda", kwargs)
    if A_log is None and (dt_bias is not None or lower_bound is not None):
        raise InvalidArgumentError(
            "dt_bias/lower_bound: given without A_log, where SGLang's chunk_kda takes g as the activated log-decay "
            "and ignores them")
    if initial_state is not None and initial_state_indices is None:
        raise InvalidArgumentError(
            "initial_state_indices: required with initial_state (SGLang's chunk_kda updates the pool in place "
            "through it)")
    gate = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound) \
        if A_log is not None else {}
    state = dict(initial_state=initial_state, ssm_state_indices=initial_state_indices) \
        if initial_state is not None else {}
    call = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=beta_is_raw,
                state_v_first=True, cu_seqlens=cu_seqlens, **gate, **state)
    if not output_intermediate_states:
        return _chunk_kda(q, k, v, g, beta, **call)[0]
    o, _, h = _chunk_kda(q, k, v, g, beta, return_intermediate_states=True, **call)
    return o, h


def _kda_gate_input(a: torch.Tensor, B: int, T: int, HV: int, K: int) -> torch.Tensor:
    """SGLang's `a` ([T,HV*K], [B,T,HV*K] or [B,T,HV,K], any token stride) as a [B,T,HV,K] view."""
    if a.dim() == 4:
        x = a
    elif a.dim() in (2, 3) and a.shape[-1] == HV * K:
        x = a.unflatten(-1, (HV, K))
        if a.dim() == 2:
            x = x.unflatten(0, (B, T)) if a.shape[0] == B * T else x
    else:
        x = a
    if tuple(x.shape) != (B, T, HV, K):
        raise InvalidArgumentError(
            f"a: expected [T,HV*K], [B,T,HV*K] or [B,T,HV,K] with B={B}, T={T}, HV={HV}, K={K}; "
            f"got shape {tuple(a.shape)}")
    return x


def _beta_input(b: torch.Tensor, B: int, T: int, HV: int) -> torch.Tensor:
    """SGLang's `b` ([T,HV] or [B,T,HV]) as [B,T,HV]."""
    x = b.unflatten(0, (B, T)) if b.dim() == 2 and b.shape[0] == B * T else b
    if tuple(x.shape) != (B, T, HV):
        raise InvalidArgumentError(f"b: expected [T,HV] or [B,T,HV] with B={B}, T={T}, HV={HV}; "
                                   f"got shape {tuple(b.shape)}")
    return x


def fused_sigmoid_gating_delta_rule_update(
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    softplus_beta: float,
    softplus_threshold: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    initial_state_source: torch.Tensor,
    initial_state_indices: torch.Tensor,
    scale: Optional[float] = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    is_kda: bool = False,
    disable_state_update: bool = False,
    intermediate_states_buffer: Optional[torch.Tensor] = None,
    intermediate_state_indices: Optional[torch.Tensor] = None,
    cache_steps: Optional[int] = None,
    retrieve_parent_token: Optional[torch.Tensor] = None,
):
    """SGLang's decode (and chain target verify) with the gate and the beta sigmoid computed in kernel.

    Sequence n reads pool slot `initial_state_indices[n]` (`initial_state_source` `[P,HV,V,K]`, v-first) and, unless
    `disable_state_update`, writes its final state back. Target verify (`disable_state_update=True`) writes the state
    after token t of sequence n to `intermediate_states_buffer[intermediate_state_indices[n], t]` (buffer
    `[slots, steps, HV, V, K]`; negative indices skip). Returns `o` `[B,T,HV,V]`.
    """
    if not is_kda:
        raise NotImplementedError("is_kda=False (the scalar-gate gated delta rule) is not served by kdakit")
    if softplus_beta != 1.0 or softplus_threshold != 20.0:
        raise InvalidArgumentError(
            f"softplus_beta/softplus_threshold: kdakit's gate uses softplus with beta 1 and threshold 20; got "
            f"{softplus_beta} and {softplus_threshold}")
    if retrieve_parent_token is not None:
        raise NotImplementedError("retrieve_parent_token: tree (EAGLE) verify is not served by kdakit; chain verify is")
    if intermediate_states_buffer is not None and not disable_state_update:
        raise NotImplementedError(
            "intermediate_states_buffer: served with disable_state_update=True (target verify) only")
    if intermediate_states_buffer is not None and intermediate_state_indices is None:
        raise InvalidArgumentError("intermediate_state_indices: required with intermediate_states_buffer")
    if scale is not None and not scale > 0:
        raise InvalidArgumentError(f"scale: must be positive, got {scale}")
    B, T, _, K = k.shape
    HV = v.shape[2]
    g = _kda_gate_input(a, B, T, HV, K)
    beta = _beta_input(b, B, T, HV)
    common = dict(scale=scale, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True)
    if initial_state_source is None:
        o, _ = _recurrent_fwd(q, k, v, g, beta, A_log, dt_bias, inplace_final_state=False, **common)
        return o
    if not disable_state_update:
        o, _ = _recurrent_fwd(q, k, v, g, beta, A_log, dt_bias, initial_state_source, inplace_final_state=True,
                              ssm_state_indices=initial_state_indices, **common)
        return o
    o, token_states = _recurrent_fwd(q, k, v, g, beta, A_log, dt_bias, float_state(initial_state_source),
                                     inplace_final_state=False, ssm_state_indices=initial_state_indices, **common)
    if intermediate_states_buffer is not None:
        _store_token_states(intermediate_states_buffer, intermediate_state_indices, token_states, q, cu_seqlens, T)
    return o


def _store_token_states(buffer: torch.Tensor, slots: torch.Tensor, token_states: torch.Tensor, q: torch.Tensor,
                        cu_seqlens: Optional[torch.Tensor], T: int) -> None:
    """Copies the state after token t of sequence n (row bos+t of `token_states`) to `buffer[slots[n], t]`, for
    t below the buffer's step count and non-negative slots. Data movement only (a masked row copy)."""
    steps = buffer.shape[1]
    rows = token_states.shape[0]
    tok = torch.arange(rows, device=token_states.device)
    if cu_seqlens is None:
        seq, step = tok // T, tok % T
        N = q.shape[0]
    else:
        cu = cu_seqlens.to(device=token_states.device, dtype=torch.long)
        N = num_sequences(q, cu_seqlens)
        seq = torch.searchsorted(cu[1:], tok, right=True)
        step = tok - cu[seq.clamp(max=N - 1)]
    valid = seq < N
    slot = slots.to(device=token_states.device, dtype=torch.long)[seq.clamp(max=N - 1)]
    valid &= (slot >= 0) & (step < steps)
    flat = buffer.view(-1, *buffer.shape[2:])
    dest = slot * steps + step
    flat[dest[valid]] = token_states[valid].to(buffer.dtype)
