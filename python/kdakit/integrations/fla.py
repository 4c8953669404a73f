"""kdakit as a backend of FLA's backend dispatch (spec §8): FLA users get kdakit for the calls it serves, and every
other call runs FLA's own implementation.

    import kdakit.integrations.fla
    kdakit.integrations.fla.enable()      # once per process, after which fla.ops.kda.chunk_kda may run on kdakit

FLA has no plugin discovery, so a process registers the backend by calling `enable()`. The environment variable
`FLA_KDAKIT` (read by FLA on every call; default on) switches the registered backend off with `FLA_KDAKIT=0`, and
`FLA_DISABLE_BACKEND_DISPATCH=1` (read by FLA at import) turns all of FLA's dispatch off.

Hooks (FLA's names and signatures): `chunk_kda`, the whole chunked op, and `fused_recurrent_kda_fwd`, decode and
verify (which FLA's `fused_recurrent_kda` calls). Each has a verifier that accepts only what kdakit serves on the
call's device and rejects with a reason otherwise (FLA logs it once and runs its own kernel):

- CPU tensors, or CUDA tensors with a CUDA build of kdakit (training included: both have a backward);
- no `cp_context`, no `use_graph` (FLA's capture-friendly chunk lists), no keyword FLA would swallow;
- q and k of one dtype, `1 <= K, V <= 256`, `HV % H == 0`, `chunk_size` 32 or 64; on CUDA q, k, v of one dtype in
  {bf16, fp16, fp32} and g, beta, A_log, dt_bias each in one of the three (spec §5.2); states in fp32 or bf16;
- `fused_recurrent_kda_fwd`: `A_log` present for the softplus gate (FLA silently uses A_log = 1 otherwise),
  `num_accepted_tokens` only with 2-D slot indices.

Dispatch hands over the raw arguments, before FLA's validation and defaults, so the hooks reproduce FLA's leniency
where kdakit is stricter: `A_log`, `dt_bias` and `lower_bound` are dropped when the gate is not computed in kernel
(FLA ignores them), and only FLA's keywords are passed on. Every other flag (`allow_neg_eigval` included) is honoured.

Two generations of FLA's dispatch are supported: the `fla.backends` module (per-function registries, 0.6) and
`fla.ops.backends` with `fla.ops.kda.backends.kda_registry` (0.5.x; the mechanism spec §8 documents at bc3b101d).
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch

import kdakit

BACKEND_TYPE = "kdakit"
ENV_VAR = "FLA_KDAKIT"
# Lower runs first: before FlashKDA (3) and TileLang (5), after the Ascend backend (0), which serves NPUs only.
PRIORITY = 2

__all__ = ["enable", "is_enabled", "BACKEND_TYPE", "ENV_VAR", "PRIORITY"]

_FLOATS_CUDA = (torch.bfloat16, torch.float16, torch.float32)
_STATE_DTYPES = (torch.float32, torch.bfloat16)
_CHUNK_KWARGS = {"A_log", "dt_bias", "chunk_size", "transpose_state_layout"}
_registered: list = []



def _check_common(q, k, v, g, beta, extra, states) -> Optional[str]:
    """The reason kdakit cannot serve these tensors on their device, or None."""
    dev = q.device.type
    if dev == "cuda":
        if not kdakit.cuda_available():
            return "kdakit was built without CUDA kernels or sees no CUDA device"
    elif dev != "cpu":
        return f"kdakit serves CPU and CUDA tensors, got {q.device}"
    if q.dim() != 4 or k.shape != q.shape or k.dtype != q.dtype:
        return "q and k must be [B,T,H,K] of one shape and dtype"
    if v.dim() != 4:
        return "v must be [B,T,HV,V]"
    K, H, HV, V = q.shape[-1], q.shape[2], v.shape[2], v.shape[-1]
    if not (1 <= K <= 256 and 1 <= V <= 256):
        return f"kdakit serves 1 <= K, V <= 256, got K={K}, V={V}"
    if HV % H:
        return f"HV ({HV}) must be a multiple of H ({H})"
    if dev == "cuda":
        if q.dtype not in _FLOATS_CUDA or v.dtype != q.dtype:
            return f"kdakit's CUDA kernels take q, k, v of one dtype in bf16/fp16/fp32, got {q.dtype}, {v.dtype}"
        if any(t is not None and t.dtype not in _FLOATS_CUDA for t in (g, beta, *extra)):
            return "kdakit's CUDA kernels take g, beta, A_log and dt_bias in bf16/fp16/fp32"
    for name, s in states:
        if s is not None and s.dtype not in _STATE_DTYPES and not (dev == "cpu" and s.dtype == torch.float64):
            return f"{name} must be fp32 or bf16, got {s.dtype}"
    return None


def _verify_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                  allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
                  return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                  cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
    if cp_context is not None:
        return False, "context parallelism (cp_context) is not served by kdakit"
    if use_graph:
        return False, "use_graph (FLA's capture-friendly chunk lists) is not served by kdakit"
    unknown = set(kwargs) - _CHUNK_KWARGS
    if unknown:
        return False, f"keywords FLA ignores: {sorted(unknown)}"
    if kwargs.get("chunk_size", 64) not in (32, 64):
        return False, f"chunk_size must be 32 or 64, got {kwargs.get('chunk_size')}"
    A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
    reason = _check_common(q, k, v, g, beta, (A_log, dt_bias), (("initial_state", initial_state),))
    return (False, reason) if reason else (True, None)


def _chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
           use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
           lower_bound=None, disable_recompute=False, return_intermediate_states=False, state_v_first=False,
           cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
    if not use_gate_in_kernel:
        # FLA ignores these with a pre-gated g; kdakit would reject them.
        kwargs.pop("A_log", None)
        kwargs.pop("dt_bias", None)
        lower_bound = None
    return kdakit.chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
                            disable_recompute, return_intermediate_states, state_v_first, cu_seqlens, cu_seqlens_cpu,
                            **kwargs)


def _verify_recurrent(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                      output_final_state=False, inplace_final_state=True, state_v_first=False, cu_seqlens=None,
                      ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                      use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                      lower_bound=None, out=None, **kwargs):
    if kwargs:
        return False, f"keywords FLA ignores: {sorted(kwargs)}"
    if use_gate_in_kernel and lower_bound is None and A_log is None:
        return False, "softplus gate without A_log (FLA's kernel then uses A_log = 1; kdakit requires A_log)"
    if num_accepted_tokens is not None and (ssm_state_indices is None or ssm_state_indices.dim() != 2):
        return False, "num_accepted_tokens is served with 2-D ssm_state_indices only"
    reason = _check_common(q, k, v, g, beta, (A_log, dt_bias), (("initial_state", initial_state),))
    return (False, reason) if reason else (True, None)


def _recurrent(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None, output_final_state=False,
               inplace_final_state=True, state_v_first=False, cu_seqlens=None, ssm_state_indices=None,
               num_accepted_tokens=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
               use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, out=None, **kwargs):
    if not use_gate_in_kernel:
        A_log = dt_bias = lower_bound = None  # ignored by FLA with a pre-gated g
    if out is None:
        out = torch.empty_like(v)  # FLA's output has v's dtype
    o, state = kdakit.fused_recurrent_kda_fwd(
        q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state, inplace_final_state,
        state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens, use_qk_l2norm_in_kernel,
        use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, out)
    if not inplace_final_state and not output_final_state:
        state = None  # FLA returns no state then; kdakit returns the per-token states of slot-indexed calls
    return o, state


def _backend_class(base):
    """A subclass of the installed FLA's `BaseBackend` with kdakit's hooks."""
    return type("KdakitBackend", (base,), {
        "__doc__": "kdakit's KDA kernels (chunk_kda, fused_recurrent_kda_fwd) as an FLA backend.",
        "backend_type": BACKEND_TYPE,
        "package_name": "kdakit",
        "env_var": ENV_VAR,
        "default_enable": True,
        "priority": PRIORITY,
        "chunk_kda_verifier": lambda self, *a, **kw: _verify_chunk(*a, **kw),
        "chunk_kda": lambda self, *a, **kw: _chunk(*a, **kw),
        "fused_recurrent_kda_fwd_verifier": lambda self, *a, **kw: _verify_recurrent(*a, **kw),
        "fused_recurrent_kda_fwd": lambda self, *a, **kw: _recurrent(*a, **kw),
    })


def enable() -> list:
    """Registers kdakit's backend with the installed FLA (idempotent). Returns the registries it is in."""
    if _registered:
        return list(_registered)
    chunk_module = importlib.import_module("fla.ops.kda.chunk")
    try:
        backends = importlib.import_module("fla.backends")
    except ImportError:
        backends = None
    if backends is not None and hasattr(backends, "register"):
        # FLA 0.6: chunk_kda has its own registry, fused_recurrent_kda_fwd is in the operation registry 'kda'.
        if getattr(backends, "_DISPATCH_DISABLED", False):
            raise RuntimeError("FLA_DISABLE_BACKEND_DISPATCH=1: FLA's dispatch is off, no backend can be registered")
        cls = _backend_class(backends.BaseBackend)
        backends.register(chunk_module.chunk_kda)(cls)
        backends.register("kda")(cls)
        _registered.extend(["fla.ops.kda.chunk.chunk_kda", "kda"])
    else:
        # FLA 0.5: one registry per operation, created by fla.ops.kda.backends.
        base = importlib.import_module("fla.ops.backends").BaseBackend
        registry = importlib.import_module("fla.ops.kda.backends").kda_registry
        registry.register(_backend_class(base)())
        _registered.append("kda")
    return list(_registered)


def is_enabled() -> bool:
    """Whether `enable()` has registered the backend in this process (FLA_KDAKIT may still switch it off)."""
    return bool(_registered)

