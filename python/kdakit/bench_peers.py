"""The peers `kdakit.bench` times kdakit against: FLA, FlashKDA and NVIDIA cuDNN Frontend's Hopper KDA engine.

Every runner takes a row's inputs as `kdakit.bench.forward_inputs` builds them (bf16 q, k, v, g, beta in [B,T,H,K]
form, fp32 A_log [HV], dt_bias [HV*K] and h0 [N,HV,K,V]) and returns results in kdakit's layouts, so that the bench
compares them with kdakit's directly. A peer that is not importable is None, with the reason logged.

cuDNN (`nvidia-cudnn-frontend`, its Python package `cudnn`, which needs `apache-tvm-ffi`): the op
`cudnn.linear_attention.ops.kimi_delta_attention(q, k, v, g, beta, cu_seqlens, scale=None, initial_state=None,
output_final_state=False, use_qk_l2norm_in_kernel=False, ..., use_beta_sigmoid_in_kernel=False, safe_gate=False,
gate_lower_bound=None, a_log=None, dt_bias=None, ..., plan_name=None)`, pinned to the plan "kda_hopper_cuda" (sm90
only; other plans are not what this column measures). Its tensors are THD: q, k [total_tokens,H,K], v
[total_tokens,HV,V], g [total_tokens,HV,K], beta [total_tokens,HV], int32 cu_seqlens [N+1] also for a dense batch,
state [N,HV,V,K] (v-first), a_log [HV], dt_bias [HV,K]; the safe gate is `gate_lower_bound * sigmoid(exp(a_log) * (g
+ dt_bias))`, kdakit's lower-bound gate. It returns (o [total_tokens,HV,V], final_state). Its backward is the autograd
formula registered on the op; that engine's backward kernels take log-space fp32 g, fp32 post-sigmoid beta and
already normalised q/k, with equal q and v head counts, and decline the in-kernel gate, L2 norm and sigmoid. So the
training step gives cuDNN those inputs computed by eager torch ops on the same raw inputs (see `cudnn_train_step`).
"""
from __future__ import annotations

import os

import torch

import kdakit

D = 128
LOWER_BOUND = -5.0
CUDNN_PLAN = "kda_hopper_cuda"
GRAD_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")


def error_text(e: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[:limit] + " ..."


class Notes:
    """Why a peer (or a row of it) did not run: each reason logged once and kept for the tables."""

    def __init__(self, log=print):
        self.log, self.lines = log, []

    def __call__(self, text: str) -> None:
        if text not in self.lines:
            self.lines.append(text)
            self.log(text)


# --- FLA -------------------------------------------------------------------------------------------------------------

def fla_chunk_kda(log=print):
    """FLA's `fla.ops.kda.chunk_kda` (its own Triton kernels), or None with the reason logged."""
    try:
        os.environ.setdefault("FLA_FLASH_KDA", "0")  # FLA's own Triton kernels; FlashKDA is timed on its own
        from fla.ops.kda import chunk_kda
    except Exception as e:  # noqa: BLE001
        log(f"FLA not importable: {error_text(e)}")
        return None
    return chunk_kda


def _fla_call(chunk_kda, x, p):
    """FLA's chunk_kda on the row `x` with tensors `p` (the row's own, or leaves that require grad)."""
    return chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=p["h0"], output_final_state=True,
                     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                     safe_gate=True, lower_bound=LOWER_BOUND, A_log=p["A_log"], dt_bias=p["dt_bias"],
                     cu_seqlens=None if x["cu"] is None else x["cu"].long(),
                     cu_seqlens_cpu=None if x["cu_cpu"] is None else x["cu_cpu"].long())


def fla_runner(log=print):
    """A forward runner for FLA: run(x) -> (o, final state), or None where FLA is missing."""
    chunk_kda = fla_chunk_kda(log)
    if chunk_kda is None:
        return None
    return lambda x: _fla_call(chunk_kda, x, x)


# --- FlashKDA --------------------------------------------------------------------------------------------------------

def flashkda_runner(log=print):
    """FlashKDA's forward (`flash_kda.fwd`: dense batches, or varlen with int64 cu_seqlens; no GVA) as `prepare(x)`,
    which makes the layout copies it needs (a v-first h0, int64 cu_seqlens) and returns the call to time; None where
    FlashKDA is missing."""
    try:
        import flash_kda  # noqa: F401
    except Exception as e:  # noqa: BLE001
        log(f"FlashKDA not importable: {error_text(e)}")
        return None

    def prepare(x):
        B, T, H, _ = x["q"].shape
        out = torch.empty_like(x["v"])
        final = torch.empty_like(x["h0"])
        h0 = x["h0"].transpose(-1, -2).contiguous()
        cu = None if x["cu"] is None else x["cu"].long()
        dt_bias = x["dt_bias"].view(H, D)

        def call():
            flash_kda.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], D ** -0.5, out, A_log=x["A_log"],
                          dt_bias=dt_bias, lower_bound=LOWER_BOUND, initial_state=h0, final_state=final,
                          cu_seqlens=cu)
            return out, final
        return call
    return prepare


# --- cuDNN -----------------------------------------------------------------------------------------------------------

def cudnn_kda(log=print):
    """cuDNN Frontend's `kimi_delta_attention` op, or None with the reason logged."""
    try:
        from cudnn.linear_attention.ops import kimi_delta_attention
    except Exception as e:  # noqa: BLE001
        log(f"cuDNN KDA (nvidia-cudnn-frontend) not importable: {error_text(e)}")
        return None
    return kimi_delta_attention


