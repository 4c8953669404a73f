"""`kdakit.chunk_kda` on CPU tensors: FLA's test grid (spec §6.2) mirrored in float32 at small sizes, against
the independent float64 torch oracle in naive.py, forward and backward."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import kdakit
import naive
from conftest import assert_close

TOL = 1e-5  # float32 kdakit vs float64 oracle, relative RMS (FLA's tests allow 5e-3 for fp16/bf16)


def inputs(B, T, H, HV, D, *, scale=1.0, gate_logit_normalizer=1.0, mask_p=0.0, use_gate=False, safe=False,
           l2_in_kernel=False, Dv=None, cu=None, reset=False, h0=True):
    """FLA's input recipe (spec §6.1) in float32."""
    Dv = Dv or D
    Ttot = T if cu is None else cu[-1]
    N = B if cu is None else len(cu) - 1
    q = torch.rand(B, Ttot, H, D)
    k = torch.rand(B, Ttot, H, D)
    if not l2_in_kernel:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = torch.rand(B, Ttot, HV, Dv)
    A_log = dt_bias = None
    if use_gate:
        g = torch.randn(B, Ttot, HV, D)
        A_log = torch.log(torch.empty(HV).uniform_(1, 16))
        dt_bias = torch.randn(HV * D)
    else:
        g = F.logsigmoid(torch.randn(B, Ttot, HV, D)) / gate_logit_normalizer
        if mask_p > 0:
            keep = torch.rand_like(g) > mask_p
            g = torch.where(keep, g, torch.full_like(g, -1000.0) if reset else torch.zeros_like(g))
        if safe:
            g = g.clamp(-5, 0)
    beta = torch.sigmoid(torch.randn(B, Ttot, HV))
    initial = torch.randn(N, HV, D, Dv) if h0 else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, h0=initial, scale=scale)


def run_both(x, *, use_gate=False, safe=False, l2=False, chunk=64, cu=None, state_v_first=False, grads=True,
             lower_bound=None, beta_sigmoid=False, neg=False):
    """kdakit.chunk_kda and the oracle on the same leaves; returns (ours, ref) dicts of outputs and grads."""
    leaves = {n: t.clone().requires_grad_(grads) for n, t in x.items() if isinstance(t, torch.Tensor)}
    cu_t = torch.tensor(cu, dtype=torch.int64) if cu is not None else None
    lb = (-5.0 if safe else None) if lower_bound is None else lower_bound
    o, ht = kdakit.chunk_kda(
        leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], scale=x["scale"],
        initial_state=leaves.get("h0"), output_final_state=True, use_qk_l2norm_in_kernel=l2,
        use_gate_in_kernel=use_gate, use_beta_sigmoid_in_kernel=beta_sigmoid, allow_neg_eigval=neg, safe_gate=safe,
        lower_bound=lb if (use_gate or safe) else None, state_v_first=state_v_first, cu_seqlens=cu_t,
        A_log=leaves.get("A_log"), dt_bias=leaves.get("dt_bias"), chunk_size=chunk)
    ro, rht = naive.kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], x["scale"],
                        leaves.get("h0"), A_log=leaves.get("A_log"), dt_bias=leaves.get("dt_bias"),
                        lower_bound=lb if use_gate else None, use_gate=use_gate, l2=l2, beta_sigmoid=beta_sigmoid,
                        neg=neg, cu_seqlens=cu, state_v_first=state_v_first)
    ours, ref = {"o": o, "ht": ht}, {"o": ro, "ht": rht}
    if grads:
        gen = torch.Generator().manual_seed(1234)  # same cotangents for every call of a test
        do, dht = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
        if state_v_first:
            dht = dht.transpose(-1, -2).contiguous()  # the same cotangent, stored v-first
        names = list(leaves)
        ours.update(zip(["d" + n for n in names], torch.autograd.grad((o * do).sum() + (ht * dht).sum(),
                                                                        list(leaves.values()))))
        ref.update(zip(["d" + n for n in names], torch.autograd.grad(
            (ro * do.double()).sum() + (rht * dht.double()).sum(), list(leaves.values()))))
    return ours, ref


def check(ours, ref, tol=TOL):
    for name in ref:
        assert_close(name, ref[name], ours[name], tol)


