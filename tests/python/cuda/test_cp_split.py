"""The split context-parallel forward (kdakit::CpPhase; kdakit.ops.SplitForward) on one GPU: a sequence cut into
`world` pieces as ranks would hold them; each piece's summary half against the float64 reference (S_ext, the end
state from zero, and M through the end state M h + S_ext from a random start state h: the forward's final-state
bound); the fold of the summaries (kdakit.cp.fold_incoming_state) into each piece's start state; the finish halves'
outputs against the float64 reference of the whole sequence; with and without intra-card segments in the pieces."""
import pytest
import torch

import kdakit
from conftest import rel_rms
from kdakit import cp
from kdakit.chunk import kernel_options
from kdakit.ops import SplitForward

pytestmark = pytest.mark.skipif(not kdakit.cuda_available(),
                                reason="no CUDA device, or kdakit was built without CUDA kernels")

TOL = {torch.bfloat16: 4e-3, torch.float32: 1e-4}  # relative RMS against float64 (the forward's bounds)


def make(T, H, HV, K, V, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.rand(*s, generator=gen, device="cuda")  # noqa: E731
    n = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    x = dict(q=r(1, T, H, K).to(dtype), k=r(1, T, H, K).to(dtype), v=r(1, T, HV, V).to(dtype),
             g=n(1, T, HV, K).to(dtype), beta=n(1, T, HV).to(dtype),
             A_log=torch.log(1 + 15 * r(HV)), dt_bias=n(HV * K))
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                lower_bound=-5.0, safe_gate=True)
    return x, opts


def halves_of(x, opts, world):
    T = x["q"].shape[1]
    scale, gate, lb = kernel_options(x["q"], None, True, opts["lower_bound"], True, 64)
    out = []
    for r in range(world):
        s, e = r * T // world, (r + 1) * T // world
        piece = [x[n][:, s:e] for n in ("q", "k", "v", "g", "beta")]
        out.append((s, e, SplitForward(*piece, x["A_log"], x["dt_bias"], scale, gate, lb, True, True, False, True, 64)))
    return out


def reference(x, opts, s=0, e=None, h0=None):
    e = x["q"].shape[1] if e is None else e
    o = {k: v for k, v in opts.items() if k != "safe_gate"}
    return kdakit.naive_recurrent_kda(*(x[n][:, s:e] for n in ("q", "k", "v", "g", "beta")), A_log=x["A_log"],
                                      dt_bias=x["dt_bias"], initial_state=h0, output_final_state=True, **o)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("world,T,K,V,group", [(2, 1400, 128, 128, 1), (3, 1500, 64, 64, 2), (4, 1000, 100, 60, 1)])
def test_split_halves_match_the_reference(monkeypatch, seed, dtype, segments, world, T, K, V, group):
    if segments:  # pieces of 5-6 chunks cut into segments of >= 2 chunks inside the GPU
        monkeypatch.setenv("KDAKIT_FORWARD_SEGMENTS", "3")
        monkeypatch.setenv("KDAKIT_FORWARD_SEGMENT_TOKENS", "128")
    x, opts = make(T, 2, 2 * group, K, V, dtype, seed)
    tol = TOL[dtype]
    with torch.inference_mode():
        halves = halves_of(x, opts, world)
        summaries = [h.summary.clone() for _, _, h in halves]
        for (s, e, _), got in zip(halves, summaries):
            assert torch.isfinite(got).all(), "summary: NaN or Inf"
            _, S_ext = reference(x, opts, s, e)
            err = rel_rms(got[..., :V], S_ext[0].to(got.device))
            assert err <= tol, f"S_ext of piece [{s}, {e}): relative RMS error {err:.2e} > {tol:.0e}"
            # M by what the fold uses it for: the piece's end state from a start state h, M h + S_ext, bounded as
            # any final state of a forward from an initial state.
            h = torch.randn(got.shape[0], K, V, generator=torch.Generator(device="cuda").manual_seed(seed + s),
                            device="cuda")
            _, want_end = reference(x, opts, s, e, h0=h[None])
            got_end = torch.matmul(got[..., V:], h) + got[..., :V]
            err = rel_rms(got_end, want_end[0].to(got.device))
            assert err <= tol, f"M h + S_ext of piece [{s}, {e}): relative RMS error {err:.2e} > {tol:.0e}"
        outs = []
        for r, (s, e, half) in enumerate(halves):
            S_in = cp.fold_incoming_state([t[..., :V] for t in summaries], [t[..., V:] for t in summaries], r, r)
            outs.append(half.finish(None if S_in is None else S_in[None].contiguous()).clone())
        o = torch.cat(outs, dim=1)
        ro, _ = reference(x, opts)
    assert torch.isfinite(o).all(), "output: NaN or Inf"
    err = rel_rms(o, ro.to(o.device))
    assert err <= tol, f"output: relative RMS error {err:.2e} > {tol:.0e}"


def test_split_forward_runs_once_and_checks_its_arguments():
    x, opts = make(256, 1, 1, 64, 64, torch.bfloat16, 0)
    with torch.inference_mode():
        (_, _, half), = halves_of(x, opts, 1)
        o = half.finish(None)
        assert torch.isfinite(o).all()
        with pytest.raises(RuntimeError, match="already run"):
            half.finish(None)
    scale, gate, lb = kernel_options(x["q"], None, True, -5.0, True, 64)
    args = [x[n].cpu() for n in ("q", "k", "v", "g", "beta")] + [x["A_log"].cpu(), x["dt_bias"].cpu()]
    with pytest.raises(kdakit.InvalidArgumentError, match="cp_phase"):
        SplitForward(*args, scale, gate, lb, True, True, False, True, 64)  # CPU tensors
    two = [torch.cat([t, t]) for t in (x[n] for n in ("q", "k", "v", "g", "beta"))]
    with pytest.raises(kdakit.InvalidArgumentError, match="one sequence"):
        SplitForward(*two, x["A_log"], x["dt_bias"], scale, gate, lb, True, True, False, True, 64)
