"""The CUDA decode / speculative verify (`fused_recurrent_kda_fwd`, `fused_recurrent_kda` on CUDA tensors), the general
form (src/cuda/decode/general.cuh): against the float64 oracle (decode_cases.py) and FLA's decode where it is
importable, over the engine recipe, layouts, dtypes, gates, sequences, verify, padding slots and tilings."""
import pytest
import torch

import kdakit
from conftest import rel_rms, same_bits
from decode_cases import (make, oracle, final, kv, tol, close, make_pool, call, call_on_copy,
                          across_prefetch_distances, zero_padding, h0_from_pool, DEV, fla_decode, needs_fla)

pytestmark = pytest.mark.skipif(not kdakit.cuda_available(),
                                reason="no CUDA device, or kdakit was built without CUDA kernels")


# ---- the engine recipe (spec §6.2 test_fused_recurrent_vllm_decode) ------------------------------------------

VLLM_GRID = [  # (B, H, D, scale, norm, qk_l2, gate, safe, dtype)
    (16, 16, 128, 0.1, 1, True, False, False, torch.bfloat16), (32, 8, 64, 1, 1, False, False, False, torch.float16),
    (7, 32, 128, 0.5, 0.5, True, False, False, torch.bfloat16), (16, 16, 128, 0.1, 1, True, True, False, torch.bfloat16),
    (32, 8, 64, 1, 1, False, True, False, torch.float16), (7, 32, 128, 0.5, 0.5, True, True, True, torch.bfloat16)]


def vllm_case(B, H, D, scale, norm, l2, gate, safe, dtype, pool_dtype, v_first):
    x = make([1] * B, H, H, D, dtype=dtype, gate=("lower_bound" if safe else "softplus") if gate else "pre", l2=l2,
             beta="prob", norm=norm, scale=scale)
    idx = torch.randperm(3 * B, device=DEV)[:B].to(torch.int32)
    pool = make_pool(3 * B, H, D, D, pool_dtype, v_first, idx)
    return x, pool, idx


@pytest.mark.parametrize("B,H,D,scale,norm,l2,gate,safe,dtype", VLLM_GRID)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v_first", [False, True])
def test_fused_recurrent_vllm_decode(seed, B, H, D, scale, norm, l2, gate, safe, dtype, pool_dtype, v_first):
    x, pool, idx = vllm_case(B, H, D, scale, norm, l2, gate, safe, dtype, pool_dtype, v_first)
    before = pool.clone()
    out = torch.full_like(x["v"], float("nan"))
    o, st = call(x, pool, inplace_final_state=True, state_v_first=v_first, ssm_state_indices=idx, out=out)
    assert o is out and st is pool
    slots = idx.tolist()
    h0 = h0_from_pool(before, slots, v_first)
    ro, rs = oracle(x, h0)
    close("o", o, ro, tol(x, dtype))
    close("ht", kv(pool[idx.long()], v_first), final(rs, h0), tol(x, pool_dtype))
    untouched = torch.ones(3 * B, dtype=torch.bool, device=DEV)
    untouched[idx.long()] = False
    assert same_bits(pool[untouched], before[untouched]), "unnamed slots must stay bit-exact"


@needs_fla
@pytest.mark.parametrize("B,H,D,scale,norm,l2,gate,safe,dtype", VLLM_GRID)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v_first", [False, True])
def test_fused_recurrent_vllm_decode_against_fla(seed, B, H, D, scale, norm, l2, gate, safe, dtype, pool_dtype, v_first):
    x, pool, idx = vllm_case(B, H, D, scale, norm, l2, gate, safe, dtype, pool_dtype, v_first)
    before = pool.clone()
    fpool = pool.clone()
    o, _ = call(x, pool, inplace_final_state=True, state_v_first=v_first, ssm_state_indices=idx)
    with torch.inference_mode():
        fo, _ = fla_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], initial_state=fpool,
                           scale=scale, inplace_final_state=True, state_v_first=v_first, cu_seqlens=x["cu"].long(),
                           ssm_state_indices=idx, **x["opts"])
    h0 = h0_from_pool(before, idx.tolist(), v_first)
    ro, rs = oracle(x, h0)
    rht = final(rs, h0)
    e_ours, e_fla = rel_rms(o, ro), rel_rms(fo, ro)
    print(f"output relative RMS vs float64: kdakit {e_ours:.2e}  FLA {e_fla:.2e}")
    assert e_ours <= tol(x, dtype)
    assert rel_rms(o, fo) <= e_ours + e_fla + 1e-3, "kdakit and FLA compute different functions"
    ht, fht = kv(pool[idx.long()], v_first), kv(fpool[idx.long()], v_first)
    assert rel_rms(ht, rht) <= tol(x, pool_dtype)
    assert rel_rms(ht, fht) <= rel_rms(ht, rht) + rel_rms(fht, rht) + 1e-3
    untouched = torch.ones(3 * B, dtype=torch.bool, device=DEV)
    untouched[idx.long()] = False
    assert same_bits(pool[untouched], before[untouched]), "unnamed slots must stay bit-exact"


