"""The CUDA backward of chunk_kda against the float64 backward (kdakit's CPU path on the same inputs, copied to the CPU
in float64), every gradient: float32 inputs to 1e-4 relative RMS, bfloat16 inputs no worse than FLA's own error
against the same reference (when FLA is importable) and within FLA's test tolerances; NaN/Inf checks; determinism and
batch invariance bit for bit; saved chunk states (disable_recompute) against recomputed ones."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import kdakit
from conftest import dA_log_terms, rel_rms, same_bits

pytestmark = pytest.mark.skipif(not kdakit.cuda_available(),
                                reason="no CUDA device, or kdakit was built without CUDA kernels")

try:
    from fla.ops.kda import chunk_kda as fla_chunk_kda
except Exception:  # noqa: BLE001 - FLA is optional: its comparisons skip without it
    fla_chunk_kda = None

TOL32 = 1e-4
# FLA's own test tolerances for fp16/bf16 gradients (spec §6.2): the sanity bound of the bf16 cases.
FLA_TOL = dict(q=0.008, k=0.008, v=0.008, g=0.02, beta=0.02, A_log=0.02, dt_bias=0.008, h0=0.008)
LEAVES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")


def make(B, T, H, HV, K, V=None, *, gate="lower_bound", cu=None, reset_p=0.0, l2=True, h0=True,
         state_dtype=torch.float32, v_first=False, beta_logits=True, neg=False, tail=0, norm=1.0):
    """FLA's input recipe in float32 on the GPU (spec §6.1); gate in kernel unless gate == 'pre' (then divided by
    norm: a weak decay for norm >> 1)."""
    V = V or K
    dev = "cuda"
    Tt = T if cu is None else cu[-1] + tail
    N = B if cu is None else len(cu) - 1
    q, k = torch.rand(B, Tt, H, K, device=dev), torch.rand(B, Tt, H, K, device=dev)
    if not l2:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    x = dict(q=q, k=k, v=torch.rand(B, Tt, HV, V, device=dev))
    if gate == "pre":
        g = F.logsigmoid(torch.randn(B, Tt, HV, K, device=dev)) / norm
        if reset_p:
            g = torch.where(torch.rand_like(g) < reset_p, torch.full_like(g, -1000.0), g)
        x["g"] = g
    else:
        x["g"] = torch.randn(B, Tt, HV, K, device=dev)
        x["A_log"] = torch.log(torch.empty(HV, device=dev).uniform_(1, 16))
        x["dt_bias"] = torch.randn(HV * K, device=dev)
    x["beta"] = torch.randn(B, Tt, HV, device=dev) if beta_logits else torch.sigmoid(torch.randn(B, Tt, HV, device=dev))
    if h0:
        s = torch.randn(N, HV, K, V, device=dev)
        x["h0"] = (s.transpose(-1, -2).contiguous() if v_first else s).to(state_dtype)
    x["opts"] = dict(use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=gate != "pre", use_beta_sigmoid_in_kernel=beta_logits,
                     allow_neg_eigval=neg, lower_bound=-5.0 if gate == "lower_bound" else None,
                     safe_gate=gate == "lower_bound", state_v_first=v_first)
    x["cu"] = torch.tensor(cu, dtype=torch.int32, device=dev) if cu is not None else None
    return x


def cotangents(x, final=True):
    o_shape = x["v"].shape
    do = torch.randn(o_shape, device="cuda")
    dht = None
    if final:
        N = x["q"].shape[0] if x["cu"] is None else x["cu"].numel() - 1
        HV, K, V = x["v"].shape[2], x["q"].shape[3], x["v"].shape[3]
        dht = torch.randn((N, HV, V, K) if x["opts"]["state_v_first"] else (N, HV, K, V), device="cuda")
    return do, dht


def grads(x, do, dht, *, dtype=torch.float32, device="cuda", chunk_size=64, disable_recompute=False, impl=None):
    """Gradients of sum(o * do) + sum(ht * dht) with respect to every leaf present, on `device` in `dtype` (q, k, v, g,
    beta; A_log, dt_bias and h0 keep theirs unless dtype is float64). impl: FLA's chunk_kda instead of kdakit's."""
    cast = {n: dtype for n in ("q", "k", "v", "g", "beta")}
    if dtype == torch.float64:
        cast.update(A_log=dtype, dt_bias=dtype, h0=dtype)
    leaves = {n: x[n].detach().to(device=device, dtype=cast.get(n, x[n].dtype)).requires_grad_()
              for n in LEAVES if n in x}
    cu = x["cu"].to(device) if x["cu"] is not None else None
    kw = dict(x["opts"])
    if "A_log" in leaves:
        kw.update(A_log=leaves["A_log"], dt_bias=leaves["dt_bias"])
    fn = impl or kdakit.chunk_kda
    if impl is None:
        kw["disable_recompute"] = disable_recompute
    o, ht = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves.get("h0"),
               output_final_state=dht is not None, cu_seqlens=cu, chunk_size=chunk_size, **kw)
    loss = (o.double() * do.to(device).double()).sum()
    if dht is not None:
        loss = loss + (ht.double() * dht.to(device).double()).sum()
    got = torch.autograd.grad(loss, list(leaves.values()))
    return {n: t for n, t in zip(leaves, got)}


def reference(x, do, dht, chunk_size=64, dtype=torch.float32):
    """kdakit's float64 CPU backward on the values the CUDA call reads: the inputs rounded to `dtype`, and do rounded
    to `dtype` too, as autograd hands the CUDA backward (and FLA's) the cotangent of o in o's dtype, the inputs'. The
    gradients of that rounded cotangent are what either library can be exact to."""
    y = dict(x)
    for n in ("q", "k", "v", "g", "beta"):
        y[n] = x[n].to(dtype)
    return grads(y, do.to(dtype).to(do.dtype), dht, dtype=torch.float64, device="cpu", chunk_size=chunk_size)


def errors(got, ref, x):
    """Relative RMS error of every gradient (dA_log: of its terms' magnitude, conftest.dA_log_terms)."""
    err = {}
    for n, r in ref.items():
        g = got[n]
        assert torch.isfinite(g.double()).all(), f"d{n}: NaN or Inf"
        err[n] = rel_rms(g, r)
        if n == "A_log":  # also against its terms' magnitudes: a cancelling sum (conftest.dA_log_terms)
            mags = dA_log_terms(ref["g"], x["g"], x.get("dt_bias"), x["A_log"], x["opts"]["lower_bound"])
            err["A_log (of its terms)"] = ((g.double().cpu() - r).abs() / mags.clamp_min(1e-300)).max().item()
    return err


def check32(x, final=True, chunk_size=64, disable_recompute=False):
    do, dht = cotangents(x, final)
    ref = reference(x, do, dht, chunk_size)
    got = grads(x, do, dht, chunk_size=chunk_size, disable_recompute=disable_recompute)
    for n, e in errors(got, ref, x).items():
        tol = TOL32
        if n == "h0" and x["h0"].dtype == torch.bfloat16:
            tol = 4e-3  # d_initial_state is stored in the state's dtype
        assert e <= tol, f"d{n}: relative RMS error {e:.2e} > {tol:.0e}"
    return got


# A sampled grid: head sizes, GVA, gates, lengths (fixed and varlen with empty sequences), states, recompute.
GRID = [
    # (B, T or cu, H, HV, K, V, gate, state, v_first, final, recompute, chunk)
    (2, 1, 1, 1, 16, 16, "lower_bound", torch.float32, False, True, False, 64),
    (2, 15, 2, 4, 60, 100, "softplus", torch.float32, True, True, True, 64),
    (1, 63, 1, 8, 64, 64, "pre", torch.bfloat16, False, False, False, 32),
    (2, 64, 2, 2, 100, 60, "lower_bound", None, False, True, True, 64),
    (1, 130, 2, 2, 30, 36, "softplus", torch.float32, False, True, False, 64),  # K, V not multiples of 4
    (1, 65, 1, 4, 128, 128, "softplus", torch.bfloat16, True, True, False, 64),
    (1, 1000, 2, 2, 128, 128, "pre", torch.float32, False, True, False, 64),
    (1, 4097, 1, 1, 64, 64, "lower_bound", torch.float32, True, False, True, 64),
    (1, [0, 1, 16, 16, 79, 143, 208, 1208, 1208, 5305], 1, 2, 128, 128, "softplus", torch.float32, False, True, False,
     64),
    (1, [0, 65, 65, 128, 129], 2, 8, 256, 256, "lower_bound", torch.float32, True, True, False, 32),
    (1, 300, 1, 2, 256, 64, "pre", None, False, True, True, 32),
]


@pytest.mark.parametrize("B,T,H,HV,K,V,gate,state,v_first,final,recompute,chunk", GRID)
def test_float32_grid(seed, B, T, H, HV, K, V, gate, state, v_first, final, recompute, chunk):
    cu = T if isinstance(T, list) else None
    x = make(B, None if cu else T, H, HV, K, V, gate=gate, cu=cu, h0=state is not None,
             state_dtype=state or torch.float32, v_first=v_first)
    check32(x, final=final, chunk_size=chunk, disable_recompute=recompute)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_gva_and_gates(seed, group, gate):
    check32(make(2, 130, 2, 2 * group, 64, 32, gate=gate, neg=group == 4))


@pytest.mark.parametrize("C", [32, 64])
@pytest.mark.parametrize("p", [0.05, 0.5])
def test_hard_resets(seed, C, p):
    check32(make(2, 300, 1, 2, 64, 64, gate="pre", reset_p=p), chunk_size=C)


@pytest.mark.parametrize("l2,beta_logits", [(False, False), (True, False), (False, True)])
def test_activations_off(seed, l2, beta_logits):
    check32(make(1, 200, 2, 2, 32, 48, l2=l2, beta_logits=beta_logits))


@pytest.mark.parametrize("HV", [1, 2])
def test_padded_token_tail_gets_zero_gradients(seed, HV):
    x = make(1, None, 1, HV, 32, 32, cu=[0, 40, 40, 107], tail=9)
    got = check32(x)
    for n in ("q", "k", "v", "g", "beta"):
        assert (got[n][:, 107:] == 0).all(), f"d{n} of the padded tail"


@pytest.mark.parametrize("disable_recompute", [False, True])
def test_float16_inputs(seed, disable_recompute):
    x = make(1, 200, 2, 4, 64, 64, gate="softplus")
    do, dht = cotangents(x)
    ref = reference(x, do, dht, dtype=torch.float16)
    got = grads(x, do, dht, dtype=torch.float16, disable_recompute=disable_recompute)
    for n, e in errors(got, ref, x).items():
        tol = FLA_TOL[n.split(" ")[0]]
        assert e <= tol, f"d{n}: relative RMS error {e:.2e} > {tol:.0e}"


BF16 = [
    (2, 512, 2, 2, 128, 128, "lower_bound", False),
    (1, 1000, 1, 4, 64, 128, "softplus", True),
    (1, [0, 15, 15, 64, 129, 1153], 2, 4, 128, 128, "lower_bound", False),
    (1, 300, 2, 2, 100, 60, "pre", False),
]


def _bf16_case(B, T, H, HV, K, V, gate, v_first):
    cu = T if isinstance(T, list) else None
    x = make(B, None if cu else T, H, HV, K, V, gate=gate, cu=cu, v_first=v_first)
    do, dht = cotangents(x)
    return x, do, dht, reference(x, do, dht, dtype=torch.bfloat16)


@pytest.mark.parametrize("B,T,H,HV,K,V,gate,v_first", BF16)
def test_bfloat16_within_fla_tolerances(seed, B, T, H, HV, K, V, gate, v_first):
    x, do, dht, ref = _bf16_case(B, T, H, HV, K, V, gate, v_first)
    for n, e in errors(grads(x, do, dht, dtype=torch.bfloat16), ref, x).items():
        tol = FLA_TOL[n.split(" ")[0]]
        assert e <= tol, f"d{n}: relative RMS error {e:.2e} > FLA's tolerance {tol:.0e}"


@pytest.mark.skipif(fla_chunk_kda is None, reason="FLA is not importable: kdakit's bf16 gradients are not compared "
                                                  "with FLA's error (test_bfloat16_within_fla_tolerances still runs)")
@pytest.mark.parametrize("B,T,H,HV,K,V,gate,v_first", BF16)
def test_bfloat16_no_worse_than_fla(seed, B, T, H, HV, K, V, gate, v_first):
    x, do, dht, ref = _bf16_case(B, T, H, HV, K, V, gate, v_first)
    ours = errors(grads(x, do, dht, dtype=torch.bfloat16), ref, x)
    theirs = errors(grads(x, do, dht, dtype=torch.bfloat16, impl=fla_chunk_kda), ref, x)
    for n, e in ours.items():  # no larger than FLA's error on the same inputs
        assert e <= theirs[n], f"d{n}: kdakit {e:.2e} > FLA {theirs[n]:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,V", [(64, 64), (64, 128)])
def test_segmented_reverse_scan(monkeypatch, seed, dtype, K, V):
    """Few heads, long sequences: the reverse scan cut where the forward cuts (forced here to segments of >= 2 chunks:
    segment pre-scans, the merge of their end gradients, then the scan of every segment) gives the reference's
    gradients, at the tolerance of the uncut scan; sequences too short to cut, empty ones and one-token ones beside."""
    monkeypatch.setenv("KDAKIT_FORWARD_SEGMENTS", "3")
    monkeypatch.setenv("KDAKIT_FORWARD_SEGMENT_TOKENS", "128")
    x = make(1, None, 1, 2, K, V, cu=[0, 700, 705, 1300, 1300, 1301, 1700], v_first=True)
    if dtype == torch.float32:
        check32(x)
        return
    do, dht = cotangents(x)
    ref = reference(x, do, dht, dtype=dtype)
    for n, e in errors(grads(x, do, dht, dtype=dtype), ref, x).items():
        tol = FLA_TOL[n.split(" ")[0]]
        assert e <= tol, f"d{n}: relative RMS error {e:.2e} > FLA's tolerance {tol:.0e}"


def test_segmented_reverse_scan_slow_decay(monkeypatch, seed):
    """The segmented reverse scan with a weak pre-gated decay (about -0.003 a token): a segment's transposed
    transition is far from zero, so the merge dS_end(s - 1) = M_s^T dS_end(s) + E_s carries the later segments."""
    monkeypatch.setenv("KDAKIT_FORWARD_SEGMENTS", "3")
    monkeypatch.setenv("KDAKIT_FORWARD_SEGMENT_TOKENS", "128")
    check32(make(1, None, 1, 2, 64, 64, cu=[0, 700, 705, 1300, 1700], gate="pre", norm=200.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_initial_state_gradient_alone_in_segments(monkeypatch, seed, dtype):
    """The initial-state-only backward (kdakit::chunk_bwd_initial_state: the prepare and the reverse scan) gives the
    whole backward's d_initial_state bit for bit where the scan runs in segments (forced), beside sequences too short
    to cut, an empty one and a one-token one."""
    from kdakit.chunk import kernel_options

    monkeypatch.setenv("KDAKIT_FORWARD_SEGMENTS", "3")
    monkeypatch.setenv("KDAKIT_FORWARD_SEGMENT_TOKENS", "128")
    x = make(1, None, 1, 2, 64, 64, cu=[0, 700, 705, 1300, 1300, 1301, 1700])
    do, dht = cotangents(x)
    t = {n: x[n].to(dtype) for n in ("q", "k", "v", "g", "beta")}
    scale, gate, lb = kernel_options(t["q"], None, True, -5.0, True, 64)
    opts = (scale, gate, lb, True, True, False, True, 64, False)
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"], x["A_log"], x["dt_bias"])
    full = torch.ops.kdakit.chunk_bwd(*args, x["h0"], x["cu"], None, do.to(dtype).cuda(), dht.cuda(), None, *opts)[7]
    alone = torch.ops.kdakit.chunk_bwd_initial_state(*args, x["cu"], None, do.to(dtype).cuda(), dht.cuda(), *opts)
    assert torch.isfinite(alone).all()
    assert same_bits(alone, full), f"max difference {(alone - full).abs().max().item():.3e}"


def test_disable_recompute_gives_the_same_bits(seed):
    """Saved chunk states (written by the forward's recurrence) and recomputed ones (the same kernel in the backward)
    are the same bits, so are the gradients."""
    x = make(1, None, 2, 4, 64, 64, cu=[0, 100, 100, 333, 334])
    do, dht = cotangents(x)
    a = grads(x, do, dht, disable_recompute=False)
    b = grads(x, do, dht, disable_recompute=True)
    for n in a:
        assert same_bits(a[n], b[n]), f"d{n} differs with saved chunk states"


def test_gradient_kernel_cache_gives_the_same_bits(monkeypatch, seed):
    """The gradient kernel's dP/dL cache in shared memory (where two such CTAs fit a multiprocessor) and its uncached
    form (KDAKIT_BACKWARD_GRAD_CACHE=0) give the same bits, chunk 64 and 32."""
    x = make(1, None, 2, 4, 64, 64, cu=[0, 100, 100, 333, 334], gate="softplus")
    do, dht = cotangents(x)
    for chunk in (64, 32):
        a = grads(x, do, dht, chunk_size=chunk)
        monkeypatch.setenv("KDAKIT_BACKWARD_GRAD_CACHE", "0")
        b = grads(x, do, dht, chunk_size=chunk)
        monkeypatch.delenv("KDAKIT_BACKWARD_GRAD_CACHE")
        for n in a:
            assert same_bits(a[n], b[n]), f"d{n} differs without the cache (chunk {chunk})"


@pytest.mark.parametrize("bv", ["16", "32"])
def test_scan_value_tile_gives_the_same_bits(monkeypatch, seed, bv):
    """The reverse scan's value tile (KDAKIT_BACKWARD_SCAN_BV) changes no bit: each value column's scan is the same
    arithmetic whatever the tile. Varlen with an empty and a one-token sequence, GVA, V not a multiple of the tile."""
    x = make(1, None, 2, 4, 64, 72, cu=[0, 100, 100, 333, 334], gate="softplus")
    do, dht = cotangents(x)
    for dtype in (torch.bfloat16, torch.float32):
        a = grads(x, do, dht, dtype=dtype)
        monkeypatch.setenv("KDAKIT_BACKWARD_SCAN_BV", bv)
        b = grads(x, do, dht, dtype=dtype)
        monkeypatch.delenv("KDAKIT_BACKWARD_SCAN_BV")
        for n in a:
            assert same_bits(a[n], b[n]), f"d{n} differs with the scan's {bv}-column tile ({dtype})"


@pytest.mark.parametrize("K,V,disable_recompute", [(128, 128, False), (100, 64, False), (64, 36, False),
                                                   (128, 128, True)])
def test_hopper_kernels_give_the_same_bits(monkeypatch, seed, K, V, disable_recompute):
    """On Hopper, bf16: the warpgroup-MMA kernels (the reverse scan; the WY pass with the state products) give the same
    bits as the mma.sync kernels (KDAKIT_BACKWARD_WGMMA=0); varlen with an empty and a one-token sequence, GVA;
    recomputed chunk states, and the forward's saved ones."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU")
    x = make(1, None, 2, 4, K, V, cu=[0, 100, 100, 333, 334], gate="softplus")
    do, dht = cotangents(x)
    a = grads(x, do, dht, dtype=torch.bfloat16, disable_recompute=disable_recompute)
    monkeypatch.setenv("KDAKIT_BACKWARD_WGMMA", "0")
    b = grads(x, do, dht, dtype=torch.bfloat16, disable_recompute=disable_recompute)
    monkeypatch.delenv("KDAKIT_BACKWARD_WGMMA")
    for n in a:
        assert same_bits(a[n], b[n]), f"d{n} differs between the Hopper kernel and the mma.sync kernels"


@pytest.mark.parametrize("K,V", [(128, 128), (64, 100)])
def test_hopper_scan_in_segments_gives_the_same_bits(monkeypatch, seed, K, V):
    """On Hopper, bf16: the warpgroup-MMA reverse scan cut into segments (forced: pre-scans with their transition
    tiles, the merge, the scans) gives the mma.sync scan's bits; sequences too short to cut, an empty one and a
    one-token one beside."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU")
    monkeypatch.setenv("KDAKIT_FORWARD_SEGMENTS", "3")
    monkeypatch.setenv("KDAKIT_FORWARD_SEGMENT_TOKENS", "128")
    x = make(1, None, 1, 2, K, V, cu=[0, 700, 705, 1300, 1300, 1301, 1700], gate="softplus")
    do, dht = cotangents(x)
    a = grads(x, do, dht, dtype=torch.bfloat16)
    monkeypatch.setenv("KDAKIT_BACKWARD_WGMMA", "0")
    b = grads(x, do, dht, dtype=torch.bfloat16)
    monkeypatch.delenv("KDAKIT_BACKWARD_WGMMA")
    for n in a:
        assert same_bits(a[n], b[n]), f"d{n} differs between the Hopper scan and the mma.sync scan in segments"


def test_determinism_and_batch_invariance(seed):
    """Two runs give the same bits, and a sequence's gradients do not depend on its neighbours in a varlen batch."""
    lens = [70, 5, 129, 0, 300]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    x = make(1, None, 2, 4, 64, 64, cu=cu, gate="softplus")
    do, dht = cotangents(x)
    a = grads(x, do, dht)
    b = grads(x, do, dht)
    for n in a:
        assert same_bits(a[n], b[n]), f"d{n} differs between two runs"
    # Sequence 2 (tokens 75..204) alone, with the same parameters, state and cotangents.
    s0, s1 = cu[2], cu[3]
    y = dict(x)
    for n in ("q", "k", "v", "g", "beta"):
        y[n] = x[n][:, s0:s1].contiguous()
    y["h0"] = x["h0"][2:3].contiguous()
    y["cu"] = torch.tensor([0, s1 - s0], dtype=torch.int32, device="cuda")
    c = grads(y, do[:, s0:s1].contiguous(), dht[2:3].contiguous())
    for n in ("q", "k", "v", "g", "beta"):
        assert same_bits(c[n], a[n][:, s0:s1].contiguous()), f"d{n} depends on the batch"
    assert same_bits(c["h0"], a["h0"][2:3].contiguous()), "d_initial_state depends on the batch"


def test_torch_compile_training_step(seed):
    x = make(1, 130, 1, 2, 32, 32)
    do, dht = cotangents(x)

    def step(q, k, v, g, beta, A_log, dt_bias, h0):
        o, ht = kdakit.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, A_log=A_log,
                                 dt_bias=dt_bias, **x["opts"])
        return (o * do).sum() + (ht * dht).sum()

    leaves = [x[n].detach().clone().requires_grad_() for n in LEAVES]
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # the custom ops trace by their fakes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = torch.autograd.grad(compiled(*leaves), leaves)
    eager_leaves = [x[n].detach().clone().requires_grad_() for n in LEAVES]
    want = torch.autograd.grad(step(*eager_leaves), eager_leaves)
    for n, g, w in zip(LEAVES, got, want):
        assert same_bits(g, w), f"d{n}: compiled and eager backward differ"
