"""Padding in serving batches (spec §1.7, §1.8, §5.4): slot ids that are -1 or `pad_slot_id`, index rows past N and a
token tail past cu_seqlens[-1], as CUDA-graph engines (vLLM) pass them. Every test runs on the CPU and, on a GPU
machine, on the CUDA kernels: padding gives exact zeros and leaves the pool bit-exact; real sequences match the
float64 oracle."""
import pytest
import torch
import torch.nn.functional as F

import kdakit
import naive
from conftest import assert_close, same_bits

H, HV, D = 2, 4, 32
BATCH, REAL = 8, 5  # the captured batch size and the real sequences in it


def tol(device, state_dtype=torch.float32):
    """spec §6.1: fp32 inputs 1e-5 on the CPU, 1e-4 on CUDA; a bf16 state 4e-3."""
    if state_dtype == torch.bfloat16:
        return 4e-3
    return 1e-5 if device == "cpu" else 1e-4


def token_inputs(T, device, real_tokens):
    """Raw inputs for the in-kernel gate, L2 norm and beta sigmoid; the tokens past `real_tokens` are NaN (padding
    must not be computed into anything)."""
    x = dict(q=torch.rand(1, T, H, D), k=torch.rand(1, T, H, D), v=torch.rand(1, T, HV, D),
             g=torch.randn(1, T, HV, D), beta=torch.randn(1, T, HV))
    for t in x.values():
        t[:, real_tokens:] = float("nan")
    x = {n: t.to(device) for n, t in x.items()}
    x["A_log"] = torch.log(torch.empty(HV).uniform_(1, 16)).to(device)
    x["dt_bias"] = torch.randn(HV * D).to(device)
    return x


def oracle(x, h0, cu):
    """float64 outputs and final states of the sequences `cu` delimits (v-first states in and out)."""
    cpu = {n: t.cpu() for n, t in x.items()}
    g = naive.gate(cpu["g"].double(), cpu["A_log"], cpu["dt_bias"], -5.0)
    T = cu[-1]
    o, ht = naive.kda(cpu["q"][:, :T], cpu["k"][:, :T], cpu["v"][:, :T], g[:, :T], cpu["beta"][:, :T], None,
                      h0, l2=True, beta_sigmoid=True, cu_seqlens=cu, state_v_first=True)
    return o, ht


def make_pool(P, device, pool_dtype=torch.float32):
    """A v-first pool [P,HV,V,K] poisoned with NaN; real slots get random states."""
    return torch.full((P, HV, D, D), float("nan"), dtype=pool_dtype, device=device)


def fill_slots(pool, slots):
    for s in slots:
        pool[s] = torch.randn(HV, D, D).to(pool.device, pool.dtype)


def decode_batch(device, pad, form, real, T=BATCH, P=16):
    """One decode step of a batch padded to BATCH entries: `real` sequences of one token, then padding. form
    'sequences': cu_seqlens and the indices have BATCH rows, the padded ones empty with padded slots; 'rows': cu_seqlens
    names the real sequences only and the indices carry BATCH rows (the extra ones ignored)."""
    usable = [s for s in range(P) if s != pad]
    slots = [usable[i] for i in torch.randperm(len(usable))[:real].tolist()]
    idx = torch.full((BATCH,), pad, dtype=torch.int32)
    idx[:real] = torch.tensor(slots, dtype=torch.int32)
    cu = list(range(real + 1)) + ([real] * (BATCH - real) if form == "sequences" else [])
    has = torch.ones(BATCH, dtype=torch.bool)
    has[1] = False  # starts from zero, still writes
    return slots, idx.to(device), torch.tensor(cu, dtype=torch.int32, device=device), has.to(device)


def decode_call(x, pool, idx, cu, has, pad, out):
    return kdakit.fused_recurrent_kda_fwd(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], pool, None, cu_seqlens=cu,
        ssm_state_indices=idx, state_v_first=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, out=out, has_initial_state=has, pad_slot_id=pad)