# ---- layouts, state dtypes, GVA, head sizes ----------------------------------------------------------------------

@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H,HV", [(4, 4), (2, 4), (2, 8)])
@pytest.mark.parametrize("K,V", [(64, 64), (128, 128), (100, 60)])
def test_layouts_dtypes_gva_head_dims(seed, v_first, pool_dtype, dtype, H, HV, K, V):
    N, T = 5, 3
    x = make([T] * N, H, HV, K, V, dtype=dtype, fixed=True)
    P = 2 * N
    idx = torch.randperm(P, device=DEV)[:N].to(torch.int32)
    pool = make_pool(P, HV, K, V, pool_dtype, v_first, idx)
    before = pool.clone()
    o, _ = call(x, pool, state_v_first=v_first, ssm_state_indices=idx)
    h0 = h0_from_pool(before, idx.tolist(), v_first)
    ro, rs = oracle(x, h0)
    close("o", o, ro, tol(x, dtype))
    close("ht", kv(pool[idx.long()], v_first), final(rs, h0), tol(x, pool_dtype))
    untouched = torch.ones(P, dtype=torch.bool, device=DEV)
    untouched[idx.long()] = False
    assert same_bits(pool[untouched], before[untouched])


@pytest.mark.parametrize("K,V", [(16, 16), (32, 256), (256, 128), (256, 256), (200, 100), (64, 8)])
@pytest.mark.parametrize("v_first", [False, True])
def test_other_head_dims(seed, K, V, v_first):
    x = make([2, 1, 5], 2, 4, K, V, dtype=torch.float32)
    h0 = torch.randn(3, 4, V, K, device=DEV) if v_first else torch.randn(3, 4, K, V, device=DEV)
    with torch.inference_mode():
        o, ht = kdakit.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],
                                           dt_bias=x["dt_bias"], initial_state=h0, output_final_state=True,
                                           state_v_first=v_first, cu_seqlens=x["cu"], **x["opts"])
    ro, rs = oracle(x, kv(h0, v_first))
    close("o", o, ro, tol(x))
    close("ht", kv(ht, v_first), final(rs, kv(h0, v_first)), tol(x))


# ---- gates, beta, input dtypes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("gate,has_A,has_bias", [("pre", False, False), ("softplus", True, True), ("softplus", True, False),
                                                 ("lower_bound", True, True), ("lower_bound", False, True),
                                                 ("lower_bound", False, False)])
@pytest.mark.parametrize("beta,neg", [("prob", False), ("logit", False), ("logit", True), ("cols", False), ("cols", True)])
def test_gates_and_beta(seed, gate, has_A, has_bias, beta, neg):
    x = make([3, 1, 4], 2, 4, 128, dtype=torch.float32, gate=gate, has_A=has_A, has_bias=has_bias, beta=beta, neg=neg)
    h0 = torch.randn(3, 4, 128, 128, device=DEV)
    with torch.inference_mode():
        o, ht = kdakit.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],
                                           dt_bias=x["dt_bias"], initial_state=h0, output_final_state=True,
                                           cu_seqlens=x["cu"], **x["opts"])
    ro, rs = oracle(x, h0.double().cpu())
    close("o", o, ro, tol(x))
    close("ht", ht, final(rs, h0.double().cpu()), tol(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("l2", [False, True])
def test_input_dtypes(seed, dtype, l2):
    x = make([2, 3], 2, 2, 128, dtype=dtype, l2=l2, scale=0.3)
    h0 = torch.randn(2, 2, 128, 128, device=DEV)
    with torch.inference_mode():
        o, ht = kdakit.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],
                                           dt_bias=x["dt_bias"], scale=0.3, initial_state=h0, output_final_state=True,
                                           cu_seqlens=x["cu"], **x["opts"])
    assert o.dtype == dtype
    ro, rs = oracle(x, h0.double().cpu())
    close("o", o, ro, tol(x, dtype))
    close("ht", ht, final(rs, h0.double().cpu()), tol(x))