def cudnn_cu_seqlens(x) -> torch.Tensor:
    """int32 [N+1] sequence starts over the packed tokens: the row's own, or [0, T, 2T, ...] for a dense batch."""
    if x["cu"] is not None:
        return x["cu"].to(torch.int32)
    B, T = x["q"].shape[:2]
    return torch.arange(0, B * T + 1, T, dtype=torch.int32, device=x["q"].device)


def thd(t: torch.Tensor) -> torch.Tensor:
    """[B,T,heads,...] -> [B*T,heads,...] (a view of a contiguous tensor)."""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def cudnn_forward_call(kda, x):
    """A forward call of cuDNN's Hopper engine on the row `x`: call() -> (o [B,T,HV,V], final state [N,HV,K,V]).

    The same math as kdakit's row: the row's raw g and beta with the lower-bound gate, L2 norm and beta sigmoid in
    its kernel, the default scale. The engine's kernel reads g and beta in fp32 (given bf16, the op converts them
    inside every call), so they are given as fp32 copies made here, as its callers hold them. That work and the
    layout work (THD views, int32 cu_seqlens, the v-first h0, dt_bias as [HV,K]) is done once, outside the timed
    call; the results come back as views in kdakit's layouts."""
    B, T, HV, V = x["v"].shape
    args = dict(q=thd(x["q"]), k=thd(x["k"]), v=thd(x["v"]), g=thd(x["g"]).float(), beta=thd(x["beta"]).float(),
                cu_seqlens=cudnn_cu_seqlens(x))
    h0 = x["h0"].transpose(-1, -2).contiguous()  # [N,HV,V,K]
    a_log, dt_bias = x["A_log"].float().contiguous(), x["dt_bias"].float().reshape(HV, D)

    def call():
        o, ht = kda(**args, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True, safe_gate=True, gate_lower_bound=LOWER_BOUND, a_log=a_log,
                    dt_bias=dt_bias, plan_name=CUDNN_PLAN)
        return o.view(B, T, HV, V), ht.transpose(-1, -2)
    return call


# --- training steps --------------------------------------------------------------------------------------------------

def leaves(x, h0=None) -> dict:
    """Fresh leaves that require grad over the row's tensors (h0: another layout of the initial state)."""
    p = {n: x[n].detach().requires_grad_(True) for n in GRAD_NAMES if n != "h0"}
    p["h0"] = (x["h0"] if h0 is None else h0).detach().requires_grad_(True)
    return p


def backward(o: torch.Tensor, ht: torch.Tensor) -> None:
    (o.float().sum() + ht.float().sum()).backward()


def kdakit_train_step(x, lib=None):
    """step() -> gradients: kdakit's chunk_kda forward and backward, gate, L2 norm and sigmoid in kernel."""
    lib = kdakit if lib is None else lib

    def step():
        p = leaves(x)
        o, ht = lib.chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=p["h0"],
                              output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                              use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND,
                              A_log=p["A_log"], dt_bias=p["dt_bias"], cu_seqlens=x["cu"], cu_seqlens_cpu=x["cu_cpu"])
        backward(o, ht)
        return {n: t.grad for n, t in p.items()}
    return step


def fla_train_step(chunk_kda, x):
    """step() -> gradients: FLA's chunk_kda forward and backward, gate, L2 norm and sigmoid in kernel."""
    def step():
        p = leaves(x)
        o, ht = _fla_call(chunk_kda, x, p)
        backward(o, ht)
        return {n: t.grad for n, t in p.items()}
    return step


def l2norm(t: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + 1e-6) over the last dim in fp32 (spec §1.5, as cuDNN's forward kernel does), rounded
    to t's dtype: cuDNN's backward takes bf16 q and k."""
    f = t.float()
    return (f * torch.rsqrt(f.square().sum(-1, keepdim=True) + 1e-6)).to(t.dtype)


def cudnn_train_step(kda, x):
    """step() -> gradients in kdakit's layouts: cuDNN's Hopper engine forward and backward (its autograd formula).

    Its backward kernels take no in-kernel fusions, so the step runs the L2 norm of q and k, the lower-bound gate
    (fp32 log-space g) and the beta sigmoid (fp32) as eager torch ops, whose backward autograd runs too; the gradients
    reach the same leaves as kdakit's. The v-first initial state is made once, outside the step."""
    B, T, HV, V = x["v"].shape
    cu = cudnn_cu_seqlens(x)
    h0_vk = x["h0"].transpose(-1, -2).contiguous()  # [N,HV,V,K]

    def step():
        p = leaves(x, h0=h0_vk)
        gate = LOWER_BOUND * torch.sigmoid(p["A_log"].float().exp()[:, None]
                                           * (p["g"].float() + p["dt_bias"].float().view(HV, D)))
        o, ht = kda(thd(l2norm(p["q"])), thd(l2norm(p["k"])), thd(p["v"]), thd(gate),
                    thd(torch.sigmoid(p["beta"].float())), cu, initial_state=p["h0"], output_final_state=True,
                    plan_name=CUDNN_PLAN)
        backward(o.view(B, T, HV, V), ht)
        grads = {n: t.grad for n, t in p.items()}
        grads["h0"] = grads["h0"].transpose(-1, -2)  # back to [N,HV,K,V]
        return grads
    return step
