"""The specification as a function: kdakit's float64 token recurrence (spec §1.4) on the CPU."""
from __future__ import annotations

from typing import Optional

import torch

from . import _C
from ._torch import fill_inputs, gate_mode, host_cu_seqlens, layout, num_chunks, num_sequences, state_shape, view


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    *,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: Optional[float] = None,
    state_v_first: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
    return_intermediate_states: bool = False,
):
    """KDA by its definition, in float64 on the CPU (inputs of any device and dtype are read as they are).

    Returns float64 ``(o, final_state or None)``, plus the states at every ``chunk_size``-th token with
    ``return_intermediate_states``.
    """
    cpu = [None if t is None else t.detach().cpu() for t in (q, k, v, g, beta, A_log, dt_bias, initial_state,
                                                             cu_seqlens)]
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens = cpu
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = num_sequences(q, cu_seqlens)
    o = torch.empty((B, T, HV, V), dtype=torch.float64)
    ht = torch.empty(state_shape(N, HV, K, V, state_v_first), dtype=torch.float64)
    p = _C.ForwardParams()
    fill_inputs(p.inputs, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, None, float(K ** -0.5 if scale is None else scale),
                gate_mode(use_gate_in_kernel, lower_bound), float(lower_bound) if lower_bound is not None else -5.0,
                use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    p.state.layout = layout(state_v_first)
    p.state.initial_state = view(initial_state)
    p.state.final_state = view(ht)
    p.chunk_size = chunk_size
    p.out = view(o)
    h = None
    if return_intermediate_states:
        cu = host_cu_seqlens(cu_seqlens, None) if cu_seqlens is not None else None
        nt = num_chunks(T, B, cu, chunk_size)
        h = torch.empty((1 if cu is not None else B, nt) + state_shape(1, HV, K, V, state_v_first)[1:],
                        dtype=torch.float64)
        p.intermediate_states = view(h)
    _C.reference_forward(p)
    result = (o, ht if output_final_state else None)
    return result + (h,) if return_intermediate_states else result
