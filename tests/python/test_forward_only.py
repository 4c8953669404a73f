"""Forward-only entry points called with inputs that require grad (spec §5.1-§5.4): FLA's layers call them in eval
mode without no_grad while A_log is a Parameter. They must run and give the forward's values; a gradient requested
through their outputs raises an error that names the function."""
import pytest
import torch

import kdakit
from test_chunk_kda import inputs


def _leaves(x, device, requires_grad):
    """The inputs on `device`; A_log a Parameter (as in FLA's layer) or q too when `requires_grad` is 'all'."""
    t = {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in x.items()}
    if t["A_log"] is not None:
        t["A_log"] = torch.nn.Parameter(t["A_log"], requires_grad=requires_grad is not None)
    if requires_grad == "all":
        t["q"] = t["q"].clone().requires_grad_()
    return t


def _decode_args(t):
    return (t["q"], t["k"], t["v"], t["g"], t["beta"])


GATE = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, lower_bound=-5.0)


def _same_values(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.detach(), b.detach())


@pytest.mark.parametrize("requires_grad", ["A_log", "all"])
def test_fused_recurrent_kda_in_grad_mode(seed, device, requires_grad):
    x = inputs(2, 6, 2, 4, 16, use_gate=True, l2_in_kernel=True)
    t = _leaves(x, device, requires_grad)
    h0 = t["h0"]
    o, ht = kdakit.fused_recurrent_kda(*_decode_args(t), A_log=t["A_log"], dt_bias=t["dt_bias"], initial_state=h0,
                                       output_final_state=True, **GATE)
    with torch.no_grad():
        ro, rht = kdakit.fused_recurrent_kda(*_decode_args(t), A_log=t["A_log"], dt_bias=t["dt_bias"],
                                             initial_state=h0, output_final_state=True, **GATE)
    _same_values(o, ro)
    _same_values(ht, rht)
    assert o.grad_fn is not None and ht.grad_fn is not None, "a gradient through the outputs must not be silent"
    with pytest.raises(RuntimeError, match="^fused_recurrent_kda: has no backward"):
        o.sum().backward()
    # Mixed with a differentiable term, the backward still raises rather than dropping this contribution.
    loss = ht.sum() + (t["A_log"] * 2).sum()
    with pytest.raises(RuntimeError, match="^fused_recurrent_kda: has no backward"):
        loss.backward()
    # The state it returns can be passed on (FLA's decode loop in eval mode).
    o2, _ = kdakit.fused_recurrent_kda(*_decode_args(t), A_log=t["A_log"], dt_bias=t["dt_bias"], initial_state=ht,
                                       output_final_state=True, **GATE)
    assert torch.isfinite(o2).all()


def test_fused_recurrent_kda_fwd_in_grad_mode(seed, device):
    """The serving entry, in place on a pool, with a caller `out`: the returned tensors view the caller's buffers."""
    x = inputs(1, 0, 2, 2, 16, use_gate=True, l2_in_kernel=True, cu=[0, 1, 2, 3], h0=False)
    t = _leaves(x, device, "all")
    pool = torch.randn(5, 2, 16, 16, device=device)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device=device)
    cu = torch.arange(4, device=device)
    expected_pool = pool.clone()
    with torch.no_grad():
        ro, _ = kdakit.fused_recurrent_kda_fwd(*_decode_args(t), t["A_log"], t["dt_bias"], expected_pool,
                                               cu_seqlens=cu, ssm_state_indices=idx, **GATE)
    out = torch.empty(1, 3, 2, 16, device=device)
    o, st = kdakit.fused_recurrent_kda_fwd(*_decode_args(t), t["A_log"], t["dt_bias"], pool, cu_seqlens=cu,
                                           ssm_state_indices=idx, out=out, **GATE)
    _same_values(o, ro)
    _same_values(pool, expected_pool)
    assert o.data_ptr() == out.data_ptr() and st.data_ptr() == pool.data_ptr()
    with pytest.raises(RuntimeError, match="^fused_recurrent_kda_fwd: has no backward"):
        (o.sum() + st.sum()).backward()


