"""FLA's KDA layer calls replayed argument for argument, and kdakit as a backend of FLA's dispatch
(`kdakit.integrations.fla`, spec §8), at small sizes, against the float64 references.

Upstream (fla-org/flash-linear-attention): `fla/layers/kda.py` (`KimiDeltaAttention.forward`) at bc3b101d (0.5.2;
eval calls with q_len <= 64 go to `fused_recurrent_kda` even in grad mode) and as released in 0.6.0 (grad mode always
takes `chunk_kda`): raw g and beta in the model dtype, A_log [HV] and dt_bias [HV*K] fp32 Parameters, the gate, the
beta sigmoid and the L2 norm in kernel, `state_v_first=True`, varlen through unpadding (B = 1 + cu_seqlens). The
dispatch follows `fla/backends.py` (0.6.0) and `fla/ops/backends/__init__.py` with `fla/ops/kda/backends/__init__.py`
(bc3b101d). The FLA-dependent tests skip (with the reason shown) where FLA is not importable; on the CPU FLA's own
Triton kernels cannot run, so comparisons with FLA's results run on CUDA only.
"""
import inspect
import sys
import types

import pytest
import torch

import kdakit
import naive
from conftest import assert_close, assert_close_cancelling, dA_log_terms
from replay import DEVICES, make, out_tol, reference, tol

H, HV, K = 2, 4, 32

try:
    import fla.ops.kda as fla_kda  # noqa: F401 - imports FLA (and its backends) when available

    import kdakit.integrations.fla as kfla
    CHUNK_HOOK = inspect.signature(kfla._chunk)
    FLA_ERROR = None
except Exception as e:  # noqa: BLE001 - FLA is optional
    FLA_ERROR = f"flash-linear-attention is not importable: {type(e).__name__}: {e}"
needs_fla = pytest.mark.skipif(FLA_ERROR is not None, reason=FLA_ERROR or "")


def _layer_call(x, *, lower_bound, neg, **extra):
    """The keyword set of KimiDeltaAttention.forward's chunk_kda / fused_recurrent_kda calls."""
    return dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                allow_neg_eigval=neg, lower_bound=lower_bound, state_v_first=True, cu_seqlens=x["cu"], **extra)


