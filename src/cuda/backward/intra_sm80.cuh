// The intra-chunk products of the gradient kernel (intra_products of src/cpu/chunk_gradients.cpp, whose comment has
// the anchoring and the gate's pair sums), over one 16-key slice, a thread per (row, key) task: its row side (dq_row,
// dk_row against the earlier blocks and within its diagonal block), its column side (dk_col against the later blocks
// and within its block) and the pairs' part of the gate gradient (dgp). dP and dL are read from the workspace (the WY
// pass's), everything else from the slice tiles in shared memory.
#pragma once

#include "cuda/backward/common.cuh"

namespace kdakit::cuda {

// The gradient kernel's slice tiles ([C][kBwdLdk] unless noted).
struct GradSlice {
  float *q, *k, *g, *lam, *rho, *sig;  // normalised q, k; gates (natural log); the sub-chunk sums
  float *dqg, *dkbg, *dkg;             // the products with the states
  float *dG, *kgt;                     // the gate gradient's chunk-start terms (reverse sum) and kg terms (forward)
  float *dqr, *dkr, *dkc, *arow, *bcol, *dgp;  // intra-chunk products (over the value tiles' bytes)
  float* wc;                           // [C][4][kBwdKSlice]: a row's pair sums with each earlier block
  float *beta, *rq, *rk;               // [C]
  float *tot;                          // [4][kBwdKSlice] sub-chunk totals
  float *gam, *dgam;                   // [kBwdKSlice]
  int* maxexp;                         // [4] a diagonal block's largest anchor exponent (float bits)
  float* red;                          // [kBwdRowGroups] block_sum scratch
};

__device__ __forceinline__ bool factorised_block(const GradSlice& s, int blk) {
  return __int_as_float(s.maxexp[blk]) <= 64.0f;  // the CPU's kMaxAnchorExponent
}

// Row i's products (row side) and column j = i's (column side), and the pair sums landing on token t = i, for key dl
// of the slice; nrows rows of chunk size C, NSUB blocks. Ends with a barrier.
__device__ __forceinline__ void intra_products(const GradSlice& s, const float* dP, const float* dL, int C, int nrows,
                                               int NSUB) {
  constexpr int LDK = kBwdLdk, KS = kBwdKSlice;
  auto at = [](const float* t, int r, int dl) { return t[r * LDK + dl]; };
  for (int e = threadIdx.x; e < nrows * KS; e += kBwdThreads) {
    const int i = e / KS, dl = e % KS, blk = i / 16, s0 = 16 * blk, s1 = min(nrows, s0 + 16);
    const bool fact = factorised_block(s, blk);
    const float qi = at(s.q, i, dl), ki = at(s.k, i, dl), bi = s.beta[i];
    // Row side: earlier blocks, anchored at this block's start.
    float acc_q = 0.f, acc_k = 0.f, mid = 0.f;
    const float el = expf(at(s.lam, i, dl));
    for (int b = blk - 1; b >= 0; --b) {
      float pq = 0.f, pk = 0.f;
      for (int j = 16 * b; j < 16 * b + 16; ++j) {
        const float opb = at(s.k, j, dl) * expf(at(s.rho, j, dl) + mid);
        pq += dP[i * C + j] * opb;
        pk += dL[i * C + j] * opb;
      }
      acc_q += pq;
      acc_k += pk;
      s.wc[(i * 4 + b) * KS + dl] = el * (qi * pq + bi * ki * pk);
      mid += s.tot[b * KS + dl];
    }
    float rq = el * acc_q, rk = el * acc_k;
    s.arow[i * LDK + dl] = qi * rq + bi * ki * rk;
    // Row side within the diagonal block (P's diagonal left out).
    if (fact) {
      float aq = 0.f, ak = 0.f;
      for (int j = s0; j < i; ++j) {
        const float kc = at(s.k, j, dl) * expf(-at(s.sig, j, dl));
        aq += dP[i * C + j] * kc;
        ak += dL[i * C + j] * kc;
      }
      const float es = expf(at(s.sig, i, dl));
      rq += es * aq;
      rk += es * ak;
    } else {
      float dec = 1.f;
      for (int j = i - 1; j >= s0; --j) {
        dec *= expf(at(s.g, j + 1, dl));
        const float kj = at(s.k, j, dl) * dec;
        rq += dP[i * C + j] * kj;
        rk += dL[i * C + j] * kj;
      }
    }
    s.dqr[i * LDK + dl] = rq;
    s.dkr[i * LDK + dl] = rk;
    // Column side of column j = i: later blocks, anchored at this block's end.
    const int j = i;
    float acc = 0.f;
    mid = 0.f;
    for (int r = blk + 1; r < NSUB; ++r) {
      const int r0 = 16 * r, r1 = min(nrows, r0 + 16);
      for (int ii = r0; ii < r1; ++ii) {
        const float ex = expf(at(s.lam, ii, dl) + mid);
        acc += dP[ii * C + j] * (at(s.q, ii, dl) * ex) + dL[ii * C + j] * (s.beta[ii] * at(s.k, ii, dl) * ex);
      }
      mid += s.tot[r * KS + dl];
    }
    const float cside = expf(at(s.rho, j, dl)) * acc;
    float dkc = cside;
    s.bcol[j * LDK + dl] = ki * cside;
    if (fact) {
      float ac = 0.f;
      for (int ii = j + 1; ii < s1; ++ii) {
        const float es = expf(at(s.sig, ii, dl));
        ac += dP[ii * C + j] * (at(s.q, ii, dl) * es) + dL[ii * C + j] * (s.beta[ii] * at(s.k, ii, dl) * es);
      }
      dkc += expf(-at(s.sig, j, dl)) * ac;
    } else {
      float dec = 1.f;
      for (int ii = j + 1; ii < s1; ++ii) {
        dec *= expf(at(s.g, ii, dl));
        dkc += (dP[ii * C + j] * at(s.q, ii, dl) + dL[ii * C + j] * s.beta[ii] * at(s.k, ii, dl)) * dec;
      }
    }
    s.dkc[j * LDK + dl] = dkc;
    // The pairs (i', j') of this block with j' < t <= i' (t = i): sum over i' >= t of sum over j' < t.
    const int t = i;
    float pairs = 0.f;
    for (int ii = t; ii < s1; ++ii) {
      const float xq = at(s.q, ii, dl), xk = s.beta[ii] * at(s.k, ii, dl);
      float racc = 0.f;
      if (fact) {
        const float es = expf(at(s.sig, ii, dl));
        const float oa = xq * es, ob = xk * es;
        for (int jj = s0; jj < t; ++jj) {
          racc += (dP[ii * C + jj] * oa + dL[ii * C + jj] * ob) * (at(s.k, jj, dl) * expf(-at(s.sig, jj, dl)));
        }
      } else {
        float dec = 1.f;
        for (int jj = ii - 1; jj >= s0; --jj) {
          dec *= expf(at(s.g, jj + 1, dl));
          if (jj < t) racc += (dP[ii * C + jj] * xq + dL[ii * C + jj] * xk) * (at(s.k, jj, dl) * dec);
        }
      }
      pairs += racc;
    }
    s.dgp[t * LDK + dl] = pairs;
  }
  __syncthreads();
  // Block-level pairs, per (block c, key): c's rows over earlier blocks (i >= t), c's columns over later blocks
  // (j < t), and the pairs between a later and an earlier block.
  for (int e = threadIdx.x; e < NSUB * KS; e += kBwdThreads) {
    const int c = e / KS, dl = e % KS, s0 = 16 * c, s1 = min(nrows, s0 + 16);
    float around = 0.f;
    for (int a_ = c + 1; a_ < NSUB; ++a_) {
      const int a0 = 16 * a_, a1 = min(nrows, a0 + 16);
      for (int b = 0; b < c; ++b) {
        float wp = 0.f;
        for (int i = a0; i < a1; ++i) wp += s.wc[(i * 4 + b) * KS + dl];
        around += wp;
      }
    }
    float rev = 0.f;
    for (int r = s1 - 1; r >= s0; --r) {
      rev += s.arow[r * LDK + dl];
      s.dgp[r * LDK + dl] += rev + around;
    }
    float fwd = 0.f;
    for (int r = s0; r < s1; ++r) {
      s.dgp[r * LDK + dl] += fwd;
      fwd += s.bcol[r * LDK + dl];
    }
  }
  __syncthreads();
}

}  // namespace kdakit::cuda
