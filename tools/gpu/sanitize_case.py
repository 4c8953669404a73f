"""A small varlen case with GVA, partial chunks, an empty sequence, states in and out and intermediate states,
for compute-sanitizer (memcheck, racecheck), run twice: as is, and with the sequences cut into context-parallel
segments (scan and merge kernels). Exits non-zero if the result is wrong."""
import os

import torch

import kdakit

torch.manual_seed(0)
cu = [0, 1, 70, 70, 135, 200]
T, H, HV, K, V = cu[-1], 2, 4, 100, 60
for dtype, cut in ((torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True), (torch.float32, True)):
    # Cut: sequences of >= 2 chunks of 32 tokens into up to 3 segments (the 69- and 65-token ones into 3: scan,
    # merge and recurrence per segment).
    os.environ["KDAKIT_FORWARD_SEGMENTS"] = "3" if cut else "1"
    os.environ["KDAKIT_FORWARD_SEGMENT_TOKENS"] = "32"
    kdakit._C.reload_overrides()  # the overrides are read once per process
    q, k = torch.rand(1, T, H, K, device="cuda", dtype=dtype), torch.rand(1, T, H, K, device="cuda", dtype=dtype)
    v, g = torch.rand(1, T, HV, V, device="cuda", dtype=dtype), torch.randn(1, T, HV, K, device="cuda", dtype=dtype)
    beta = torch.randn(1, T, HV, device="cuda", dtype=dtype)
    A_log, dt_bias = torch.zeros(HV, device="cuda"), torch.zeros(HV * K, device="cuda")
    h0 = torch.randn(len(cu) - 1, HV, V, K, device="cuda")
    args = (q, k, v, g, beta)
    kw = dict(A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, state_v_first=True)
    with torch.inference_mode():
        o, ht, h = kdakit.chunk_kda(*args, initial_state=h0, output_final_state=True, safe_gate=True,
                                    cu_seqlens=torch.tensor(cu, device="cuda"), cu_seqlens_cpu=torch.tensor(cu),
                                    return_intermediate_states=True, chunk_size=32, **kw)
    torch.cuda.synchronize()
    ro, rht = kdakit.naive_recurrent_kda(*args, initial_state=h0, output_final_state=True,
                                         cu_seqlens=torch.tensor(cu), **kw)
    err = ((o.double().cpu() - ro).norm() / ro.norm()).item()
    print(f"{dtype}{' (context-parallel segments)' if cut else ''}: relative error {err:.2e}")
    assert err < 4e-3, err
print("sanitize case OK")
