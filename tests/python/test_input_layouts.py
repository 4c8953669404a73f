"""Input layouts and dtypes the engines pass (spec §1.2, §5.5): q, k, v as split views of one projection (last
dimension contiguous, other strides not) read in place; g and beta as views of a bigger tensor; a last stride other
than 1 copied once; g and beta in float32 next to bf16/fp16 q, k, v; A_log and dt_bias in float32 or the input dtype,
A_log as [HV] or [1,1,HV,1]. On the CPU and, on a GPU machine, on the CUDA kernels, against the float64 oracle."""
import pytest
import torch
import torch.nn.functional as F

import kdakit
import naive
from conftest import assert_close
from kdakit._torch import unit_last_stride

B, T, H, HV, K = 2, 70, 2, 4, 32


def tol(device, out_dtype):
    """spec §6.1: float32 1e-5 on the CPU and 1e-4 on CUDA; 16-bit inputs or outputs 4e-3 (a float16 output on the
    CPU 1e-3)."""
    if out_dtype == torch.float32:
        return 1e-5 if device == "cpu" else 1e-4
    if out_dtype == torch.float16 and device == "cpu":
        return 1e-3
    return 4e-3


def state_tol(device, in_dtype):
    return tol(device, torch.float32) if (device == "cpu" or in_dtype == torch.float32) else 4e-3


def split_projection(device, dtype, requires_grad=False):
    """q, k, v as split views of one projection's output [B,T,H*K + H*K + HV*K] (strides [T*W, W, K, 1]); g and beta
    as views of one [B,T,HV,K+1] tensor (beta is its last column, strides [T*HV*(K+1), HV*(K+1), K+1])."""
    W = 2 * H * K + HV * K
    proj = torch.rand(B, T, W, device=device).to(dtype).requires_grad_(requires_grad)
    q, k, v = proj.split([H * K, H * K, HV * K], dim=-1)
    q, k, v = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, HV, K)
    gb = torch.cat([torch.randn(B, T, HV, K, device=device), torch.randn(B, T, HV, 1, device=device)], -1)
    gb = gb.to(dtype).requires_grad_(requires_grad)
    g, beta = gb[..., :K], gb[..., K]
    return proj, gb, dict(q=q, k=k, v=v, g=g, beta=beta)


GATE = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def gate_params(device):
    return torch.log(torch.empty(HV).uniform_(1, 16)).to(device), torch.randn(HV * K).to(device)


def oracle(x, A_log, dt_bias, h0=None, lower_bound=None):
    c = {n: t.detach().cpu() for n, t in x.items()}
    g = naive.gate(c["g"].double(), A_log.detach().cpu().double(), dt_bias.detach().cpu().double(), lower_bound)
    return naive.kda(c["q"], c["k"], c["v"], g, c["beta"], None, h0, l2=True, beta_sigmoid=True)


def test_split_views_are_read_in_place(seed, device):
    _, _, x = split_projection(device, torch.float32)
    assert not x["q"].is_contiguous() and x["q"].stride(-1) == 1 and x["beta"].stride(-1) == K + 1
    assert all(a is b for a, b in zip(unit_last_stride(x["q"], x["k"], x["v"], x["g"]),
                                      (x["q"], x["k"], x["v"], x["g"]))), "no copy for a contiguous last dimension"
    view = kdakit._C.view(x["q"])
    assert view.strides == list(x["q"].stride()) and view.data_ptr == x["q"].data_ptr()
    A_log, dt_bias = gate_params(device)
    dense = {n: t.contiguous() for n, t in x.items()}
    ro, rht = oracle(x, A_log, dt_bias)
    with torch.no_grad():
        for call in ("chunk", "recurrent", "fwd"):
            results = []
            for inp in (x, dense):
                a = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
                if call == "chunk":
                    results.append(kdakit.chunk_kda(*a, A_log=A_log, dt_bias=dt_bias, output_final_state=True,
                                                    **GATE))
                elif call == "recurrent":
                    results.append(kdakit.fused_recurrent_kda(*a, A_log, dt_bias, output_final_state=True, **GATE))
                else:
                    results.append(kdakit.fused_recurrent_kda_fwd(*a, A_log, dt_bias, None, output_final_state=True,
                                                                  inplace_final_state=False, **GATE))
            (o, ht), (o2, ht2) = results
            assert torch.equal(o, o2) and torch.equal(ht, ht2), f"{call}: strided and dense inputs differ"
            assert_close(f"{call} o", ro, o, tol(device, torch.float32))
            assert_close(f"{call} ht", rht, ht, tol(device, torch.float32))


