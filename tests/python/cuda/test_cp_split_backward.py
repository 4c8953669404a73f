"""The split context-parallel backward (kdakit::BackwardParams::cp_phase; kdakit.ops.SplitBackward) on one GPU: the
summary half's d_initial (the gradient with respect to the initial state for a zero d_final_state) and the finish
half's gradients for a given d_final_state against the float64 reference (float32 inputs to 1e-4, bfloat16 within
FLA's tolerances) and, where the scan is not cut, against the one-call backward bit for bit; with and without
segments in the reverse scan, with a slow decay that gives the segments' transitions weight; the arguments each half
refuses."""
import pytest
import torch

import kdakit
from conftest import rel_rms, same_bits
from kdakit.chunk import kernel_options
from kdakit.ops import SplitBackward
from test_backward import FLA_TOL, TOL32, cotangents, errors, make, reference

pytestmark = pytest.mark.skipif(not kdakit.cuda_available(),
                                reason="no CUDA device, or kdakit was built without CUDA kernels")


def _force_segments(monkeypatch):  # the reverse scan cuts where the forward does: segments of >= 2 chunks
    monkeypatch.setenv("KDAKIT_FORWARD_SEGMENTS", "3")
    monkeypatch.setenv("KDAKIT_FORWARD_SEGMENT_TOKENS", "128")


def _args(x, dtype):
    t = [x[n].to(dtype) for n in ("q", "k", "v", "g", "beta")]
    gate_in_kernel = x["opts"]["use_gate_in_kernel"]
    scale, gate, lb = kernel_options(t[0], None, gate_in_kernel, x["opts"]["lower_bound"], x["opts"]["safe_gate"], 64)
    opts = (scale, gate, lb, True, True, False, x["opts"]["safe_gate"], 64)
    return t + [x.get("A_log"), x.get("dt_bias")], opts


NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("T,gate,h0,final", [(700, "lower_bound", True, True), (1000, "pre", False, True),
                                             (457, "softplus", True, False), (1, "lower_bound", True, True)])
def test_split_backward_halves(monkeypatch, seed, dtype, segments, T, gate, h0, final):
    if segments:
        _force_segments(monkeypatch)
    # "pre": a slow decay (about -0.003 a token), so that the segments' transposed transitions carry weight.
    x = make(1, T, 1, 2, 64, 64, gate=gate, h0=h0, norm=200.0 if gate == "pre" else 1.0)
    do, dht = cotangents(x, final)
    args, opts = _args(x, dtype)
    d_out = do.to(dtype)
    tol = (lambda n: TOL32) if dtype == torch.float32 else (lambda n: FLA_TOL[n.split(" ")[0]])

    # The summary's d_initial: the gradient with respect to the initial state for a zero d_final_state (it depends
    # on neither the state's value nor v), as accurate as the initial-state-only backward's (within 1% of its error
    # where that exceeds the bound: bfloat16 with the slow decay), and uncut the same bits.
    split = SplitBackward(*args, x.get("h0"), d_out, None, True, *opts)
    assert torch.isfinite(split.d_initial).all()
    alone = torch.ops.kdakit.chunk_bwd_initial_state(*args, None, None, d_out, None, *opts, False)
    x0 = dict(x, h0=x.get("h0", torch.zeros(1, 2, 64, 64, device="cuda")))
    ref0 = reference(x0, do, None, dtype=dtype)["h0"]
    e, e_alone = rel_rms(split.d_initial, ref0), rel_rms(alone, ref0)
    bound = max(tol("h0"), 1.01 * e_alone)
    assert e <= bound, f"d_initial: relative RMS error {e:.2e} > {bound:.2e} (initial-state-only: {e_alone:.2e})"
    if not segments:
        assert same_bits(split.d_initial, alone), "d_initial differs from the initial-state-only backward"

    # The finish's gradients: as accurate as the one-call backward on the same inputs (within 1% of its error, where
    # that exceeds the bound: the one-call float32 dA_log misses 1e-4 on some draws), and uncut the same bits.
    got = {n: t for n, t in zip(NAMES, split.finish(dht)) if n in x}
    whole = torch.ops.kdakit.chunk_bwd(*args, x.get("h0"), None, None, d_out, dht, None, *opts, False)
    whole = {n: t for n, t in zip(NAMES, whole) if n in x}
    ref = reference(x, do, dht, dtype=dtype)
    errs, errs_whole = errors(got, ref, x), errors(whole, ref, x)
    for n, e in errs.items():
        bound = max(tol(n), 1.01 * errs_whole[n])
        assert e <= bound, f"d{n}: relative RMS error {e:.2e} > {bound:.2e} (one call: {errs_whole[n]:.2e})"
    if not segments:  # the finish is the one call's scan from dht, on the summary's workspace
        for n in got:
            assert same_bits(got[n], whole[n]), f"d{n} differs from the one-call backward's"


def test_split_backward_without_d_initial_and_with_saved_states(monkeypatch, seed):
    """A summary that is not asked for d_initial (a rank whose first sequence starts there) runs only the pre-scan;
    the finish's gradients are the same bits as with it; saved chunk states (disable_recompute) too."""
    _force_segments(monkeypatch)
    x = make(1, 900, 1, 2, 64, 64, h0=True)
    do, dht = cotangents(x)
    args, opts = _args(x, torch.float32)
    a = SplitBackward(*args, x["h0"], do, None, True, *opts).finish(dht)
    b = SplitBackward(*args, x["h0"], do, None, False, *opts)
    assert b.d_initial is None
    b = b.finish(dht)
    with torch.inference_mode():
        states = kdakit.chunk_kda(*(t for t in args[:5]), A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=x["h0"],
                                  return_intermediate_states=True, **{k: v for k, v in x["opts"].items()})[2]
    c = SplitBackward(*args, x["h0"], do, states.float(), False, *opts).finish(dht)
    for n, ta, tb, tc in zip(NAMES, a, b, c):
        if ta.numel():
            assert same_bits(ta, tb), f"d{n} differs without d_initial"
            assert same_bits(ta, tc), f"d{n} differs with saved chunk states"


def test_split_backward_checks_its_arguments(seed):
    x = make(1, 200, 1, 2, 64, 64, h0=True)
    do, dht = cotangents(x)
    args, opts = _args(x, torch.float32)
    split = SplitBackward(*args, x["h0"], do, None, True, *opts)
    split.finish(dht)
    with pytest.raises(RuntimeError, match="already run"):
        split.finish(dht)
    # The kSummary call's rules, through the binding.
    from kdakit import _C
    from kdakit._torch import view
    from kdakit.ops import _backward_params

    p = _backward_params(*args, None, None, do, dht, *opts, False)
    p.cp_phase = _C.CpPhase.SUMMARY
    with pytest.raises(kdakit.InvalidArgumentError, match="d_final_state"):
        _C.BackwardCall(p)
    p = _backward_params(*args, None, None, do, None, *opts, False)
    p.cp_phase = _C.CpPhase.SUMMARY
    p.dq = view(torch.empty_like(args[0]))
    with pytest.raises(kdakit.InvalidArgumentError, match="dq"):
        _C.BackwardCall(p)
    two = torch.tensor([0, 100, 200], dtype=torch.int32, device="cuda")
    p = _backward_params(*args, two, two.cpu(), do, None, *opts, False)
    p.cp_phase = _C.CpPhase.SUMMARY
    with pytest.raises(kdakit.InvalidArgumentError, match="cu_seqlens"):
        _C.BackwardCall(p)
