"""Shared pieces of the engine replay tests: the device parameter, FLA's input recipe (spec §6.1) in the engines'
dtypes, the float64 references (kdakit.naive_recurrent_kda) for pools read and written through slots, and the
tolerances of spec §6.1."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kdakit
from conftest import assert_close

NO_CUDA = "no CUDA device, or kdakit was built without CUDA kernels"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not kdakit.cuda_available(), reason=NO_CUDA))]


def tol(dtype: torch.dtype, device: str) -> float:
    """Relative RMS tolerance against the float64 reference for a result stored in `dtype` (spec §6.1)."""
    if dtype == torch.bfloat16:
        return 4e-3
    if dtype == torch.float16:
        return 1e-3 if device == "cpu" else 4e-3
    return 1e-5 if device == "cpu" else 1e-4


def prefill_tol(state_dtype: torch.dtype, in_dtype: torch.dtype, device: str) -> float:
    """States of a chunked forward (prefill): on CUDA its matrix operands follow the inputs, so 16-bit inputs give the
    16-bit tolerance whatever the state's dtype (spec §6.1, "fp16/bf16 inputs or bf16 states"); elsewhere tol()."""
    if device == "cuda" and in_dtype != torch.float32:
        return 4e-3
    return tol(state_dtype, device)


def out_tol(x: dict, device: str) -> float:
    """Outputs: the 16-bit rounding of the output, or of the inputs on CUDA (its operands follow the inputs)."""
    if device == "cuda" and x["q"].dtype != torch.float32:
        return 4e-3
    return tol(x["q"].dtype, device)


def make(lens, H, HV, K, V=None, *, device="cpu", dtype=torch.bfloat16, varlen=True, gate="pre",
         g_dtype=torch.float32, beta="prob", beta_dtype=torch.float32, norm=1.0, l2_in_kernel=True, lower_bound=None,
         T_pad=0):
    """Inputs as the engines hand them over.

    lens: tokens per sequence; packed `[1, sum(lens) + T_pad, ...]` with int32 cu_seqlens when `varlen`, else
    `[len(lens), lens[0], ...]`. gate: 'pre' (g = logsigmoid(N)/norm, the activated log-decay) or 'raw' (the gate
    input; A_log [HV] and dt_bias [HV*K] fp32 drive the gate in kernel). beta: 'prob' (sigmoid(N)) or 'logit'.
    q and k are U(0,1), L2-normalised unless the kernel does it (`l2_in_kernel`)."""
    V = V or K
    if varlen:
        B, T = 1, sum(lens) + T_pad
    else:
        assert len(set(lens)) == 1 and T_pad == 0
        B, T = len(lens), lens[0]
    q, k = torch.rand(B, T, H, K), torch.rand(B, T, H, K)
    if not l2_in_kernel:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = torch.rand(B, T, HV, V)
    if gate == "pre":
        g = F.logsigmoid(torch.randn(B, T, HV, K)) / norm
        if lower_bound is not None:
            g = g.clamp(min=lower_bound)
    else:
        g = torch.randn(B, T, HV, K)
    b = torch.randn(B, T, HV)
    beta_t = b if beta == "logit" else torch.sigmoid(b)
    x = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.to(g_dtype), beta=beta_t.to(beta_dtype),
             A_log=torch.rand(HV).mul(15).add(1).log(), dt_bias=torch.randn(HV * K),
             cu=torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32) if varlen else None)
    return {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in x.items()}


def reference(x, *, initial_state=None, gate=False, lower_bound=None, beta_sigmoid=False, neg=False, l2=True,
              state_v_first=True, tokens=None):
    """(o, final states) in float64 by kdakit's definition (spec §1.4) on the CPU, for the real tokens `tokens`
    (default all) of `x`."""
    T = x["q"].shape[1] if tokens is None else tokens
    cut = lambda t: t[:, :T].contiguous()  # noqa: E731
    return kdakit.naive_recurrent_kda(
        cut(x["q"]), cut(x["k"]), cut(x["v"]), cut(x["g"]), cut(x["beta"]), initial_state=initial_state,
        output_final_state=True, A_log=x["A_log"] if gate else None, dt_bias=x["dt_bias"] if gate else None,
        use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=gate, use_beta_sigmoid_in_kernel=beta_sigmoid,
        allow_neg_eigval=neg, lower_bound=lower_bound, state_v_first=state_v_first,
        cu_seqlens=None if x["cu"] is None else x["cu"].cpu())


def pool(P, HV, K, V=None, *, dtype=torch.float32, device="cpu"):
    """A v-first state pool [P,HV,V,K] with N(0,1) states."""
    return torch.randn(P, HV, V or K, K).to(device=device, dtype=dtype)


def pool_reference(x, pool_before, slots, *, is_pad, **flags):
    """Sequence n starts from pool slot slots[n] (zeros when `is_pad(slot)`) and writes its final state back there.
    Returns (o_ref, pool_ref, pad_rows): float64 outputs (padded sequences' rows zero), the expected pool, and a
    bool mask of the output rows that belong to padded sequences."""
    N = len(slots)
    HV, V, K = pool_before.shape[1:]
    h0 = torch.zeros(N, HV, V, K, dtype=torch.float64)
    for n, s in enumerate(slots):
        if not is_pad(s):
            h0[n] = pool_before[s].double().cpu()
    o_ref, ht = reference(x, initial_state=h0, tokens=int(x["cu"][N]) if x["cu"] is not None else None, **flags)
    T = x["q"].shape[1]
    o_full = torch.zeros(x["q"].shape[0], T, HV, V, dtype=torch.float64)
    o_full[:, :o_ref.shape[1]] = o_ref
    pad_rows = torch.zeros(x["q"].shape[0], T, dtype=torch.bool)
    pool_ref = pool_before.double().cpu().clone()
    cu = x["cu"].cpu().tolist() if x["cu"] is not None else None
    for n, s in enumerate(slots):
        if is_pad(s):
            if cu is not None:
                pad_rows[0, cu[n]:cu[n + 1]] = True
            else:
                pad_rows[n] = True
        else:
            pool_ref[s] = ht[n]
    if cu is not None:
        pad_rows[0, cu[N]:] = True  # the token tail past cu_seqlens[-1]
    o_full[pad_rows] = 0
    return o_full, pool_ref, pad_rows


def token_states_reference(x, h0, lens, **flags):
    """The state after every token of every sequence (float64, v-first), sequence by sequence from h0[n]."""
    cu = [0] + list(torch.tensor(lens).cumsum(0).tolist())
    out = []
    for n in range(len(lens)):
        for t in range(lens[n]):
            sub = {key: (val[:, cu[n]:cu[n] + t + 1] if key in ("q", "k", "v", "g", "beta") else val)
                   for key, val in x.items()}
            sub["cu"] = None
            _, ht = reference(sub, initial_state=h0[n:n + 1], **flags)
            out.append(ht[0])
    return torch.stack(out)


def check_pool(name, pool_after, pool_ref, touched, device, prefill_inputs=None):
    """Slots in `touched` close to the reference; every other slot bit for bit unchanged. prefill_inputs: the input
    dtype when a chunked forward wrote the slots (prefill_tol)."""
    touched = sorted(set(touched))
    untouched = [s for s in range(pool_after.shape[0]) if s not in touched]
    if touched:
        ratio = (tol(pool_after.dtype, device) if prefill_inputs is None
                 else prefill_tol(pool_after.dtype, prefill_inputs, device))
        assert_close(name, pool_ref[touched], pool_after[touched], ratio)
    assert torch.equal(pool_after[untouched].double().cpu(), pool_ref[untouched]), f"{name}: untouched slots changed"