# ---- sequences: fixed and varlen, long ones, empty ones ----------------------------------------------------------

@pytest.mark.parametrize("K", [128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_varlen_lengths(seed, K, dtype):
    """Lengths 0..40: more tokens than one staged batch (16, or 8 at K = 256), empty sequences (whose final state is
    their initial state), single tokens."""
    lens = [1, 16, 0, 17, 3, 40, 0, 8, 9, 1]
    x = make(lens, 2, 4, K, dtype=dtype)
    h0 = torch.randn(len(lens), 4, K, K, device=DEV)
    with torch.inference_mode():
        o, ht = kdakit.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],
                                           dt_bias=x["dt_bias"], initial_state=h0, output_final_state=True,
                                           cu_seqlens=x["cu"], **x["opts"])
    ro, rs = oracle(x, h0.double().cpu())
    close("o", o, ro, tol(x, dtype))
    close("ht", ht, final(rs, h0.double().cpu()), tol(x))


@pytest.mark.parametrize("T", [1, 2, 16, 33])
def test_fixed_length(seed, T):
    x = make([T] * 3, 4, 4, 128, dtype=torch.float32, fixed=True)
    h0 = torch.randn(3, 4, 128, 128, device=DEV)
    with torch.inference_mode():
        o, ht = kdakit.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],
                                           dt_bias=x["dt_bias"], initial_state=h0, output_final_state=True, **x["opts"])
    ro, rs = oracle(x, h0.double().cpu())
    close("o", o, ro, tol(x))
    close("ht", ht, final(rs, h0.double().cpu()), tol(x))


# ---- speculative verify and commit ---------------------------------------------------------------------------------

@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_multi_token_verify_then_commit(seed, v_first, pool_dtype, dtype):
    """Verify (no final state): outputs of every draft token and the state after each, pool untouched bit-exact.
    Then the same step in place with 2-D indices: every token's state lands in its slot, read from idx[n, a_n - 1]."""
    lens = [4, 1, 16, 3, 7]
    N, Tm, HV, D = len(lens), 16, 4, 128
    x = make(lens, 2, HV, D, dtype=dtype)
    P = 4 * N * Tm
    idx = torch.randperm(P, device=DEV)[:N * Tm].reshape(N, Tm).to(torch.int32)
    accepted = torch.tensor([2, 1, 16, 3, 5], device=DEV, dtype=torch.int32)
    pool = make_pool(P, HV, D, D, pool_dtype, v_first, idx[torch.arange(N, device=DEV), accepted.long() - 1])
    before = pool.clone()
    o, token_states = call(x, pool, inplace_final_state=False, state_v_first=v_first, ssm_state_indices=idx,
                           num_accepted_tokens=accepted)
    torch.cuda.synchronize()
    assert same_bits(pool, before), "verify must not touch the pool"
    assert token_states.shape == ((sum(lens), HV, D, D)) and token_states.dtype == torch.float32
    read = [idx[n, accepted[n] - 1].item() for n in range(N)]
    h0 = h0_from_pool(before, read, v_first)
    ro, rs = oracle(x, h0)
    close("o", o, ro, tol(x, dtype))
    cu = x["cu"].tolist()
    got = torch.cat([kv(token_states[cu[n]:cu[n + 1]], v_first) for n in range(N)])
    ref = torch.cat([torch.stack(s) for s in rs])
    close("token states", got, ref, tol(x))
    # Commit in place: state after token t to slot idx[n, t].
    o2, st = call(x, pool, inplace_final_state=True, state_v_first=v_first, ssm_state_indices=idx,
                  num_accepted_tokens=accepted)
    assert st is pool
    assert same_bits(o2, o), "verify and commit compute the same outputs"
    written = torch.zeros(P, dtype=torch.bool, device=DEV)
    for n in range(N):
        slots = idx[n, :lens[n]].long()
        written[slots] = True
        close(f"slots of sequence {n}", kv(pool[slots], v_first), torch.stack(rs[n]), tol(x, pool_dtype))
    assert same_bits(pool[~written], before[~written]), "slots past each sequence's tokens stay untouched"