def check_decode_step(x, before, pool, out, slots, has, real, device):
    """Real rows against the oracle, padded rows exactly zero, unnamed slots (slot 0 under pad_slot_id=0) bit-exact."""
    h0 = torch.stack([before[s].cpu().double() if has[n] else torch.zeros(HV, D, D, dtype=torch.float64)
                      for n, s in enumerate(slots)])
    ro, rht = oracle(x, h0, list(range(real + 1)))
    assert_close("o", ro[:, :real], out[:, :real], tol(device))
    assert torch.count_nonzero(out[:, real:]) == 0 and not out[:, real:].isnan().any(), "padded rows must be zero"
    assert_close("slots", rht, pool[slots], tol(device, pool.dtype))
    for s in range(pool.shape[0]):
        if s not in slots:
            assert same_bits(pool[s], before[s]), f"slot {s} was touched"


@pytest.mark.parametrize("pad", [-1, 0])
@pytest.mark.parametrize("form", ["sequences", "rows"])
def test_decode_batch_of_a_captured_size(seed, device, pad, form):
    """vLLM's full-CUDA-graph decode: batch 8 of which 5 real, indices padded with -1 or with 0 (pad_slot_id=0), the
    token tail past cu_seqlens[-1] padding too."""
    slots, idx, cu, has = decode_batch(device, pad, form, REAL)
    x = token_inputs(BATCH, device, REAL)
    pool = make_pool(16, device)
    fill_slots(pool, slots)
    before = pool.clone()
    out = torch.full((1, BATCH, HV, D), float("nan"), device=device)
    with torch.inference_mode():
        o, st = decode_call(x, pool, idx, cu, has, pad, out)
    assert o is out and st is pool
    check_decode_step(x, before, pool, out, slots, has.cpu(), REAL, device)


