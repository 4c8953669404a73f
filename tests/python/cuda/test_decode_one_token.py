"""The CUDA decode's one-token form (src/cuda/decode/one_token.cuh: one token per sequence, the serving decode): against
the float64 oracle (decode_cases.py) and the general form, bit for bit where they must agree."""
import pytest
import torch

import kdakit
from conftest import same_bits
from decode_cases import (make, oracle, kv, tol, close, make_pool, call, call_on_copy, host_then_general,
                          across_prefetch_distances, zero_padding, h0_from_pool, DEV)

pytestmark = pytest.mark.skipif(not kdakit.cuda_available(),
                                reason="no CUDA device, or kdakit was built without CUDA kernels")


# One token per sequence (the serving decode): the register-prepared form, with a fall-back to the general path
# inside the launch for varlen calls whose lengths the host cannot read.
ONE_TOKEN_CASES = [  # (lengths, fixed length, input dtype, gate, beta)
    ([1] * 7, True, torch.bfloat16, "lower_bound", "logit"),
    ([1] * 7, False, torch.float16, "softplus", "cols"),
    ([1, 0, 2, 1, 1, 0, 2], False, torch.float32, "pre", "prob"),  # at most N tokens: empty and 2-token sequences too
]


@pytest.mark.parametrize("lens,fixed,dtype,gate,beta", ONE_TOKEN_CASES)
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_one_token_form(seed, monkeypatch, lens, fixed, dtype, gate, beta, K, v_first, pool_dtype):
    """Against the oracle (GVA, -1 padding slots, has_initial_state, poisoned pool, caller out) and bit for bit against the
    general form (KDAKIT_DECODE_GENERAL): a sequence's result does not depend on which form ran it."""
    N, HV = len(lens), 4
    x = make(lens, 2, HV, K, dtype=dtype, fixed=fixed, gate=gate, beta=beta, neg=beta == "cols")
    P = 3 * N
    idx = torch.randperm(P, device=DEV)[:N].to(torch.int32)
    idx[3] = -1
    has = torch.tensor([True, False, True, True, True, True, False], device=DEV)
    pool = make_pool(P, HV, K, K, pool_dtype, v_first, idx[idx >= 0])

    def run():
        o, out, p = call_on_copy(x, pool, state_v_first=v_first, ssm_state_indices=idx, has_initial_state=has)
        assert o is out
        return o, p

    (o, p), (og, pg) = host_then_general(monkeypatch, run)
    h0 = h0_from_pool(pool, idx.tolist(), v_first, has.tolist())
    ro, rs = oracle(x, h0)
    ro = zero_padding(ro, x, idx.tolist())
    close("o", o, ro, tol(x, dtype))
    for n, s in enumerate(idx.tolist()):
        if s >= 0:
            close(f"slot {s}", kv(p[s], v_first), rs[n][-1] if rs[n] else h0[n], tol(x, pool_dtype))
    untouched = torch.ones(P, dtype=torch.bool, device=DEV)
    untouched[idx[idx >= 0].long()] = False
    assert same_bits(p[untouched], pool[untouched])
    assert same_bits(o, og) and same_bits(p, pg), "the one-token and the general form differ"
    # At one pass the one-token form's state goes through shared memory ([K,V] pools) or straight to registers
    # (v-first); the other way (KDAKIT_DECODE_ONE_STAGED) gives the same bits.
    monkeypatch.delenv("KDAKIT_DECODE_GENERAL", raising=False)
    monkeypatch.setenv("KDAKIT_DECODE_ONE_STAGED", "1" if v_first else "0")
    oo, po = run()
    assert same_bits(oo, o) and same_bits(po, p), "the staged and the direct one-token form differ"


