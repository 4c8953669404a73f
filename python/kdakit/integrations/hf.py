"""The KDA functions HF transformers' Kimi Linear calls, computed by kdakit.

`src/transformers/models/kimi_linear/modeling_kimi_linear.py` (c1a44bc9; and as released in transformers 5.24)
decorates its torch reference functions with `use_kernel_func_from_hub_with_fallback("chunk_kda", "fla")` (and
`"fused_recurrent_kda"`), so that a hub kernel or FLA can take their place, and calls them as

    kda_fn(query, key, value, g=g, beta=beta, initial_state=recurrent_state,
           output_final_state=cache is not None, use_qk_l2norm_in_kernel=True, **kwargs)

with q, k, v split views of the convolved projection (last dimension contiguous in decode, strided after the
prefill convolution; kdakit copies what it cannot read in place), g the fp32 log-decay (the softplus gate computed in
the model), beta activated (fp32 or the model dtype), and the recurrent state fp32 `[B,H,K,V]` (K-first) or None.
Training goes through the chunked function with autograd. The `**kwargs` are the model's `TransformersKwargs`:
`cu_seq_lens_q` (packed sequences) becomes `cu_seqlens`; the ones that do not describe this computation are accepted
and have no effect here (`_MODEL_KWARGS`).

`enable()` puts these functions in place of the reference ones in `modeling_kimi_linear` (the forward looks them up
by name at every call).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..chunk import chunk_kda as _chunk_kda
from ..fused_recurrent import fused_recurrent_kda as _fused_recurrent_kda
from ._common import InvalidArgumentError, reject_kwargs

__all__ = ["chunk_kda", "fused_recurrent_kda", "enable"]

# TransformersKwargs that reach the KDA call and concern other layers (attention masks' lengths, outputs wanted).
_MODEL_KWARGS = {"num_items_in_batch", "output_hidden_states", "output_attentions", "output_router_logits",
                 "max_length_q", "max_length_k", "cu_seq_lens_k", "position_ids", "is_causal"}

# modeling_kimi_linear's names for the chunked and recurrent functions, across versions.
_CHUNK_NAMES = ("chunk_kimi_delta_attention", "torch_chunk_kda")
_RECURRENT_NAMES = ("recurrent_kimi_delta_attention", "torch_recurrent_kda")


def _packed_boundaries(cu_seqlens: Optional[torch.Tensor], kwargs: dict) -> Optional[torch.Tensor]:
    if "seq_idx" in kwargs and kwargs["seq_idx"] is not None:
        raise NotImplementedError("seq_idx: packed sequences are served through cu_seqlens / cu_seq_lens_q")
    kwargs.pop("seq_idx", None)
    if kwargs.get("is_causal") is False:
        raise InvalidArgumentError("is_causal: KDA is a causal recurrence; got is_causal=False")
    from_model = kwargs.pop("cu_seq_lens_q", None)
    for name in _MODEL_KWARGS:
        kwargs.pop(name, None)
    if cu_seqlens is not None and from_model is not None and cu_seqlens is not from_model:
        raise InvalidArgumentError("cu_seqlens: given together with cu_seq_lens_q; pass one")
    return cu_seqlens if cu_seqlens is not None else from_model


def chunk_kda(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    **kwargs,
):
    """HF's chunked KDA (prefill and training): pre-gated g, activated beta, scale `K^-0.5`, K-first states.
    Returns `(o, final_state or None)`; differentiable (CPU and CUDA)."""
    cu_seqlens = _packed_boundaries(cu_seqlens, kwargs)
    reject_kwargs("chunk_kda", kwargs)
    return _chunk_kda(query, key, value, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, chunk_size=chunk_size)


def fused_recurrent_kda(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    **kwargs,
):
    """HF's one-token decode with a cache: the state `[B,H,K,V]` fp32 is read, not updated in place; returns
    `(o, final_state or None)` (HF stores the new state in its cache). Forward only."""
    cu_seqlens = _packed_boundaries(cu_seqlens, kwargs)
    reject_kwargs("fused_recurrent_kda", kwargs)
    return _fused_recurrent_kda(query, key, value, g, beta, initial_state=initial_state,
                                output_final_state=output_final_state,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)


def enable(module=None) -> list:
    """Replaces Kimi Linear's reference KDA functions by kdakit's in `module` (default:
    `transformers.models.kimi_linear.modeling_kimi_linear`). Returns the names replaced."""
    if module is None:
        from transformers.models.kimi_linear import modeling_kimi_linear as module
    replaced = []
    for names, fn in ((_CHUNK_NAMES, chunk_kda), (_RECURRENT_NAMES, fused_recurrent_kda)):
        for name in names:
            if hasattr(module, name):
                setattr(module, name, fn)
                replaced.append(name)
    if len(replaced) < 2:
        raise RuntimeError(f"{module.__name__}: expected a chunked and a recurrent KDA function "
                           f"({_CHUNK_NAMES} / {_RECURRENT_NAMES}), replaced {replaced}")
    return replaced
