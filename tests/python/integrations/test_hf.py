"""HF transformers' Kimi Linear KDA calls replayed argument for argument through `kdakit.integrations.hf`, at small
sizes, against the float64 references (kdakit.naive_recurrent_kda; naive.py's autograd oracle for gradients).

Upstream (huggingface/transformers): `src/transformers/models/kimi_linear/modeling_kimi_linear.py` @ c1a44bc9 and as
released in transformers 5.24: `KimiLinearDeltaAttention.forward` splits the convolved `[B, C, T]` projection into
q, k, v views (`mixed_qkv.transpose(1, 2)`, `torch.split`, `.view`), computes g = -exp(A_log) * softplus(f + dt_bias)
in fp32 and beta = sigmoid(b), and calls `chunk_kda(q, k, v, g=, beta=, initial_state=, output_final_state=,
use_qk_l2norm_in_kernel=True, **kwargs)` for prefill and training, or the recurrent function for one-token decode
with a cache (state fp32 [B, H, K, V]). Packed sequences arrive as `cu_seq_lens_q` (5.24) or `cu_seqlens` (c1a44bc9).
"""
import pytest
import torch

import kdakit
import naive
from conftest import assert_close
from kdakit.integrations import hf
from replay import DEVICES, out_tol, prefill_tol, reference, tol

B, H, D = 2, 2, 32  # Kimi Linear: HV = H, K = V = head_dim


def _model_tensors(B_, T, device, dtype, requires_grad=False, beta_dtype=torch.float32):
    """What the layer hands over: q, k, v split views of one [B, 3*H*D, T] convolution output (the last dimension
    strided by T), g the fp32 softplus log-decay, beta = sigmoid(b) in `beta_dtype`."""
    mixed = torch.rand(B_, 3 * H * D, T, device=device, dtype=dtype).requires_grad_(requires_grad)
    f = torch.randn(B_, T, H, D, device=device)
    A_log = torch.rand(1, 1, H, 1, device=device).mul(15).add(1).log()
    dt_bias = torch.randn(H * D, device=device)
    gate_in = (f + dt_bias.view(H, D)).requires_grad_(requires_grad)
    b = torch.randn(B_, T, H, device=device).requires_grad_(requires_grad)
    return mixed, gate_in, A_log, b, beta_dtype


def _layer_inputs(mixed, gate_in, A_log, b, beta_dtype):
    q, k, v = torch.split(mixed.transpose(1, 2), [H * D] * 3, dim=-1)
    shape = (mixed.shape[0], mixed.shape[2], H, D)
    g = -A_log.exp() * torch.where(gate_in > 20.0, gate_in, torch.log(1.0 + torch.exp(gate_in)))
    return q.view(shape), k.view(shape), v.view(shape), g, torch.sigmoid(b).to(beta_dtype)


