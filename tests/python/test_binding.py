"""The framework-free binding: numpy arrays through DLPack, no torch import (but for the one test of torch tensor
views, which skips without torch)."""
import subprocess
import sys

import numpy as np
import pytest

from kdakit import _C

TOL = 1e-5


def _problem(rng, B=2, T=70, H=2, HV=4, K=16, V=8, dtype=np.float32):
    q = rng.random((B, T, H, K), dtype=np.float64).astype(dtype)
    k = rng.random((B, T, H, K), dtype=np.float64).astype(dtype)
    v = rng.standard_normal((B, T, HV, V)).astype(dtype)
    g = rng.standard_normal((B, T, HV, K)).astype(dtype)
    beta = rng.standard_normal((B, T, HV)).astype(dtype)
    A_log = np.log(rng.uniform(1, 16, HV)).astype(np.float32)
    h0 = rng.standard_normal((B, HV, K, V)).astype(np.float32)
    return q, k, v, g, beta, A_log, h0


def _params(arrays, out, final, chunk=64):
    q, k, v, g, beta, A_log, h0 = arrays
    p = _C.ForwardParams()
    inp = p.inputs
    inp.q, inp.k, inp.v, inp.g, inp.beta = (_C.view(a) for a in (q, k, v, g, beta))
    inp.scale = q.shape[-1] ** -0.5
    inp.gate.mode = _C.GateMode.SOFTPLUS
    inp.gate.A_log = _C.view(A_log)
    inp.qk_l2norm = True
    inp.beta_sigmoid = True
    p.state.initial_state = _C.view(h0)
    p.state.final_state = _C.view(final)
    p.out = _C.view(out)
    p.chunk_size = chunk
    return p


def test_binding_imports_without_torch():
    code = "import sys, kdakit, kdakit._C; assert 'torch' not in sys.modules, 'kdakit imported torch'; " \
           "print(kdakit.__version__)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == _C.version()


@pytest.mark.parametrize("chunk", [32, 64])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_numpy_forward_matches_reference(chunk, dtype):
    rng = np.random.default_rng()
    arrays = _problem(rng, dtype=dtype)
    B, T, HV, V = 2, 70, 4, 8
    out, final = np.full((B, T, HV, V), np.nan, np.float32), np.full((B, HV, 16, V), np.nan, np.float32)
    p = _params(arrays, out, final, chunk)
    ws = np.empty(_C.forward_workspace_size(p), np.uint8)
    p.set_workspace(_C.view(ws))
    _C.forward(p)
    ref_out, ref_final = np.empty((B, T, HV, V), np.float64), np.empty((B, HV, 16, V), np.float64)
    pr = _params(arrays, ref_out, ref_final, chunk)
    _C.reference_forward(pr)
    assert np.isfinite(out).all() and np.isfinite(final).all()
    assert np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out) < TOL
    assert np.linalg.norm(final - ref_final) / np.linalg.norm(ref_final) < TOL


def test_strided_views():
    rng = np.random.default_rng()
    big = rng.random((2, 70, 2, 32), dtype=np.float64).astype(np.float32)
    q = big[..., ::2]  # last-dim stride 2: rejected by name
    view = _C.view(q)
    assert view.strides == [70 * 2 * 32, 2 * 32, 32, 2]
    arrays = list(_problem(rng))
    arrays[0] = q
    out, final = np.empty((2, 70, 4, 8), np.float32), np.empty((2, 4, 16, 8), np.float32)
    with pytest.raises(_C.InvalidArgumentError, match="^q: .*stride 1"):
        _C.validate_forward(_params(arrays, out, final))
    # Row-strided (padded) inputs are fine.
    arrays[0] = np.ascontiguousarray(q)
    padded = np.zeros((2, 70, 4, 12), np.float32)
    padded[..., :8] = arrays[2]
    arrays[2] = padded[..., :8]
    pr = _C.validate_forward(_params(arrays, out, final))
    assert (pr.N, pr.HV, pr.group) == (2, 4, 2)


def test_errors_are_value_and_assertion_errors():
    assert issubclass(_C.InvalidArgumentError, ValueError)
    assert issubclass(_C.InvalidArgumentError, AssertionError)
    rng = np.random.default_rng()
    arrays = _problem(rng)
    out, final = np.empty((2, 70, 4, 8), np.float32), np.empty((2, 4, 16, 8), np.float32)
    p = _params(arrays, out, final)
    p.chunk_size = 16
    with pytest.raises(ValueError, match="`chunk_size` must be either 32 or 64"):
        _C.forward(p)
    with pytest.raises(AssertionError, match="^chunk_size"):
        _C.forward(p)
    p.chunk_size = 64
    with pytest.raises(_C.InvalidArgumentError, match="^workspace: needs"):
        _C.forward(p)


def test_count_chunks():
    assert _C.count_chunks([0, 1, 64, 64, 130], 64) == 1 + 1 + 0 + 2
    assert _C.count_chunks([0, 33], 32) == 2


def test_torch_tensor_views():
    """torch tensors are read through their attributes (not DLPack): every field must match the tensor."""
    torch = pytest.importorskip("torch")
    base = torch.randn(3, 5, 8, requires_grad=True)  # grad-requiring tensors need no detach
    for t, dtype in ((base, "float32"), (base.detach().bfloat16()[:, 1:, ::2], "bfloat16"),
                     (torch.zeros((), dtype=torch.int64), "int64"), (torch.zeros(4, dtype=torch.bool), "bool")):
        v = _C.view(t)
        assert v.present and v.dtype == dtype
        assert v.shape == list(t.shape) and v.strides == list(t.stride()) and v.data_ptr == t.data_ptr()
    assert not _C.view(None).present
    with pytest.raises(_C.InvalidArgumentError, match="device meta"):
        _C.view(torch.zeros(2, device="meta"))
    with pytest.raises(_C.InvalidArgumentError, match="element type"):
        _C.view(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="got str"):
        _C.view("not a tensor")


def test_whole_struct_setters_match_field_assignment():
    """set_inputs / set_state fill the same params as field-by-field assignment: the forward gives the same bits."""
    rng = np.random.default_rng()
    arrays = _problem(rng)
    q, k, v, g, beta, A_log, h0 = arrays
    B, T, HV, V = 2, 70, 4, 8
    results = []
    for use_setters in (False, True):
        out, final = np.full((B, T, HV, V), np.nan, np.float32), np.full((B, HV, 16, V), np.nan, np.float32)
        if use_setters:
            p = _C.ForwardParams()
            _C.set_inputs(p.inputs, q, k, v, g, beta, A_log, None, None, None, q.shape[-1] ** -0.5,
                          int(_C.GateMode.SOFTPLUS), -5.0, True, True, False)
            _C.set_state(p.state, False, h0, final, None, None)
            p.out = _C.view(out)
        else:
            p = _params(arrays, out, final)
        assert p.inputs.q.shape == list(q.shape) and p.inputs.gate.A_log.present
        assert not p.inputs.gate.dt_bias.present and not p.state.state_indices.present
        ws = np.empty(_C.forward_workspace_size(p), np.uint8)
        p.set_workspace(_C.view(ws))
        _C.forward(p)
        results.append((out.copy(), final.copy()))
    assert np.isfinite(results[0][0]).all()
    assert np.array_equal(results[0][0], results[1][0]) and np.array_equal(results[0][1], results[1][1])
    with pytest.raises(_C.InvalidArgumentError, match="^gate: "):
        _C.set_inputs(_C.ForwardParams().inputs, q, k, v, g, beta, None, None, None, None, 1.0, 7, -5.0, False,
                      False, False)
