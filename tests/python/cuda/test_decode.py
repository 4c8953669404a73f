"""The CUDA decode / speculative verify (`fused_recurrent_kda_fwd`, `fused_recurrent_kda` on CUDA tensors) against a
float64 oracle of the token recurrence (naive.py's math, with the decode slot rules of src/cpu/state.h), and against
FLA's `fused_recurrent_kda_fwd` where it is importable."""
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

import kdakit
import naive
from conftest import rel_rms

pytestmark = pytest.mark.skipif(not kdakit.cuda_available(),
                                reason="no CUDA device, or kdakit was built without CUDA kernels")

try:
    try:
        from fla.ops.kda import fused_recurrent_kda_fwd as fla_decode
    except ImportError:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_decode
    # FLA swallows unknown keywords (**kwargs): only trust a version that names state_v_first.
    if "state_v_first" not in inspect.signature(fla_decode).parameters:
        fla_decode = None
except Exception:  # noqa: BLE001 - FLA is optional: its comparisons skip without it
    fla_decode = None

needs_fla = pytest.mark.skipif(fla_decode is None, reason="flash-linear-attention (with state_v_first) is not importable")
DEV = "cuda"


def make(lens, H, HV, K, V=None, *, dtype=torch.bfloat16, fixed=False, gate="lower_bound", l2=True, beta="logit",
         neg=False, has_A=True, has_bias=True, norm=1.0, scale=None):
    """FLA's input recipe (spec §6.1) on the GPU. `lens`: tokens per sequence (varlen unless `fixed`).
    gate: 'pre' (g = logsigmoid(N)/norm), 'softplus' or 'lower_bound' (raw g ~ N, gate in kernel).
    beta: 'prob' (sigmoid(N), no activation in kernel), 'logit' (sigmoid in kernel) or 'cols' (logits [B,T,HV,V])."""
    V = V or K
    N = len(lens)
    if fixed:
        assert len(set(lens)) == 1
        B, T, cu = N, lens[0], None
    else:
        B, T = 1, sum(lens)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
    q, k = torch.rand(B, T, H, K, device=DEV), torch.rand(B, T, H, K, device=DEV)
    if not l2:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    x = dict(q=q, k=k, v=torch.rand(B, T, HV, V, device=DEV))
    if gate == "pre":
        x["g"] = F.logsigmoid(torch.randn(B, T, HV, K, device=DEV)) / norm
        x["A_log"] = x["dt_bias"] = None
    else:
        x["g"] = torch.randn(B, T, HV, K, device=DEV)
        x["A_log"] = torch.log(torch.empty(HV, device=DEV).uniform_(1, 16)) if (has_A or gate == "softplus") else None
        x["dt_bias"] = torch.randn(HV * K, device=DEV) if has_bias else None
    if beta == "prob":
        x["beta"] = torch.sigmoid(torch.randn(B, T, HV, device=DEV))
    elif beta == "cols":
        x["beta"] = torch.randn(B, T, HV, V, device=DEV)
    else:
        x["beta"] = torch.randn(B, T, HV, device=DEV)
    x = {n: t.to(dtype) if n in ("q", "k", "v", "g", "beta") else t for n, t in x.items()}
    x["cu"] = torch.tensor(cu, dtype=torch.int32, device=DEV) if cu is not None else None
    x["lens"] = list(lens)
    x["scale"] = scale
    x["opts"] = dict(use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=gate != "pre", use_beta_sigmoid_in_kernel=beta != "prob",
                     allow_neg_eigval=neg, lower_bound=-5.0 if gate == "lower_bound" else None)
    return x


