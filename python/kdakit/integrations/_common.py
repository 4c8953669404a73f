"""Small helpers the adapters share: argument checks that name the argument, and layout plumbing (views only)."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _C

InvalidArgumentError = _C.InvalidArgumentError


def reject_kwargs(caller: str, kwargs: dict) -> None:
    """Engines' functions swallow unknown keywords (`**kwargs`); the adapters name them instead."""
    if kwargs:
        raise TypeError(f"{caller}() got keyword arguments it does not serve: {sorted(kwargs)}")


def leading_tokens(x: torch.Tensor, T: int, name: str) -> torch.Tensor:
    """`x[:, :T]` when `x` has more tokens than q (callers that slice q/k/v to the real tokens but pass the
    padded g and beta, which their kernels read only up to T); an error when it has fewer."""
    if x.dim() < 2:
        raise InvalidArgumentError(f"{name}: expected [B,T,...], got shape {tuple(x.shape)}")
    if x.shape[1] < T:
        raise InvalidArgumentError(f"{name}: has {x.shape[1]} tokens, q has {T}")
    return x[:, :T] if x.shape[1] > T else x


def float_state(state: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A copied (not in-place) state in a dtype kdakit reads: fp32 and bf16 as they are, other floats as fp32."""
    if state is None or state.dtype in (torch.float32, torch.bfloat16, torch.float64):
        return state
    return state.float()


def num_sequences(q: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
