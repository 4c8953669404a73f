"""Shared helpers of the torch layer: tensors to kdakit views, params, workspaces and streams."""
from __future__ import annotations

from typing import Optional

import torch

from . import _C

# A kdakit view of a tensor (None: absent). torch tensors are read through their attributes in C++ (no DLPack
# export, no detach: a decode step passes a dozen tensors, and each export cost ~2 us of host time).
view = _C.view

# The current stream of a CUDA device as an integer: the raw getter when this torch has it (no Stream object).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_of(t: torch.Tensor) -> int:
    if not t.is_cuda:
        return 0
    if _raw_stream is not None:
        return _raw_stream(t.get_device())
    return torch.cuda.current_stream(t.device).cuda_stream


def workspace(nbytes: int, device: torch.device) -> Optional[torch.Tensor]:
    if nbytes == 0:
        return None
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


# kdakit::GateMode values as plain ints (traceable by torch.compile, unlike the binding's enum).
PRE_GATED, SOFTPLUS, LOWER_BOUND = 0, 1, 2


def gate_mode(use_gate_in_kernel: bool, lower_bound: Optional[float]) -> int:
    if not use_gate_in_kernel:
        return PRE_GATED
    return LOWER_BOUND if lower_bound is not None else SOFTPLUS


def fill_inputs(inputs, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu, scale: float, gate: int,
                lower_bound: float, qk_l2norm: bool, beta_sigmoid: bool, allow_neg_eigval: bool) -> None:
    _C.set_inputs(inputs, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu, scale, gate, lower_bound,
                  qk_l2norm, beta_sigmoid, allow_neg_eigval)


def layout(state_v_first: bool):
    return _C.StateLayout.VK if state_v_first else _C.StateLayout.KV


def num_sequences(q: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def state_shape(n: int, HV: int, K: int, V: int, state_v_first: bool):
    return (n, HV, V, K) if state_v_first else (n, HV, K, V)


def host_cu_seqlens(cu_seqlens: torch.Tensor, cu_seqlens_cpu: Optional[torch.Tensor]) -> list:
    """Sequence boundaries on the host (a device-to-host copy unless cu_seqlens_cpu is given)."""
    src = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    return [int(x) for x in src.tolist()]


def num_chunks(T: int, B: int, cu: Optional[list], chunk_size: int) -> int:
    """Chunks per batch row (fixed length) or in total (varlen)."""
    if cu is None:
        return (T + chunk_size - 1) // chunk_size
    return _C.count_chunks(cu, chunk_size)


# ----------------------------------------------------------------------------------------------------------
# Inputs read in place, and calls that autograd would record.


def unit_last_stride(*tensors):
    """Token tensors (q, k, v, g, a per-column beta) are read in place when their last dimension is contiguous,
    whatever their other strides (split views of one projection); any other layout gets one copy."""
    return tuple(t if t is None or t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()
                 for t in tensors)


def dense(*tensors):
    """A_log and dt_bias are read as flat vectors: a non-contiguous one gets one copy."""
    return tuple(t if t is None or t.is_contiguous() else t.contiguous() for t in tensors)


def tracked(*tensors) -> tuple:
    """The tensors through which autograd would record this call: those that require grad, in grad mode."""
    if not torch.is_grad_enabled():
        return ()
    return tuple(t for t in tensors if t is not None and t.requires_grad)