GATES = [(False, None, False), (True, -5.0, True)]  # (safe_gate, lower_bound, allow_neg_eigval)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("safe_gate,lower_bound,neg", GATES)
def test_layer_train_chunk(seed, device, safe_gate, lower_bound, neg):
    """Training: `chunk_kda(...)` with A_log and dt_bias Parameters; gradients against naive.py's float64 oracle on
    the CPU (float32 inputs); the CUDA backward to the tolerance of its float32 kernels (1e-4)."""
    x = make([37, 64, 9], H, HV, K, device=device, dtype=torch.float32, gate="raw", g_dtype=torch.float32,
             beta="logit")
    leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")}
    call = _layer_call(dict(x, **leaves), lower_bound=lower_bound, neg=neg, initial_state=None,
                       output_final_state=False, safe_gate=safe_gate)
    tol = 1e-4 if device == "cuda" else 1e-5
    o, _ = kdakit.chunk_kda(**call)
    do = torch.randn_like(o)
    grads = torch.autograd.grad((o * do).sum(), list(leaves.values()))
    ref_leaves = {n: t.detach().double().cpu().requires_grad_() for n, t in leaves.items()}
    ro, _ = naive.kda(ref_leaves["q"], ref_leaves["k"], ref_leaves["v"], ref_leaves["g"], ref_leaves["beta"],
                      A_log=ref_leaves["A_log"], dt_bias=ref_leaves["dt_bias"], lower_bound=lower_bound,
                      use_gate=True, l2=True, beta_sigmoid=True, neg=neg, cu_seqlens=x["cu"].cpu())
    ref_grads = torch.autograd.grad((ro * do.double().cpu()).sum(), list(ref_leaves.values()))
    assert_close("o", ro, o, tol)
    named = dict(zip(leaves, zip(grads, ref_grads)))
    for name, (got, want) in named.items():
        assert_close("d" + name, want, got, tol)
        if name == "A_log" and device == "cuda":  # a cancelling sum: also against its terms' magnitudes (conftest)
            mags = dA_log_terms(named["g"][1], x["g"], x["dt_bias"], x["A_log"], lower_bound)
            assert_close_cancelling("dA_log", want, got, mags, tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_mode", ["no_grad", "enabled"])
def test_layer_eval_recurrent(seed, device, grad_mode):
    """Eval with q_len <= 64: `fused_recurrent_kda(...)` with the cache's state (fp32 v-first) and
    output_final_state=use_cache, bf16 raw g and beta. FLA 0.5.2 makes this call in grad mode too."""
    x = make([5, 12], H, HV, K, device=device, gate="raw", g_dtype=torch.bfloat16, beta="logit",
             beta_dtype=torch.bfloat16)
    A_log, dt_bias = (torch.nn.Parameter(x[n]) for n in ("A_log", "dt_bias"))
    h0 = torch.randn(2, HV, K, K, device=device)
    with torch.set_grad_enabled(grad_mode == "enabled"):
        o, ht = kdakit.fused_recurrent_kda(**_layer_call(dict(x, A_log=A_log, dt_bias=dt_bias), lower_bound=None,
                                                         neg=False, initial_state=h0, output_final_state=True))
    o_ref, ht_ref = reference(x, initial_state=h0.double().cpu(), gate=True, beta_sigmoid=True)
    assert_close("o", o_ref, o, out_tol(x, device))
    assert_close("final_state", ht_ref, ht, tol(torch.float32, device))


# ---------------------------------------------------------------------------------------------------------------
# kdakit as an FLA backend.


@pytest.fixture
def backend(monkeypatch):
    """The registered backend, with calls to kdakit counted (a spy on the hooks' implementations)."""
    kfla.enable()
    calls = []
    for name in ("_chunk", "_recurrent"):
        impl = getattr(kfla, name)
        monkeypatch.setattr(kfla, name, lambda *a, _impl=impl, _name=name, **kw: (calls.append(_name),
                                                                                 _impl(*a, **kw))[1])
    monkeypatch.delenv(kfla.ENV_VAR, raising=False)
    return calls


def _fla_inputs(device, dtype=torch.bfloat16):
    return make([20, 50], H, HV, K, device=device, dtype=dtype, gate="raw", g_dtype=dtype, beta="logit",
                beta_dtype=dtype)


def _fla_chunk_kwargs(x):
    return dict(A_log=x["A_log"], dt_bias=x["dt_bias"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, output_final_state=True, state_v_first=True, cu_seqlens=x["cu"])


@needs_fla
@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_chunk(seed, device, backend, monkeypatch):
    """An accepted chunk_kda call runs kdakit (same bits as calling kdakit directly); FLA_KDAKIT=0 hands the call
    back to FLA (compared with FLA's result on CUDA, where FLA's kernels run)."""
    x = _fla_inputs(device)
    with torch.no_grad():
        o, ht = fla_kda.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **_fla_chunk_kwargs(x))
        o_direct, ht_direct = kdakit.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **_fla_chunk_kwargs(x))
    assert backend == ["_chunk"]
    assert torch.equal(o, o_direct) and torch.equal(ht, ht_direct)
    o_ref, ht_ref = reference(x, gate=True, beta_sigmoid=True)
    assert_close("o", o_ref, o, out_tol(x, device))
    monkeypatch.setenv(kfla.ENV_VAR, "0")
    try:
        with torch.no_grad():
            o_fla, ht_fla = fla_kda.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **_fla_chunk_kwargs(x))
    except Exception:  # noqa: BLE001 - FLA's Triton kernels do not run on the CPU
        if device == "cuda":
            raise
    else:
        # FLA's own bf16 kernels, at FLA's tolerance for them (spec §6.2: 0.005).
        assert_close("o (FLA)", o_ref, o_fla, 5e-3)
        assert_close("final state (FLA)", ht_ref, ht_fla, 5e-3)
    assert backend == ["_chunk"], "FLA_KDAKIT=0 must leave the call to FLA"