@pytest.mark.parametrize("v_first", [False, True])
def test_2d_indices_with_padding_slots(seed, v_first):
    """-1 entries of 2-D indices skip that token's write; a sequence whose read slot is -1 is padding: zero outputs,
    no state read or written (spec §1.7)."""
    N, Tm, HV, D = 3, 4, 2, 64
    x = make([Tm] * N, 2, HV, D, dtype=torch.float32, fixed=True)
    idx = torch.arange(N * Tm, device=DEV, dtype=torch.int32).reshape(N, Tm)
    idx[0, 2] = -1
    idx[1, 0] = -1  # read slot of sequence 1 (a = 1): zero initial state
    accepted = torch.tensor([2, 1, 4], device=DEV, dtype=torch.int32)
    pool = make_pool(N * Tm, HV, D, D, torch.float32, v_first, range(N * Tm))
    before = pool.clone()
    o, _ = call(x, pool, state_v_first=v_first, ssm_state_indices=idx, num_accepted_tokens=accepted)
    read = [idx[n, accepted[n] - 1].item() for n in range(N)]
    h0 = h0_from_pool(before, read, v_first)
    ro, rs = oracle(x, h0)
    ro = zero_padding(ro, x, read)
    close("o", o, ro, tol(x))
    assert torch.equal(o[1], torch.zeros_like(o[1])), "the padding sequence's outputs are zeros"
    for n in range(N):
        for t in range(Tm):
            s = idx[n, t].item()
            if s >= 0 and read[n] >= 0:
                close(f"slot {s}", kv(pool[s], v_first), rs[n][t], tol(x))
    written = {idx[n, t].item() for n in range(N) for t in range(Tm) if read[n] >= 0} - {-1}
    for s in set(range(N * Tm)) - written:
        assert same_bits(pool[s], before[s]), f"slot {s} (a -1 entry's or a padding sequence's) is not written"


# ---- padding slots, has_initial_state, caller out -----------------------------------------------------------------

@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_padding_slots_and_has_initial_state(seed, v_first, pool_dtype):
    lens = [1, 1, 2, 1, 3, 1]
    HV, D = 4, 128
    x = make(lens, 2, HV, D, dtype=torch.bfloat16)
    idx = torch.tensor([5, -1, 0, 9, 3, -1], device=DEV, dtype=torch.int32)
    has = torch.tensor([True, True, False, True, False, False], device=DEV)
    pool = make_pool(12, HV, D, D, pool_dtype, v_first, [5, 0, 9, 3])
    before = pool.clone()
    out = torch.full_like(x["v"], float("nan"))
    o, _ = call(x, pool, state_v_first=v_first, ssm_state_indices=idx, has_initial_state=has, out=out)
    assert o is out and torch.isfinite(out).all(), "every output row is written"
    h0 = h0_from_pool(before, idx.tolist(), v_first, has.tolist())
    ro, rs = oracle(x, h0)
    ro = zero_padding(ro, x, idx.tolist())
    close("o", o, ro, tol(x, torch.bfloat16))
    for n, s in enumerate(idx.tolist()):
        if s >= 0:  # has_initial_state=False still writes
            close(f"slot {s}", kv(pool[s], v_first), rs[n][-1], tol(x, pool_dtype))
    for s in set(range(12)) - {5, 0, 9, 3}:
        assert same_bits(pool[s], before[s]), f"slot {s} touched"


