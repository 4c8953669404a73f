"""The CUDA chunked forward in the serving engines' forms, against the float64 reference (kdakit.naive_recurrent_kda,
run per sequence on the CPU):

- g in its own dtype beside q, k, v (spec §1.2): float32 g next to bf16 / fp16 activations, pre-gated and raw with
  either in-kernel gate formula (spec §2.2), beta in another dtype, A_log [1,1,HV,1] and dt_bias [HV*K] in theirs; the
  16-bit g of the other type; chunk 32, K = 256, hard resets and a g without 16-byte rows.
- CUDA-graph padding (StateIO's contract, spec §1.7): slots -1 and pad_slot_id, a slot past the pool, index and
  has_initial_state rows past N, a padded token tail with and without host boundaries, intermediate states, and the
  context-parallel cut.

Outputs and intermediate states are poisoned (NaN) before each call, so every row the forward owes is checked.
Tolerances are those of spec §6.1: 4e-3 for 16-bit q, k, v, 1e-4 for float32 ones (g is read as it is, so its dtype
adds no rounding).

Run on a GPU machine: ``python tests/python/cuda/check_forward_forms.py`` (prints each case, exits 1 on a failure),
or ``pytest tests/python/cuda/check_forward_forms.py``.
"""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kdakit  # noqa: E402
from kdakit import _C  # noqa: E402
from kdakit._torch import gate_mode, stream_of, view, workspace  # noqa: E402
from conftest import rel_rms  # noqa: E402

pytestmark = pytest.mark.skipif(not kdakit.cuda_available(),
                                reason="no CUDA device, or kdakit was built without CUDA kernels")

TOL = {torch.bfloat16: 4e-3, torch.float16: 4e-3, torch.float32: 1e-4}


def inputs(T, H, HV, K, V, *, dtype=torch.bfloat16, g_dtype=torch.float32, beta_dtype=torch.float32, gate="pre",
           beta_logits=False, reset_p=0.0, a_log_shape=None, bias_dtype=torch.float32):
    """FLA's input recipe (spec §6.1), packed [1, T, ...], each tensor in its own dtype."""
    dev = "cuda"
    x = dict(q=torch.rand(1, T, H, K, device=dev).to(dtype), k=torch.rand(1, T, H, K, device=dev).to(dtype),
             v=torch.rand(1, T, HV, V, device=dev).to(dtype), gate=gate)
    if gate == "pre":
        g = F.logsigmoid(torch.randn(1, T, HV, K, device=dev))
        if reset_p:
            g = torch.where(torch.rand_like(g) < reset_p, torch.full_like(g, -1000.0), g)
        x["g"] = g.to(g_dtype)
    else:
        x["g"] = torch.randn(1, T, HV, K, device=dev).to(g_dtype)
        a_log = torch.log(torch.empty(HV, device=dev).uniform_(1, 16))
        x["A_log"] = a_log.reshape(a_log_shape or (HV,))
        x["dt_bias"] = torch.randn(HV * K, device=dev).to(bias_dtype)
    b = torch.randn(1, T, HV, device=dev)
    x["beta"] = (b if beta_logits else torch.sigmoid(b)).to(beta_dtype)
    x["beta_logits"] = beta_logits
    return x


def lower_bound_of(x):
    return -5.0 if x["gate"] == "lower_bound" else None


def cuda_forward(x, *, cu, cu_cpu=None, pool=None, indices=None, has_initial=None, pad_slot_id=None, v_first=True,
                 chunk_size=64, inter_chunks=None):
    """One planned call through the C++ API (validation, plan, launch); returns (out, intermediate states)."""
    q, k, v = x["q"], x["k"], x["v"]
    K, HV, V = q.shape[3], v.shape[2], v.shape[3]
    p = _C.ForwardParams()
    lb = lower_bound_of(x)
    _C.set_inputs(p.inputs, q, k, v, x["g"], x["beta"], x.get("A_log"), x.get("dt_bias"), cu, cu_cpu, K ** -0.5,
                  gate_mode(x["gate"] != "pre", lb), -5.0 if lb is None else lb, True, x["beta_logits"], False)
    _C.set_state(p.state, v_first, pool, pool, indices, has_initial, -1 if pad_slot_id is None else pad_slot_id)
    p.chunk_size = chunk_size
    out = torch.full(v.shape, float("nan"), device=q.device, dtype=q.dtype)
    p.out = view(out)
    h = None
    if inter_chunks is not None:
        h = torch.full((1, inter_chunks, HV) + ((V, K) if v_first else (K, V)), float("nan"), device=q.device,
                       dtype=torch.float32)
        p.intermediate_states = view(h)
    call = _C.ForwardCall(p)
    ws = workspace(call.workspace_size, q.device)
    call.run(view(ws), stream_of(q))
    torch.cuda.synchronize()
    return out, h


