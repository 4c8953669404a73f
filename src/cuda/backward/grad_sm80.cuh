// The backward's gradient kernel (the key side of src/cpu/chunk_gradients.cpp and the activations' chains), one CTA
// per (chunk, v-head): the rows' facts once (beta, the L2 norms, the diagonal blocks' algorithm), then 16-key slices
// in turn: the slice's q, k (L2-normalised over all K) and gates with their sub-chunk sums; its products with the
// states (dqg, dkbg, dkg and rowsum(S dH), from state_products_sm80.cuh); the intra-chunk products through dP and dL
// (intra_sm80.cuh), from the slice's anchored exponentials, taken once per (row, key); then per (row, key) dq, dk of
// this v-head (to the workspace: the GVA sum and the L2 norm's backward come after), beta's key-side part, the gate
// gradient summed as the CPU sums it, and the gate's chain to the raw input with per-chunk partial sums of dA_log and
// ddt_bias.
#pragma once

#include "cuda/backward/intra_sm80.cuh"

namespace kdakit::cuda {

template <typename InT>
__global__ void __launch_bounds__(kBwdThreads) backward_grad_kernel(const BackwardArgs a) {
  constexpr int LDK = kBwdLdk, KS = kBwdKSlice;
  const int64_t slot = blockIdx.x;
  const int hv = blockIdx.y;
  ChunkOf ch;
  if (!chunk_of(a, slot, ch)) return;
  const int C = a.chunk, K = a.K, nrows = ch.nrows, NSUB = (nrows + 15) / 16;
  const int h = hv / a.group, tid = threadIdx.x;
  const int64_t tile = a.tile(slot, hv);
  const float* dP = a.ws_dP + tile * C * C;
  const float* dL = a.ws_dL + tile * C * C;

  extern __shared__ __align__(16) float smem[];
  GradSlice s;
  {
    float* p = smem;
    auto take = [&p](int n) { float* r = p; p += n; return r; };
    const int tl = C * LDK;
    s.q = take(tl); s.k = take(tl); s.g = take(tl); s.el = take(tl); s.er = take(tl); s.es = take(tl);
    s.ies = take(tl); s.xq = take(tl); s.xb = take(tl); s.ker = take(tl); s.dG = take(tl); s.kgt = take(tl);
    float* uni = take(static_cast<int>(bwd_grad_intra(C)));
    s.dqr = uni; s.dkr = uni + tl; s.dkc = uni + 2 * tl; s.arow = uni + 3 * tl; s.bcol = uni + 4 * tl;
    s.dgp = uni + 5 * tl; s.cpart = uni + 6 * tl; s.wc = uni + 7 * tl;
    s.beta = take(C); s.rq = take(C); s.rk = take(C);
    s.tot = take(4 * KS); s.etot = take(4 * KS); s.gam = take(KS); s.dgam = take(KS);
    s.maxexp = reinterpret_cast<int*>(take(4));
    s.red = take(kBwdRowGroups);
  }

  // Rows: beta, the L2 norms (below, a warp a row, over all K); the diagonal blocks' algorithm, from the largest anchor
  // exponent over all keys (as the CPU decides it).
  for (int i = tid; i < C; i += kBwdThreads) {
    s.beta[i] = i < nrows ? math::beta_value(a.beta.load(a.beta.offset(ch.b, ch.row0 + i, hv)), a.beta_sigmoid,
                                             a.neg_eigval)
                          : 0.f;
  }
  if (tid < 4) s.maxexp[tid] = 0;
  // The L2 norms' reciprocals, a warp per row.
  for (int r = tid >> 5; r < C; r += kBwdRowGroups) {
    float sq = 0.f, sk = 0.f;
    if (r < nrows) {
      const int64_t qo = a.q.offset(ch.b, ch.row0 + r, h), ko = a.k.offset(ch.b, ch.row0 + r, h);
      for (int d = tid & 31; d < K; d += 32) {
        const float x = token_at<InT>(a.q, qo, d), y = token_at<InT>(a.k, ko, d);
        sq += x * x;
        sk += y * y;
      }
    }
    sq = warp_sum(sq);
    sk = warp_sum(sk);
    if ((tid & 31) == 0) {
      const float eps = static_cast<float>(math::kL2NormEps);
      s.rq[r] = r < nrows ? (a.l2norm ? 1.f / sqrtf(sq + eps) : 1.f) : 0.f;
      s.rk[r] = r < nrows ? (a.l2norm ? 1.f / sqrtf(sk + eps) : 1.f) : 0.f;
    }
  }
  __syncthreads();
  for (int e = tid; e < NSUB * K; e += kBwdThreads) {
    const int blk = e / K, d = e % K, s0 = 16 * blk, s1 = min(nrows, s0 + 16), m = s0 + min(8, s1 - s0 - 1);
    float acc = 0.f, mx = 0.f;
    for (int i = m + 1; i < s1; ++i) acc += gate_at(a, a.g, ch.b, ch.row0 + i, hv, d);
    mx = fmaxf(mx, -acc);
    acc = 0.f;
    for (int i = m - 1; i >= s0; --i) acc -= gate_at(a, a.g, ch.b, ch.row0 + i + 1, hv, d);
    mx = fmaxf(mx, acc);
    atomicMax(&s.maxexp[blk], __float_as_int(mx));  // non-negative floats order as their bits
  }
  // The 16-key slices in turn, each ending in its own partial sums (dbeta's key part, dA_log); the rows' facts above
  // are the chunk's, taken once.
  for (int ks = 0; ks < a.nks; ++ks) {
    const int d0 = ks * KS;
    __syncthreads();  // the previous slice's readers are done
    // The slice: q and k normalised, the gates, then the sub-chunk sums (chunk_sums of the CPU).
    for (int e = tid; e < C * KS; e += kBwdThreads) {
      const int r = e / KS, dl = e % KS, d = d0 + dl;
      const bool in = r < nrows && d < K;
      s.q[r * LDK + dl] = in ? token_at<InT>(a.q, a.q.offset(ch.b, ch.row0 + r, h), d) * s.rq[r] : 0.f;
      s.k[r * LDK + dl] = in ? token_at<InT>(a.k, a.k.offset(ch.b, ch.row0 + r, h), d) * s.rk[r] : 0.f;
      s.g[r * LDK + dl] = in ? gate_at(a, a.g, ch.b, ch.row0 + r, hv, d) : 0.f;
    }
    __syncthreads();
    // The sub-chunk sums (chunk_sums of the CPU), kept as the exponentials the products take: exp(lam) (inclusive
    // prefix), exp(rho) (exclusive suffix), exp(+-sigma) (around the block's middle row; only read in factorised
    // blocks, where |sigma| <= 64), exp(total).
    for (int e = tid; e < NSUB * KS; e += kBwdThreads) {
      const int blk = e / KS, dl = e % KS, s0 = 16 * blk, s1 = min(nrows, s0 + 16), m = s0 + min(8, s1 - s0 - 1);
      float acc = 0.f;
      for (int r = s0; r < s1; ++r) {
        acc += s.g[r * LDK + dl];
        s.el[r * LDK + dl] = expf(acc);
      }
      s.tot[blk * KS + dl] = acc;
      s.etot[blk * KS + dl] = expf(acc);
      acc = 0.f;
      for (int r = s1 - 1; r >= s0; --r) {
        s.er[r * LDK + dl] = expf(acc);
        acc += s.g[r * LDK + dl];
      }
      auto put_sigma = [&](int r, float x) {
        s.es[r * LDK + dl] = expf(x);
        s.ies[r * LDK + dl] = expf(-x);
      };
      put_sigma(m, 0.f);
      acc = 0.f;
      for (int i = m + 1; i < s1; ++i) {
        acc += s.g[i * LDK + dl];
        put_sigma(i, acc);
      }
      acc = 0.f;
      for (int i = m - 1; i >= s0; --i) {
        acc -= s.g[(i + 1) * LDK + dl];
        put_sigma(i, acc);
      }
    }
    __syncthreads();
    if (tid < KS) {
      float t = 0.f;
      for (int blk = 0; blk < NSUB; ++blk) t += s.tot[blk * KS + tid];
      s.gam[tid] = expf(t);
    }

    // The products' factors of the anchored rows and columns: q e^lam, beta k e^lam, k e^rho.
    for (int e = tid; e < C * KS; e += kBwdThreads) {
      const int x = (e / KS) * LDK + e % KS;
      s.xq[x] = s.q[x] * s.el[x];
      s.xb[x] = s.beta[e / KS] * s.k[x] * s.el[x];
      s.ker[x] = s.k[x] * s.er[x];
    }
    if (tid < KS) s.dgam[tid] = d0 + tid < K ? a.ws_dgam[tile * K + d0 + tid] : 0.f;  // rowsum(S dH)
    __syncthreads();

    intra_products(s, dP, dL, C, nrows, NSUB);

    // Assembly per (row, key); beta's key-side part summed over the slice's keys (16 lanes a row).
    for (int e = tid; e < C * KS; e += kBwdThreads) {
      const int r = e / KS, dl = e % KS, d = d0 + dl, blk = r / 16;
      float db = 0.f;
      if (r < nrows) {
        float before = 1.f, after = 1.f;  // exp of the totals of the blocks before and after this one
        for (int c = 0; c < blk; ++c) before *= s.etot[c * KS + dl];
        for (int c = blk + 1; c < NSUB; ++c) after *= s.etot[c * KS + dl];
        const int x = r * LDK + dl;
        const float eg = s.el[x] * before, egl = s.er[x] * after;
        const float kd = s.k[x], qd = s.q[x], bt = s.beta[r], pd = dP[r * C + r];
        // The products with the states (backward_state_products_kernel): dqg and dkbg in the dq and dk parts, which
        // this element's results overwrite, and dkg.
        const int64_t o = (a.row(ch.b, ch.row0 + r) * a.HV + hv) * K + d;
        const float dqg = d < K ? a.ws_dq[o] : 0.f, dkbg = d < K ? a.ws_dk[o] : 0.f, dkg = d < K ? a.ws_dkg[o] : 0.f;
        db = kd * s.dkr[x] + dkbg * kd * eg;
        const float dk_kg = egl * dkg, dq_g = eg * dqg, dk_g = bt * eg * dkbg;
        const float dq = s.dqr[x] + dq_g + pd * kd;
        const float dk = dk_g + bt * s.dkr[x] + s.dkc[x] + pd * qd + dk_kg;
        s.dG[x] = qd * dq_g + kd * dk_g;
        s.kgt[x] = kd * dk_kg;
        if (d < K) {
          a.ws_dq[o] = dq;
          a.ws_dk[o] = dk;
        }
      }
#pragma unroll
      for (int o = KS / 2; o > 0; o >>= 1) db += __shfl_xor_sync(0xffffffffu, db, o);
      if (dl == 0 && r < nrows) a.ws_dbeta[(a.row(ch.b, ch.row0 + r) * a.HV + hv) * (1 + a.nks) + 1 + ks] = db;
    }
    __syncthreads();
    // The gate gradient per key: the pairs' part, the chunk-start terms summed in reverse, the kg terms forward over
    // the earlier rows, and the state's decay on every row (dg written over dgp).
    if (tid < KS) {
      const int dl = tid;
      float rev = 0.f;
      for (int r = nrows - 1; r >= 0; --r) {
        rev += s.dG[r * LDK + dl];
        s.dgp[r * LDK + dl] = s.dgp[r * LDK + dl] + rev;
      }
      float fwd = 0.f;
      const float last = s.gam[dl] * s.dgam[dl];
      for (int r = 0; r < nrows; ++r) {
        s.dgp[r * LDK + dl] += fwd + last;
        fwd += s.kgt[r * LDK + dl];
      }
    }
    __syncthreads();
    // The gate's chain to the raw input (spec §4.2 B8) and dg; partial sums of dA_log (the CTA) and ddt_bias (per
    // key).
    const bool in_kernel = a.gate_mode != GateMode::kPreGated;
    const float A = a.A_log.present() ? a.A_log.load(hv) : 0.f;
    float dA = 0.f;
    for (int e = tid; e < nrows * KS; e += kBwdThreads) {
      const int r = e / KS, dl = e % KS, d = d0 + dl;
      if (d >= K) continue;
      float dg = s.dgp[r * LDK + dl];
      if (in_kernel) {
        float x, d_dx, d_dA;
        gate_at(a, a.g, ch.b, ch.row0 + r, hv, d, &x);
        math::gate_grad<float>(static_cast<int>(a.gate_mode), x, A, a.A_log.present(), a.lower_bound, &d_dx, &d_dA);
        dA += dg * d_dA;
        dg *= d_dx;
        s.dgp[r * LDK + dl] = dg;
      }
      a.dg.store(a.dg.offset(ch.b, ch.row0 + r, hv) + d, dg);
    }
    dA = block_sum(dA, s.red);
    if (tid == 0) a.ws_dA[tile * a.nks + ks] = dA;
    if (tid < KS && d0 + tid < K) {
      float acc = 0.f;
      for (int r = 0; r < nrows; ++r) acc += s.dgp[r * LDK + tid];
      a.ws_ddt[tile * K + d0 + tid] = acc;
    }
  }
}

}  // namespace kdakit::cuda