# test_naive_chunk: (B,T,H,HV,D,scale,norm)
@pytest.mark.parametrize("B,T,H,HV,D,scale,norm", [
    (1, 64, 1, 1, 64, 1, 1), (2, 512, 3, 3, 60, 1, 1), (2, 256, 4, 4, 128, 0.1, 1), (2, 256, 4, 4, 128, 1, 10),
    (1, 64, 1, 2, 64, 1, 1), (2, 512, 2, 4, 60, 1, 1)])
def test_naive_chunk(seed, B, T, H, HV, D, scale, norm):
    ours, ref = run_both(inputs(B, T, H, HV, D, scale=scale, gate_logit_normalizer=norm), grads=False)
    check(ours, ref)


def test_chunk_invalid_chunk_size():
    x = inputs(1, 16, 1, 1, 8)
    with pytest.raises(ValueError, match="`chunk_size` must be either 32 or 64"):
        kdakit.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=16)


# test_chunk: (B,T,H,HV,D,scale,norm,mask_p,qk_l2,gate,safe,C); FLA's T divided by 4, B at most 2.
@pytest.mark.parametrize("B,T,H,HV,D,scale,norm,mask_p,l2,gate,safe,C", [
    (1, 63, 1, 1, 64, 1, 1, 0, False, False, True, 64),
    (2, 125, 3, 3, 60, 1, 1, 0, False, False, True, 64),
    (2, 250, 3, 3, 64, 0.1, 1, 0.5, False, False, False, 64),
    (2, 256, 4, 4, 100, 1, 0.1, 0, False, False, False, 64),
    (2, 256, 4, 4, 128, 0.1, 1, 0, False, False, True, 64),
    (2, 256, 4, 4, 128, 0.1, 1, 0, True, False, True, 64),
    (2, 375, 4, 4, 128, 0.1, 10, 0, False, True, False, 64),
    (2, 512, 8, 8, 64, 0.1, 1, 0, False, True, True, 64),
    (2, 256, 2, 4, 64, 0.1, 1, 0, False, False, False, 64),
    (2, 256, 2, 8, 64, 0.1, 1, 0, False, True, False, 64),
    (2, 256, 4, 8, 128, 0.1, 1, 0, True, True, False, 64),
    (2, 160, 2, 4, 64, 0.1, 1, 0, False, True, True, 32),
    (2, 256, 2, 4, 64, 0.1, 1, 0, True, True, True, 64),
    (2, 160, 2, 4, 64, 0.1, 1, 0, False, True, True, 32),
    (2, 256, 2, 8, 128, 0.1, 1, 0, True, True, False, 64)])
def test_chunk(seed, B, T, H, HV, D, scale, norm, mask_p, l2, gate, safe, C):
    x = inputs(B, T, H, HV, D, scale=scale, gate_logit_normalizer=norm, mask_p=mask_p, use_gate=gate,
               safe=safe and not gate, l2_in_kernel=l2)
    ours, ref = run_both(x, use_gate=gate, safe=safe, l2=l2, chunk=C)
    check(ours, ref)
    for name in ("dq", "dk", "dv", "dg", "dbeta", "dh0"):
        assert ours[name].dtype == torch.float32, name


@pytest.mark.parametrize("B,T,H,D,scale,norm", [(1, 63, 1, 64, 1, 1), (2, 125, 3, 60, 1, 1),
                                                (3, 256, 4, 128, 0.1, 1), (2, 512, 8, 64, 0.1, 1)])
def test_chunk_state_v_first(seed, B, T, H, D, scale, norm):
    x = inputs(B, T, H, H, D, scale=scale, gate_logit_normalizer=norm)
    ours_kv, _ = run_both(x)
    xv = dict(x, h0=x["h0"].transpose(-1, -2).contiguous())
    ours_vk, ref_vk = run_both(xv, state_v_first=True)
    check(ours_vk, ref_vk)
    assert_close("o", ours_kv["o"], ours_vk["o"], 1e-6)
    assert_close("ht", ours_kv["ht"], ours_vk["ht"].transpose(-1, -2), 1e-6)
    assert_close("dh0", ours_kv["dh0"], ours_vk["dh0"].transpose(-1, -2), 1e-6)
    assert_close("dq", ours_kv["dq"], ours_vk["dq"], 1e-6)


@pytest.mark.parametrize("B,T,H,D,neg", [(1, 256, 4, 128, False), (1, 256, 4, 128, True), (2, 96, 2, 64, True)])
def test_chunk_use_beta_sigmoid_in_kernel(seed, B, T, H, D, neg):
    x = inputs(B, T, H, H, D, scale=0.1)
    x["beta"] = torch.randn(B, T, H)
    ours, ref = run_both(x, beta_sigmoid=True, neg=neg)
    check(ours, ref)


