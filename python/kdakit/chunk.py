"""`chunk_kda`: FLA's chunked KDA with FLA's exact signature (spec §5.1), plus kdakit's serving arguments."""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from . import _C
from ._torch import (dense, gate_mode, host_cu_seqlens, num_chunks, num_sequences, state_shape, tracked,
                     unit_last_stride)
from .ops import chunk_forward, chunk_forward_into, forward_only

InvalidArgumentError = _C.InvalidArgumentError

_KNOWN_KWARGS = {"A_log", "dt_bias", "chunk_size", "transpose_state_layout", "ssm_state_indices",
                 "has_initial_state", "inplace_final_state", "out", "pad_slot_id"}


def pad_slot_id_of(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"pad_slot_id: expected an int (-1 or a slot id >= 0), got {value!r}")
    return value


def resolve_state_layout(state_v_first: bool, kwargs: dict) -> bool:
    """FLA's deprecated alias `transpose_state_layout` (spec §1.6)."""
    if "transpose_state_layout" in kwargs:
        alias = kwargs.pop("transpose_state_layout")
        if state_v_first:
            raise ValueError("pass either `state_v_first` or the deprecated `transpose_state_layout`, not both")
        warnings.warn("`transpose_state_layout` is deprecated; use `state_v_first`", DeprecationWarning, stacklevel=3)
        return bool(alias)
    return state_v_first


def kernel_options(q, scale, use_gate_in_kernel: bool, lower_bound, safe_gate: bool, chunk_size):
    """chunk_kda's checks of the gate and chunk options; the kernels' scale, gate mode and lower bound."""
    if lower_bound is not None and not use_gate_in_kernel and not safe_gate:
        raise InvalidArgumentError(
            f"lower_bound: {lower_bound} has no effect on a pre-gated g (use_gate_in_kernel=False); pass it with "
            "use_gate_in_kernel=True, or with safe_gate=True to state the bound of g")
    if lower_bound is not None and not use_gate_in_kernel and not (-5.0 <= lower_bound < 0.0):
        raise InvalidArgumentError(f"lower_bound: safe_gate=True needs lower_bound in [-5, 0), got {lower_bound}")
    if not isinstance(chunk_size, int):
        raise InvalidArgumentError(f"chunk_size: `chunk_size` must be either 32 or 64, got {chunk_size!r}")
    K = q.shape[-1]
    scale = float(K ** -0.5 if scale is None else scale)
    gate = gate_mode(use_gate_in_kernel, lower_bound)
    lb = float(lower_bound) if (lower_bound is not None and use_gate_in_kernel) else -5.0
    return scale, gate, lb


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: Optional[float] = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    cp_context=None,
    **kwargs,
):
    """Chunked KDA forward (with autograd), FLA-compatible.

    Args are FLA's (spec §5.1); keyword-only extras: ``A_log``, ``dt_bias``, ``chunk_size`` (32 or 64) and
    ``transpose_state_layout`` (deprecated alias of ``state_v_first``), and kdakit's serving arguments:

    - ``ssm_state_indices`` ([N] int, or more rows: those past N are ignored): ``initial_state`` is a state pool;
      sequence n starts from slot ``ssm_state_indices[n]`` and its final state is written back to that slot in
      place. ``inplace_final_state`` must be True (the default) in this mode.
    - ``pad_slot_id`` (int, default -1): a slot id that is padding, besides any negative one (vLLM's 0). A padded
      sequence reads and writes no state and its output rows are zeros.
    - ``has_initial_state`` ([N] bool): False starts that sequence from zero.
    - ``out``: a caller-provided output buffer [B,T,HV,V].

    With ``cu_seqlens`` the tokens past ``cu_seqlens[-1]`` are padding: their output rows are zeros.

    The serving arguments and ``return_intermediate_states`` make the call forward-only: it runs when inputs require
    grad, and a gradient requested through its outputs raises.

    Returns ``(o, final_state)``, or ``(o, final_state, h)`` with ``return_intermediate_states``; ``h`` holds the
    state at the start of every chunk, ``[B,NT,HV,K,V]`` (varlen ``[1,NT_total,...]``) in k's dtype.
    """
    state_v_first = resolve_state_layout(state_v_first, kwargs)
    unknown = set(kwargs) - _KNOWN_KWARGS
    if unknown:
        raise TypeError(f"chunk_kda() got unexpected keyword arguments: {sorted(unknown)}")
    A_log = kwargs.pop("A_log", None)
    dt_bias = kwargs.pop("dt_bias", None)
    chunk_size = kwargs.pop("chunk_size", 64)
    ssm_state_indices = kwargs.pop("ssm_state_indices", None)
    has_initial_state = kwargs.pop("has_initial_state", None)
    inplace_final_state = kwargs.pop("inplace_final_state", None)
    out = kwargs.pop("out", None)
    pad_slot_id = pad_slot_id_of(kwargs.pop("pad_slot_id", -1))

    if cp_context is not None:
        if initial_state is not None:
            raise InvalidArgumentError("initial_state: must be None with cp_context (context parallelism)")
        if output_final_state:
            raise InvalidArgumentError("output_final_state: must be False with cp_context (context parallelism)")
        if getattr(cp_context, "cu_seqlens", None) is None:
            raise InvalidArgumentError("cp_context: its cu_seqlens must be set")
        if cu_seqlens is not None or cu_seqlens_cpu is not None:
            raise InvalidArgumentError("cu_seqlens: must be None with cp_context (the context holds the local ones)")
        if return_intermediate_states:
            raise InvalidArgumentError("return_intermediate_states: not taken with cp_context (context parallelism)")
        serving = [n for n, t in (("ssm_state_indices", ssm_state_indices), ("has_initial_state", has_initial_state),
                                  ("out", out)) if t is not None]
        if serving:
            raise InvalidArgumentError(f"{serving[0]}: not taken with cp_context (context parallelism)")
        if state_v_first:
            raise InvalidArgumentError("state_v_first: not taken with cp_context (no state goes in or out)")
        from . import cp

        opts = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                    allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
                    disable_recompute=disable_recompute, A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size)
        return cp.forward(q, k, v, g, beta, cp_context, **opts), None
    if return_intermediate_states and disable_recompute:
        raise InvalidArgumentError("return_intermediate_states: cannot be combined with disable_recompute=True")
    scale, gate, lb = kernel_options(q, scale, use_gate_in_kernel, lower_bound, safe_gate, chunk_size)
    varlen = cu_seqlens is not None
    chunks = -1
    if return_intermediate_states:
        cu = host_cu_seqlens(cu_seqlens, cu_seqlens_cpu) if varlen else None
        chunks = num_chunks(q.shape[1], q.shape[0], cu, chunk_size)

    q, k, v, g = unit_last_stride(q, k, v, g)
    A_log, dt_bias = dense(A_log, dt_bias)
    serving = ssm_state_indices is not None or has_initial_state is not None or out is not None
    grad_inputs = tracked(q, k, v, g, beta, A_log, dt_bias, initial_state)
    if serving or return_intermediate_states:
        return _forward_only(q, k, v, g, beta, A_log, dt_bias, initial_state, output_final_state, cu_seqlens,
                             cu_seqlens_cpu, ssm_state_indices, has_initial_state, pad_slot_id, inplace_final_state,
                             out, return_intermediate_states, chunks, grad_inputs, serving, scale, gate, lb,
                             use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
                             chunk_size, state_v_first)
    # disable_recompute: the forward also writes its chunk-start states in float32 for the backward to read (FLA's
    # memory-for-time trade); only worth it when a backward follows.
    save_states = bool(disable_recompute) and bool(grad_inputs)
    if save_states:
        cu = host_cu_seqlens(cu_seqlens, cu_seqlens_cpu) if varlen else None
        chunks = num_chunks(q.shape[1], q.shape[0], cu, chunk_size)
    o, ht, _ = chunk_forward(
        grad_inputs, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, gate, lb,
        use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, chunk_size,
        state_v_first, output_final_state, chunks if save_states else -1, save_states)
    return o, (ht if output_final_state else None)


