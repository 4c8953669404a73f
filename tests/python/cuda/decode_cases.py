"""What the CUDA decode tests share (test_decode*.py): the inputs and pools, the float64 oracle of the token recurrence
(naive.py's math, with the decode slot rules of src/cpu/state.h), tolerances and bit checks, and FLA's decode where it
is importable."""
import inspect

import pytest
import torch
import torch.nn.functional as F

import kdakit
import naive
from conftest import rel_rms


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


def across_prefetch_distances(monkeypatch, x, pool, **kw):
    """call_on_copy under the L2 prefetch distances (KDAKIT_DECODE_PREFETCH CTAs per SM ahead): off, the default, one
    past the end of the grid and a fractional one. Asserts finite outputs and the same bits under each; returns the
    outputs and pool of the run without prefetch."""
    from conftest import same_bits
    results = {}
    for ahead in ("0", None, "1000", "0.5"):
        if ahead is None:
            monkeypatch.delenv("KDAKIT_DECODE_PREFETCH", raising=False)
        else:
            monkeypatch.setenv("KDAKIT_DECODE_PREFETCH", ahead)
        _, out, p = call_on_copy(x, pool, **kw)
        assert torch.isfinite(out).all()
        results[ahead] = (out, p)
    base_out, base_pool = results["0"]
    for ahead, (out, p) in results.items():
        assert same_bits(out, base_out) and same_bits(p, base_pool), f"KDAKIT_DECODE_PREFETCH={ahead} changed results"
    return base_out, base_pool


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