def test_out_of_range_slots_are_ignored(seed):
    """Device-side indices cannot be checked on the host without a synchronisation: ids outside the pool are padding
    (zero outputs, no read, no write) instead of touching memory outside it."""
    x = make([1, 1], 2, 2, 64, dtype=torch.float32)
    idx = torch.tensor([7, 2], device=DEV, dtype=torch.int32)
    pool = make_pool(4, 2, 64, 64, torch.float32, True, [2])
    before = pool.clone()
    o, _ = call(x, pool, state_v_first=True, ssm_state_indices=idx)
    h0 = h0_from_pool(before, [-1, 2], True)
    ro, rs = oracle(x, h0)
    ro = zero_padding(ro, x, [-1, 2])
    close("o", o, ro, tol(x))
    assert same_bits(pool[[0, 1, 3]], before[[0, 1, 3]])


# ---- determinism, batch invariance -----------------------------------------------------------------------------

def test_determinism_and_batch_invariance(seed):
    lens = [3, 1, 16, 5]
    x = make(lens, 2, 4, 128, dtype=torch.bfloat16)
    idx = torch.tensor([3, 0, 6, 1], device=DEV, dtype=torch.int32)
    pool = make_pool(8, 4, 128, 128, torch.float32, True, idx)
    p1, p2 = pool.clone(), pool.clone()
    o1, _ = call(x, p1, state_v_first=True, ssm_state_indices=idx)
    o2, _ = call(x, p2, state_v_first=True, ssm_state_indices=idx)
    assert same_bits(o1, o2) and same_bits(p1, p2), "two runs differ"
    # Sequence 2 alone (fixed length, one sequence: another launch shape) gives the same bits.
    s = slice(4, 20)
    alone = dict(x, q=x["q"][:, s], k=x["k"][:, s], v=x["v"][:, s], g=x["g"][:, s], beta=x["beta"][:, s], cu=None)
    p3 = pool.clone()
    o3, _ = call(alone, p3, state_v_first=True, ssm_state_indices=idx[2:3])
    assert same_bits(o3, o1[:, s]) and same_bits(p3[6], p1[6]), "a sequence's result depends on its batch"


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_prefetch_distance_does_not_change_verify_results(seed, monkeypatch, v_first, pool_dtype):
    """The whole-tile general form's L2 prefetch of later CTAs' tiles (Hopper; KDAKIT_DECODE_PREFETCH CTAs per SM
    ahead, 0 off) on verify-and-commit with [N, T] indices and accepted counts: off, the default, a distance past the
    end of the grid and a fractional one give the same bits, with -1 read slots, out-of-range read slots and -1 write
    entries among the prefetch targets; slots no token names stay untouched."""
    N, Tm, H, HV = 96, 4, 2, 8
    x = make([Tm] * N, H, HV, 128, dtype=torch.bfloat16, fixed=True)
    P = 2 * N * Tm
    idx = torch.randperm(P, device=DEV)[:N * Tm].reshape(N, Tm).to(torch.int32)
    acc = torch.randint(1, Tm + 1, (N,), device=DEV, dtype=torch.int32)
    rows = torch.arange(N, device=DEV)
    idx[rows[::7], acc[::7].long() - 1] = -1       # padding sequences: read slot -1
    idx[rows[3::11], acc[3::11].long() - 1] = P + 7  # read slot outside the pool: padding too, never prefetched
    idx[5::9, 1] = -1                               # a token's write skipped
    read = idx[rows, acc.long() - 1]
    pool = make_pool(P, HV, 128, 128, pool_dtype, v_first, read[(read >= 0) & (read < P)])
    base_out, base_pool = across_prefetch_distances(monkeypatch, x, pool, state_v_first=v_first,
                                                    ssm_state_indices=idx, num_accepted_tokens=acc)
    named = torch.zeros(P, dtype=torch.bool, device=DEV)
    live = (read >= 0) & (read < P)
    w = idx[live]
    named[w[(w >= 0) & (w < P)].long()] = True
    assert same_bits(base_pool[~named], pool[~named]), "slots no token writes stay untouched"
    assert torch.equal(base_out[~live], torch.zeros_like(base_out[~live])), "padding sequences output zeros"


