"""vLLM's KDA call sites replayed argument for argument through `kdakit.integrations.vllm`, at small sizes, against
the float64 reference.

Upstream (vllm-project/vllm):
- prefill, pre-gated: `vllm/model_executor/layers/kda.py` @ 01a7e5d9 (`chunk_kda`; g, beta passed unsliced);
- prefill, gate in kernel: `vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py` @ 0195c9ec
  (`chunk_kda_with_fused_gate(raw_g=g1, g_bias=dt_bias, A_log=[1,1,H,1])`), with the bounded gate of the vendored
  `vllm/third_party/flash_linear_attention/ops/kda.py` @ 933876c3 (`safe_gate`, `lower_bound`) and K3's
  `lower_bound=gate_lower_bound`;
- decode: the same layer file (`fused_kda_gate`, then `fused_recurrent_kda(initial_state=pool,
  cu_seqlens=query_start_loc[:num_decodes + 1], ssm_state_indices=...)`), in place by default;
- full-cudagraph decode: `vllm/v1/attention/backends/gdn_attn.py` @ 5bf4f1c5 (indices padded to the captured batch
  with PAD_SLOT_ID = -1, query_start_loc padded with its last value) and NULL_BLOCK_ID = 0 of the decode kernel in
  `vllm/third_party/flash_linear_attention/ops/fused_recurrent.py` @ 5c7cb312;
- spec-decode verify: `spec_state_indices_tensor` [N, num_spec + 1] and `num_accepted_tokens` from gdn_attn.py,
  passed to `fused_recurrent_kda` (vendored kda.py @ 933876c3).
"""
import pytest
import torch
import torch.nn.functional as F

import kdakit
from conftest import assert_close
from kdakit.integrations import vllm
from replay import (DEVICES, check_pool, make, out_tol, pool, pool_reference, prefill_tol, reference, tol,
                    token_states_reference)

H, K = 2, 32