def bounds(x):
    if x["cu"] is None:
        T = x["q"].shape[1]
        return [(n, 0, T) for n in range(x["q"].shape[0])]
    cu = x["cu"].tolist()
    return [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def oracle(x, h0):
    """float64 token recurrence from the raw inputs. h0: [N,HV,K,V] float64 (zeros where a sequence starts from zero).
    Returns o [B,T,HV,V] and, per sequence, the list of states [HV,K,V] after each of its tokens."""
    o = x["opts"]
    d = lambda t: None if t is None else t.detach().double().cpu()
    q, k, v, g, beta = (d(x[n]) for n in ("q", "k", "v", "g", "beta"))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if o["use_qk_l2norm_in_kernel"]:
        q, k = naive.l2norm(q), naive.l2norm(k)
    if o["use_gate_in_kernel"]:
        g = naive.gate(g, d(x["A_log"]), d(x["dt_bias"]), o["lower_bound"])
    if o["use_beta_sigmoid_in_kernel"]:
        beta = torch.sigmoid(beta) * (2.0 if o["allow_neg_eigval"] else 1.0)
    scale = K ** -0.5 if x["scale"] is None else x["scale"]
    G = HV // H
    q, k = q.repeat_interleave(G, dim=2), k.repeat_interleave(G, dim=2)
    out = torch.zeros(B, T, HV, V, dtype=torch.float64)
    states = []
    for n, (b, s, e) in enumerate(bounds(x)):
        S = h0[n].clone()
        seq = []
        for t in range(s, e):
            S = S * g[b, t].exp()[..., None]
            bt = beta[b, t][..., None] if beta.dim() == 3 else beta[b, t]  # [HV,1] or [HV,V]
            u = v[b, t] - (S * k[b, t][..., None]).sum(-2)
            S = S + k[b, t][..., None] * (bt * u)[:, None, :]
            out[b, t] = scale * (S * q[b, t][..., None]).sum(-2)
            seq.append(S.clone())
        states.append(seq)
    return out, states


def final(states, h0):
    return torch.stack([s[-1] if s else h0[n] for n, s in enumerate(states)])


def kv(s, v_first):
    """A state tensor as float64 [..,K,V] on the CPU."""
    s = s.detach().double().cpu()
    return s.transpose(-1, -2) if v_first else s


def tol(x, stored=torch.float32):
    """1e-4 for float32 inputs into float32 storage, 4e-3 where 16-bit inputs or storage round (spec §6.1)."""
    return 1e-4 if x["q"].dtype == torch.float32 and stored == torch.float32 else 4e-3


def close(name, got, ref, t):
    got = got.detach()
    assert torch.isfinite(got).all(), f"{name}: NaN or Inf"
    err = rel_rms(got, ref)
    assert err <= t, f"{name}: relative RMS error {err:.2e} > {t:.0e}"
    return err


def bits(t):
    t = t.detach().contiguous()
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def same_bits(a, b):
    return torch.equal(bits(a), bits(b))


def make_pool(P, HV, K, V, dtype, v_first, used):
    """A pool of P slots poisoned with NaN, N(0,1) states in the `used` slots."""
    shape = (P, HV, V, K) if v_first else (P, HV, K, V)
    pool = torch.full(shape, float("nan"), device=DEV, dtype=dtype)
    used = torch.as_tensor(used, device=DEV).long()
    pool[used] = torch.randn((len(used),) + shape[1:], device=DEV).to(dtype)
    return pool


def call(x, pool, **kw):
    with torch.inference_mode():
        return kdakit.fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], pool,
                                              x["scale"], cu_seqlens=x["cu"], **x["opts"], **kw)


def call_on_copy(x, pool, **kw):
    """One call on a copy of `pool` with a NaN-poisoned caller `out`: (returned output, that `out`, the copy)."""
    p = pool.clone()
    out = torch.full_like(x["v"], float("nan"))
    o, _ = call(x, p, out=out, **kw)
    torch.cuda.synchronize()
    return o, out, p


def host_then_general(monkeypatch, run):
    """run() in the form the host chooses, then in the masked general form (KDAKIT_DECODE_GENERAL)."""
    monkeypatch.delenv("KDAKIT_DECODE_GENERAL", raising=False)
    chosen = run()
    monkeypatch.setenv("KDAKIT_DECODE_GENERAL", "1")
    return chosen, run()


def zero_padding(out, x, slots, pad_slot_id=-1):
    """The oracle's outputs with the rows of padding sequences (read slot negative or pad_slot_id) set to zero."""
    out = out.clone()
    for n, (b, s, e) in enumerate(bounds(x)):
        if slots[n] < 0 or slots[n] == pad_slot_id:
            out[b, s:e] = 0
    return out


def h0_from_pool(pool, slots, v_first, has=None):
    """Initial states of the oracle: pool[slot] per sequence, zero for slot -1 or has_initial_state False."""
    HV = pool.shape[1]
    K, V = (pool.shape[3], pool.shape[2]) if v_first else (pool.shape[2], pool.shape[3])
    h0 = torch.zeros(len(slots), HV, K, V, dtype=torch.float64)
    for n, s in enumerate(slots):
        if s >= 0 and (has is None or bool(has[n])):
            h0[n] = kv(pool[s], v_first)
    return h0


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
    N, HV, D = len(lens), 4, 128
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


@pytest.mark.parametrize("fixed", [True, False])
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_one_token_staged(seed, monkeypatch, fixed, v_first, pool_dtype):
    """A batch large enough for the one-token form's staged tiles (several passes per CTA, the state in shared
    memory; chosen by the host, no override): GVA, -1 slots, has_initial_state, poisoned pool; the oracle's results
    and the general form's bits."""
    N, H, HV = 80, 2, 8
    x = make([1] * N, H, HV, 128, dtype=torch.bfloat16, fixed=fixed)
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
    close("slots", torch.stack([kv(p[s], v_first) for _, s in used]), torch.stack([rs[n][-1] for n, _ in used]),
          tol(x, pool_dtype))
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
    results = {}
    for ahead in ("0", None, "1000", "0.5"):
        if ahead is None:
            monkeypatch.delenv("KDAKIT_DECODE_PREFETCH", raising=False)
        else:
            monkeypatch.setenv("KDAKIT_DECODE_PREFETCH", ahead)
        o, out, p = call_on_copy(x, pool, state_v_first=v_first, ssm_state_indices=idx, has_initial_state=has)
        assert torch.isfinite(out).all()
        results[ahead] = (out, p)
    base_out, base_pool = results["0"]
    for ahead, (out, p) in results.items():
        assert same_bits(out, base_out) and same_bits(p, base_pool), f"KDAKIT_DECODE_PREFETCH={ahead} changed results"
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