def bf16_kv_verify_case(V, skip_write):
    """Verify on a bf16 [K,V] pool, K = 128, GVA 2 -> 4 heads: five sequences of 1-4 tokens with [N, 4] slot ids
    (random, distinct) and accepted counts, sequence 3's read slot padding, and with `skip_write` token 2 of sequence 0
    not written. Returns (inputs, slot ids, accepted counts, each sequence's read slot, the pool)."""
    HV, K, lens, Tm = 4, 128, [4, 1, 3, 4, 2], 4
    x = make(lens, 2, HV, K, V, dtype=torch.bfloat16)
    P = 4 * len(lens) * Tm
    idx = torch.randperm(P, device=DEV)[:len(lens) * Tm].reshape(len(lens), Tm).to(torch.int32)
    acc = torch.tensor([4, 1, 2, 3, 2], device=DEV, dtype=torch.int32)
    idx[3, 2] = -1  # a padding sequence (its read slot)
    if skip_write:
        idx[0, 2] = -1  # a token whose state is not written
    read = [idx[n, acc[n] - 1].item() for n in range(len(lens))]
    return x, idx, acc, read, make_pool(P, HV, K, V, torch.bfloat16, False, [r for r in read if r >= 0])


@pytest.mark.parametrize("nj", ["8", "4"])
@pytest.mark.parametrize("V", [128, 256])
def test_wide_kv_tiles_agree(seed, monkeypatch, V, nj):
    """The wide bf16 [K,V] tiles (K = 128, nj columns per thread, the state loaded and stored by the threads holding
    it: src/cuda/decode/wide_kv.cuh; KDAKIT_DECODE_WIDE_KV=nj) against the float64 oracle, and to the bit with the
    staged tiles (KDAKIT_DECODE_WIDE_KV=0) and, for the one-token sequence, the one-token form: verify with [N, T]
    indices and accepted counts (a padding sequence, a skipped write, a one-token sequence), and long varlen sequences
    in place on the pool (several staged batches, an empty sequence)."""
    HV, K = 4, 128
    x2, idx2, acc2, read, pool2 = bf16_kv_verify_case(V, skip_write=True)
    lens2, P = x2["lens"], pool2.shape[0]
    lens3 = [17, 0, 1, 40]
    x3 = make(lens3, 2, HV, K, V, dtype=torch.bfloat16)
    idx3 = torch.randperm(2 * len(lens3), device=DEV)[:len(lens3)].to(torch.int32)
    pool3 = make_pool(2 * len(lens3), HV, K, V, torch.bfloat16, False, idx3)

    def run_all():
        _, o2, p2 = call_on_copy(x2, pool2, state_v_first=False, ssm_state_indices=idx2, num_accepted_tokens=acc2)
        _, o3, p3 = call_on_copy(x3, pool3, state_v_first=False, ssm_state_indices=idx3)
        return [o2, p2, o3, p3]

    monkeypatch.setenv("KDAKIT_DECODE_WIDE_KV", nj)
    wide = run_all()
    o2, p2, o3, p3 = wide
    ro, rs = oracle(x2, h0_from_pool(pool2, read, False))
    ro = zero_padding(ro, x2, read)
    close("o (T=4)", o2, ro, tol(x2))
    written = torch.zeros(P, dtype=torch.bool, device=DEV)
    for n in range(len(lens2)):
        if read[n] < 0:
            continue
        for t in range(lens2[n]):
            s = idx2[n, t].item()
            if s >= 0:
                written[s] = True
                close(f"slot of sequence {n}, token {t}", kv(p2[s], False), rs[n][t], tol(x2, torch.bfloat16))
    assert same_bits(p2[~written], pool2[~written]), "slots no token writes stay untouched"
    h0 = h0_from_pool(pool3, idx3.tolist(), False)
    ro, rs = oracle(x3, h0)
    close("o (varlen)", o3, ro, tol(x3))
    close("ht (varlen)", kv(p3[idx3.long()], False), final(rs, h0), tol(x3, torch.bfloat16))
    monkeypatch.setenv("KDAKIT_DECODE_WIDE_KV", "0")
    staged = run_all()
    for i, (w, s) in enumerate(zip(wide, staged)):
        assert same_bits(w, s), f"result {i}: the wide tiles and the staged ones differ"
    # The one-token sequence (n = 1) alone takes the one-token form.
    s = slice(4, 5)
    alone = dict(x2, q=x2["q"][:, s], k=x2["k"][:, s], v=x2["v"][:, s], g=x2["g"][:, s], beta=x2["beta"][:, s],
                 cu=None)
    _, o1, p1 = call_on_copy(alone, pool2, state_v_first=False, ssm_state_indices=idx2[1:2, 0])
    assert same_bits(o1, o2[:, s]), "the one-token form's output differs from the wide tiles'"
    assert same_bits(p1[idx2[1, 0].long()], p2[idx2[1, 0].long()]), "the one-token form's state differs"