def test_chunk_kda_serving_form_in_grad_mode(seed, device):
    H, D, cu = 2, 16, [0, 20, 21, 70]
    x = inputs(1, 0, H, H, D, cu=cu, use_gate=True, l2_in_kernel=True, h0=False)
    t = _leaves(x, device, "all")
    pool = torch.randn(6, H, D, D, device=device)
    idx = torch.tensor([5, -1, 1], dtype=torch.int32, device=device)
    cu_t = torch.tensor(cu, device=device)
    kw = dict(A_log=t["A_log"], dt_bias=t["dt_bias"], cu_seqlens=cu_t, ssm_state_indices=idx, **GATE)
    expected_pool = pool.clone()
    with torch.no_grad():
        ro, _ = kdakit.chunk_kda(*_decode_args(t), initial_state=expected_pool, **kw)
    o, st = kdakit.chunk_kda(*_decode_args(t), initial_state=pool, **kw)
    _same_values(o, ro)
    _same_values(pool, expected_pool)
    with pytest.raises(RuntimeError, match="^chunk_kda: the serving form .* has no backward"):
        o.sum().backward()


def test_chunk_kda_intermediate_states_in_grad_mode(seed, device):
    """return_intermediate_states runs outside inference mode (unlike FLA) and is forward-only."""
    x = inputs(2, 100, 2, 2, 16, use_gate=True, l2_in_kernel=True)
    t = _leaves(x, device, "all")
    kw = dict(A_log=t["A_log"], dt_bias=t["dt_bias"], initial_state=t["h0"], output_final_state=True, **GATE)
    with torch.inference_mode():
        ro, rht, rh = kdakit.chunk_kda(*_decode_args(t), return_intermediate_states=True, **kw)
    o, ht, h = kdakit.chunk_kda(*_decode_args(t), return_intermediate_states=True, **kw)
    for got, ref in ((o, ro), (ht, rht), (h, rh)):
        _same_values(got, ref)
    with pytest.raises(RuntimeError, match="^chunk_kda: return_intermediate_states=True .* has no backward"):
        (o.sum() + h.sum()).backward()


def test_plain_chunk_kda_keeps_its_gradients(seed, device):
    x = inputs(1, 40, 1, 1, 16)
    t = _leaves(x, device, None)
    q = t["q"].clone().requires_grad_()
    o, _ = kdakit.chunk_kda(q, t["k"], t["v"], t["g"], t["beta"])
    (dq,) = torch.autograd.grad(o.sum(), q)
    assert torch.isfinite(dq).all() and dq.abs().sum() > 0


def test_outputs_are_the_buffers_without_grad(seed):
    """Without autograd in play nothing is wrapped: `out` and the pool come back as the same objects."""
    x = inputs(1, 0, 1, 1, 8, cu=[0, 1, 2], h0=False)
    pool = torch.zeros(3, 1, 8, 8)
    out = torch.empty(1, 2, 1, 8)
    o, st = kdakit.fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, pool,
                                           cu_seqlens=torch.arange(3), ssm_state_indices=torch.tensor([2, 0]),
                                           out=out)
    assert o is out and st is pool and o.grad_fn is None


def test_torch_compile_in_grad_mode(seed):
    """An eval-mode layer compiled with fullgraph=True: the forward-only call traces (its gradient function by the
    fake of kdakit::no_backward) and a gradient requested through it still raises."""
    import warnings

    x = inputs(1, 5, 2, 2, 16, use_gate=True, l2_in_kernel=True)
    t = _leaves(x, "cpu", "A_log")

    def layer(q, k, v, g, beta):
        o, ht = kdakit.fused_recurrent_kda(q, k, v, g, beta, A_log=t["A_log"], dt_bias=t["dt_bias"],
                                           initial_state=t["h0"], output_final_state=True, **GATE)
        return o * 2, ht

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o, ht = compiled(*_decode_args(t))
    ro, rht = layer(*_decode_args(t))
    _same_values(o, ro)
    _same_values(ht, rht)
    with pytest.raises(RuntimeError, match="^fused_recurrent_kda: has no backward"):
        o.sum().backward()
