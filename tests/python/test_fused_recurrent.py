"""`kdakit.fused_recurrent_kda` and the serving entry `fused_recurrent_kda_fwd` on CPU tensors: FLA's grid
(spec §6.2) in float32 at small sizes against the float64 oracle, plus pools, verify and the errors."""

import pytest
import torch

import kdakit
import naive
from conftest import assert_close, compiled_and_eager, same_bits
from test_chunk_kda import inputs

TOL = 1e-5
# Outputs stored in 16-bit floats carry their rounding (RMS ~0.6 ulp): 2^-11 for float16, 2^-8 for bfloat16.
OUT_TOL = {torch.float32: TOL, torch.float16: 1e-3, torch.bfloat16: 4e-3}


def call(x, *, l2=False, gate=False, lower_bound=None, beta_sigmoid=False, neg=False, state_v_first=False, cu=None,
         h0=None, **kw):
    return kdakit.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x.get("A_log"),
                                      dt_bias=x.get("dt_bias"), scale=x["scale"], initial_state=h0,
                                      output_final_state=True, use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=gate,
                                      use_beta_sigmoid_in_kernel=beta_sigmoid, allow_neg_eigval=neg,
                                      lower_bound=lower_bound, state_v_first=state_v_first,
                                      cu_seqlens=None if cu is None else torch.tensor(cu), **kw)


@pytest.mark.parametrize("B,T,H,HV,D,scale,norm,l2", [
    (1, 64, 1, 1, 64, 1, 1, False), (2, 512, 3, 3, 60, 1, 1, False), (3, 250, 4, 4, 100, 0.1, 1, True),
    (2, 256, 4, 4, 128, 0.1, 1, False), (2, 512, 2, 4, 60, 1, 1, False), (2, 256, 2, 8, 128, 0.1, 1, True)])
def test_fused_recurrent(seed, B, T, H, HV, D, scale, norm, l2):
    x = inputs(B, T, H, HV, D, scale=scale, gate_logit_normalizer=norm, l2_in_kernel=l2)
    if D % 32:
        # FLA's guard against reads past D: g lives in a buffer followed by 1e30.
        buf = torch.full((B, T, HV, D + 8), 1e30)
        buf[..., :D] = x["g"]
        x["g"] = buf[..., :D]
    with torch.no_grad():
        o, ht = call(x, l2=l2, h0=x["h0"])
    ro, rht = naive.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["h0"], l2=l2)
    assert_close("o", ro, o, TOL)
    assert_close("ht", rht, ht, TOL)


@pytest.mark.parametrize("B,T,H,D,neg", [(2, 256, 4, 64, False), (2, 256, 4, 64, True), (1, 512, 3, 60, True)])
def test_fused_recurrent_use_beta_sigmoid_in_kernel(seed, B, T, H, D, neg):
    x = inputs(B, T, H, H, D)
    logits = torch.randn(B, T, H)
    with torch.no_grad():
        o, ht = call(dict(x, beta=logits), beta_sigmoid=True, neg=neg, h0=x["h0"])
        o2, ht2 = call(dict(x, beta=torch.sigmoid(logits) * (2 if neg else 1)), h0=x["h0"])
    assert_close("o", o2, o, TOL)
    assert_close("ht", ht2, ht, TOL)


@pytest.mark.parametrize("B,T,H,D,scale", [(1, 64, 1, 64, 1), (2, 512, 3, 60, 1), (3, 250, 4, 100, 0.1)])
def test_fused_recurrent_state_v_first(seed, B, T, H, D, scale):
    x = inputs(B, T, H, H, D, scale=scale)
    with torch.no_grad():
        o, ht = call(x, h0=x["h0"])
        ov, htv = call(x, h0=x["h0"].transpose(-1, -2).contiguous(), state_v_first=True)
    assert_close("o", o, ov, 1e-6)
    assert_close("ht", ht, htv.transpose(-1, -2), 1e-6)
    with pytest.warns(DeprecationWarning):
        kdakit.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], transpose_state_layout=True)
    with pytest.raises(ValueError):
        kdakit.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], state_v_first=True,
                                   transpose_state_layout=True)


