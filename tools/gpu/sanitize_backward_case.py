"""A small varlen training step for compute-sanitizer (memcheck, racecheck): GVA, partial chunks, an empty sequence,
initial and final states, gate, L2 norm and beta sigmoid in kernel; bf16 with chunk 64 (K = 100, V = 60: padded keys,
a partial value tile) and fp32 with chunk 32 (K = V = 64); each as is and with the sequences cut into segments (the
reverse scan's segment pre-scans and merge). Exits non-zero on a non-finite gradient."""
import os

import torch

import kdakit

torch.manual_seed(0)
cu = [0, 1, 70, 70, 135, 200]
T, H, HV = cu[-1], 2, 4
for dtype, chunk, K, V, cut in ((torch.bfloat16, 64, 100, 60, False), (torch.float32, 32, 64, 64, False),
                                (torch.bfloat16, 64, 100, 60, True), (torch.float32, 32, 64, 64, True)):
    # Cut: the sequences of two or more chunks into up to 3 segments of whole chunks.
    os.environ["KDAKIT_FORWARD_SEGMENTS"] = "3" if cut else "1"
    os.environ["KDAKIT_FORWARD_SEGMENT_TOKENS"] = "32"
    kdakit._C.reload_overrides()  # the overrides are read once per process
    leaf = lambda *s, d=dtype: torch.randn(*s, device="cuda", dtype=d).requires_grad_()  # noqa: E731
    q, k, v, g, beta = leaf(1, T, H, K), leaf(1, T, H, K), leaf(1, T, HV, V), leaf(1, T, HV, K), leaf(1, T, HV)
    A_log, dt_bias = leaf(HV, d=torch.float32), leaf(HV * K, d=torch.float32)
    h0 = leaf(len(cu) - 1, HV, K, V, d=torch.float32)
    o, ht = kdakit.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, A_log=A_log,
                             dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, safe_gate=True, chunk_size=chunk,
                             cu_seqlens=torch.tensor(cu, device="cuda"), cu_seqlens_cpu=torch.tensor(cu))
    (o.float().sum() + ht.float().sum()).backward()
    for name, t in dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, h0=h0).items():
        if not torch.isfinite(t.grad).all():
            raise SystemExit(f"{dtype} cut={cut} d{name}: not finite")
torch.cuda.synchronize()
print("backward case ok")
