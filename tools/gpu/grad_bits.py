"""The CUDA backward's gradients on fixed inputs, saved or compared bit for bit with an earlier build's.

    python3 tools/gpu/grad_bits.py dump FILE       gradients of the installed kdakit, saved to FILE
    python3 tools/gpu/grad_bits.py compare FILE    the same gradients against FILE: which tensors differ (exit 1 if any)

A change meant to keep the arithmetic (a hoisted load, a compile-time bound) is checked by dumping with the old build
and comparing with the new one, each in its own process. The cases cover bf16, fp16 and fp32 inputs, K = 30..256,
chunk 32 and 64, varlen with an empty sequence, GVA, both gates and the forward's saved chunk states."""
import sys

import torch

import kdakit

# (B, T, H, HV, K, V, dtype, chunk, gate, varlen, recompute)
CASES = [
    (2, 300, 2, 2, 128, 128, torch.bfloat16, 64, "softplus", False, True),
    (1, 1000, 2, 4, 128, 128, torch.bfloat16, 64, "lower_bound", True, True),
    (2, 200, 2, 2, 64, 64, torch.float32, 64, "softplus", False, True),
    (1, 257, 1, 1, 100, 60, torch.float32, 32, "softplus", False, False),
    (1, 130, 2, 2, 256, 256, torch.bfloat16, 64, "softplus", False, True),
    (1, 130, 1, 2, 256, 128, torch.float32, 64, "lower_bound", True, True),
    (2, 100, 2, 2, 128, 128, torch.float16, 64, "softplus", False, True),
    (1, 77, 1, 1, 30, 36, torch.float32, 64, "softplus", False, True),
    (2, 129, 2, 2, 128, 128, torch.bfloat16, 32, "lower_bound", False, True),
]
NAMES = ["dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"]


def gradients(case, seed):
    B, T, H, HV, K, V, dt, C, gate, varlen, recompute = case
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s):
        return torch.randn(*s, device="cuda", generator=g)

    q = r(B, T, H, K).to(dt).requires_grad_()
    k = r(B, T, H, K).to(dt).requires_grad_()
    v = r(B, T, HV, V).to(dt).requires_grad_()
    graw = r(B, T, HV, K).to(dt).requires_grad_()
    beta = r(B, T, HV).to(dt).requires_grad_()
    A_log = torch.log(torch.rand(HV, device="cuda", generator=g) * 4 + 1).requires_grad_()
    dt_bias = (r(HV * K) * 0.1).requires_grad_()
    h0 = r(B, HV, K, V).requires_grad_()
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
              use_beta_sigmoid_in_kernel=True, initial_state=h0, output_final_state=True, chunk_size=C,
              disable_recompute=not recompute)
    if gate == "lower_bound":
        kw["lower_bound"] = -5.0
    if varlen:  # three sequences, the middle one empty
        kw["cu_seqlens"] = torch.tensor([0, T // 3, T // 3, T], device="cuda", dtype=torch.int32)
        h0 = kw["initial_state"] = r(3, HV, K, V).requires_grad_()
    o, ht = kdakit.chunk_kda(q, k, v, graw, beta, **kw)
    do = r(*o.shape).to(o.dtype)
    dht = r(*ht.shape)
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (ht * dht).sum(),
                                [q, k, v, graw, beta, A_log, dt_bias, h0])
    return [x.detach().cpu() for x in grads]


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def main(argv):
    if len(argv) != 3 or argv[1] not in ("dump", "compare"):
        sys.exit(__doc__)
    mode, path = argv[1], argv[2]
    out = {ci: gradients(case, 100 + ci) for ci, case in enumerate(CASES)}
    if mode == "dump":
        torch.save(out, path)
        print(f"saved the gradients of {len(out)} cases to {path}")
        return 0
    ref = torch.load(path)
    bad = 0
    for ci, grads in out.items():
        for name, a, b in zip(NAMES, ref[ci], grads):
            if not same_bits(a, b):
                bad += 1
                d = (a.double() - b.double()).abs().max().item()
                finite = torch.isfinite(b).all().item()
                print(f"case {ci} {name}: bits differ, max abs difference {d:.3e}, finite {finite}")
    print(f"bit comparison: {bad} gradient tensors differ over {len(out)} cases")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