def _forward_only(q, k, v, g, beta, A_log, dt_bias, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                  ssm_state_indices, has_initial_state, pad_slot_id, inplace_final_state, out,
                  return_intermediate_states, chunks, grad_inputs, serving, scale, gate, lb, qk_l2norm, beta_sigmoid,
                  allow_neg_eigval, safe_gate, chunk_size, state_v_first):
    """chunk_kda's forward-only forms: serving (caller buffers, a state pool in place) and intermediate states."""
    what = ("the serving form (ssm_state_indices / has_initial_state / out)" if serving
            else "return_intermediate_states=True")
    message = (f"chunk_kda: {what} is forward-only and has no backward; call chunk_kda without it to train "
               "(the intermediate states and state pools carry no gradient)")
    if not serving:
        with torch.no_grad():
            o, ht, h = chunk_forward(
                (), q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, gate, lb,
                qk_l2norm, beta_sigmoid, allow_neg_eigval, safe_gate, chunk_size, state_v_first, output_final_state,
                chunks, False)
        return forward_only(message, grad_inputs, o, ht if output_final_state else None, h)

    # Serving prefill: caller buffers and/or a state pool, in place.
    if inplace_final_state is False and ssm_state_indices is not None:
        raise InvalidArgumentError(
            "inplace_final_state: with ssm_state_indices the final states are written back into the pool "
            "(initial_state); inplace_final_state=False is not supported here")
    if ssm_state_indices is not None and initial_state is None:
        raise InvalidArgumentError("ssm_state_indices: needs the state pool as initial_state")
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if out is None:
        out = q.new_empty((B, T, HV, V))
    final_is_initial = ssm_state_indices is not None
    final_state = None
    if final_is_initial:
        final_state = initial_state
    elif output_final_state:
        final_state = q.new_empty(state_shape(num_sequences(q, cu_seqlens), HV, K, V, state_v_first),
                                  dtype=torch.float32)
    h = None
    if return_intermediate_states:
        h = q.new_empty((1 if cu_seqlens is not None else B, chunks) + state_shape(1, HV, K, V, state_v_first)[1:],
                        dtype=k.dtype)
    args = (q, k, v, g, beta, A_log, dt_bias, None if final_is_initial else initial_state, out, final_state, h,
            cu_seqlens, cu_seqlens_cpu, ssm_state_indices, has_initial_state, pad_slot_id, final_is_initial, scale,
            gate, lb, qk_l2norm, beta_sigmoid, allow_neg_eigval, safe_gate, chunk_size, state_v_first)
    if grad_inputs:
        with torch.no_grad():
            chunk_forward_into(*args)
    else:
        chunk_forward_into(*args)
    ret_final = final_state if (output_final_state or final_is_initial) else None
    outs = forward_only(message, grad_inputs, out, ret_final, h)
    return outs if return_intermediate_states else outs[:2]
