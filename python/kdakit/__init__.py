"""kdakit: Kimi Delta Attention kernels with an FLA-compatible API.

The torch layer (`chunk_kda`, `fused_recurrent_kda`, `fused_recurrent_kda_fwd`) is imported on first use so
that `kdakit._C`, the framework-free binding, works without torch.
"""
from . import _C
from ._C import InvalidArgumentError, NotBuiltError, CudaError

__version__ = _C.version()

_TORCH_API = {
    "chunk_kda": "kdakit.chunk",
    "fused_recurrent_kda": "kdakit.fused_recurrent",
    "fused_recurrent_kda_fwd": "kdakit.fused_recurrent",
    "naive_recurrent_kda": "kdakit.reference",
}

__all__ = ["chunk_kda", "fused_recurrent_kda", "fused_recurrent_kda_fwd", "naive_recurrent_kda",
           "InvalidArgumentError", "NotBuiltError", "CudaError", "cuda_available", "__version__"]


def cuda_available() -> bool:
    """True when this build has CUDA kernels and a CUDA device is visible."""
    return _C.cuda_available()


def __getattr__(name):
    if name in _TORCH_API:
        import importlib

        return getattr(importlib.import_module(_TORCH_API[name]), name)
    raise AttributeError(f"module 'kdakit' has no attribute {name!r}")
