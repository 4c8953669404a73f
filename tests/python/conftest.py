import faulthandler
import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# A run that hangs can be asked where: with KDAKIT_TEST_STACKS=<file>, SIGUSR1 writes every thread's Python stack to
# that file and the run goes on (`timeout -s USR1 -k 30 LIMIT pytest ...` asks at LIMIT, then kills 30 s later). A
# file, since pytest holds the process's stderr while it runs.
_stacks_file = os.environ.get("KDAKIT_TEST_STACKS")
if _stacks_file and hasattr(signal, "SIGUSR1"):
    faulthandler.register(signal.SIGUSR1, file=open(_stacks_file, "w"), all_threads=True)


def rel_rms(got, ref) -> float:
    """||got - ref|| / ||ref|| in float64 (FLA's metric, spec §6.1, without its absolute shortcut)."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    assert got.shape == ref.shape, (got.shape, ref.shape)
    num = (got - ref).norm().item()
    den = ref.norm().item()
    return num / den if den > 0 else num


def assert_close(name, ref, got, tol):
    __tracebackhide__ = True
    assert got is not None, f"{name}: missing"
    assert not (got.detach().double().isnan().any() or got.detach().double().isinf().any()), f"{name}: NaN or Inf"
    err = rel_rms(got, ref)
    assert err <= tol, f"{name}: relative RMS error {err:.3e} > {tol:.1e}"


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """The device a test runs on: every such test checks the CPU path and, on a GPU machine, the CUDA kernels."""
    if request.param == "cuda":
        import kdakit

        if not kdakit.cuda_available():
            pytest.skip("no CUDA device, or kdakit was built without CUDA kernels")
    return request.param


def dA_log_terms(dg_raw, g, dt_bias, A_log, lower_bound):
    """Per v-head, the sum of the magnitudes of the terms whose sum is dA_log: |dg_raw * (d gate/d A_log) / (d gate/d x)|
    over tokens and keys, x = g + dt_bias (spec §4.2 B8). dA_log is a cancelling sum (the terms reach 10^4 times it on
    FLA's recipe with strong softplus gates), so its error is measured against this (float64, CPU)."""
    import torch

    x = g.detach().double().cpu()
    HV, K = x.shape[-2], x.shape[-1]
    if dt_bias is not None:
        x = x + dt_bias.detach().double().cpu().reshape(HV, K)
    if lower_bound is None:  # softplus gate: ratio softplus(x) / sigmoid(x), FLA's threshold at 20
        ratio = torch.where(x > 20, x, torch.nn.functional.softplus(x) / torch.sigmoid(x))
    else:  # lower-bound gate: ratio x
        ratio = x
    terms = (dg_raw.detach().double().cpu() * ratio).abs()
    return terms.reshape(-1, HV, K).sum(dim=(0, 2))


def assert_close_cancelling(name, ref, got, magnitudes, tol):
    """Every element's error within tol of the magnitudes of its terms (a cancelling sum such as dA_log)."""
    __tracebackhide__ = True
    import torch

    got_d = got.detach().double().cpu().reshape(-1)
    assert torch.isfinite(got_d).all(), f"{name}: NaN or Inf"
    err = ((got_d - ref.detach().double().cpu().reshape(-1)).abs() / magnitudes.clamp_min(1e-300)).max().item()
    assert err <= tol, f"{name}: error {err:.3e} of its terms' magnitude > {tol:.1e}"


def compiled_and_eager(step, arg_compiled, arg_eager):
    """step(arg) under torch.compile(fullgraph=True) (aot_eager) and eagerly, each on its own argument (a state pool
    the call writes), in inference mode: (compiled result, eager result)."""
    import warnings

    import torch

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compiled(arg_compiled), step(arg_eager)


def same_bits(a, b) -> bool:
    """Bit-for-bit equality (NaN poison included), for tensors of one dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}
    import torch

    as_int = getattr(torch, ints[a.element_size()])
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


@pytest.fixture
def seed():
    """A fresh seed per test, printed on failure so the case can be replayed: KDAKIT_TEST_SEED=<seed> sets it."""
    import torch

    given = os.environ.get("KDAKIT_TEST_SEED")
    s = int(given) if given else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    print(f"seed={s}")
    return s


class _OverridesMonkeyPatch:
    """pytest's monkeypatch whose changes to KDAKIT_* environment variables reach the library: its developer
    overrides are read once per process, so every change (and the undo at the end of the test) reloads them."""

    def __init__(self, mp):
        self._mp = mp

    @staticmethod
    def _reload(name):
        if name.startswith("KDAKIT_"):
            from kdakit import _C

            _C.reload_overrides()

    def setenv(self, name, value, prepend=None):
        self._mp.setenv(name, value, prepend)
        self._reload(name)

    def delenv(self, name, raising=True):
        self._mp.delenv(name, raising)
        self._reload(name)

    def __getattr__(self, attr):
        return getattr(self._mp, attr)


@pytest.fixture
def monkeypatch(monkeypatch):
    mp = _OverridesMonkeyPatch(monkeypatch)
    yield mp
    monkeypatch.undo()
    _OverridesMonkeyPatch._reload("KDAKIT_")