def _fused_kda_gate(raw_g, A_log, g_bias, lower_bound=None):
    """What vLLM's `fused_kda_gate` hands to the decode: the fp32 log-decay (its softplus: beta 1, threshold 20)."""
    HV = raw_g.shape[-2]
    x = raw_g.float() + g_bias.reshape(HV, K)
    if lower_bound is None:
        return -A_log.reshape(HV, 1).exp() * F.softplus(x, beta=1.0, threshold=20.0)
    return lower_bound * torch.sigmoid(A_log.reshape(HV, 1).exp() * x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g_unsliced", [False, True])
def test_prefill_pregated(seed, device, state_dtype, g_unsliced):
    """kda.py @ 01a7e5d9: zero the new sequences' slots, gather, chunk_kda, scatter the final states back."""
    lens = [5, 70, 1, 33]
    x = make(lens, H, H, K, device=device)
    g1, beta = x["g"], x["beta"]
    if g_unsliced:  # g1[:num_actual_tokens] slices dim 0 of [1, num_tokens, H, K]: the padded tail stays
        g1 = torch.cat([g1, torch.zeros_like(g1[:, :3])], 1)
        beta = torch.cat([beta, torch.zeros_like(beta[:, :3])], 1)
    recurrent_state = pool(9, H, K, dtype=state_dtype, device=device)
    before = recurrent_state.clone()
    idx = torch.tensor([7, 2, 5, 3], dtype=torch.int32, device=device)
    has_initial_state = torch.tensor([True, False, True, True], device=device)
    zero_idx = idx[~has_initial_state]
    recurrent_state[zero_idx] = 0
    initial_state = recurrent_state[idx].contiguous()
    with torch.inference_mode():
        o, last = vllm.chunk_kda(q=x["q"], k=x["k"], v=x["v"], g=g1, beta=beta, initial_state=initial_state,
                                 output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"])
        recurrent_state[idx] = last.to(state_dtype)
    assert last.dtype == torch.float32 and last.shape == (4, H, K, K)
    before[zero_idx] = 0
    o_ref, pool_ref, _ = pool_reference(x, before, idx.tolist(), is_pad=lambda s: False)
    assert_close("o", o_ref, o, out_tol(x, device))
    check_pool("pool", recurrent_state, pool_ref, idx.tolist(), device, prefill_inputs=x["q"].dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["softplus", "safe_gate", "k3_lower_bound"])
def test_prefill_fused_gate(seed, device, form):
    """kimi_gdn_linear_attn.py @ 0195c9ec: raw bf16 g1 with g_bias and A_log [1,1,H,1] fp32, beta fp32 sigmoid."""
    lens = [17, 64, 2]
    x = make(lens, H, H, K, device=device, gate="raw", g_dtype=torch.bfloat16)
    A_log = x["A_log"].reshape(1, 1, H, 1)
    extra, lb = {}, None
    if form == "safe_gate":  # the vendored op @ 933876c3: safe_gate selects lower_bound * sigmoid(...), default -5
        extra, lb = dict(safe_gate=True), -5.0
    elif form == "k3_lower_bound":  # K3: lower_bound=gate_lower_bound, in [-20, 0), without safe_gate
        extra, lb = dict(lower_bound=-8.0), -8.0
    h0 = pool(3, H, K, device=device)
    with torch.inference_mode():
        o, last = vllm.chunk_kda_with_fused_gate(
            q=x["q"], k=x["k"], v=x["v"], raw_g=x["g"], beta=x["beta"], A_log=A_log, g_bias=x["dt_bias"],
            initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"], **extra)
    o_ref, ht_ref = reference(x, initial_state=h0, gate=True, lower_bound=lb)
    assert_close("o", o_ref, o, out_tol(x, device))
    assert_close("final_state", ht_ref, last, prefill_tol(torch.float32, x["q"].dtype, device))


def _decode_batch(device, N, pad_to=None, pad_value=None, state_dtype=torch.float32):
    """One decode step of N requests (gdn_attn.py's metadata), optionally padded to a captured batch of `pad_to`:
    indices filled with `pad_value`, query_start_loc with its last value, the token count padded."""
    P = 3 * (pad_to or N) + 2
    x = make([1] * N, H, H, K, device=device, gate="raw", g_dtype=torch.bfloat16, T_pad=(pad_to or N) - N)
    slots = (torch.randperm(P - 1)[:N] + 1).tolist()  # slot 0 is vLLM's null block
    idx = torch.tensor(slots + [pad_value] * ((pad_to or N) - N), dtype=torch.int32, device=device)
    qsl = torch.arange((pad_to or N) + 1, dtype=torch.int32, device=device).clamp(max=N)
    g1 = _fused_kda_gate(x["g"], x["A_log"], x["dt_bias"])
    return x, g1, pool(P, H, K, dtype=state_dtype, device=device), idx, qsl, slots


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_decode(seed, device, state_dtype):
    """kimi_gdn_linear_attn.py @ 0195c9ec, decode: the whole pool as initial_state, updated in place."""
    N = 5
    x, g1, recurrent_state, idx, qsl, slots = _decode_batch(device, N, state_dtype=state_dtype)
    before = recurrent_state.clone()
    with torch.inference_mode():
        o, last = vllm.fused_recurrent_kda(q=x["q"], k=x["k"], v=x["v"], g=g1, beta=x["beta"],
                                           initial_state=recurrent_state, use_qk_l2norm_in_kernel=True,
                                           cu_seqlens=qsl[:N + 1], ssm_state_indices=idx)
    assert last is recurrent_state
    x = dict(x, g=g1)
    o_ref, pool_ref, _ = pool_reference(x, before, slots, is_pad=lambda s: s <= 0)
    assert_close("o", o_ref, o, out_tol(x, device))
    check_pool("pool", recurrent_state, pool_ref, slots, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pad_value", [-1, vllm.NULL_BLOCK_ID])
def test_full_cudagraph_decode(seed, device, pad_value):
    """gdn_attn.py @ 5bf4f1c5 under full CUDA graphs: 3 requests in a batch captured for 8. The padded rows read and
    write no state (slot 0 and every unused slot stay bit for bit) and output zeros."""
    N, batch = 3, 8
    x, g1, recurrent_state, idx, qsl, slots = _decode_batch(device, N, pad_to=batch, pad_value=pad_value)
    before = recurrent_state.clone()
    o = torch.full_like(x["v"], float("nan"))
    with torch.inference_mode():
        o, _ = vllm.fused_recurrent_kda(q=x["q"], k=x["k"], v=x["v"], g=g1, beta=x["beta"],
                                        initial_state=recurrent_state, use_qk_l2norm_in_kernel=True,
                                        cu_seqlens=qsl[:N + 1], ssm_state_indices=idx, out=o)
    x = dict(x, g=g1)
    o_ref, pool_ref, pad_rows = pool_reference(x, before, slots, is_pad=lambda s: s <= 0)
    assert_close("o", o_ref[~pad_rows], o[~pad_rows.to(device)], out_tol(x, device))
    assert torch.equal(o[pad_rows.to(device)].float().cpu(), torch.zeros_like(o_ref[pad_rows]).float())
    check_pool("pool", recurrent_state, pool_ref, slots, device)


def _spec_batch(device, N, S, pad_to, state_dtype, pad_value):
    """Speculative verify: N requests with S = num_spec + 1 tokens each, padded (full CUDA graph) to `pad_to`
    sequences: indices rows of `pad_value` (PAD_SLOT_ID -1, or NULL_BLOCK_ID 0 in newer vLLM), num_accepted_tokens
    1, spec_query_start_loc repeating its last value (so the padded sequences are empty)."""
    P = S * pad_to + 3
    x = make([S] * N, H, H, K, device=device, gate="raw", g_dtype=torch.bfloat16, T_pad=0)
    perm = (torch.randperm(P - 1)[:N * S] + 1).reshape(N, S)
    idx = torch.full((pad_to, S), pad_value, dtype=torch.int32)
    idx[:N] = perm
    acc = torch.ones(pad_to, dtype=torch.int32)
    acc[:N] = torch.randint(1, S + 1, (N,))
    cu = torch.arange(pad_to + 1, dtype=torch.int32).clamp(max=N) * S
    g1 = _fused_kda_gate(x["g"], x["A_log"], x["dt_bias"])
    return dict(x, g=g1, cu=cu.to(device)), pool(P, H, K, dtype=state_dtype, device=device), idx.to(device), \
        acc.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace,pad_value", [(True, -1), (True, vllm.NULL_BLOCK_ID), (False, vllm.NULL_BLOCK_ID)])
def test_spec_decode_verify(seed, device, state_dtype, inplace, pad_value):
    """Verify S = 3 draft tokens per request from slot idx[n, a_n - 1]; in place the state after token t goes to
    idx[n, t] (vLLM's default), else the per-token states come back [T, H, V, K] in the pool's dtype."""
    N, S, pad_to = 3, 3, 5
    x, recurrent_state, idx, acc = _spec_batch(device, N, S, pad_to, state_dtype, pad_value)
    before = recurrent_state.clone()
    with torch.inference_mode():
        o, states = vllm.fused_recurrent_kda(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"],
                                             initial_state=recurrent_state, inplace_final_state=inplace,
                                             use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"],
                                             ssm_state_indices=idx, num_accepted_tokens=acc)
    read = [int(idx[n, acc[n] - 1]) for n in range(N)]
    h0 = before[read].double().cpu()
    xr = dict(x, cu=x["cu"][:N + 1])
    o_ref, _ = reference(xr, initial_state=h0)
    assert_close("o", o_ref, o, out_tol(x, device))
    per_token = token_states_reference(xr, h0, [S] * N)
    if inplace:
        assert states is recurrent_state
        pool_ref = before.double().cpu().clone()
        written = idx[:N].reshape(-1).tolist()
        pool_ref[written] = per_token
        check_pool("pool", recurrent_state, pool_ref, written, device)
    else:
        assert torch.equal(recurrent_state, before)
        assert states.dtype == state_dtype and states.shape == (N * S, H, K, K)
        assert_close("token states", per_token, states, tol(state_dtype, device))


@pytest.mark.parametrize("device", DEVICES)
def test_decode_compute_gate(seed, device):
    """The vendored `fused_recurrent_kda` @ 933876c3 with the gate and the beta sigmoid in kernel: raw g, beta logits,
    a_log [1,1,H,1], g_bias [H*K], the bounded gate with lower_bound."""
    N = 4
    x = make([1] * N, H, H, K, device=device, gate="raw", g_dtype=torch.bfloat16, beta="logit",
             beta_dtype=torch.bfloat16)
    recurrent_state = pool(2 * N + 1, H, K, device=device)
    before = recurrent_state.clone()
    slots = [1 + 2 * n for n in range(N)]
    idx = torch.tensor(slots, dtype=torch.int32, device=device)
    with torch.inference_mode():
        o, _ = vllm.fused_recurrent_kda(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"],
                                        initial_state=recurrent_state, cu_seqlens=x["cu"], ssm_state_indices=idx,
                                        sigmoid_beta=True, a_log=x["A_log"].reshape(1, 1, H, 1),
                                        g_bias=x["dt_bias"], compute_gate=True, lower_bound=-6.0)
    o_ref, pool_ref, _ = pool_reference(x, before, slots, is_pad=lambda s: s <= 0, gate=True, lower_bound=-6.0,
                                        beta_sigmoid=True)
    assert_close("o", o_ref, o, out_tol(x, device))
    check_pool("pool", recurrent_state, pool_ref, slots, device)


@pytest.mark.parametrize("device", DEVICES)
def test_null_block_slot_is_padding(seed, device):
    """The contract of vLLM's decode kernel (fused_recurrent.py @ 5c7cb312: `if state_idx <= 0: return`): a sequence
    whose slot is NULL_BLOCK_ID or negative reads and writes no state; its output rows are zeros here."""
    x = make([1, 1, 1, 1], H, H, K, device=device)
    recurrent_state = pool(4, H, K, device=device)
    before = recurrent_state.clone()
    slots = [2, vllm.NULL_BLOCK_ID, 3, -1]
    idx = torch.tensor(slots, dtype=torch.int32, device=device)
    with torch.inference_mode():
        o, _ = vllm.fused_recurrent_kda(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"],
                                        initial_state=recurrent_state, cu_seqlens=x["cu"], ssm_state_indices=idx)
    o_ref, pool_ref, pad_rows = pool_reference(x, before, slots, is_pad=lambda s: s <= 0)
    assert pad_rows[0].tolist() == [False, True, False, True]
    assert_close("o", o_ref, o, out_tol(x, device))
    assert torch.equal(o[0, [1, 3]].float().cpu(), torch.zeros(2, H, K))
    check_pool("pool", recurrent_state, pool_ref, [2, 3], device)


def test_errors():
    x = make([1, 1], H, H, K, device="cpu")
    pool_ = pool(3, H, K)
    idx = torch.tensor([1, 2], dtype=torch.int32)
    common = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], initial_state=pool_, cu_seqlens=x["cu"],
                  ssm_state_indices=idx)
    with torch.inference_mode():
        with pytest.raises(TypeError, match="retrieve_parent_token"):
            vllm.fused_recurrent_kda(**common, retrieve_parent_token=idx)
        with pytest.raises(kdakit.InvalidArgumentError, match="a_log/g_bias"):
            vllm.fused_recurrent_kda(**common, a_log=x["A_log"])
        with pytest.raises(kdakit.InvalidArgumentError, match="a_log/g_bias"):
            vllm.fused_recurrent_kda(**common, compute_gate=True)
        with pytest.raises(kdakit.InvalidArgumentError, match="beta"):
            vllm.fused_recurrent_kda(**dict(common, beta=None))
        with pytest.raises(kdakit.InvalidArgumentError, match="^g: has 2 tokens, q has 4"):
            vllm.fused_recurrent_kda(**dict(common, q=torch.cat([x["q"]] * 2, 1)))
        with pytest.raises(TypeError, match="chunk_size"):
            vllm.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=32)