@pytest.mark.parametrize("H,D,mask_p,cu,gate,safe,C", [
    (4, 60, 0.1, [0, 15], True, False, 64),
    (4, 64, 0.9, [0, 256, 500, 1000], True, False, 64),
    (4, 128, 0.5, [0, 256, 500, 1000], False, False, 64),
    (4, 100, 0, [0, 15, 100, 300, 1200, 2000], True, False, 64),
    (4, 256, 0, [0, 25, 75, 300, 750, 1024], False, True, 64),
    (4, 60, 0.1, [0, 31, 96, 160], True, False, 32),
    (2, 32, 0.3, [0, 1, 1, 64, 129, 130], False, False, 64)])  # T=1, empty, exact chunk, chunk+1
def test_chunk_varlen(seed, H, D, mask_p, cu, gate, safe, C):
    # FLA's recipe: g = -1000 with probability mask_p (hard resets); k normalised in float32.
    x = inputs(1, 0, H, H, D, mask_p=mask_p if not gate else 0, use_gate=gate, safe=safe and not gate, cu=cu,
               reset=True)
    ours, ref = run_both(x, use_gate=gate, safe=safe, chunk=C, cu=cu)
    check(ours, ref)


@pytest.mark.parametrize("H,D,cu,gate", [(4, 60, [0, 2048], True), (4, 64, [0, 256, 500, 1000], True),
                                         (4, 100, [0, 15, 100, 300, 1200, 2000], True)])
def test_chunk_varlen_prefill(seed, H, D, cu, gate):
    x = inputs(1, 0, H, H, D, use_gate=gate, cu=cu)
    with torch.inference_mode():
        ours, ref = run_both(x, use_gate=gate, cu=cu, grads=False)
    check(ours, ref)


def test_chunk_gva_softplus_gate_gradients(seed):
    x = inputs(2, 70, 2, 8, 32, use_gate=True)
    ours, ref = run_both(x, use_gate=True, l2=True, beta_sigmoid=True)
    check(ours, ref)
    assert ours["dA_log"].shape == x["A_log"].shape and ours["ddt_bias"].shape == x["dt_bias"].shape


def test_chunk_lower_bound_gate_without_A_log(seed):
    x = inputs(1, 100, 2, 2, 32, use_gate=True)
    x["A_log"] = None
    ours, ref = run_both(x, use_gate=True, lower_bound=-3.0)
    check(ours, ref)


def test_chunk_return_intermediate_states(seed):
    B, T, H, D = 2, 256, 4, 32
    x = inputs(B, T, H, H, D)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with torch.inference_mode():
        o, ht, h = kdakit.chunk_kda(*args, initial_state=x["h0"], output_final_state=True,
                                    return_intermediate_states=True)
        assert h.shape == (B, 4, H, D, D) and h.dtype == x["k"].dtype
        _, _, ref_h = kdakit.naive_recurrent_kda(*args, initial_state=x["h0"], return_intermediate_states=True)
        assert_close("h", ref_h, h, TOL)
        cu = torch.tensor([0, 100, 256])
        xv = inputs(1, 0, H, H, D, cu=[0, 100, 256])
        o, ht, h = kdakit.chunk_kda(xv["q"], xv["k"], xv["v"], xv["g"], xv["beta"], initial_state=xv["h0"],
                                    output_final_state=True, return_intermediate_states=True, cu_seqlens=cu,
                                    state_v_first=True)
        assert h.shape == (1, 2 + 3, H, D, D) and ht.shape == (2, H, D, D)
    # Unlike FLA, outside inference mode too (forward-only: tests/python/test_forward_only.py).
    _, _, h_grad_mode = kdakit.chunk_kda(*args, initial_state=x["h0"], return_intermediate_states=True)
    assert_close("h outside inference mode", ref_h, h_grad_mode, TOL)
    with pytest.raises(AssertionError, match="^return_intermediate_states: .*disable_recompute"):
        kdakit.chunk_kda(*args, return_intermediate_states=True, disable_recompute=True)