@pytest.mark.parametrize("B,T,H,HV,D,scale,has_A,has_bias,safe,dtype", [
    (1, 64, 1, 1, 64, 1, True, False, False, torch.float32), (2, 256, 2, 2, 64, 1, True, True, False, torch.float32),
    (2, 512, 2, 4, 64, 0.1, True, True, True, torch.float16), (3, 250, 2, 8, 128, 1, True, False, False, torch.float16),
    (1, 64, 1, 1, 64, 1, False, False, True, torch.float32), (2, 256, 2, 4, 64, 1, False, True, True, torch.float32)])
def test_fused_recurrent_gate_in_kernel(seed, B, T, H, HV, D, scale, has_A, has_bias, safe, dtype):
    x = inputs(B, T, H, HV, D, scale=scale, use_gate=True, l2_in_kernel=True)
    x = {n: (t.to(dtype) if isinstance(t, torch.Tensor) and n in ("q", "k", "v", "g", "beta") else t)
         for n, t in x.items()}
    if not has_A:
        x["A_log"] = None
    if not has_bias:
        x["dt_bias"] = None
    lb = -5.0 if safe else None
    with torch.no_grad():
        o, ht = call(x, l2=True, gate=True, lower_bound=lb, h0=x["h0"])
    g = naive.gate(x["g"].double(), x["A_log"], x["dt_bias"], lb)
    ro, rht = naive.kda(x["q"], x["k"], x["v"], g, x["beta"], scale, x["h0"], l2=True)
    assert_close("o", ro, o, OUT_TOL[dtype])
    assert_close("ht", rht, ht, TOL)


def _pool_case(B, H, D, scale, dtype, gate, safe, pool_dtype=torch.float32, v_first=False):
    """FLA's vLLM decode recipe: T=1 per sequence, cu_seqlens=arange, a pool of 3B slots, random slot ids,
    unused slots poisoned with 1e30."""
    x = inputs(1, 0, H, H, D, scale=scale, use_gate=gate, l2_in_kernel=True, cu=list(range(B + 1)), h0=False)
    x = {n: (t.to(dtype) if isinstance(t, torch.Tensor) and n in ("q", "k", "v", "g", "beta") else t)
         for n, t in x.items()}
    shape = (3 * B, H, D, D)
    pool = torch.full(shape, 1e30, dtype=pool_dtype)
    idx = torch.randperm(3 * B)[:B].to(torch.int32)
    pool[idx.long()] = torch.randn(B, H, D, D).to(pool_dtype)
    if v_first:
        pool = pool.transpose(-1, -2).contiguous()
    return x, pool, idx


@pytest.mark.parametrize("B,H,D,scale,gate,safe,dtype", [
    (16, 16, 128, 0.1, False, False, torch.bfloat16), (32, 8, 64, 1, False, False, torch.float16),
    (7, 32, 128, 0.5, False, False, torch.bfloat16), (16, 16, 128, 0.1, True, False, torch.bfloat16),
    (32, 8, 64, 1, True, False, torch.float16), (7, 32, 128, 0.5, True, True, torch.bfloat16)])
