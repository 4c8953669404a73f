"""Token-recurrent KDA for decode and speculative verify: `fused_recurrent_kda` (spec §5.3) and the serving entry
`fused_recurrent_kda_fwd` (spec §5.4), with FLA's signatures. Forward only."""
from __future__ import annotations

from typing import Optional

import torch

from . import _C
from ._torch import dense, gate_mode, num_sequences, state_shape, tracked, unit_last_stride
from .chunk import pad_slot_id_of, resolve_state_layout
from .ops import forward_only, recurrent_into

InvalidArgumentError = _C.InvalidArgumentError

_SERVING_KWARGS = {"transpose_state_layout", "ssm_state_indices", "num_accepted_tokens", "inplace_final_state", "out",
                   "has_initial_state", "pad_slot_id"}


def _recurrent(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, inplace_final_state,
               state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens, has_initial_state, pad_slot_id,
               use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
               out, caller):
    pad_slot_id = pad_slot_id_of(pad_slot_id)
    q, k, v, g = unit_last_stride(q, k, v, g)
    if beta.dim() == 4:
        beta, = unit_last_stride(beta)
    A_log, dt_bias = dense(A_log, dt_bias)
    # Forward only: inputs may require grad (a model in eval mode), a gradient through the outputs raises.
    grad_inputs = tracked(q, k, v, g, beta, A_log, dt_bias, initial_state)
    if inplace_final_state and initial_state is None:
        raise InvalidArgumentError("initial_state: inplace_final_state=True needs the state (pool) to update")
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = float(K ** -0.5 if scale is None else scale)
    gate = gate_mode(use_gate_in_kernel, lower_bound)
    lb = float(lower_bound) if (lower_bound is not None and use_gate_in_kernel) else -5.0
    if lower_bound is not None and not use_gate_in_kernel:
        raise InvalidArgumentError(f"lower_bound: {lower_bound} has no effect unless use_gate_in_kernel=True")
    if initial_state is not None and not inplace_final_state and initial_state.dtype == torch.float16:
        initial_state = initial_state.float()  # FLA loads any float state as float32
    if out is None:
        out = q.new_empty((B, T, HV, V))
    final_state = None
    token_states = None
    if inplace_final_state:
        final_state = initial_state
    elif ssm_state_indices is not None:
        # Not in place with slot indices: the state after every token, row bos+t (FLA's layout for one token per
        # sequence, where it is [N,HV,K,V]).
        token_states = q.new_empty(state_shape(B * T, HV, K, V, state_v_first), dtype=torch.float32)
    elif output_final_state:
        final_state = q.new_empty(state_shape(num_sequences(q, cu_seqlens), HV, K, V, state_v_first),
                                  dtype=torch.float32)
    args = (q, k, v, g, beta, A_log, dt_bias, None if inplace_final_state else initial_state, out, final_state,
            token_states, cu_seqlens, ssm_state_indices, num_accepted_tokens, has_initial_state, pad_slot_id,
            bool(inplace_final_state), scale, gate, lb, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
            allow_neg_eigval, state_v_first)
    if grad_inputs:
        with torch.no_grad():
            recurrent_into(*args)
    else:
        recurrent_into(*args)
    second = token_states if token_states is not None else \
        (final_state if (output_final_state or inplace_final_state) else None)
    if not grad_inputs:
        return out, second
    return forward_only(f"{caller}: has no backward (it is forward-only, for inference); use chunk_kda to train",
                        grad_inputs, out, second)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: Optional[float] = None,
    state_v_first: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    **kwargs,
):
    """Token-recurrent KDA forward (no autograd), FLA-compatible.

    Unlike FLA, the serving keywords are honoured, not swallowed: ``ssm_state_indices`` ([N] or [N,T_max]),
    ``num_accepted_tokens`` ([N]), ``inplace_final_state`` (default False here), ``has_initial_state`` ([N]),
    ``pad_slot_id`` and ``out``; see `fused_recurrent_kda_fwd`. ``beta`` may be per value column, [B,T,HV,V].
    Returns ``(o, final_state)``. Inputs may require grad (a model in eval mode); a gradient requested through the
    outputs raises.
    """
    state_v_first = resolve_state_layout(state_v_first, kwargs)
    unknown = set(kwargs) - _SERVING_KWARGS
    if unknown:
        raise TypeError(f"fused_recurrent_kda() got unexpected keyword arguments: {sorted(unknown)}")
    return _recurrent(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                      kwargs.get("inplace_final_state", False), state_v_first, cu_seqlens,
                      kwargs.get("ssm_state_indices"), kwargs.get("num_accepted_tokens"),
                      kwargs.get("has_initial_state"), kwargs.get("pad_slot_id", -1), use_qk_l2norm_in_kernel,
                      use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
                      kwargs.get("out"), "fused_recurrent_kda")


def fused_recurrent_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    output_final_state: bool = False,
    inplace_final_state: bool = True,
    state_v_first: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    ssm_state_indices: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    pad_slot_id: int = -1,
):
    """The serving entry (decode and speculative verify), FLA's signature (spec §5.4).

    - ``initial_state`` is a state pool ``[slots,HV,K,V]`` (``[slots,HV,V,K]`` with ``state_v_first``) in float32
      or bfloat16 when ``ssm_state_indices`` is given, else ``[N,HV,K,V]``.
    - ``ssm_state_indices`` [N]: read slot ``idx[n]`` and, in place, write the final state back to it.
      [N,T_max]: read slot ``idx[n, a_n-1]`` (``a_n = num_accepted_tokens[n]``, or 1) and, in place, write the
      state after every token t to slot ``idx[n, t]``. Rows past N are ignored.
    - Padding (CUDA-graph batches): a slot id that is negative or equal to ``pad_slot_id`` (default -1; vLLM's 0)
      is padding. A sequence whose (read) slot is padding reads and writes no state and its output rows are zeros;
      a per-token write slot that is padding is skipped. With ``cu_seqlens`` the tokens past ``cu_seqlens[-1]`` are
      padding too (zero output rows).
    - ``inplace_final_state=False`` leaves the pool untouched (speculative verify): with slot indices the second
      return value is then the state after every token, ``[T_total,HV,K,V]`` float32, to commit later (zeros for
      the tokens of padding).
    - ``has_initial_state`` [N] bool: False starts that sequence from the zero state.
    - ``out``: caller-provided output ``[B,T,HV,V]``.

    Forward only: inputs may require grad, and a gradient requested through the outputs raises.
    """
    return _recurrent(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, inplace_final_state,
                      state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens, has_initial_state, pad_slot_id,
                      use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                      lower_bound, out, "fused_recurrent_kda_fwd")
