"""An independent float64 oracle in plain torch (autograd gives its gradients): spec §1.4, §1.5, §2.2, §2.5."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gate(g_raw, A_log=None, dt_bias=None, lower_bound=None):
    """In-kernel gate: -exp(A_log)*softplus(x) or lower_bound*sigmoid(exp(A_log)*x), x = g + dt_bias."""
    HV, K = g_raw.shape[-2], g_raw.shape[-1]
    x = g_raw + (dt_bias.reshape(HV, K) if dt_bias is not None else 0)
    if lower_bound is None:
        return -A_log.reshape(HV, 1).exp() * F.softplus(x, threshold=20)
    a = A_log.reshape(HV, 1).exp() if A_log is not None else 1.0
    return lower_bound * torch.sigmoid(a * x)


def recurrent(q, k, v, g, beta, scale, h0=None, cu_seqlens=None, state_v_first=False):
    """Token recurrence; q,k [B,T,H,K] (already normalised), v [B,T,HV,V], g [B,T,HV,K] log-decay, beta [B,T,HV]
    activated. Returns o [B,T,HV,V] and the final states [N,HV,K,V] (v-first if asked)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    q, k = q.repeat_interleave(G, dim=2), k.repeat_interleave(G, dim=2)
    bounds = [(b, 0, T) for b in range(B)] if cu_seqlens is None else \
        [(0, int(cu_seqlens[i]), int(cu_seqlens[i + 1])) for i in range(len(cu_seqlens) - 1)]
    outs = torch.zeros(B, T, HV, V, dtype=torch.float64)
    o_rows, finals = {}, []
    for n, (b, s, e) in enumerate(bounds):
        if h0 is not None:
            S = h0[n].transpose(-1, -2) if state_v_first else h0[n]
        else:
            S = torch.zeros(HV, K, V, dtype=torch.float64)
        for t in range(s, e):
            S = S * g[b, t].exp()[..., None]
            u = v[b, t] - (S * k[b, t][..., None]).sum(-2)
            S = S + beta[b, t][:, None, None] * k[b, t][..., None] * u[:, None, :]
            o_rows[(b, t)] = scale * (S * q[b, t][..., None]).sum(-2)
        finals.append(S.transpose(-1, -2) if state_v_first else S)
    if o_rows:
        idx = list(o_rows)
        outs = outs.index_put((torch.tensor([i[0] for i in idx]), torch.tensor([i[1] for i in idx])),
                              torch.stack([o_rows[i] for i in idx]))
    return outs, torch.stack(finals) if finals else torch.zeros(0, HV, K, V, dtype=torch.float64)


def kda(q, k, v, g, beta, scale=None, h0=None, *, A_log=None, dt_bias=None, lower_bound=None, use_gate=False,
        l2=False, beta_sigmoid=False, neg=False, cu_seqlens=None, state_v_first=False):
    """The whole op from raw inputs, in float64 (inputs are upcast, so gradients flow to the originals)."""
    d = lambda t: None if t is None else t.double()
    q, k, v, g, beta, h0, A_log, dt_bias = map(d, (q, k, v, g, beta, h0, A_log, dt_bias))
    if l2:
        q, k = l2norm(q), l2norm(k)
    if use_gate:
        g = gate(g, A_log, dt_bias, lower_bound)
    if beta_sigmoid:
        beta = torch.sigmoid(beta) * (2.0 if neg else 1.0)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return recurrent(q, k, v, g, beta, scale, h0, cu_seqlens, state_v_first)