@pytest.mark.parametrize("pad", [-1, 0])
def test_decode_cuda_graph_capture_and_replay(seed, device, pad):
    """The same step captured once in a torch.cuda.CUDAGraph at batch 8 and replayed with new inputs, slots and
    real counts (5, then 3): the graph reads everything from device memory."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    P = 16
    slots, idx, cu, has = decode_batch(device, pad, "sequences", REAL, P=P)
    x = token_inputs(BATCH, device, REAL)
    pool = make_pool(P, device)
    fill_slots(pool, range(P))
    out = torch.zeros(1, BATCH, HV, D, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        decode_call(x, pool.clone(), idx, cu, has, pad, out)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        decode_call(x, pool, idx, cu, has, pad, out)
    for real in (REAL, 3):
        new_slots, new_idx, new_cu, new_has = decode_batch(device, pad, "sequences", real, P=P)
        new_x = token_inputs(BATCH, device, real)
        with torch.inference_mode():
            for n in x:
                x[n].copy_(new_x[n])
            idx.copy_(new_idx)
            cu.copy_(new_cu)
            has.copy_(new_has)
            out.fill_(float("nan"))
            pool.fill_(float("nan"))
            fill_slots(pool, new_slots)
        before = pool.clone()
        graph.replay()
        torch.cuda.synchronize()
        check_decode_step(x, before, pool, out, new_slots, has.cpu(), real, device)


@pytest.mark.parametrize("pad", [-1, 0])
def test_verify_with_padded_sequences(seed, device, pad):
    """Speculative verify (2-D indices, num_accepted_tokens, not in place) in a padded batch: the per-token states of
    a padded sequence and of the token tail are zeros, the pool is untouched; a padded write slot of a real sequence
    only skips that write (in place)."""
    N, S, P = 4, 3, 40
    usable = [s for s in range(P) if s != pad]
    idx = torch.tensor(usable[:N * S], dtype=torch.int64)[torch.randperm(N * S)].reshape(N, S)
    idx = torch.cat([idx, torch.full((2, S), -7, dtype=torch.int64)])  # rows past N: ignored
    idx[2] = pad  # sequence 2 is padding
    accepted = torch.tensor([1, 3, 2, 2, 0, 0])  # entries past N: ignored
    lens = [3, 3, 3, 0]
    cu = [0, 3, 6, 9, 9]
    T = 11  # a tail of two tokens
    x = token_inputs(T, device, cu[-1])
    pool = make_pool(P, device)
    fill_slots(pool, usable)
    before = pool.clone()
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], pool)
    kw = dict(cu_seqlens=torch.tensor(cu, device=device), num_accepted_tokens=accepted.to(device),
              state_v_first=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, pad_slot_id=pad)
    with torch.inference_mode():
        o, token_states = kdakit.fused_recurrent_kda_fwd(*args, inplace_final_state=False,
                                                         ssm_state_indices=idx.to(device), **kw)
    assert all(same_bits(pool[s], before[s]) for s in range(P)), "verify must not touch the pool"
    read = [int(idx[n, accepted[n] - 1]) for n in range(N)]
    h0 = torch.stack([before[s].cpu().double() if n != 2 else torch.zeros(HV, D, D, dtype=torch.float64)
                      for n, s in enumerate(read)])
    ro, _ = oracle(x, h0, cu)
    real_rows = [t for n in range(N) if n != 2 for t in range(cu[n], cu[n + 1])]
    assert_close("o", ro[:, real_rows], o[:, real_rows], tol(device))
    for t in list(range(cu[2], cu[3])) + list(range(cu[-1], T)):
        assert torch.count_nonzero(o[:, t]) == 0 and not o[:, t].isnan().any(), f"output of padding token {t}"
        assert torch.count_nonzero(token_states[t]) == 0 and not token_states[t].isnan().any(), \
            f"state of padding token {t}"
    # In place, with one write slot of sequence 1 (not the one it reads) made padding.
    skipped = int(idx[1, accepted[1] % lens[1]])
    idx[1, accepted[1] % lens[1]] = pad
    with torch.inference_mode():
        o2, _ = kdakit.fused_recurrent_kda_fwd(*args, ssm_state_indices=idx.to(device), **kw)
    assert same_bits(o2, o)
    written = {int(idx[n, t]) for n in range(N) if n != 2 for t in range(lens[n])} - {skipped, pad}
    for n in range(N):
        for t in range(lens[n]):
            s = int(idx[n, t])
            if s in written:
                assert_close(f"slot of n={n} t={t}", token_states[cu[n] + t].double(), pool[s].double(), tol(device))
    for s in range(P):
        if s not in written:
            assert same_bits(pool[s], before[s]), f"slot {s} was touched"


@pytest.mark.parametrize("pad", [-1, 0])
def test_prefill_with_padded_sequences(seed, device, pad):
    """chunk_kda's serving prefill: padded sequences anywhere in the batch (their output rows and chunk states are
    zeros, their slots untouched), index and has_initial_state rows past N, and a token tail."""
    P, lens, tail = 10, [40, 70, 0, 33, 5], 9
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T = cu[-1] + tail
    x = token_inputs(T, device, cu[-1])
    slots = [3, pad, 7, pad, 5]
    idx = torch.tensor(slots + [-9, 100], dtype=torch.int32, device=device)  # two rows past N = 5
    has = torch.tensor([True, True, True, True, False, False, True], device=device)
    pool = make_pool(P, device)
    fill_slots(pool, [3, 7, 5])
    before = pool.clone()
    out = torch.full((1, T, HV, D), float("nan"), device=device)
    with torch.inference_mode():
        o, st, h = kdakit.chunk_kda(
            x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, state_v_first=True,
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device), cu_seqlens_cpu=torch.tensor(cu),
            ssm_state_indices=idx, has_initial_state=has, pad_slot_id=pad, out=out, chunk_size=32,
            return_intermediate_states=True, A_log=x["A_log"], dt_bias=x["dt_bias"])
    assert o is out and st is pool
    real = [n for n, s in enumerate(slots) if s != pad]
    h0 = torch.stack([before[s].cpu().double() if (s != pad and n != 4) else
                      torch.zeros(HV, D, D, dtype=torch.float64) for n, s in enumerate(slots)])
    ro, rht = oracle(x, h0, cu)
    real_rows = [t for n in real for t in range(cu[n], cu[n + 1])]
    assert_close("o", ro[:, real_rows], out[:, real_rows], tol(device))
    for n in range(len(lens)):
        if n not in real:
            assert torch.count_nonzero(out[:, cu[n]:cu[n + 1]]) == 0, f"output of padded sequence {n}"
    assert torch.count_nonzero(out[:, cu[-1]:]) == 0 and not out[:, cu[-1]:].isnan().any(), "token tail"
    chunks = [0]
    for n in lens:
        chunks.append(chunks[-1] + (n + 31) // 32)
    for n in range(len(lens)):
        hn = h[:, chunks[n]:chunks[n + 1]]
        if n in real:
            assert not hn.isnan().any(), f"chunk states of sequence {n}"
        else:
            assert torch.count_nonzero(hn) == 0 and not hn.isnan().any(), f"chunk states of padded sequence {n}"
    for n in real:
        assert_close(f"slot {slots[n]}", rht[n], pool[slots[n]], tol(device))
    for s in range(P):
        if s not in (3, 7, 5):
            assert same_bits(pool[s], before[s]), f"slot {s} was touched"


def test_padding_arguments_are_checked():
    x = token_inputs(4, "cpu", 4)
    a = (x["q"], x["k"], x["v"], x["g"], x["beta"].sigmoid(), None, None, torch.zeros(4, HV, D, D))
    one_token = dict(cu_seqlens=torch.arange(5))  # four sequences of one token
    with torch.inference_mode():
        with pytest.raises(ValueError, match="^pad_slot_id: .*got -2"):
            kdakit.fused_recurrent_kda_fwd(*a, ssm_state_indices=torch.tensor([0, 1, 2, 3]), pad_slot_id=-2,
                                           **one_token)
        # Without indices nothing is padding: the pad id changes nothing (engines pass their constant always).
        for call, kw in ((kdakit.fused_recurrent_kda_fwd, dict(inplace_final_state=False)), (kdakit.chunk_kda, {})):
            o0, s0 = call(*a[:5], output_final_state=True, **kw, **one_token)
            o1, s1 = call(*a[:5], output_final_state=True, pad_slot_id=0, **kw, **one_token)
            assert torch.equal(o0, o1) and torch.equal(s0, s1) and torch.count_nonzero(o1) > 0
        with pytest.raises(ValueError, match="^pad_slot_id: expected an int"):
            kdakit.fused_recurrent_kda(*a[:5], pad_slot_id=torch.tensor(0))
        with pytest.raises(ValueError, match="^ssm_state_indices: .*one row per sequence"):
            kdakit.fused_recurrent_kda_fwd(*a, ssm_state_indices=torch.tensor([0, 1, 2]), **one_token)
        with pytest.raises(ValueError, match="^ssm_state_indices: .*padding is -1 or pad_slot_id = 0"):
            kdakit.fused_recurrent_kda_fwd(*a, ssm_state_indices=torch.tensor([0, 1, -3, 2]), pad_slot_id=0,
                                           **one_token)
        with pytest.raises(ValueError, match="^has_initial_state: .*expected 4 entries"):
            kdakit.fused_recurrent_kda_fwd(*a, ssm_state_indices=torch.tensor([0, 1, 2, 3]),
                                           has_initial_state=torch.ones(3, dtype=torch.bool), **one_token)
        with pytest.raises(ValueError, match="^cu_seqlens: .*not exceed the number of tokens T = 4"):
            kdakit.fused_recurrent_kda_fwd(*a, cu_seqlens=torch.tensor([0, 2, 5]),
                                           ssm_state_indices=torch.tensor([0, 1]))
        # A pad id past the pool is padding, not out of range; ids past the pool are errors otherwise.
        o, _ = kdakit.fused_recurrent_kda_fwd(*a, ssm_state_indices=torch.tensor([0, 9, 2, 3]), pad_slot_id=9,
                                              **one_token)
        assert torch.count_nonzero(o[:, 1]) == 0 and torch.count_nonzero(o[:, 0]) > 0
        with pytest.raises(ValueError, match="^ssm_state_indices: .*out of range"):
            kdakit.fused_recurrent_kda_fwd(*a, ssm_state_indices=torch.tensor([0, 9, 2, 3]), **one_token)