@pytest.mark.parametrize("v_first", [False, True])
def test_fused_recurrent_vllm_decode(seed, B, H, D, scale, gate, safe, dtype, v_first):
    x, pool, idx = _pool_case(B, H, D, scale, dtype, gate, safe, v_first=v_first)
    before = pool.clone()
    lb = -5.0 if safe else None
    with torch.inference_mode():
        o, st = kdakit.fused_recurrent_kda_fwd(
            x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], pool, scale,
            inplace_final_state=True, state_v_first=v_first, cu_seqlens=torch.arange(B + 1), ssm_state_indices=idx,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=gate, lower_bound=lb)
    assert st is pool
    h0 = before[idx.long()]
    h0 = h0.transpose(-1, -2) if v_first else h0
    g = naive.gate(x["g"].double(), x["A_log"], x["dt_bias"], lb) if gate else x["g"]
    ro, rht = naive.kda(x["q"], x["k"], x["v"], g, x["beta"], scale, h0, l2=True, cu_seqlens=list(range(B + 1)))
    got = pool[idx.long()]
    got = got.transpose(-1, -2) if v_first else got
    assert_close("o", ro, o, OUT_TOL[dtype])
    assert_close("ht", rht, got, TOL)
    untouched = torch.ones(3 * B, dtype=torch.bool)
    untouched[idx.long()] = False
    assert torch.equal(pool[untouched], before[untouched]), "unnamed slots must stay bit-exact"


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_speculative_verify_and_commit(seed, pool_dtype):
    """Verify: outputs for every draft token, per-token states returned, pool untouched. Then decode in place with
    2-D indices and num_accepted_tokens reads the accepted slot."""
    N, T, H, D = 4, 3, 2, 32
    x = inputs(1, 0, H, H, D, cu=[0, 3, 6, 9, 12], use_gate=True, l2_in_kernel=True, h0=False)
    pool = torch.randn(4 * N * T, H, D, D).to(pool_dtype)
    before = pool.clone()
    idx = torch.randperm(4 * N * T)[:N * T].reshape(N, T).to(torch.int32)
    accepted = torch.tensor([1, 3, 2, 1])
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], pool)
    cu = torch.tensor([0, 3, 6, 9, 12])
    with torch.inference_mode():
        o, token_states = kdakit.fused_recurrent_kda_fwd(*args, inplace_final_state=False, cu_seqlens=cu,
                                                         ssm_state_indices=idx, num_accepted_tokens=accepted,
                                                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
    assert torch.equal(pool, before), "verify must not touch the pool"
    assert token_states.shape == (N * T, H, D, D)
    h0 = before[idx[torch.arange(N), accepted - 1].long()].double()
    g = naive.gate(x["g"].double(), x["A_log"], x["dt_bias"])
    ro, _ = naive.kda(x["q"], x["k"], x["v"], g, x["beta"], None, h0, l2=True, cu_seqlens=[0, 3, 6, 9, 12])
    assert_close("o", ro, o, TOL)
    # The state after token t of sequence n equals a run over its first t+1 tokens.
    for n in range(N):
        for t in range(T):
            s = slice(3 * n, 3 * n + t + 1)
            _, rh = naive.kda(x["q"][:, s], x["k"][:, s], x["v"][:, s], g[:, s], x["beta"][:, s], None, h0[n:n + 1],
                              l2=True)
            assert_close(f"state n={n} t={t}", rh[0], token_states[3 * n + t], TOL)
    # In place: every token's state lands in its slot.
    with torch.inference_mode():
        o2, st = kdakit.fused_recurrent_kda_fwd(*args, cu_seqlens=cu, ssm_state_indices=idx,
                                                num_accepted_tokens=accepted, use_qk_l2norm_in_kernel=True,
                                                use_gate_in_kernel=True)
    assert torch.equal(o2, o)
    tol = TOL if pool_dtype == torch.float32 else 4e-3
    for n in range(N):
        for t in range(T):
            assert_close(f"slot of n={n} t={t}", token_states[3 * n + t], pool[idx[n, t]].float(), tol)


def test_padding_slots_and_has_initial_state(seed):
    """A -1 slot is padding: no read, no write, zero output rows. has_initial_state False starts from zero and
    still writes."""
    B, H, D = 5, 2, 16
    x, pool, idx = _pool_case(B, H, D, 1.0, torch.float32, False, False)
    idx[1] = -1
    has = torch.tensor([True, True, False, True, True])
    before = pool.clone()
    out = torch.full((1, B, H, D), float("nan"))
    with torch.inference_mode():
        o, _ = kdakit.fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, pool, None,
                                              cu_seqlens=torch.arange(B + 1), ssm_state_indices=idx, out=out,
                                              has_initial_state=has, use_qk_l2norm_in_kernel=True)
    assert o is out
    h0 = before[idx.clamp_min(0).long()].clone()
    h0[2] = 0
    ro, rht = naive.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], None, h0, l2=True, cu_seqlens=list(range(B + 1)))
    real = [0, 2, 3, 4]
    assert_close("o", ro[:, real], o[:, real], TOL)
    assert torch.count_nonzero(o[:, 1]) == 0 and not o[:, 1].isnan().any(), "the padded row must be zero"
    for n in real:
        assert_close(f"slot {n}", rht[n], pool[idx[n]], TOL)
    named = set(idx.tolist()) - {-1}
    for s in range(3 * B):
        if s not in named:
            assert torch.equal(pool[s], before[s]), f"slot {s} touched"


