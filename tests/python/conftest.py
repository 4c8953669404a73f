import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


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
    """A fresh seed per test, printed on failure so the case can be replayed."""
    import torch

    s = int.from_bytes(os.urandom(4), "little")
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