def reference(x, lens, starts, *, h0, v_first, chunk_size=64):
    """float64 outputs, final states and chunk-start states of each sequence, by the token recurrence (h0[n]: its
    initial state, or None for zeros)."""
    K, HV, V = x["q"].shape[3], x["v"].shape[2], x["v"].shape[3]
    res = []
    for t0, n, s0 in zip(starts, lens, h0):
        if n == 0:  # an empty sequence's final state is its initial state (spec §1.7)
            zero = torch.zeros((HV,) + ((V, K) if v_first else (K, V)), dtype=torch.float64)
            res.append((torch.zeros(0, HV, V, dtype=torch.float64), zero if s0 is None else s0.double().cpu(),
                        torch.zeros((0,) + zero.shape, dtype=torch.float64)))
            continue
        sl = slice(t0, t0 + n)
        o, ht, h = kdakit.naive_recurrent_kda(
            x["q"][:, sl], x["k"][:, sl], x["v"][:, sl], x["g"][:, sl], x["beta"][:, sl],
            initial_state=None if s0 is None else s0[None], output_final_state=True, A_log=x.get("A_log"),
            dt_bias=x.get("dt_bias"), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=x["gate"] != "pre",
            use_beta_sigmoid_in_kernel=x["beta_logits"], lower_bound=lower_bound_of(x), state_v_first=v_first,
            chunk_size=chunk_size, return_intermediate_states=True)
        res.append((o[0], ht[0], h[0]))
    return res


def expect(name, got, want, tol):
    assert torch.isfinite(got).all(), f"{name}: NaN or Inf (a row not written?)"
    err = rel_rms(got, want)
    print(f"  {name}: relative RMS error {err:.2e} (tolerance {tol:.0e})")
    assert err <= tol, f"{name}: relative RMS error {err:.2e} > {tol:.0e}"


