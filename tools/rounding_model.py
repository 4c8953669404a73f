"""A model of the bf16 CUDA forward's rounding points for one-token chunks (T = 1), in float64 on the CPU: which
rounding makes the output error, and what a change of the algebra would give. Inputs follow the GPU tests' recipe
(tests/python/test_cuda_forward.py: q, k, v uniform in [0, 1), lower-bound gate, beta logits, random fp32 state).

    python3 tools/rounding_model.py [draws]

At T = 1 the kernel computes o = (q e^G) S + Aqk (u - w S) with, as bf16: q e^G, k e^G, beta (the Tm diag(beta)
operand), w, u, Aqk and its operands, v_new (the MMA operand) and o. The model prints the error spread with every
rounding, with each one removed, and for the rewritten form o = (q e^G - Aqk w) S + Aqk u (the cancellation between
the two S terms done in fp32 inside the prepare kernel, one rounding of the difference), with Aqk u formed in the
prepare kernel or in the recurrence.
"""
import sys

import torch

ROUNDINGS = ["qg", "ke", "tb", "w", "u", "aqk", "qa", "kb", "vnew", "o"]


def bf(x):
    return x.to(torch.bfloat16).to(torch.float64)


def draw(N=2, H=2, HV=4, K=128):
    q, k, v = bf(torch.rand(N, H, K)), bf(torch.rand(N, H, K)), bf(torch.rand(N, HV, K))
    g = bf(torch.randn(N, HV, K))
    A_log = torch.log(torch.empty(HV).uniform_(1, 16)).double()
    dt_bias = torch.randn(HV, K).double()
    beta = bf(torch.randn(N, HV))
    S0 = torch.randn(N, HV, K, K).double()
    return q, k, v, g, A_log, dt_bias, beta, S0


def prepared(x):
    q, k, v, g, A_log, dt_bias, beta, S0 = x
    H, K, HV = q.shape[1], q.shape[2], v.shape[1]
    hq = torch.arange(HV) // (HV // H)
    qn = q[:, hq] / (q[:, hq].square().sum(-1, keepdim=True) + 1e-6).sqrt()
    kn = k[:, hq] / (k[:, hq].square().sum(-1, keepdim=True) + 1e-6).sqrt()
    G = -5.0 * torch.sigmoid(A_log.exp()[None, :, None] * (g + dt_bias[None]))  # natural log, lower bound -5
    b = torch.sigmoid(beta)
    Sd = G.exp()[..., None] * S0
    ref = torch.einsum("nhk,nhkv->nhv", qn, Sd + b[..., None, None] * kn[..., None]
                       * (v - torch.einsum("nhk,nhkv->nhv", kn, Sd))[..., None, :]) * K ** -0.5
    return qn, kn, G, b, v, S0, K ** -0.5, ref


def err(o, ref):
    return ((o - ref).norm() / ref.norm()).item()


def current(x, rounded):
    qn, kn, G, b, v, S0, sc, ref = prepared(x)
    r = lambda name, t: bf(t) if name in rounded else t  # noqa: E731
    qg = r("qg", sc * qn * G.exp())
    tb = r("tb", b)[..., None]
    w = r("w", tb * r("ke", kn * G.exp()))
    u = r("u", tb * v)
    A = r("aqk", sc * (r("qa", qn) * r("kb", kn)).sum(-1, keepdim=True))
    vnew = u - torch.einsum("nhk,nhkv->nhv", w, S0)
    o = r("o", torch.einsum("nhk,nhkv->nhv", qg, S0) + A * r("vnew", vnew))
    return err(o, ref)


def rewritten(x, mode):
    """mode "split": q e^G - Aqk w and Aqk u formed in the prepare kernel from split (hi + lo) operands (~16
    significant bits, modelled as exact), each rounded once; "bf16": the same from bf16 operands; "recurrence":
    q e^G - Aqk w from split operands in the prepare kernel, Aqk u in the recurrence from the bf16 Aqk and u tiles
    (fp32 accumulation, added to (q e^G - Aqk w) S before the output's rounding: no Aqk lo tile)."""
    qn, kn, G, b, v, S0, sc, ref = prepared(x)
    qg = sc * qn * G.exp()
    w, u = bf(b)[..., None] * bf(kn * G.exp()), bf(b)[..., None] * v
    A = sc * (bf(qn) * bf(kn)).sum(-1, keepdim=True)
    if mode == "bf16":
        qp, au = bf(qg - bf(A) * bf(w)), bf(bf(A) * bf(u))
    elif mode == "split":
        qp, au = bf(qg - A * w), bf(A * u)
    else:
        qp, au = bf(qg - A * w), bf(A) * bf(u)
    return err(bf(torch.einsum("nhk,nhkv->nhv", qp, S0) + au), ref)


def spread(errs, tol=4e-3):
    e = torch.tensor(errs)
    return (f"median {e.median():.2e}  p90 {e.quantile(0.9):.2e}  max {e.max():.2e}  "
            f"over {tol:.0e}: {(e > tol).float().mean() * 100:.1f}%")


def main(argv):
    torch.manual_seed(1)
    xs = [draw() for _ in range(int(argv[0]) if argv else 300)]
    print(f"{'every rounding':34s}", spread([current(x, set(ROUNDINGS)) for x in xs]))
    for name in ROUNDINGS:
        print(f"{'without ' + name:34s}", spread([current(x, set(ROUNDINGS) - {name}) for x in xs]))
    print(f"{'only the output':34s}", spread([current(x, {'o'}) for x in xs]))
    print(f"{'(qg - A w) S + A u, split operands':34s}", spread([rewritten(x, "split") for x in xs]))
    print(f"{'(qg - A w) S + A u, bf16 operands':34s}", spread([rewritten(x, "bf16") for x in xs]))
    print(f"{'(qg - A w) S + A u, A u in recur.':34s}", spread([rewritten(x, "recurrence") for x in xs]))


if __name__ == "__main__":
    main(sys.argv[1:])