# ---- CUDA graphs, one launch per call, errors ------------------------------------------------------------------

def test_cuda_graph_capture_and_replay(seed):
    lens = [1] * 12
    x = make(lens, 4, 8, 128, dtype=torch.bfloat16)
    idx = torch.randperm(36, device=DEV)[:12].to(torch.int32)
    pool = make_pool(36, 8, 128, 128, torch.bfloat16, True, idx)
    out = torch.empty_like(x["v"])
    call(x, pool.clone(), state_v_first=True, ssm_state_indices=idx, out=out)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(x, pool, state_v_first=True, ssm_state_indices=idx, out=out)
    fresh = make(lens, 4, 8, 128, dtype=torch.bfloat16)
    for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias"):
        x[name].copy_(fresh[name])
    pool.copy_(make_pool(36, 8, 128, 128, torch.bfloat16, True, idx))
    before = pool.clone()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    h0 = h0_from_pool(before, idx.tolist(), True)
    ro, rs = oracle(x, h0)
    close("o", out, ro, tol(x, torch.bfloat16))
    close("ht", kv(pool[idx.long()], True), final(rs, h0), tol(x, torch.bfloat16))
    # A second replay continues from the updated pool.
    mid = pool.clone()
    graph.replay()
    torch.cuda.synchronize()
    h1 = h0_from_pool(mid, idx.tolist(), True)
    ro2, rs2 = oracle(x, h1)
    close("o (second replay)", out, ro2, tol(x, torch.bfloat16))
    close("ht (second replay)", kv(pool[idx.long()], True), final(rs2, h1), tol(x, torch.bfloat16))


def _cuda_kernels(fn):
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm-up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [e.name for e in events]


@pytest.mark.parametrize("mode", ["one_token_fixed", "one_token", "decode", "spec_commit", "verify"])
def test_one_launch_per_call(seed, mode):
    lens = [1, 1, 1] if mode.startswith("one_token") else [3, 1, 4]
    x = make(lens, 2, 4, 128, dtype=torch.bfloat16, fixed=mode == "one_token_fixed")
    N = len(lens)
    idx2 = torch.arange(4 * N, device=DEV, dtype=torch.int32).reshape(N, 4)
    pool = make_pool(4 * N, 4, 128, 128, torch.float32, True, range(4 * N))
    out = torch.empty_like(x["v"])
    kw = dict(state_v_first=True, out=out)
    if mode in ("one_token_fixed", "one_token", "decode"):
        kw.update(ssm_state_indices=idx2[:, 0].contiguous())
    elif mode == "spec_commit":
        kw.update(ssm_state_indices=idx2, num_accepted_tokens=torch.tensor([1, 1, 2], device=DEV, dtype=torch.int32))
    else:
        kw.update(ssm_state_indices=idx2, inplace_final_state=False)
    names = _cuda_kernels(lambda: call(x, pool, **kw))
    if not names:
        pytest.skip("the profiler recorded no CUDA activity (CUPTI unavailable)")
    expected = "decode_one_kernel" if mode == "one_token_fixed" else "decode_kernel"
    assert len(names) == 1 and expected in names[0], f"expected one {expected}, got {names}"


def test_errors_on_cuda():
    x = make([1, 1], 2, 2, 64, dtype=torch.float32)
    pool64 = torch.zeros(2, 2, 64, 64, device=DEV, dtype=torch.float64)
    with pytest.raises(ValueError, match="^initial_state"):
        call(x, pool64, ssm_state_indices=torch.tensor([0, 1], device=DEV, dtype=torch.int32))
    x64 = dict(x, **{n: x[n].double() for n in ("q", "k", "v", "g", "beta")})
    with pytest.raises(ValueError, match="^q"):
        call(x64, torch.zeros(2, 2, 64, 64, device=DEV), ssm_state_indices=torch.tensor([0, 1], device=DEV))


def test_torch_compile_fullgraph_on_cuda(seed):
    x = make([1] * 4, 2, 2, 64, dtype=torch.bfloat16)
    idx = torch.tensor([2, 0, 3, 1], device=DEV, dtype=torch.int32)
    pool = make_pool(4, 2, 64, 64, torch.float32, True, range(4))
    pool2 = pool.clone()

    def step(p):
        o, _ = kdakit.fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], p,
                                              None, state_v_first=True, cu_seqlens=x["cu"], ssm_state_indices=idx,
                                              **x["opts"])
        return o

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oc = compiled(pool)
        oe = step(pool2)
    assert same_bits(oc, oe) and same_bits(pool, pool2)