def check_pool_call(x, lens, slots, *, pool_slots=8, pad_slot_id=None, tail=0, host_cu=True, extra_rows=0,
                    has_initial=None, v_first=True, chunk_size=64):
    """Varlen sequences of `lens` (then `tail` padded tokens) against a state pool through `slots`; a slot that is
    padding (negative, pad_slot_id, or >= pool_slots) must give zero outputs and chunk states and touch no slot."""
    K, HV, V = x["q"].shape[3], x["v"].shape[2], x["v"].shape[3]
    N = len(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    assert cu[-1] + tail == x["q"].shape[1]
    chunks = [(n + chunk_size - 1) // chunk_size for n in lens]
    pool = torch.randn((pool_slots, HV) + ((V, K) if v_first else (K, V)), device="cuda")
    before = pool.clone()
    pad = pad_slot_id if pad_slot_id is not None else -1
    padding = [s < 0 or s == pad or s >= pool_slots for s in slots]
    idx = torch.tensor(slots + [pool_slots + 5] * extra_rows, dtype=torch.int32, device="cuda")  # rows past N: ignored
    hi = None
    if has_initial is not None:
        hi = torch.tensor(has_initial + [1] * extra_rows, dtype=torch.int32, device="cuda")
    cu_dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    out, h = cuda_forward(x, cu=cu_dev, cu_cpu=torch.tensor(cu) if host_cu else None, pool=pool, indices=idx,
                          has_initial=hi, pad_slot_id=pad_slot_id, v_first=v_first, chunk_size=chunk_size,
                          inter_chunks=sum(chunks))
    h0 = [None if padding[n] or (has_initial is not None and not has_initial[n]) else before[slots[n]]
          for n in range(N)]
    real = [n for n in range(N) if not padding[n]]
    ref = dict(zip(real, reference(x, [lens[n] for n in real], [cu[n] for n in real], h0=[h0[n] for n in real],
                                   v_first=v_first, chunk_size=chunk_size)))
    tol = TOL[x["q"].dtype]
    want_o = torch.zeros(out.shape, dtype=torch.float64)
    want_h = torch.zeros(h.shape, dtype=torch.float64)
    base = 0
    for n in range(N):
        if not padding[n]:
            want_o[0, cu[n]:cu[n + 1]] = ref[n][0]
            want_h[0, base:base + chunks[n]] = ref[n][2][:chunks[n]]
        base += chunks[n]
    expect("output", out, want_o, tol)
    expect("intermediate states", h, want_h, tol)
    for n in range(N):
        if padding[n]:
            s = slice(cu[n], cu[n + 1])
            assert torch.equal(out[0, s], torch.zeros_like(out[0, s])), f"padding sequence {n}: outputs not zero"
            b = sum(chunks[:n])
            assert torch.equal(h[0, b:b + chunks[n]], torch.zeros_like(h[0, b:b + chunks[n]])), \
                f"padding sequence {n}: chunk states not zero"
    if tail:
        assert torch.equal(out[0, cu[-1]:], torch.zeros_like(out[0, cu[-1]:])), "padded token tail: outputs not zero"
    written = {slots[n]: n for n in range(N) if not padding[n]}
    for s in range(pool_slots):
        if s in written:
            expect(f"pool slot {s} (sequence {written[s]})", pool[s], ref[written[s]][1], tol)
        else:
            assert torch.equal(pool[s], before[s]), f"pool slot {s} touched"


# ---------------------------------------------------------------------------------------------------------------
# g in its own dtype.

def check_dtypes(dtype, g_dtype, *, gate="pre", beta_dtype=torch.float32, beta_logits=False, K=128, V=128,
                 chunk_size=64, reset_p=0.0, a_log_shape=None, bias_dtype=torch.float32):
    lens = [700, 1, 65, 300]
    x = inputs(sum(lens), 2, 4, K, V, dtype=dtype, g_dtype=g_dtype, beta_dtype=beta_dtype, gate=gate,
               beta_logits=beta_logits, reset_p=reset_p, a_log_shape=a_log_shape, bias_dtype=bias_dtype)
    check_pool_call(x, lens, [3, 0, 6, 1], chunk_size=chunk_size)


@pytest.mark.parametrize("gate", ["pre", "softplus", "lower_bound"])
def test_float32_g_with_bf16_inputs(gate):
    """vLLM's prefill (g from fused_kda_gate in float32, beta float32) and HF's gate; raw float32 g in kernel."""
    check_dtypes(torch.bfloat16, torch.float32, gate=gate, beta_logits=gate != "pre")


def test_float16_inputs_with_float32_g_and_bf16_beta():
    check_dtypes(torch.float16, torch.float32, gate="softplus", beta_dtype=torch.bfloat16, beta_logits=True)


def test_gate_parameters_in_the_engines_shapes():
    """vLLM's fused gate: raw bf16 g, A_log [1,1,HV,1] float32, dt_bias [HV*K] bf16."""
    check_dtypes(torch.bfloat16, torch.bfloat16, gate="softplus", beta_logits=True, a_log_shape=(1, 1, 4, 1),
                 bias_dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype,g_dtype", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16),
                                           (torch.float32, torch.bfloat16), (torch.float32, torch.float16)])
def test_other_g_dtypes_read_as_they_are(dtype, g_dtype):
    check_dtypes(dtype, g_dtype, gate="lower_bound", beta_logits=True)


@pytest.mark.parametrize("dtype,gate,K,chunk_size", [(torch.bfloat16, "softplus", 128, 64),
                                                     (torch.bfloat16, "pre", 256, 64),
                                                     (torch.bfloat16, "lower_bound", 128, 32),
                                                     (torch.float16, "softplus", 128, 64),
                                                     (torch.float32, "lower_bound", 100, 64)])
def test_g_width_changes_no_bit(dtype, gate, K, chunk_size):
    """g's values, not its dtype, make the result: float32 g holding 16-bit values gives the bits of the 16-bit g
    (both widths stage and read the same numbers), and so does the other 16-bit type where the values are exact."""
    lens = [300, 1, 129]
    x = inputs(sum(lens), 2, 4, K, K, dtype=dtype, g_dtype=torch.bfloat16, gate=gate, beta_logits=gate != "pre")
    cu = [0, 300, 301, 430]
    cu_dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    pool = torch.randn(3, 4, K, K, device="cuda")
    results = []
    for g_dtype in (torch.bfloat16, torch.float32):
        y = dict(x, g=x["g"].to(g_dtype))
        p = pool.clone()
        out, h = cuda_forward(y, cu=cu_dev, pool=p, indices=torch.tensor([2, 0, 1], dtype=torch.int32, device="cuda"),
                              chunk_size=chunk_size, inter_chunks=sum((n + chunk_size - 1) // chunk_size for n in lens))
        results.append((out, h, p))
    for a, b in zip(results[0], results[1]):
        assert torch.equal(a, b), "float32 g holding bf16 values changed the result"
    # float16 g holding values that float16 represents exactly (small integers / 8) against the same values in float32
    small = (torch.randint(-40, 1, x["g"].shape, device="cuda") / 8.0)
    outs = []
    for g_dtype in (torch.float16, torch.float32):
        y = dict(x, g=small.to(g_dtype))
        outs.append(cuda_forward(y, cu=cu_dev, chunk_size=chunk_size)[0])
    assert torch.equal(outs[0], outs[1]), "float16 g and float32 g of the same values differ"


@pytest.mark.parametrize("K,chunk_size", [(256, 64), (128, 32), (64, 32)])
def test_float32_g_tile_shapes(K, chunk_size):
    """Two 128-dimension slices (K = 256) and the chunk-32 layout, whose float32 g rows need more than its tiles."""
    check_dtypes(torch.bfloat16, torch.float32, gate="softplus", beta_logits=True, K=K, chunk_size=chunk_size)


@pytest.mark.parametrize("g_dtype", [torch.float32, torch.float16])
def test_g_of_its_own_dtype_through_hard_resets(g_dtype):
    """g = -1000 resets take the exact path, which reads g element by element."""
    check_dtypes(torch.bfloat16, g_dtype, reset_p=0.05)


@pytest.mark.parametrize("g_dtype", [torch.float32, torch.bfloat16])
def test_g_without_16_byte_rows(g_dtype):
    """g a view with odd strides and an odd base: no 16-byte copies, no paired loads."""
    lens = [300, 77]
    T, HV, K = sum(lens), 4, 128
    x = inputs(T, 2, HV, K, K, g_dtype=g_dtype, gate="softplus", beta_logits=True)
    wide = torch.empty(1, T, HV, K + 1, device="cuda", dtype=g_dtype)
    wide[..., 1:] = x["g"]
    x["g"] = wide[..., 1:]
    check_pool_call(x, lens, [2, 5])


# ---------------------------------------------------------------------------------------------------------------
# CUDA-graph padding (StateIO's contract).

@pytest.mark.parametrize("host_cu", [True, False])
@pytest.mark.parametrize("v_first", [True, False])
def test_padding_slot_minus_one_and_a_padded_tail(host_cu, v_first):
    """Slot -1 and a slot past the pool are padding; index and has_initial_state rows past N are ignored; tokens past
    cu_seqlens[N] are zero rows (with boundaries on the host: extra CTAs; without: the chunk bound's surplus)."""
    lens, tail = [130, 0, 64, 257, 5], 203
    x = inputs(sum(lens) + tail, 2, 4, 128, 128, gate="softplus", beta_logits=True)
    check_pool_call(x, lens, [4, -1, 9, 2, 0], pool_slots=8, tail=tail, host_cu=host_cu, extra_rows=3,
                    has_initial=[1, 1, 1, 0, 1], v_first=v_first)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_padding_pad_slot_id_zero(dtype):
    """vLLM's NULL_BLOCK_ID: slot 0 means padding (nothing read or written there, zero outputs)."""
    lens, tail = [64, 200, 1, 90], 64
    x = inputs(sum(lens) + tail, 2, 4, 128, 128, dtype=dtype, gate="lower_bound", beta_logits=True)
    check_pool_call(x, lens, [0, 3, 0, 5], pad_slot_id=0, tail=tail, host_cu=False, extra_rows=2)


def test_padding_with_context_parallel_cuts():
    """A padding sequence long enough to be cut: the scan and the merge skip it, every segment zeroes its rows."""
    overrides = {"KDAKIT_FORWARD_SEGMENTS": "4", "KDAKIT_FORWARD_SEGMENT_TOKENS": "128"}
    saved = {n: os.environ.get(n) for n in overrides}
    os.environ.update(overrides)
    _C.reload_overrides()
    try:
        lens, tail = [1000, 700, 1100], 100
        x = inputs(sum(lens) + tail, 2, 4, 128, 128, gate="softplus", beta_logits=True)
        check_pool_call(x, lens, [1, -1, 6], tail=tail)
    finally:
        for n, val in saved.items():
            if val is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = val
        _C.reload_overrides()


if __name__ == "__main__":
    if not kdakit.cuda_available():
        print("skipped: no CUDA device, or kdakit was built without CUDA kernels")
        sys.exit(0)
    sys.exit(pytest.main([__file__, "-v", "-s"]))