@pytest.mark.parametrize("V", [128, 256])
def test_bf16_per_token_states(seed, monkeypatch, V):
    """Per-token states in bf16 from a bf16 [K,V] pool (the C++ API's DecodeParams::token_states; the Python front end
    allocates them in float32, so the call's buffer is swapped here): verify with [N, T] indices and accepted counts,
    where the wide tiles store every token's state from registers. Against the float64 oracle, to the bit with the
    staged tiles (KDAKIT_DECODE_WIDE_KV=0), and to the bit with float32 per-token states rounded to bf16."""
    import kdakit.fused_recurrent as front
    x, idx, acc, read, pool = bf16_kv_verify_case(V, skip_write=False)
    lens = x["lens"]
    real = front.recurrent_into

    def run(token_dtype):
        seen = {}

        def swapped(*args):  # recurrent_into's arguments: token_states is the 11th
            args = list(args)
            if token_dtype is not None:
                args[10] = torch.full_like(args[10], float("nan"), dtype=token_dtype)
            seen["states"] = args[10]
            real(*args)

        monkeypatch.setattr(front, "recurrent_into", swapped)
        _, out, p = call_on_copy(x, pool, state_v_first=False, ssm_state_indices=idx, num_accepted_tokens=acc,
                                 inplace_final_state=False)
        monkeypatch.setattr(front, "recurrent_into", real)
        assert same_bits(p, pool), "the pool is not written without inplace_final_state"
        return out, seen["states"]

    out, states = run(torch.bfloat16)
    assert states.dtype == torch.bfloat16 and states.shape == (sum(lens),) + pool.shape[1:]
    ro, rs = oracle(x, h0_from_pool(pool, read, False))
    live = [n for n in range(len(lens)) if read[n] >= 0]
    rows = [sum(lens[:n]) + t for n in live for t in range(lens[n])]
    close("o", out, zero_padding(ro, x, read), tol(x))
    close("per-token states", kv(states[rows], False), torch.stack([s for n in live for s in rs[n]]),
          tol(x, torch.bfloat16))
    pad = [r for r in range(sum(lens)) if r not in rows]
    assert pad and same_bits(states[pad], torch.zeros_like(states[pad])), "padding tokens' states are zeros"
    out32, states32 = run(None)
    assert states32.dtype == torch.float32
    assert same_bits(out, out32), "the outputs differ with float32 per-token states"
    assert same_bits(states, states32.to(torch.bfloat16)), "bf16 per-token states are not float32's rounded to bf16"
    monkeypatch.setenv("KDAKIT_DECODE_WIDE_KV", "0")
    out_s, states_s = run(torch.bfloat16)
    assert same_bits(out, out_s) and same_bits(states, states_s), "the wide tiles and the staged ones differ"


