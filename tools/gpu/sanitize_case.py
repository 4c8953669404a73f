"""A small varlen case with GVA, partial chunks, an empty sequence, states in and out and intermediate states,
for compute-sanitizer (memcheck, racecheck), run twice: as is, and with the sequences cut into context-parallel
segments (scan and merge kernels); then, where the GPU has them, the Hopper recurrence's warpgroup-MMA kernels (bf16,
chunk 64, K = V = 128) at both tile widths, uncut and cut. Exits non-zero if a result is wrong."""
import os

import torch

import kdakit


def overrides(**values):
    """Sets the KDAKIT_FORWARD_* overrides given (None: unset) and has the extension read them again."""
    for name, value in values.items():
        key = "KDAKIT_FORWARD_" + name
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = str(value)
    kdakit._C.reload_overrides()  # the overrides are read once per process


def check(label, cu, H, HV, K, V, dtype, rand_qk, chunk_size, intermediate):
    """One forward call against the float64 reference (bf16 and fp32 bound 4e-3 relative)."""
    T = cu[-1]
    make = torch.rand if rand_qk else torch.randn
    q, k = make(1, T, H, K, device="cuda", dtype=dtype), make(1, T, H, K, device="cuda", dtype=dtype)
    v, g = torch.rand(1, T, HV, V, device="cuda", dtype=dtype), torch.randn(1, T, HV, K, device="cuda", dtype=dtype)
    beta = torch.randn(1, T, HV, device="cuda", dtype=dtype)
    A_log, dt_bias = torch.zeros(HV, device="cuda"), torch.zeros(HV * K, device="cuda")
    h0 = torch.randn(len(cu) - 1, HV, V, K, device="cuda")
    args = (q, k, v, g, beta)
    kw = dict(A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, state_v_first=True)
    with torch.inference_mode():
        res = kdakit.chunk_kda(*args, initial_state=h0, output_final_state=True, safe_gate=True,
                               cu_seqlens=torch.tensor(cu, device="cuda"), cu_seqlens_cpu=torch.tensor(cu),
                               return_intermediate_states=intermediate, chunk_size=chunk_size, **kw)
    torch.cuda.synchronize()
    ro, _ = kdakit.naive_recurrent_kda(*args, initial_state=h0, output_final_state=True, cu_seqlens=torch.tensor(cu),
                                       **kw)
    err = ((res[0].double().cpu() - ro).norm() / ro.norm()).item()
    print(f"{label}: relative error {err:.2e}")
    assert err < 4e-3, err


torch.manual_seed(0)
for dtype, cut in ((torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True), (torch.float32, True)):
    # Cut: sequences of >= 2 chunks of 32 tokens into up to 3 segments (the 69- and 65-token ones into 3: scan,
    # merge and recurrence per segment).
    overrides(SEGMENTS=3 if cut else 1, SEGMENT_TOKENS=32)
    check(f"{dtype}{' (context-parallel segments)' if cut else ''}", [0, 1, 70, 70, 135, 200], 2, 4, 100, 60, dtype,
          rand_qk=True, chunk_size=32, intermediate=True)

# The warpgroup-MMA recurrence (sm_90: bf16 operands, chunk 64, K <= 128), whose copier warpgroup hands each stage over
# by a named barrier: 64- and 128-column tiles (KDAKIT_FORWARD_BV), uncut and cut into segments (the scan instance).
if torch.cuda.get_device_capability() == (9, 0):
    for bv, cut in ((64, False), (128, False), (128, True)):
        overrides(BV=bv, SEGMENTS=2 if cut else 1, SEGMENT_TOKENS=64)
        check(f"warpgroup MMAs, {bv}-column tiles{' (segments)' if cut else ''}", [0, 130, 130, 200], 1, 2, 128, 128,
              torch.bfloat16, rand_qk=False, chunk_size=64, intermediate=False)
overrides(BV=None, SEGMENTS=None, SEGMENT_TOKENS=None)
print("sanitize case OK")