@needs_fla
@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_recurrent(seed, device, backend):
    """FLA's `fused_recurrent_kda` reaches kdakit through the dispatched `fused_recurrent_kda_fwd`; a pre-gated
    call's A_log/dt_bias/lower_bound (which FLA ignores) are dropped."""
    x = _fla_inputs(device)
    h0 = torch.randn(2, HV, K, K, device=device)
    with torch.no_grad():
        o, ht = fla_kda.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                                            **_fla_chunk_kwargs(x))
        g_pre = -torch.nn.functional.softplus(x["g"].float()).to(x["g"].dtype)
        o2, _ = fla_kda.fused_recurrent_kda(x["q"], x["k"], x["v"], g_pre, x["beta"], A_log=x["A_log"],
                                            lower_bound=-3.0, use_beta_sigmoid_in_kernel=True,
                                            use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"])
    assert backend == ["_recurrent", "_recurrent"]
    o_ref, ht_ref = reference(x, initial_state=h0.double().cpu(), gate=True, beta_sigmoid=True)
    assert_close("o", o_ref, o, out_tol(x, device))
    assert_close("final_state", ht_ref, ht, tol(torch.float32, device))
    o2_ref, _ = reference(dict(x, g=g_pre), beta_sigmoid=True)
    assert_close("o (pre-gated)", o2_ref, o2, out_tol(x, device))


@needs_fla
@pytest.mark.parametrize("change,reason", [
    (dict(cp_context=object()), "cp_context"),
    (dict(use_graph=True), "use_graph"),
    (dict(unknown_flag=True), "keywords FLA ignores"),
    (dict(chunk_size=16), "chunk_size"),
    (dict(k_dim=288), "K, V <= 256"),
    (dict(hv=3), "multiple of H"),
    (dict(state_dtype=torch.float16), "initial_state must be fp32 or bf16"),
])
def test_chunk_verifier_rejects(change, reason):
    """Each rejection of chunk_kda_verifier, with its reason (FLA logs it and runs its own kernel)."""
    change = dict(change)
    Kd, hv = change.pop("k_dim", K), change.pop("hv", HV)
    x = make([3], H, hv, Kd, dtype=torch.float32, gate="raw", g_dtype=torch.float32)
    state = torch.zeros(1, hv, Kd, Kd, dtype=change.pop("state_dtype", torch.float32))
    ok, why = kfla._verify_chunk(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=state,
                                 cu_seqlens=x["cu"], **change)
    assert not ok and reason in why


@needs_fla
def test_verifiers_accept_and_reject_by_device_and_form():
    x = make([3], H, HV, K, dtype=torch.float32, gate="raw", g_dtype=torch.float32)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert kfla._verify_chunk(*args, cu_seqlens=x["cu"], A_log=x["A_log"], chunk_size=32) == (True, None)
    with torch.enable_grad():  # the CPU backward exists: training calls on CPU tensors are served
        assert kfla._verify_chunk(x["q"].requires_grad_(), *args[1:]) == (True, None)
    ok, why = kfla._verify_recurrent(*args, use_gate_in_kernel=True)
    assert not ok and "A_log" in why
    ok, why = kfla._verify_recurrent(*args, ssm_state_indices=torch.zeros(1, dtype=torch.int32),
                                     num_accepted_tokens=torch.ones(1, dtype=torch.int32))
    assert not ok and "2-D" in why
    assert kfla._verify_recurrent(*args, A_log=x["A_log"], use_gate_in_kernel=True) == (True, None)
    meta = torch.empty(1, 3, H, K, device="meta")
    ok, why = kfla._verify_chunk(meta, meta, meta, meta, torch.empty(1, 3, H, device="meta"))
    assert not ok and "CPU and CUDA" in why


@needs_fla
def test_rejected_call_falls_back_to_fla(seed, backend):
    """A call the verifier rejects never reaches kdakit (on the CPU, FLA's own Triton kernel then fails)."""
    x = _fla_inputs("cpu")
    try:
        with torch.no_grad():
            fla_kda.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=16, **_fla_chunk_kwargs(x))
    except Exception:  # noqa: BLE001 - FLA raises for chunk_size=16, or its kernels cannot run on the CPU
        pass
    assert backend == []