def test_headwise_beta(seed):
    x = inputs(2, 9, 1, 4, 8)
    beta_cols = torch.rand(2, 9, 4, 8)
    with torch.no_grad():
        o, ht = call(dict(x, beta=beta_cols), h0=x["h0"])
    # Reference: per-column beta, by hand.
    q, k = x["q"].double().repeat_interleave(4, 2), x["k"].double().repeat_interleave(4, 2)
    S = x["h0"].double().clone()
    outs = []
    for t in range(9):
        S = S * x["g"][:, t].double().exp()[..., None]
        u = x["v"][:, t].double() - (S * k[:, t][..., None]).sum(-2)
        S = S + k[:, t][..., None] * (beta_cols[:, t].double() * u)[:, :, None, :]
        outs.append(x["scale"] * (S * q[:, t][..., None]).sum(-2))
    assert_close("o", torch.stack(outs, 1), o, TOL)
    assert_close("ht", S, ht, TOL)


def test_errors():
    x = inputs(2, 4, 1, 1, 8)
    a = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match="^A_log"):  # FLA silently uses A_log = 1 here
        kdakit.fused_recurrent_kda(*a, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="^cu_seqlens: .*batch size 1"):
        kdakit.fused_recurrent_kda(*a, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="^allow_neg_eigval"):
        kdakit.fused_recurrent_kda(*a, allow_neg_eigval=True)
    with pytest.raises(ValueError, match="^initial_state"):
        kdakit.fused_recurrent_kda(*a, initial_state=torch.zeros(3, 1, 8, 8))
    with pytest.raises(ValueError, match="^num_accepted_tokens"):
        with torch.no_grad():
            kdakit.fused_recurrent_kda_fwd(*a, None, None, torch.zeros(4, 1, 8, 8),
                                           ssm_state_indices=torch.tensor([0, 1]),
                                           num_accepted_tokens=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="^ssm_state_indices: .*out of range"):
        with torch.no_grad():
            kdakit.fused_recurrent_kda_fwd(*a, None, None, torch.zeros(4, 1, 8, 8),
                                           ssm_state_indices=torch.tensor([0, 4]))
    with pytest.raises(TypeError, match="unexpected keyword"):
        kdakit.fused_recurrent_kda(*a, bogus=1)


def test_torch_compile_decode_fullgraph(seed):
    B, H, D = 4, 2, 16
    x, pool, _ = _pool_case(B, H, D, 1.0, torch.float32, True, True)
    pool = torch.randn_like(pool)
    idx = torch.tensor([5, 0, 3, 9], dtype=torch.int32)  # sequence 1 is padding under pad_slot_id=0
    pool[0] = float("nan")
    pool2 = pool.clone()
    cu = torch.arange(B + 1)

    def step(pool):
        o, _ = kdakit.fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
                                              pool, None, cu_seqlens=cu, ssm_state_indices=idx,
                                              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                              lower_bound=-5.0, pad_slot_id=0)
        return o

    oc, oe = compiled_and_eager(step, pool, pool2)
    assert torch.equal(oc, oe) and torch.count_nonzero(oc[:, 1]) == 0
    assert same_bits(pool, pool2)