@pytest.mark.parametrize("cu", [None, [0, 100, 100, 230]])
def test_chunk_disable_recompute_same_gradients(seed, cu):
    """disable_recompute=True saves the forward's float32 chunk states for the backward (spec §4.1): the gradients do
    not change (the CPU backward recomputes its states whatever is passed)."""
    x = inputs(2 if cu is None else 1, 150, 2, 4, 32, cu=cu, use_gate=True)
    cu_t = torch.tensor(cu) if cu is not None else None
    got = []
    for disable in (False, True):
        leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")]
        o, ht = kdakit.chunk_kda(*leaves[:5], initial_state=leaves[7], output_final_state=True, A_log=leaves[5],
                                 dt_bias=leaves[6], use_gate_in_kernel=True, cu_seqlens=cu_t,
                                 disable_recompute=disable)
        got.append(torch.autograd.grad(o.square().sum() + ht.sum(), leaves))
    for a, b in zip(*got):
        assert torch.equal(a, b)


def test_chunk_serving_pool_in_place(seed):
    """Prefill reads and writes a state pool through slot indices; a -1 slot is padding (zero output rows, no state
    read or written) and unnamed slots stay untouched."""
    H, D, cu = 2, 32, [0, 40, 41, 130]
    x = inputs(1, 0, H, H, D, cu=cu, use_gate=True)
    pool = torch.randn(8, H, D, D)
    pool_before = pool.clone()
    idx = torch.tensor([5, -1, 2], dtype=torch.int32)
    has_init = torch.tensor([True, True, False])
    out = torch.full((1, 130, H, D), float("nan"))
    cu_t = torch.tensor(cu)
    with torch.no_grad():
        o, st = kdakit.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool,
                                 use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"], cu_seqlens=cu_t,
                                 ssm_state_indices=idx, has_initial_state=has_init, out=out)
    assert o is out and st is pool
    h0 = torch.stack([pool_before[5], torch.zeros(H, D, D), torch.zeros(H, D, D)])
    ro, rht = naive.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], None, h0, A_log=x["A_log"],
                        dt_bias=x["dt_bias"], use_gate=True, cu_seqlens=cu)
    real = list(range(0, 40)) + list(range(41, 130))
    assert_close("o", ro[:, real], out[:, real], TOL)
    assert torch.count_nonzero(out[:, 40]) == 0 and not out[:, 40].isnan().any(), "the padded sequence's row"
    assert_close("slot 5", rht[0], pool[5], TOL)
    assert_close("slot 2", rht[2], pool[2], TOL)
    for s in (0, 1, 3, 4, 6, 7):
        assert torch.equal(pool[s], pool_before[s]), f"slot {s} touched"


def test_chunk_deterministic_and_batch_invariant(seed):
    H, D, cu = 2, 32, [0, 70, 75, 200]
    x = inputs(1, 0, H, H, D, cu=cu)
    cu_t = torch.tensor(cu)
    with torch.no_grad():
        a, ha = kdakit.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                 output_final_state=True, cu_seqlens=cu_t)
        b, hb = kdakit.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                 output_final_state=True, cu_seqlens=cu_t)
        assert torch.equal(a, b) and torch.equal(ha, hb)
        s = slice(75, 200)
        c, hc = kdakit.chunk_kda(x["q"][:, s], x["k"][:, s], x["v"][:, s], x["g"][:, s], x["beta"][:, s],
                                 initial_state=x["h0"][2:3], output_final_state=True)
        assert torch.equal(c, a[:, s]) and torch.equal(hc[0], ha[2])