def _as_x(q, k, v, g, beta, cu=None):
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=None, dt_bias=None, cu=cu)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,beta_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.float32, torch.float32)])
def test_prefill(seed, device, dtype, beta_dtype):
    """Prefill with a cache: no initial state, the final state [B, H, K, V] fp32 returned for the cache."""
    q, k, v, g, beta = _layer_inputs(*_model_tensors(B, 70, device, dtype, beta_dtype=beta_dtype))
    assert q.stride(-1) != 1
    with torch.no_grad():
        o, state = hf.chunk_kda(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True,
                                use_qk_l2norm_in_kernel=True, cu_seqlens=None)
    o_ref, ht_ref = reference(_as_x(q, k, v, g, beta), state_v_first=False)
    assert o.dtype == dtype and state.dtype == torch.float32 and state.shape == (B, H, D, D)
    assert_close("o", o_ref, o, out_tol(dict(q=q), device))
    assert_close("state", ht_ref, state, prefill_tol(torch.float32, q.dtype, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_mode", ["no_grad", "enabled"])
def test_decode(seed, device, grad_mode):
    """One token with the cache's fp32 state [B, H, K, V]; the views of a [B, C, 1] update are contiguous.
    Generation runs under no_grad; a forward with a cache outside it passes inputs that require grad."""
    mixed, gate_in, A_log, b, beta_dtype = _model_tensors(B, 1, device, torch.bfloat16,
                                                          requires_grad=grad_mode == "enabled")
    state = torch.randn(B, H, D, D, device=device)
    with torch.set_grad_enabled(grad_mode == "enabled"):
        q, k, v, g, beta = _layer_inputs(mixed, gate_in, A_log, b, beta_dtype)
        o, new_state = hf.fused_recurrent_kda(q, k, v, g=g, beta=beta, initial_state=state,
                                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, ht_ref = reference(_as_x(q, k, v, g, beta), initial_state=state.double().cpu(), state_v_first=False)
    assert_close("o", o_ref, o, out_tol(dict(q=q), device))
    assert_close("state", ht_ref, new_state, tol(torch.float32, device))
    assert not torch.equal(new_state, state)


def _training_step(device, packed):
    """A training step through hf.chunk_kda: leaves mixed, gate_in, b; loss sum(o * dO)."""
    T = 45
    mixed, gate_in, A_log, b, beta_dtype = _model_tensors(1 if packed else B, T, device, torch.float32,
                                                          requires_grad=True)
    q, k, v, g, beta = _layer_inputs(mixed, gate_in, A_log, b, beta_dtype)
    kwargs = dict(cu_seq_lens_q=torch.tensor([0, 20, 21, 45], dtype=torch.int32, device=device)) if packed else {}
    o, _ = hf.chunk_kda(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=True, **kwargs)
    return o, (mixed, gate_in, b), A_log, kwargs.get("cu_seq_lens_q")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", [False, True])
def test_training(seed, device, packed):
    """Gradients through the strided views, the fp32 gate and beta, against naive.py's float64 autograd oracle on
    the CPU; the CUDA backward to the tolerance of its float32 kernels (1e-4)."""
    tol = 1e-4 if device == "cuda" else 1e-5
    o, leaves, A_log, cu = _training_step(device, packed)
    do = torch.randn_like(o)
    grads = torch.autograd.grad((o * do).sum(), leaves)
    ref_leaves = [t.detach().double().cpu().requires_grad_() for t in leaves]
    rq, rk, rv, rg, rbeta = _layer_inputs(ref_leaves[0], ref_leaves[1], A_log.detach().double().cpu(), ref_leaves[2],
                                          torch.float64)
    ro, _ = naive.kda(rq, rk, rv, rg, rbeta, None, None, l2=True, cu_seqlens=None if cu is None else cu.cpu())
    ref_grads = torch.autograd.grad((ro * do.double().cpu()).sum(), ref_leaves)
    assert_close("o", ro, o, tol)
    for name, got, want in zip(("d_mixed", "d_gate_in", "d_b"), grads, ref_grads):
        assert_close(name, want, got, tol)


def test_kwargs():
    q, k, v, g, beta = _layer_inputs(*_model_tensors(1, 4, "cpu", torch.float32))
    q, k, v = (t.contiguous() for t in (q, k, v))
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)
    with torch.no_grad():
        o1, _ = hf.chunk_kda(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seq_lens_q=cu,
                             cu_seq_lens_k=cu, max_length_q=3, max_length_k=3, position_ids=None)
        o2, _ = hf.chunk_kda(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        assert torch.equal(o1, o2)
        with pytest.raises(TypeError, match="attention_mask"):
            hf.chunk_kda(q, k, v, g=g, beta=beta, attention_mask=None)
        with pytest.raises(NotImplementedError, match="seq_idx"):
            hf.chunk_kda(q, k, v, g=g, beta=beta, seq_idx=torch.zeros(1, 4, dtype=torch.int32))
        with pytest.raises(kdakit.InvalidArgumentError, match="is_causal"):
            hf.fused_recurrent_kda(q, k, v, g=g, beta=beta, is_causal=False)


def _kimi_linear_module():
    try:
        from transformers.models.kimi_linear import configuration_kimi_linear, modeling_kimi_linear
    except Exception:  # noqa: BLE001 - transformers is optional: the module test skips without it
        return None, None
    return modeling_kimi_linear, configuration_kimi_linear


def test_enable_swaps_the_model_functions(seed, monkeypatch):
    """The real KimiLinearDeltaAttention (when transformers is importable) runs its prefill through kdakit after
    `hf.enable()`: the arguments the layer passes give the reference's output, and its gradients flow."""
    modeling, configuration = _kimi_linear_module()
    if modeling is None or not hasattr(modeling, "KimiLinearDeltaAttention"):
        pytest.skip("transformers with models.kimi_linear is not importable")
    for name in hf._CHUNK_NAMES + hf._RECURRENT_NAMES:
        if hasattr(modeling, name):
            monkeypatch.setattr(modeling, name, getattr(modeling, name))  # restored after the test
    assert len(hf.enable(modeling)) == 2
    calls = []

    def spy(*args, **kwargs):
        out = hf.chunk_kda(*args, **kwargs)
        calls.append((args, kwargs, out))
        return out

    for name in hf._CHUNK_NAMES:
        if hasattr(modeling, name):
            monkeypatch.setattr(modeling, name, spy)
    cfg = configuration.KimiLinearConfig(hidden_size=64, linear_head_dim=D, linear_num_heads=H, num_hidden_layers=1,
                                         layer_types=["linear_attention"], vocab_size=32, num_attention_heads=H,
                                         num_key_value_heads=H, bos_token_id=None, eos_token_id=None,
                                         pad_token_id=None)
    layer = modeling.KimiLinearDeltaAttention(cfg, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.1)
        for name, p in layer.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand_like(p).mul(15).add(1).log())
    hidden = torch.randn(2, 37, 64)
    out = layer(hidden)
    assert len(calls) == 1
    (q, k, v), kwargs, (o, _) = calls[0]
    o_ref, _ = reference(_as_x(q, k, v, kwargs["g"], kwargs["beta"]), state_v_first=False)
    assert_close("o", o_ref, o, 1e-5)
    out.square().sum().backward()
    assert layer.q_proj.weight.grad is not None and torch.isfinite(layer.q_proj.weight.grad).all()
