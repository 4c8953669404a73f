"""The CUDA decode's launch (src/cuda/decode/launch.cuh, run.cu): CUDA graph capture and replay, one kernel launch per
call, errors on CUDA tensors, torch.compile."""

import pytest
import torch

import kdakit
from conftest import compiled_and_eager, same_bits
from decode_cases import (make, oracle, final, kv, tol, close, make_pool, call, h0_from_pool, DEV)

pytestmark = pytest.mark.skipif(not kdakit.cuda_available(),
                                reason="no CUDA device, or kdakit was built without CUDA kernels")


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
    out.fill_(float("nan"))

    def replay_and_check(which):
        before = pool.clone()
        graph.replay()
        torch.cuda.synchronize()
        h0 = h0_from_pool(before, idx.tolist(), True)
        ro, rs = oracle(x, h0)
        close(f"o ({which} replay)", out, ro, tol(x, torch.bfloat16))
        close(f"ht ({which} replay)", kv(pool[idx.long()], True), final(rs, h0), tol(x, torch.bfloat16))

    replay_and_check("first")
    replay_and_check("second")  # continues from the updated pool


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
    expected = "decode_one_kernel" if mode.startswith("one_token") else "decode_kernel"
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

    oc, oe = compiled_and_eager(step, pool, pool2)
    assert same_bits(oc, oe) and same_bits(pool, pool2)