def test_split_views_gradients(seed):
    """The CPU backward through split views: the gradients reach the projection as through dense inputs."""
    A_log, dt_bias = gate_params("cpu")
    grads = []
    for dense in (False, True):
        torch.manual_seed(7)
        proj, gb, x = split_projection("cpu", torch.float32, requires_grad=True)
        if dense:
            x = {n: t.contiguous() for n, t in x.items()}
        o, ht = kdakit.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=A_log, dt_bias=dt_bias,
                                 output_final_state=True, **GATE)
        grads.append(torch.autograd.grad((o * o).sum() + ht.sum(), [proj, gb]))
    for a, b in zip(*grads):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_last_stride_other_than_one_is_copied_once(seed, device):
    _, _, x = split_projection(device, torch.float32)
    x = {n: t.contiguous() for n, t in x.items()}
    # The same values stored with the head dimension strided (a transposed buffer).
    strided = {n: (t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() == 4 else t) for n, t in x.items()}
    assert strided["q"].stride(-1) != 1 and torch.equal(strided["q"], x["q"])
    copied = unit_last_stride(strided["q"])[0]
    assert copied is not strided["q"] and copied.stride(-1) == 1 and torch.equal(copied, x["q"])
    A_log, dt_bias = gate_params(device)
    with torch.no_grad():
        for call in (kdakit.chunk_kda, kdakit.fused_recurrent_kda):
            o, ht = call(*(x[n] for n in "q k v g beta".split()), A_log=A_log, dt_bias=dt_bias,
                         output_final_state=True, **GATE)
            o2, ht2 = call(*(strided[n] for n in "q k v g beta".split()), A_log=A_log, dt_bias=dt_bias,
                           output_final_state=True, **GATE)
            assert torch.equal(o, o2) and torch.equal(ht, ht2)
        # A per-column beta [B,T,HV,V] with a strided last dimension (decode only).
        cols = torch.randn(B, T, HV, K, device=device)
        o, _ = kdakit.fused_recurrent_kda(*(x[n] for n in "q k v g".split()), cols, A_log, dt_bias, **GATE)
        o2, _ = kdakit.fused_recurrent_kda(*(x[n] for n in "q k v g".split()),
                                           cols.transpose(-1, -2).contiguous().transpose(-1, -2), A_log, dt_bias,
                                           **GATE)
        assert torch.equal(o, o2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("param_dtype", ["float32", "input"])
@pytest.mark.parametrize("A_log_shape", ["[HV]", "[1,1,HV,1]"])
@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_mixed_dtypes(seed, device, dtype, param_dtype, A_log_shape, gate):
    """16-bit q, k, v with float32 g and beta (vLLM), A_log / dt_bias in float32 or the input dtype, A_log as [HV] or
    [1,1,HV,1]: chunk_kda and fused_recurrent_kda_fwd against the float64 oracle on the same rounded inputs."""
    x = dict(q=torch.rand(1, T, H, K), k=torch.rand(1, T, H, K), v=torch.rand(1, T, HV, K),
             g=torch.randn(1, T, HV, K), beta=torch.randn(1, T, HV))
    x = {n: (t.to(dtype) if n in "qkv" else t).to(device) for n, t in x.items()}
    A_log, dt_bias = gate_params(device)
    pdt = torch.float32 if param_dtype == "float32" else dtype
    A_log, dt_bias = A_log.to(pdt), dt_bias.to(pdt)
    if A_log_shape == "[1,1,HV,1]":
        A_log = A_log.reshape(1, 1, HV, 1)
    lb = -5.0 if gate == "lower_bound" else None
    cu = [0, 30, 31, T]
    h0 = torch.randn(3, HV, K, K, device=device)
    ro, rht = [], []
    for n in range(3):
        s = slice(cu[n], cu[n + 1])
        o_n, ht_n = oracle({m: t[:, s] for m, t in x.items()}, A_log.reshape(HV), dt_bias, h0[n:n + 1].cpu().double(),
                           lb)
        ro.append(o_n)
        rht.append(ht_n)
    ro, rht = torch.cat(ro, 1), torch.cat(rht)
    a = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    cu_t = torch.tensor(cu, device=device)
    with torch.no_grad():
        o, ht = kdakit.chunk_kda(*a, initial_state=h0, output_final_state=True, A_log=A_log, dt_bias=dt_bias,
                                 lower_bound=lb, cu_seqlens=cu_t, **GATE)
        assert o.dtype == dtype
        assert_close("chunk o", ro, o, tol(device, dtype))
        assert_close("chunk ht", rht, ht, state_tol(device, dtype))
        pool = h0.clone()
        o, _ = kdakit.fused_recurrent_kda_fwd(*a, A_log, dt_bias, pool, cu_seqlens=cu_t, lower_bound=lb, **GATE)
        assert o.dtype == dtype
        assert_close("fwd o", ro, o, tol(device, dtype))
        assert_close("fwd pool", rht, pool, state_tol(device, dtype))