@needs_fla
def test_fla_layer_runs_on_kdakit(seed, backend):
    """FLA's own KimiDeltaAttention on CPU tensors (its output norm swapped for the torch formula, FLA's being a
    Triton kernel): training and eval forwards reach kdakit through the dispatch, and training's arguments give
    the reference's output."""
    from fla.layers.kda import KimiDeltaAttention

    layer = KimiDeltaAttention(hidden_size=64, head_dim=16, num_heads=2, num_v_heads=4, use_short_conv=False)

    class RMSNormGated(torch.nn.Module):
        def forward(self, x, gate):
            x = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
            return (x * torch.sigmoid(gate.float())).to(gate.dtype)

    layer.o_norm = RMSNormGated()
    seen = []
    impl = kfla._chunk

    def record(*a, **kw):
        out = impl(*a, **kw)
        seen.append((CHUNK_HOOK.bind(*a, **kw).arguments, out))
        return out

    kfla._chunk = record
    try:
        hidden = torch.randn(1, 24, 64)
        mask = torch.ones(1, 24, dtype=torch.long)
        mask[0, :5] = 0
        layer.train()
        out, _, _ = layer(hidden, attention_mask=mask)
        out.sum().backward()
    finally:
        kfla._chunk = impl
    assert len(seen) == 1
    args, (o, _) = seen[0]
    kw = dict(args.pop("kwargs"), **args)
    assert kw["state_v_first"] and kw["use_gate_in_kernel"] and kw["cu_seqlens"] is not None
    x = dict(q=kw["q"], k=kw["k"], v=kw["v"], g=kw["g"], beta=kw["beta"], A_log=kw["A_log"], dt_bias=kw["dt_bias"],
             cu=kw["cu_seqlens"])
    o_ref, _ = reference(x, gate=True, beta_sigmoid=True, lower_bound=kw["lower_bound"])
    assert_close("o", o_ref, o, 1e-5)
    assert layer.A_log.grad is not None and torch.isfinite(layer.dt_bias.grad).all()
    layer.eval()
    with torch.no_grad():
        layer(hidden[:, :8])
    assert "_recurrent" in backend


def test_registers_with_fla_0_5_registry(monkeypatch):
    """The FLA 0.5 mechanism (spec §8.1, §8.4): no `fla.backends`; the backend goes into
    `fla.ops.kda.backends.kda_registry`, subclassing `fla.ops.backends.BaseBackend`. A stand-in package checks the
    registration's shape (FLA 0.5.2 itself does not import with this environment's Triton)."""
    class BaseBackend:
        pass

    class Registry:
        def __init__(self):
            self.backends = []

        def register(self, backend):
            self.backends.append(backend)

    registry = Registry()
    fake = {"fla": types.ModuleType("fla"), "fla.ops": types.ModuleType("fla.ops"),
            "fla.ops.backends": types.ModuleType("fla.ops.backends"),
            "fla.ops.kda": types.ModuleType("fla.ops.kda"), "fla.ops.kda.chunk": types.ModuleType("fla.ops.kda.chunk"),
            "fla.ops.kda.backends": types.ModuleType("fla.ops.kda.backends")}
    fake["fla.ops.backends"].BaseBackend = BaseBackend
    fake["fla.ops.kda.backends"].kda_registry = registry
    for name in list(sys.modules):
        if name == "fla" or name.startswith("fla."):
            monkeypatch.delitem(sys.modules, name)
    for name, module in fake.items():
        monkeypatch.setitem(sys.modules, name, module)
    import kdakit.integrations.fla as adapter

    monkeypatch.setattr(adapter, "_registered", [])
    assert adapter.enable() == ["kda"]
    (backend,) = registry.backends
    assert isinstance(backend, BaseBackend)
    assert (backend.backend_type, backend.package_name, backend.env_var, backend.priority) == \
        ("kdakit", "kdakit", "FLA_KDAKIT", 2)
    for hook in ("chunk_kda", "chunk_kda_verifier", "fused_recurrent_kda_fwd", "fused_recurrent_kda_fwd_verifier"):
        assert callable(getattr(backend, hook))