@pytest.mark.parametrize("form", ["fixed", "varlen", "varlen-mixed"])
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_one_token_staged(seed, monkeypatch, form, v_first, pool_dtype):
    """A batch large enough for the one-token form's staged tiles (several passes per CTA, the state in shared
    memory; chosen by the host, no override): GVA, -1 slots, has_initial_state, poisoned pool; the oracle's results
    and the general form's bits. varlen-mixed: at most N tokens with empty sequences and a 4-token one beside, which
    runs token by token on the staged tile."""
    N, H, HV = 80, 2, 8
    lens = [1] * N
    if form == "varlen-mixed":
        lens[5] = lens[9] = lens[10] = 0
        lens[20] = 4
    x = make(lens, H, HV, 128, dtype=torch.bfloat16, fixed=form == "fixed")
    P = 2 * N
    idx = torch.randperm(P, device=DEV)[:N].to(torch.int32)
    idx[::7] = -1
    has = torch.rand(N, device=DEV) > 0.2
    pool = make_pool(P, HV, 128, 128, pool_dtype, v_first, idx[idx >= 0])

    def run():
        o, _, p = call_on_copy(x, pool, state_v_first=v_first, ssm_state_indices=idx, has_initial_state=has)
        return o, p

    monkeypatch.delenv("KDAKIT_DECODE_PASSES", raising=False)
    (o, p), (og, pg) = host_then_general(monkeypatch, run)
    h0 = h0_from_pool(pool, idx.tolist(), v_first, has.tolist())
    ro, rs = oracle(x, h0)
    ro = zero_padding(ro, x, idx.tolist())
    close("o", o, ro, tol(x, pool_dtype))
    used = [(n, s) for n, s in enumerate(idx.tolist()) if s >= 0]
    close("slots", torch.stack([kv(p[s], v_first) for _, s in used]),
          torch.stack([rs[n][-1] if rs[n] else h0[n] for n, _ in used]), tol(x, pool_dtype))
    untouched = torch.ones(P, dtype=torch.bool, device=DEV)
    untouched[idx[idx >= 0].long()] = False
    assert same_bits(p[untouched], pool[untouched])
    assert same_bits(o, og) and same_bits(p, pg), "the staged one-token form and the general form differ"


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_prefetch_distance_does_not_change_results(seed, monkeypatch, v_first, pool_dtype):
    """The staged one-token kernel's L2 prefetch of later CTAs' tiles (Hopper; KDAKIT_DECODE_PREFETCH CTAs per SM
    ahead, 0 off): off, the default, a distance past the end of the grid and a fractional one give the same bits,
    with -1 slots, out-of-range slots and has_initial_state False among the prefetch targets."""
    N, H, HV = 96, 2, 8
    x = make([1] * N, H, HV, 128, dtype=torch.bfloat16, fixed=True)
    P = 2 * N
    idx = torch.randperm(P, device=DEV)[:N].to(torch.int32)
    idx[::5] = -1
    idx[3::11] = P + 7  # outside the pool: neither read nor written, nor prefetched
    has = torch.rand(N, device=DEV) > 0.2
    pool = make_pool(P, HV, 128, 128, pool_dtype, v_first, idx[(idx >= 0) & (idx < P)])
    base_out, base_pool = across_prefetch_distances(monkeypatch, x, pool, state_v_first=v_first,
                                                    ssm_state_indices=idx, has_initial_state=has)
    untouched = torch.ones(P, dtype=torch.bool, device=DEV)
    untouched[idx[(idx >= 0) & (idx < P)].long()] = False
    assert same_bits(base_pool[untouched], pool[untouched])

@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_one_token_pool_and_index_layouts(seed, v_first, pool_dtype):
    """One token per sequence against a pool and slot ids laid out as engines may hold them: slots padded (a slot's
    heads followed by other data: the one-token form), heads not adjacent (every other head of a wider buffer: the
    general form, as the one-token form's packed arguments take dense heads only) and slot ids a strided column.
    Each gives the bits of the call on the dense pool, and the buffer's bytes outside the viewed pool stay as they
    were."""
    N, H, HV, K = 6, 2, 4, 128
    x = make([1] * N, H, HV, K, fixed=True)
    P = 2 * N
    idx = torch.randperm(P, device=DEV)[:N].to(torch.int32)
    idx[2] = -1
    pool = make_pool(P, HV, K, K, pool_dtype, v_first, idx[idx >= 0])
    base_o, _, base_p = call_on_copy(x, pool, state_v_first=v_first, ssm_state_indices=idx)
    assert torch.isfinite(base_o).all()
    for name, heads, step in (("padded slots", HV + 1, 1), ("every other head", 2 * HV, 2)):
        buf = torch.randn((P, heads) + tuple(pool.shape[2:]), device=DEV).to(pool_dtype)
        view = buf[:, :HV * step:step]
        view.copy_(pool)
        before = buf.clone()
        out = torch.full_like(x["v"], float("nan"))
        o, _ = call(x, view, out=out, state_v_first=v_first, ssm_state_indices=idx)
        torch.cuda.synchronize()
        assert same_bits(o, base_o), f"{name}: the output differs from the dense pool's"
        assert same_bits(view, base_p), f"{name}: the state differs from the dense pool's"
        inside = torch.zeros(buf.shape[:2], dtype=torch.bool, device=DEV)
        inside[:, :HV * step:step] = True
        assert same_bits(buf[~inside], before[~inside]), f"{name}: bytes outside the pool changed"
    wide = torch.full((N, 3), -1, dtype=torch.int32, device=DEV)
    wide[:, 1] = idx
    o, _, p = call_on_copy(x, pool, state_v_first=v_first, ssm_state_indices=wide[:, 1])
    assert same_bits(o, base_o) and same_bits(p, base_p), "strided slot ids differ from contiguous ones"


@pytest.mark.parametrize("v_first", [False, True])
def test_index_dtypes_agree(seed, v_first):
    """int32 slot ids and cu_seqlens take the one-token form, int64 ones the general form: the same bits either way."""
    N, HV = 9, 4
    x = make([1] * N, 2, HV, 128, dtype=torch.bfloat16)
    idx = torch.randperm(2 * N, device=DEV)[:N].to(torch.int32)
    pool = make_pool(2 * N, HV, 128, 128, torch.float32, v_first, idx)
    results = []
    for dt in (torch.int32, torch.int64):
        p = pool.clone()
        o, _ = call(dict(x, cu=x["cu"].to(dt)), p, state_v_first=v_first, ssm_state_indices=idx.to(dt))
        torch.cuda.synchronize()
        results.append((o, p))
    ro, rs = oracle(x, h0_from_pool(pool, idx.tolist(), v_first))
    close("o", results[0][0], ro, tol(x, torch.bfloat16))
    assert same_bits(results[0][0], results[1][0]) and same_bits(results[0][1], results[1][1])
