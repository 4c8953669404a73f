"""SGLang's KDA call sites replayed argument for argument through `kdakit.integrations.sglang`, at small sizes,
against the float64 reference.

Upstream (sgl-project/sglang):
- extend: `python/sglang/srt/layers/attention/linear/kda_backend.py` @ 5c39fd02 -> `TritonKDAKernel.extend` in
  `.../linear/kernels/kda_triton.py` @ 70310f05 (`chunk_kda(q, k, v, g, beta, initial_state=ssm_states,
  initial_state_indices=cache_indices, use_qk_l2norm_in_kernel=True, cu_seqlens=query_start_loc)`, returns o), and
  its newer form @ 007d1d93 (`A_log=`, `dt_bias=`, `lower_bound=` with the raw gate,
  `output_intermediate_states=`), against `python/sglang/kernels/ops/attention/fla/kda.py` @ 2cd7fddd;
- decode and target verify: `TritonKDAKernel.decode` / `.target_verify` @ 007d1d93
  (`fused_sigmoid_gating_delta_rule_update(A_log=, dt_bias=, q=, k=, v=, a=, b=, initial_state_source=ssm_states,
  initial_state_indices=cache_indices, cu_seqlens=query_start_loc, use_qk_l2norm_in_kernel=True, softplus_beta=1.0,
  softplus_threshold=20.0, is_kda=True[, disable_state_update=True, intermediate_states_buffer=, ...])`), against
  `python/sglang/kernels/ops/attention/fla/fused_sigmoid_gating_recurrent.py` @ 7e1816db.
"""
import pytest
import torch

import kdakit
from conftest import assert_close
from kdakit.integrations import sglang
from replay import (DEVICES, check_pool, make, out_tol, pool, pool_reference, reference, tol,
                    token_states_reference)