# (warps, passes, general): general "1" forces the masked form where the whole-tile (FULL) form would run.
TILINGS = [(w, p, "") for w in (1, 2, 4) for p in (1, 2, 4)] + [(4, 1, "1"), (2, 4, "1")]


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,V", [(128, 128), (64, 64), (100, 60), (256, 128)])
def test_tilings_agree(seed, monkeypatch, v_first, pool_dtype, K, V):
    """Every launch shape (KDAKIT_DECODE_WARPS x KDAKIT_DECODE_PASSES: warps per CTA, column groups per CTA tile,
    the state tile staged in shared memory; KDAKIT_DECODE_GENERAL: the masked form for whole tiles) gives the same
    bits, and the oracle's results: T = 1 with [N] indices into
    a poisoned pool, verify-and-commit with [N, T] indices, and long varlen sequences (several staged batches per
    pass, an empty sequence)."""
    N, HV = 6, 4
    x1 = make([1] * N, 2, HV, K, V, dtype=torch.bfloat16, fixed=True)
    idx1 = torch.randperm(3 * N, device=DEV)[:N].to(torch.int32)
    pool1 = make_pool(3 * N, HV, K, V, pool_dtype, v_first, idx1)
    lens2, Tm = [4, 1, 3, 4], 4
    x2 = make(lens2, 2, HV, K, V, dtype=torch.bfloat16)
    idx2 = torch.randperm(4 * len(lens2) * Tm, device=DEV)[:len(lens2) * Tm].reshape(len(lens2), Tm).to(torch.int32)
    acc2 = torch.tensor([4, 1, 2, 3], device=DEV, dtype=torch.int32)
    pool2 = make_pool(4 * len(lens2) * Tm, HV, K, V, pool_dtype, v_first,
                      idx2[torch.arange(len(lens2), device=DEV), acc2.long() - 1])
    lens3 = [17, 0, 1, 40]
    x3 = make(lens3, 2, HV, K, V, dtype=torch.float32)
    h3 = torch.randn(len(lens3), HV, V, K, device=DEV) if v_first else torch.randn(len(lens3), HV, K, V, device=DEV)

    def run_all():
        p1, p2 = pool1.clone(), pool2.clone()
        o1, _ = call(x1, p1, state_v_first=v_first, ssm_state_indices=idx1)
        o2, _ = call(x2, p2, state_v_first=v_first, ssm_state_indices=idx2, num_accepted_tokens=acc2)
        with torch.inference_mode():
            o3, ht3 = kdakit.fused_recurrent_kda(x3["q"], x3["k"], x3["v"], x3["g"], x3["beta"], A_log=x3["A_log"],
                                                 dt_bias=x3["dt_bias"], initial_state=h3, output_final_state=True,
                                                 state_v_first=v_first, cu_seqlens=x3["cu"], **x3["opts"])
        torch.cuda.synchronize()
        return [o1, p1, o2, p2, o3, ht3]

    base = None
    for warps, passes, general in TILINGS:
        monkeypatch.setenv("KDAKIT_DECODE_WARPS", str(warps))
        monkeypatch.setenv("KDAKIT_DECODE_PASSES", str(passes))
        if general:
            monkeypatch.setenv("KDAKIT_DECODE_GENERAL", general)
        else:
            monkeypatch.delenv("KDAKIT_DECODE_GENERAL", raising=False)
        got = run_all()
        if base is None:
            base = got
            o1, p1, o2, p2, o3, ht3 = got
            ro, rs = oracle(x1, h0_from_pool(pool1, idx1.tolist(), v_first))
            close("o (T=1)", o1, ro, tol(x1))
            close("slots (T=1)", kv(p1[idx1.long()], v_first), final(rs, None), tol(x1, pool_dtype))
            untouched = torch.ones(p1.shape[0], dtype=torch.bool, device=DEV)
            untouched[idx1.long()] = False
            assert same_bits(p1[untouched], pool1[untouched])
            read = [idx2[n, acc2[n] - 1].item() for n in range(len(lens2))]
            ro, rs = oracle(x2, h0_from_pool(pool2, read, v_first))
            close("o (T=4)", o2, ro, tol(x2))
            written = torch.zeros(p2.shape[0], dtype=torch.bool, device=DEV)
            for n in range(len(lens2)):
                slots = idx2[n, :lens2[n]].long()
                written[slots] = True
                close(f"slots of sequence {n}", kv(p2[slots], v_first), torch.stack(rs[n]), tol(x2, pool_dtype))
            assert same_bits(p2[~written], pool2[~written])
            h0 = kv(h3, v_first)
            ro, rs = oracle(x3, h0)
            close("o (varlen)", o3, ro, tol(x3))
            close("ht (varlen)", kv(ht3, v_first), final(rs, h0), tol(x3))
        else:
            for i, (g, b) in enumerate(zip(got, base)):
                assert same_bits(g, b), f"result {i} differs with {warps} warps, {passes} passes, general {general!r}"
