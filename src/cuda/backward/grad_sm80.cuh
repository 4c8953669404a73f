// The backward's gradient kernel (the key side of src/cpu/chunk_gradients.cpp and the activations' chains), one CTA
// per (chunk, v-head, 16 keys): the slice's q, k (L2-normalised over all K) and gates with their sub-chunk sums; the
// products with the states dqg = scale dO S^T, dkbg = -dbv S^T, dkg = v_new dH^T and rowsum(S dH), over 32-column
// value tiles; the intra-chunk products through dP and dL (intra_sm80.cuh); then per (row, key) dq, dk of this v-head
// (to the workspace: the GVA sum and the L2 norm's backward come after), beta's key-side part, the gate gradient
// summed as the CPU sums it, and the gate's chain to the raw input with per-chunk partial sums of dA_log and ddt_bias.
#pragma once

#include "cuda/backward/intra_sm80.cuh"

namespace kdakit::cuda {

template <typename InT>
__global__ void __launch_bounds__(kBwdThreads) backward_grad_kernel(const BackwardArgs a) {
  constexpr int LD = kBwdLd, LDK = kBwdLdk, KS = kBwdKSlice, MR = kBwdMaxChunk / (kBwdThreads / KS);
  const int64_t slot = blockIdx.x;
  const int hv = blockIdx.y, ks = blockIdx.z;
  ChunkOf ch;
  if (!chunk_of(a, slot, ch)) return;
  const int C = a.chunk, K = a.K, V = a.V, nrows = ch.nrows, NSUB = (nrows + 15) / 16, d0 = ks * KS;
  const int h = hv / a.group, tid = threadIdx.x;
  const int64_t tile = a.tile(slot, hv), t_v = tile * C * V;
  const float* dP = a.ws_dP + tile * C * C;
  const float* dL = a.ws_dL + tile * C * C;
  const bool varlen = a.cu_seqlens.present();

  extern __shared__ __align__(16) float smem[];
  GradSlice s;
  {
    float* p = smem;
    auto take = [&p](int n) { float* r = p; p += n; return r; };
    const int tl = C * LDK;
    s.q = take(tl); s.k = take(tl); s.g = take(tl); s.lam = take(tl); s.rho = take(tl); s.sig = take(tl);
    s.dqg = take(tl); s.dkbg = take(tl); s.dkg = take(tl); s.dG = take(tl); s.kgt = take(tl);
    float* uni = take(static_cast<int>(bwd_grad_union(C)));
    s.dqr = uni; s.dkr = uni + tl; s.dkc = uni + 2 * tl; s.arow = uni + 3 * tl; s.bcol = uni + 4 * tl;
    s.dgp = uni + 5 * tl; s.wc = uni + 6 * tl;
    s.beta = take(C); s.rq = take(C); s.rk = take(C);
    s.tot = take(4 * KS); s.gam = take(KS); s.dgam = take(KS);
    s.maxexp = reinterpret_cast<int*>(take(4));
    s.red = take(kBwdRowGroups);
  }
  // The value tiles, over the intra products' bytes.
  float* sdO = s.dqr;               // [C][LD]
  float* sdbv = sdO + C * LD;       // [C][LD]
  float* svn = sdbv + C * LD;       // [C][LD]
  float* sS = svn + C * LD;         // [KS][LD]
  float* sdH = sS + KS * LD;        // [KS][LD]

  // Rows: beta, the L2 norms (4 threads a row, over all K); the diagonal blocks' algorithm, from the largest anchor
  // exponent over all keys (as the CPU decides it).
  for (int i = tid; i < C; i += kBwdThreads) {
    s.beta[i] = i < nrows ? math::beta_value(a.beta.load(a.beta.offset(ch.b, ch.row0 + i, hv)), a.beta_sigmoid,
                                             a.neg_eigval)
                          : 0.f;
  }
  if (tid < 4) s.maxexp[tid] = 0;
  {
    const int r = tid >> 2, part = tid & 3;
    float sq = 0.f, sk = 0.f;
    if (r < nrows) {
      const int64_t qo = a.q.offset(ch.b, ch.row0 + r, h), ko = a.k.offset(ch.b, ch.row0 + r, h);
      for (int d = part; d < K; d += 4) {
        const float x = token_at<InT>(a.q, qo, d), y = token_at<InT>(a.k, ko, d);
        sq += x * x;
        sk += y * y;
      }
    }
    sq += __shfl_xor_sync(0xffffffffu, sq, 1);
    sq += __shfl_xor_sync(0xffffffffu, sq, 2);
    sk += __shfl_xor_sync(0xffffffffu, sk, 1);
    sk += __shfl_xor_sync(0xffffffffu, sk, 2);
    if (part == 0 && r < C) {
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
  // The slice: q and k normalised, the gates, then the sub-chunk sums (chunk_sums of the CPU).
  for (int e = tid; e < C * KS; e += kBwdThreads) {
    const int r = e / KS, dl = e % KS, d = d0 + dl;
    const bool in = r < nrows && d < K;
    s.q[r * LDK + dl] = in ? token_at<InT>(a.q, a.q.offset(ch.b, ch.row0 + r, h), d) * s.rq[r] : 0.f;
    s.k[r * LDK + dl] = in ? token_at<InT>(a.k, a.k.offset(ch.b, ch.row0 + r, h), d) * s.rk[r] : 0.f;
    s.g[r * LDK + dl] = in ? gate_at(a, a.g, ch.b, ch.row0 + r, hv, d) : 0.f;
  }
  __syncthreads();
  for (int e = tid; e < NSUB * KS; e += kBwdThreads) {
    const int blk = e / KS, dl = e % KS, s0 = 16 * blk, s1 = min(nrows, s0 + 16), m = s0 + min(8, s1 - s0 - 1);
    float acc = 0.f;
    for (int r = s0; r < s1; ++r) {
      acc += s.g[r * LDK + dl];
      s.lam[r * LDK + dl] = acc;
    }
    s.tot[blk * KS + dl] = acc;
    acc = 0.f;
    for (int r = s1 - 1; r >= s0; --r) {
      s.rho[r * LDK + dl] = acc;
      acc += s.g[r * LDK + dl];
    }
    s.sig[m * LDK + dl] = 0.f;
    acc = 0.f;
    for (int i = m + 1; i < s1; ++i) {
      acc += s.g[i * LDK + dl];
      s.sig[i * LDK + dl] = acc;
    }
    acc = 0.f;
    for (int i = m - 1; i >= s0; --i) {
      acc -= s.g[(i + 1) * LDK + dl];
      s.sig[i * LDK + dl] = acc;
    }
  }
  __syncthreads();
  if (tid < KS) {
    float t = 0.f;
    for (int blk = 0; blk < NSUB; ++blk) t += s.tot[blk * KS + tid];
    s.gam[tid] = expf(t);
  }

  // Products with the states over the value tiles: thread (rows i = tid / KS + 16 m, key dl = tid % KS).
  const int dl_own = tid % KS, i_own = tid / KS;
  float aq[MR], ab[MR], ak[MR], dgam = 0.f;
#pragma unroll
  for (int m = 0; m < MR; ++m) aq[m] = ab[m] = ak[m] = 0.f;
  const int64_t hblk = a.h.block(varlen, ch.b, ch.ci, slot, hv);
  const int VT = (V + kBwdCols - 1) / kBwdCols;
  for (int vt = 0; vt < VT; ++vt) {
    for (int e = tid; e < C * kBwdCols; e += kBwdThreads) {
      const int i = e / kBwdCols, c = e % kBwdCols, col = vt * kBwdCols + c;
      const bool in = i < nrows && col < V;
      sdO[i * LD + c] = in ? a.d_out.load(a.d_out.offset(ch.b, ch.row0 + i, hv) + col) : 0.f;
      sdbv[i * LD + c] = in ? a.ws_dbv[t_v + int64_t(i) * V + col] : 0.f;
      svn[i * LD + c] = in ? a.ws_vnew[t_v + int64_t(i) * V + col] : 0.f;
    }
    for (int e = tid; e < KS * kBwdCols; e += kBwdThreads) {
      const int dl = e / kBwdCols, c = e % kBwdCols, d = d0 + dl, col = vt * kBwdCols + c;
      const bool in = d < K && col < V;
      sS[dl * LD + c] = in ? a.h.load(hblk + (a.vk ? int64_t(col) * K + d : int64_t(d) * V + col)) : 0.f;
      sdH[dl * LD + c] = in ? a.ws_dh[(tile * K + d) * V + col] : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < MR; ++m) {
      const int i = i_own + (kBwdThreads / KS) * m;
      if (i < C) {
#pragma unroll 8
        for (int c = 0; c < kBwdCols; ++c) {
          const float sv = sS[dl_own * LD + c];
          aq[m] += sdO[i * LD + c] * sv;
          ab[m] += sdbv[i * LD + c] * sv;
          ak[m] += svn[i * LD + c] * sdH[dl_own * LD + c];
        }
      }
    }
    if (tid < KS) {
      for (int c = 0; c < kBwdCols; ++c) dgam += sS[tid * LD + c] * sdH[tid * LD + c];
    }
    __syncthreads();
  }
#pragma unroll
  for (int m = 0; m < MR; ++m) {
    const int i = i_own + (kBwdThreads / KS) * m;
    if (i < C) {
      s.dqg[i * LDK + dl_own] = a.scale * aq[m];
      s.dkbg[i * LDK + dl_own] = -ab[m];
      s.dkg[i * LDK + dl_own] = ak[m];
    }
  }
  if (tid < KS) s.dgam[tid] = dgam;
  __syncthreads();

  intra_products(s, dP, dL, C, nrows, NSUB);

  // Assembly per (row, key); beta's key-side part summed over the slice's keys (16 lanes a row).
  for (int e = tid; e < C * KS; e += kBwdThreads) {
    const int r = e / KS, dl = e % KS, d = d0 + dl, blk = r / 16;
    float db = 0.f;
    if (r < nrows) {
      float before = 0.f, after = 0.f;
      for (int c = 0; c < blk; ++c) before += s.tot[c * KS + dl];
      for (int c = blk + 1; c < NSUB; ++c) after += s.tot[c * KS + dl];
      const int x = r * LDK + dl;
      const float eg = expf(s.lam[x] + before), egl = expf(s.rho[x] + after);
      const float kd = s.k[x], qd = s.q[x], bt = s.beta[r], pd = dP[r * C + r];
      db = kd * s.dkr[x] + s.dkbg[x] * kd * eg;
      const float dk_kg = egl * s.dkg[x], dq_g = eg * s.dqg[x], dk_g = bt * eg * s.dkbg[x];
      const float dq = s.dqr[x] + dq_g + pd * kd;
      const float dk = dk_g + bt * s.dkr[x] + s.dkc[x] + pd * qd + dk_kg;
      s.dG[x] = qd * dq_g + kd * dk_g;
      s.kgt[x] = kd * dk_kg;
      if (d < K) {
        const int64_t o = (a.row(ch.b, ch.row0 + r) * a.HV + hv) * K + d;
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
  // The gate's chain to the raw input (spec §4.2 B8) and dg; partial sums of dA_log (the CTA) and ddt_bias (per key).
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

}  // namespace kdakit::cuda