H, HV, K = 2, 4, 32  # GVA: SGLang's kernels take HV a multiple of H


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_extend_pregated(seed, device, state_dtype):
    """kda_triton.py @ 70310f05: the activated g and beta, the pool updated in place through cache_indices."""
    lens = [40, 1, 65]
    x = make(lens, H, HV, K, device=device)
    ssm_states = pool(6, HV, K, dtype=state_dtype, device=device)
    before = ssm_states.clone()
    cache_indices = torch.tensor([4, 0, 2], dtype=torch.int32, device=device)
    with torch.inference_mode():
        o = sglang.chunk_kda(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], initial_state=ssm_states,
                             initial_state_indices=cache_indices, use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"])
    assert isinstance(o, torch.Tensor) and o.shape == x["v"].shape
    o_ref, pool_ref, _ = pool_reference(x, before, cache_indices.tolist(), is_pad=lambda s: s < 0)
    assert_close("o", o_ref, o, out_tol(x, device))
    check_pool("ssm_states", ssm_states, pool_ref, cache_indices.tolist(), device, prefill_inputs=x["q"].dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lower_bound,beta_is_raw", [(None, False), (-5.0, False), (-5.0, True)])
def test_extend_raw_gate_with_chunk_states(seed, device, lower_bound, beta_is_raw):
    """kda_triton.py @ 007d1d93: raw g with A_log, dt_bias and lower_bound (the gate in kernel), and the chunk-start
    states h for prefix caching (`output_intermediate_states=True` returns `(o, h)`, h [1,NT,HV,V,K])."""
    lens = [70, 64, 3]
    x = make(lens, H, HV, K, device=device, gate="raw", g_dtype=torch.bfloat16,
             beta="logit" if beta_is_raw else "prob", beta_dtype=torch.bfloat16 if beta_is_raw else torch.float32)
    ssm_states = pool(5, HV, K, device=device)
    before = ssm_states.clone()
    cache_indices = torch.tensor([1, 3, 4], dtype=torch.int32, device=device)
    o, h = sglang.chunk_kda(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], initial_state=ssm_states,
                            initial_state_indices=cache_indices, use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"],
                            A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=lower_bound,
                            output_intermediate_states=True, beta_is_raw=beta_is_raw)
    assert not o.is_inference()
    flags = dict(gate=True, lower_bound=lower_bound, beta_sigmoid=beta_is_raw)
    o_ref, pool_ref, _ = pool_reference(x, before, cache_indices.tolist(), is_pad=lambda s: s < 0, **flags)
    assert_close("o", o_ref, o, out_tol(x, device))
    check_pool("ssm_states", ssm_states, pool_ref, cache_indices.tolist(), device, prefill_inputs=x["q"].dtype)
    *_, h_ref = kdakit.naive_recurrent_kda(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=before[cache_indices.long()], A_log=x["A_log"],
        dt_bias=x["dt_bias"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=beta_is_raw, lower_bound=lower_bound, state_v_first=True,
        cu_seqlens=x["cu"].cpu(), return_intermediate_states=True)
    assert h.shape == h_ref.shape == (1, 2 + 1 + 1, HV, K, K) and h.dtype == x["k"].dtype
    assert_close("h", h_ref, h, tol(h.dtype, device))


def _decode_inputs(device, N, pad_to, a_form):
    """A decode batch of N requests padded (CUDA graph) to `pad_to`: cache_indices -1 and one token each for the
    padded requests; a raw [T,HV*K] (or [1,T,HV,K]), b raw [T,HV], both in the model dtype."""
    x = make([1] * pad_to, H, HV, K, device=device, gate="raw", g_dtype=torch.bfloat16, beta="logit",
             beta_dtype=torch.bfloat16)
    a = x["g"][0].flatten(-2) if a_form == "flat" else x["g"]
    b = x["beta"][0]
    slots = (torch.randperm(3 * pad_to)[:N]).tolist() + [-1] * (pad_to - N)
    return x, a, b, torch.tensor(slots, dtype=torch.int32, device=device), slots


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("a_form", ["flat", "4d"])
def test_decode(seed, device, a_form):
    """TritonKDAKernel.decode: A_log [1,1,HV,1], dt_bias [HV*K], a and b raw, v-first pool in place."""
    N = 5
    x, a, b, cache_indices, slots = _decode_inputs(device, N, N, a_form)
    ssm_states = pool(3 * N, HV, K, device=device)
    before = ssm_states.clone()
    with torch.inference_mode():
        o = sglang.fused_sigmoid_gating_delta_rule_update(
            A_log=x["A_log"].reshape(1, 1, HV, 1), dt_bias=x["dt_bias"], q=x["q"], k=x["k"], v=x["v"], a=a, b=b,
            initial_state_source=ssm_states, initial_state_indices=cache_indices, cu_seqlens=x["cu"],
            use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, is_kda=True)
    flags = dict(gate=True, beta_sigmoid=True)
    o_ref, pool_ref, _ = pool_reference(x, before, slots, is_pad=lambda s: s < 0, **flags)
    assert_close("o", o_ref, o, out_tol(x, device))
    check_pool("ssm_states", ssm_states, pool_ref, slots, device)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_cuda_graph_padding(seed, device):
    """The CUDA-graph batch: 3 requests padded to 8 with cache_indices -1 (one dummy token each). The padded
    requests read and write no state; their rows are zeros (SGLang computes them from a zero state and drops them)."""
    N, pad_to = 3, 8
    x, a, b, cache_indices, slots = _decode_inputs(device, N, pad_to, "flat")
    ssm_states = pool(3 * pad_to, HV, K, device=device)
    before = ssm_states.clone()
    with torch.inference_mode():
        o = sglang.fused_sigmoid_gating_delta_rule_update(
            x["A_log"], a, x["dt_bias"], 1.0, 20.0, x["q"], x["k"], x["v"], b, ssm_states, cache_indices,
            use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"], is_kda=True)
    o_ref, pool_ref, pad_rows = pool_reference(x, before, slots, is_pad=lambda s: s < 0, gate=True,
                                               beta_sigmoid=True)
    assert int(pad_rows.sum()) == pad_to - N
    assert_close("o", o_ref, o, out_tol(x, device))
    check_pool("ssm_states", ssm_states, pool_ref, slots[:N], device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("buffer_dtype", [torch.float32, torch.bfloat16])
def test_target_verify(seed, device, buffer_dtype):
    """TritonKDAKernel.target_verify (chain): S draft tokens per request, the committed pool untouched
    (disable_state_update=True), the state after every token into intermediate_states_buffer[slot, step]."""
    N, S = 3, 4
    x = make([S] * N, H, HV, K, device=device, gate="raw", g_dtype=torch.bfloat16, beta="logit",
             beta_dtype=torch.bfloat16)
    ssm_states = pool(6, HV, K, device=device)
    before = ssm_states.clone()
    cache_indices = torch.tensor([5, 2, 0], dtype=torch.int32, device=device)
    buffer = torch.full((4, S, HV, K, K), float("nan"), dtype=buffer_dtype, device=device)
    ist_indices = torch.tensor([3, -1, 0], dtype=torch.int32, device=device)
    with torch.inference_mode():
        o = sglang.fused_sigmoid_gating_delta_rule_update(
            A_log=x["A_log"], dt_bias=x["dt_bias"], q=x["q"], k=x["k"], v=x["v"], a=x["g"][0].flatten(-2),
            b=x["beta"][0], initial_state_source=ssm_states, initial_state_indices=cache_indices,
            cu_seqlens=x["cu"], use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0,
            is_kda=True, disable_state_update=True, intermediate_states_buffer=buffer,
            intermediate_state_indices=ist_indices, cache_steps=S, retrieve_parent_token=None)
    assert torch.equal(ssm_states, before)
    flags = dict(gate=True, beta_sigmoid=True)
    h0 = before[cache_indices.long()].double().cpu()
    o_ref, _ = reference(x, initial_state=h0, **flags)
    assert_close("o", o_ref, o, out_tol(x, device))
    per_token = token_states_reference(x, h0, [S] * N, **flags).reshape(N, S, HV, K, K)
    assert_close("buffer[3]", per_token[0], buffer[3], tol(buffer_dtype, device))
    assert_close("buffer[0]", per_token[2], buffer[0], tol(buffer_dtype, device))
    assert buffer[[1, 2]].isnan().all(), "rows of no request (and of index -1) must stay untouched"


def test_errors():
    x = make([2, 1], H, HV, K, gate="raw", beta="logit")
    ssm = pool(3, HV, K)
    idx = torch.tensor([0, 1], dtype=torch.int32)
    a, b = x["g"][0].flatten(-2), x["beta"][0]
    args = (x["A_log"], a, x["dt_bias"], 1.0, 20.0, x["q"], x["k"], x["v"], b, ssm, idx)
    with torch.inference_mode():
        with pytest.raises(NotImplementedError, match="is_kda=False"):
            sglang.fused_sigmoid_gating_delta_rule_update(*args, cu_seqlens=x["cu"])
        with pytest.raises(kdakit.InvalidArgumentError, match="softplus_beta"):
            sglang.fused_sigmoid_gating_delta_rule_update(*args[:3], 2.0, *args[4:], cu_seqlens=x["cu"], is_kda=True)
        with pytest.raises(NotImplementedError, match="retrieve_parent_token"):
            sglang.fused_sigmoid_gating_delta_rule_update(*args, cu_seqlens=x["cu"], is_kda=True,
                                                          retrieve_parent_token=idx[None])
        with pytest.raises(kdakit.InvalidArgumentError, match="^a: expected"):
            sglang.fused_sigmoid_gating_delta_rule_update(*args[:1], a[:, :-1], *args[2:], cu_seqlens=x["cu"],
                                                          is_kda=True)
        with pytest.raises(NotImplementedError, match="track_state"):
            sglang.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=ssm,
                             initial_state_indices=idx, cu_seqlens=x["cu"], track_state=ssm)
        with pytest.raises(kdakit.InvalidArgumentError, match="dt_bias/lower_bound"):
            sglang.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=ssm,
                             initial_state_indices=idx, cu_seqlens=x["cu"], dt_bias=x["dt_bias"])
        with pytest.raises(kdakit.InvalidArgumentError, match="initial_state_indices"):
            sglang.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=ssm, cu_seqlens=x["cu"])