def test_chunk_bfloat16_inputs_and_state(seed):
    x = inputs(1, 130, 2, 4, 64, use_gate=True)
    xb = {n: (t.bfloat16() if isinstance(t, torch.Tensor) and n in "qkvg beta" else t) for n, t in x.items()}
    xb["h0"] = x["h0"].bfloat16()
    with torch.no_grad():
        o, ht = kdakit.chunk_kda(xb["q"], xb["k"], xb["v"], xb["g"], xb["beta"], initial_state=xb["h0"],
                                 output_final_state=True, use_gate_in_kernel=True, A_log=x["A_log"],
                                 dt_bias=x["dt_bias"], lower_bound=-5.0, safe_gate=True)
    ro, rht = naive.kda(xb["q"], xb["k"], xb["v"], xb["g"], xb["beta"], None, xb["h0"], A_log=x["A_log"],
                        dt_bias=x["dt_bias"], lower_bound=-5.0, use_gate=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    assert_close("o", ro, o, 4e-3)  # the output is rounded to bfloat16
    assert_close("ht", rht, ht, TOL)


def test_errors_name_the_argument():
    x = inputs(1, 8, 2, 2, 8)
    a = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match="state_v_first"):
        kdakit.chunk_kda(*a, state_v_first=True, transpose_state_layout=True)
    with pytest.warns(DeprecationWarning):
        kdakit.chunk_kda(*a, transpose_state_layout=False)
    with pytest.raises(AssertionError, match="initial_state"):
        kdakit.chunk_kda(*a, initial_state=torch.zeros(1, 2, 8, 8), cp_context=object())
    with pytest.raises(ValueError, match="^cu_seqlens: .*batch size 1"):
        kdakit.chunk_kda(*(t.expand(2, *t.shape[1:]) for t in a), cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="^initial_state"):
        kdakit.chunk_kda(*a, initial_state=torch.zeros(2, 2, 8, 8))
    with pytest.raises(AssertionError, match="^initial_state: .*float32 or bfloat16"):
        kdakit.chunk_kda(*a, initial_state=torch.zeros(1, 2, 8, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="^A_log"):
        kdakit.chunk_kda(*a, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="^lower_bound"):
        kdakit.chunk_kda(*a, use_gate_in_kernel=True, safe_gate=True, A_log=torch.zeros(2))
    with pytest.raises(ValueError, match="^lower_bound: .*\\[-5, 0\\)"):
        kdakit.chunk_kda(*a, use_gate_in_kernel=True, safe_gate=True, lower_bound=-6.0)
    with pytest.raises(ValueError, match="^allow_neg_eigval"):
        kdakit.chunk_kda(*a, allow_neg_eigval=True)
    with pytest.raises(AssertionError, match="^k: "):
        kdakit.chunk_kda(x["q"], x["k"][..., :4], *a[2:])
    big = torch.rand(1, 8, 2, 300)
    with pytest.raises(AssertionError, match="^q: .*K = 300"):
        kdakit.chunk_kda(big, big, x["v"], torch.zeros(1, 8, 2, 300), x["beta"])
    with pytest.raises(AssertionError, match="^v: .*multiple"):
        kdakit.chunk_kda(*a[:2], torch.rand(1, 8, 3, 8), torch.zeros(1, 8, 3, 8), torch.rand(1, 8, 3))
    with pytest.raises(AssertionError, match="^g: "):
        kdakit.chunk_kda(*a[:3], x["g"][:, :, :1], x["beta"])
    with pytest.raises(AssertionError, match="^beta: "):
        kdakit.chunk_kda(*a[:4], x["beta"][..., :1])
    with pytest.raises(ValueError, match="^q: .*float"):
        kdakit.chunk_kda(x["q"].int(), x["k"].int(), *a[2:])
    with pytest.raises(ValueError, match="^cu_seqlens: .*non-decreasing"):
        kdakit.chunk_kda(*a, cu_seqlens=torch.tensor([0, 5, 3, 8]))
    with pytest.raises(ValueError, match="^cu_seqlens: .*not exceed the number of tokens T = 8"):
        kdakit.chunk_kda(*a, cu_seqlens=torch.tensor([0, 5, 9]))
    with pytest.raises(ValueError, match="^ssm_state_indices: .*out of range"):
        with torch.no_grad():
            kdakit.chunk_kda(*a, initial_state=torch.zeros(4, 2, 8, 8), ssm_state_indices=torch.tensor([4]))
    with pytest.raises(ValueError, match="^lower_bound"):
        kdakit.chunk_kda(*a, use_gate_in_kernel=True, lower_bound=0.5)
    with pytest.raises(ValueError, match="^lower_bound: .*no effect"):
        kdakit.chunk_kda(*a, lower_bound=-1.0)
    with pytest.raises(ValueError, match="^A_log: .*use_gate_in_kernel=False"):
        kdakit.chunk_kda(*a, A_log=torch.zeros(2))
    with pytest.raises(TypeError, match="unexpected keyword"):
        kdakit.chunk_kda(*a, ssm_state_indice=torch.tensor([0]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CUDA-not-built error needs one")
def test_cuda_tensors_without_cuda_kernels():
    if kdakit.cuda_available():
        pytest.skip("this kdakit has CUDA kernels")
    x = {n: t.cuda() for n, t in inputs(1, 8, 1, 1, 8).items() if isinstance(t, torch.Tensor)}
    with pytest.raises(RuntimeError, match="CUDA kernels not built"):
        kdakit.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"])


def test_torch_compile_fullgraph(seed):
    """The custom ops (with fake implementations and autograd) trace without graph breaks."""
    x = inputs(1, 70, 2, 4, 16, use_gate=True)
    leaves = [t.clone().requires_grad_() for t in (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"])]

    def f(q, k, v, g, beta, A_log):
        o, ht = kdakit.chunk_kda(q, k, v, g, beta, output_final_state=True, use_gate_in_kernel=True, A_log=A_log,
                                 use_qk_l2norm_in_kernel=True)
        return (o * o).sum() + ht.sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = compiled(*leaves)
    grads = torch.autograd.grad(loss, leaves)
    ref_loss = f(*leaves)
    ref_grads = torch.autograd.grad(ref_loss, leaves)
    assert torch.equal(loss, ref_loss)
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a, b)


def test_eager_calls_take_the_implementation_directly(seed, monkeypatch):
    """Without autograd (and outside torch.compile) chunk_kda and its serving prefill call their implementation
    directly; with an input that requires grad, chunk_kda goes through the custom op, which autograd records (a
    gradient comes back). Both give the same bits."""
    direct = []
    impl, impl_into = kdakit.ops._chunk_fwd_impl, kdakit.ops._chunk_fwd_into_impl
    monkeypatch.setattr(kdakit.ops, "_chunk_fwd_impl", lambda *a: direct.append("fwd") or impl(*a))
    monkeypatch.setattr(kdakit.ops, "_chunk_fwd_into_impl", lambda *a: direct.append("into") or impl_into(*a))
    x = inputs(1, 70, 2, 4, 16, use_gate=True)
    kw = dict(output_final_state=True, use_gate_in_kernel=True, A_log=x["A_log"], use_qk_l2norm_in_kernel=True)
    o1, h1 = kdakit.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    assert direct == ["fwd"]
    q = x["q"].clone().requires_grad_()
    o2, h2 = kdakit.chunk_kda(q, x["k"], x["v"], x["g"], x["beta"], **kw)
    assert direct == ["fwd"], "a call autograd records must go through the custom op"
    assert o2.grad_fn is not None
    (dq,) = torch.autograd.grad(o2.sum(), q)
    assert torch.isfinite(dq).all() and dq.abs().sum() > 0
    assert torch.equal(o1, o2.detach()) and torch.equal(h1, h2.detach())
    out = torch.full_like(o1, float("nan"))
    kdakit.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], out=out, **kw)
    assert direct == ["fwd", "into"]
    assert torch.equal(out, o1)


@pytest.mark.parametrize("v_first", [False, True])
def test_initial_state_gradient_alone(seed, device, v_first):
    """kdakit::chunk_bwd_initial_state (BackwardParams::d_initial_state_only) gives the whole backward's initial-state
    gradient bit for bit, from another v and no initial state: the gradient depends on neither (the recurrence is
    linear in the state; its adjoint reads q, k, g, beta and the cotangents). Varlen with an empty sequence, GVA, the
    lower-bound gate, L2 norm and beta sigmoid in kernel, a final-state gradient."""
    from kdakit.chunk import kernel_options

    cu = torch.tensor([0, 37, 37, 100], dtype=torch.int32, device=device)
    T, N, H, HV, K, V = 100, 3, 2, 4, 16, 8
    q, k = torch.rand(1, T, H, K, device=device), torch.rand(1, T, H, K, device=device)
    v, g, beta = torch.rand(1, T, HV, V, device=device), torch.randn(1, T, HV, K, device=device), torch.randn(
        1, T, HV, device=device)
    A_log, dt_bias = torch.log(torch.empty(HV, device=device).uniform_(1, 16)), torch.randn(HV * K, device=device)
    shape = (N, HV, V, K) if v_first else (N, HV, K, V)
    h0, dht = torch.randn(shape, device=device), torch.randn(shape, device=device)
    do = torch.randn(1, T, HV, V, device=device)
    scale, gate, lb = kernel_options(q, None, True, -5.0, True, 64)
    opts = (scale, gate, lb, True, True, False, True, 64, v_first)
    full = torch.ops.kdakit.chunk_bwd(q, k, v, g, beta, A_log, dt_bias, h0, cu, None, do, dht, None, *opts)[7]
    alone = torch.ops.kdakit.chunk_bwd_initial_state(q, k, torch.rand_like(v), g, beta, A_log, dt_bias, cu, None, do,
                                                     dht, *opts)
    assert alone.shape == shape and alone.dtype == torch.float32
    assert torch.isfinite(alone).all()
    assert torch.equal(alone, full), f"max difference {(alone - full).abs().max().item():.3e}"
    assert alone[1].abs().max() > 0, "the empty sequence passes its final-state gradient on"
