"""vLLM's KDA ops with vLLM's exact signatures and defaults, computed by kdakit.

Follows the ops vLLM vendors from FLA, `vllm/third_party/flash_linear_attention/ops/kda.py` at 933876c3 (earlier
`vllm/model_executor/layers/fla/ops/kda.py`, 00bb9c07), as the model layers call them:
`vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py` (0195c9ec), `.../gdn/kda_linear_attn.py` (eda8c32a)
and the older `vllm/model_executor/layers/kda.py` (01a7e5d9). Padding follows the decode kernel in
`vllm/third_party/flash_linear_attention/ops/fused_recurrent.py` (5c7cb312) and the full-cudagraph metadata of
`vllm/v1/attention/backends/gdn_attn.py` (5bf4f1c5).

What differs from FLA's (and kdakit's) defaults, and is fixed here:

- Every state is v-first, `[..., V, K]`, and vLLM passes no layout flag (`state_v_first=True` always).
- `fused_recurrent_kda` updates the state pool in place by default (`inplace_final_state=True`) and normalises q and
  k by default (`use_qk_l2norm_in_kernel=True`).
- Padding (CUDA-graph batches): a slot id of `NULL_BLOCK_ID` (0) or a negative one (the older `PAD_SLOT_ID = -1`)
  reads and writes no state and its outputs are zeros; `ssm_state_indices` may have more rows than sequences, and
  tokens past `cu_seqlens[-1]` are padding.
- The older layer slices q/k/v to the real tokens but passes g and beta unsliced; vLLM's kernels read only the first
  T tokens of them, and so does this adapter (`g[:, :T]`, `beta[:, :T]`).

To use it, import `chunk_kda`, `chunk_kda_with_fused_gate` and `fused_recurrent_kda` from this module instead of
from vLLM's vendored `ops.kda`; the call sites stay as they are.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..chunk import chunk_kda as _chunk_kda
from ..fused_recurrent import fused_recurrent_kda_fwd as _recurrent_fwd
from ._common import InvalidArgumentError, float_state, leading_tokens, num_sequences, reject_kwargs

# vLLM's block id for "no block" (vllm.v1.attention.backends.utils.NULL_BLOCK_ID). vLLM's block pools never hand
# out block 0, so treating slot 0 as padding is also right for the versions that padded with PAD_SLOT_ID = -1.
NULL_BLOCK_ID = 0

__all__ = ["chunk_kda", "chunk_kda_with_fused_gate", "fused_recurrent_kda", "NULL_BLOCK_ID"]


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    **kwargs,
):
    """vLLM's prefill with a pre-gated g (fp32 log-decay from `fused_kda_gate`) and an activated beta.

    `initial_state` is the gathered `[N,H,V,K]` (v-first) copy of the sequences' pool rows; returns
    `(o, final_state)` with the fp32 v-first final state (None unless `output_final_state`), which vLLM scatters
    back into its pool.
    """
    reject_kwargs("chunk_kda", kwargs)
    T = q.shape[1]
    return _chunk_kda(q, k, v, leading_tokens(g, T, "g"), leading_tokens(beta, T, "beta"), scale=scale,
                      initial_state=float_state(initial_state), output_final_state=output_final_state,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=True, cu_seqlens=cu_seqlens)


def chunk_kda_with_fused_gate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor,
    g_bias: Optional[torch.Tensor],
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    safe_gate: bool = False,
    lower_bound: Optional[float] = None,
    **kwargs,
):
    """vLLM's prefill from the raw gate projection: the gate (`g_bias` is FLA's `dt_bias`, `[H*K]`; `A_log` any
    shape of H elements, e.g. `[1,1,H,1]`) is computed in kernel; beta is activated.

    Gate: `-exp(A_log) * softplus(raw_g + g_bias)` (softplus beta 1, threshold 20); the bounded
    `lower_bound * sigmoid(exp(A_log) * (raw_g + g_bias))` when `safe_gate=True` (vLLM's default bound -5) or when a
    `lower_bound` is passed (vLLM's K3 layers pass `lower_bound=gate_lower_bound` without `safe_gate`).
    Returns `(o, final_state)` as `chunk_kda`.
    """
    reject_kwargs("chunk_kda_with_fused_gate", kwargs)
    if A_log is None:
        raise InvalidArgumentError("A_log: chunk_kda_with_fused_gate needs A_log (H elements), got None")
    bounded = safe_gate or lower_bound is not None
    bound = (-5.0 if lower_bound is None else float(lower_bound)) if bounded else None
    T = q.shape[1]
    return _chunk_kda(q, k, v, leading_tokens(raw_g, T, "raw_g"), leading_tokens(beta, T, "beta"), scale=scale,
                      initial_state=float_state(initial_state), output_final_state=output_final_state,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=True, safe_gate=safe_gate,
                      lower_bound=bound, state_v_first=True, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=g_bias)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor = None,
    scale: float = None,
    initial_state: torch.Tensor = None,
    inplace_final_state: bool = True,
    use_qk_l2norm_in_kernel: bool = True,
    cu_seqlens: Optional[torch.Tensor] = None,
    ssm_state_indices: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    sigmoid_beta: bool = False,
    a_log: Optional[torch.Tensor] = None,
    g_bias: Optional[torch.Tensor] = None,
    compute_gate: bool = False,
    lower_bound: Optional[float] = -5.0,
    **kwargs,
):
    """vLLM's decode and speculative verify against its v-first state pool `initial_state` `[P,H,V,K]`.

    - `ssm_state_indices` `[N]`: read slot `idx[n]`, write the final state back (in place, the default).
      `[N,S]` with `num_accepted_tokens`: read slot `idx[n, a_n - 1]`, write the state after token t to `idx[n, t]`.
    - Slot `NULL_BLOCK_ID` (0) or negative: padding (no state read or written, zero outputs).
    - `inplace_final_state=False`: the pool is left untouched and the second return value is the state after every
      token, `[T_total,HV,V,K]` in the pool's dtype (vLLM's layout, one row per token).
    - `compute_gate=True`: g is the raw gate and the bounded gate `lower_bound * sigmoid(exp(a_log) * (g + g_bias))`
      is computed in kernel (vLLM implements only that branch here); otherwise g is the fp32 log-decay and `a_log`,
      `g_bias` must be None (`lower_bound` is then unused, as in vLLM). `sigmoid_beta=True`: beta is a logit.

    Returns `(o, pool)` in place, `(o, per-token states)` otherwise.
    """
    reject_kwargs("fused_recurrent_kda", kwargs)
    if beta is None:
        raise InvalidArgumentError("beta: vLLM's KDA decode needs beta ([B,T,HV] or [B,T,HV,V]), got None")
    if compute_gate:
        if a_log is None or g_bias is None:
            raise InvalidArgumentError("a_log/g_bias: compute_gate=True needs both (vLLM's bounded gate)")
        if lower_bound is None:
            raise InvalidArgumentError("lower_bound: compute_gate=True implements the bounded gate; got None")
    elif a_log is not None or g_bias is not None:
        raise InvalidArgumentError("a_log/g_bias: given with compute_gate=False, where g is already the log-decay")
    T = q.shape[1]
    g = leading_tokens(g, T, "g")
    beta = leading_tokens(beta, T, "beta")
    gate = dict(use_gate_in_kernel=True, A_log=a_log, dt_bias=g_bias, lower_bound=float(lower_bound)) \
        if compute_gate else {}
    common = dict(scale=scale, state_v_first=True, cu_seqlens=cu_seqlens, num_accepted_tokens=num_accepted_tokens,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=sigmoid_beta, out=out,
                  pad_slot_id=NULL_BLOCK_ID, **gate)
    if inplace_final_state:
        return _recurrent_fwd(q, k, v, g, beta, initial_state=initial_state, inplace_final_state=True,
                              ssm_state_indices=ssm_state_indices, **common)
    if ssm_state_indices is not None:
        o, token_states = _recurrent_fwd(q, k, v, g, beta, initial_state=float_state(initial_state),
                                         inplace_final_state=False, ssm_state_indices=ssm_state_indices, **common)
    else:
        # Without slots vLLM's kernel reads state row `bos` and writes row `bos + t`: the per-token states equal the
        # final states only when every sequence has one token.
        N = num_sequences(q, cu_seqlens)
        if N != q.shape[0] * T:
            raise InvalidArgumentError(
                f"ssm_state_indices: inplace_final_state=False without slot indices serves one token per sequence "
                f"(vLLM reads state row bos); got {N} sequences for {q.shape[0] * T} tokens")
        o, token_states = _recurrent_fwd(q, k, v, g, beta, initial_state=float_state(initial_state),
                                         inplace_final_state=False, output_final_state=True, **common)
    if initial_state is not None and token_states.dtype != initial_state.dtype:
        token_states = token_states.to(initial_state.dtype)
    return o, token_states
