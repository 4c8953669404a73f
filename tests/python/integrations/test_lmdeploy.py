"""lmdeploy's KDA call sites replayed argument for argument, at small sizes, against the float64 reference.

lmdeploy calls FLA's `chunk_kda` and `fused_recurrent_kda` with FLA's keywords, so kdakit's own functions
(`kdakit.chunk_kda`, `kdakit.fused_recurrent_kda`) take its calls unchanged; no adapter is needed.

Upstream: `lmdeploy/pytorch/backends/cuda/kda.py` @ a17e90b4 (InternLM/lmdeploy), `CudaKdaImpl.forward`: the state
rows of the batch are gathered (`_select_state`: zeros for invalid or new requests), prefill runs
`chunk_kda(q=, k=, v=, g=raw_gate, beta=raw_beta, A_log=a_log, dt_bias=dt_bias, initial_state=selected_state,
output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
safe_gate=True, lower_bound=lower_bound, state_v_first=True, cu_seqlens=metadata.cu_seqlens)` on contiguous bf16
q/k/v and the raw bf16 gate and beta, decode runs `fused_recurrent_kda` with the same keywords (no safe_gate, no
cu_seqlens) on `[B, 1, H, K]` views, and the final states are scattered back (`_store_state`).
"""
import pytest
import torch

import kdakit
from conftest import assert_close
from replay import DEVICES, make, out_tol, pool, prefill_tol, reference, tol

H, K = 4, 32
LOWER_BOUND = -5.0


def _select_state(recurrent_state, state_ids, valid):
    """lmdeploy's gather: the rows of the batch, zeros where the request has no valid (or a fresh) state."""
    selected = recurrent_state[state_ids.long()].clone()
    selected[~valid] = 0
    return selected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_prefill(seed, device, state_dtype):
    lens = [33, 64, 7]
    x = make(lens, H, H, K, device=device, gate="raw", g_dtype=torch.bfloat16, beta="logit",
             beta_dtype=torch.bfloat16)
    recurrent_state = pool(5, H, K, dtype=state_dtype, device=device)
    state_ids = torch.tensor([3, 0, 4], device=device)
    valid = torch.tensor([True, False, True], device=device)
    selected = _select_state(recurrent_state, state_ids, valid)
    with torch.inference_mode():
        output, final_state = kdakit.chunk_kda(
            q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
            initial_state=selected, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND, state_v_first=True,
            cu_seqlens=x["cu"])
        recurrent_state[state_ids] = final_state.to(state_dtype)
    flags = dict(gate=True, lower_bound=LOWER_BOUND, beta_sigmoid=True)
    o_ref, ht_ref = reference(x, initial_state=selected.double().cpu(), **flags)
    assert_close("output", o_ref, output, out_tol(x, device))
    assert_close("final_state", ht_ref, final_state, prefill_tol(torch.float32, x["q"].dtype, device))
    assert_close("recurrent_state", ht_ref, recurrent_state[state_ids], prefill_tol(state_dtype, x["q"].dtype, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_decode(seed, device, state_dtype):
    """One token per request as a [B, 1, H, K] batch (`decode_view`), without cu_seqlens."""
    B = 5
    x = make([1] * B, H, H, K, device=device, varlen=False, gate="raw", g_dtype=torch.bfloat16, beta="logit",
             beta_dtype=torch.bfloat16)
    recurrent_state = pool(8, H, K, dtype=state_dtype, device=device)
    state_ids = torch.tensor([6, 1, 2, 7, 0], device=device)
    valid = torch.tensor([True, True, False, True, True], device=device)
    selected = _select_state(recurrent_state, state_ids, valid)
    with torch.inference_mode():
        output, final_state = kdakit.fused_recurrent_kda(
            q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
            initial_state=selected, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND, state_v_first=True)
        recurrent_state[state_ids] = final_state.to(state_dtype)
    flags = dict(gate=True, lower_bound=LOWER_BOUND, beta_sigmoid=True)
    o_ref, ht_ref = reference(x, initial_state=selected.double().cpu(), **flags)
    assert output.shape == (B, 1, H, K)
    assert_close("output", o_ref, output, out_tol(x, device))
    assert_close("final_state", ht_ref, final_state, tol(torch.float32, device))
    assert_close("recurrent_state", ht_ref, recurrent_state[state_ids], tol(state_dtype, device))
