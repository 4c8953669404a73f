// The intra-chunk products of the gradient kernel (intra_products of src/cpu/chunk_gradients.cpp, whose comment has
// the anchoring and the gate's pair sums), over one 16-key slice, a thread per (row, key) task: its row side (dq_row,
// dk_row against the earlier blocks and within its diagonal block), its column side (dk_col against the later blocks
// and within its block) and the pairs' part of the gate gradient (dgp). dP and dL are read from the workspace (the WY
// pass's), everything else from the slice tiles in shared memory. The anchored exponentials are the slice's tiles
// (exp(lam), exp(rho), exp(+-sigma), exp(total)), taken once per (row, key): a product over blocks b < c < a is a
// product of exp(total)s, never an exponential of a difference.
#pragma once

#include "cuda/backward/common.cuh"

namespace kdakit::cuda {

// The gradient kernel's slice tiles ([C][kBwdLdk] unless noted).
struct GradSlice {
  float *q, *k, *g;                    // normalised q, k; gates (natural log)
  float *el, *er, *es, *ies;           // exp(lam), exp(rho), exp(sigma), exp(-sigma) (the sub-chunk sums)
  float *xq, *xb, *ker;                // q exp(lam), beta k exp(lam), k exp(rho)
  float *dG, *kgt;                     // the gate gradient's chunk-start terms (reverse sum) and kg terms (forward)
  float *dqr, *dkr, *dkc, *arow, *bcol, *dgp;  // intra-chunk products (over the value tiles' bytes)
  float* cpart;                        // a column's pairs within its diagonal block, k_j times their sum
  float* wc;                           // [C][3][kBwdKSlice]: a row's pair sums with each earlier block
  float *beta, *rq, *rk;               // [C]
  float *tot, *etot;                   // [4][kBwdKSlice] sub-chunk totals and their exponentials
  float *gam, *dgam;                   // [kBwdKSlice]
  int* maxexp;                         // [4] a diagonal block's largest anchor exponent (float bits)
  float* red;                          // [kBwdRowGroups] block_sum scratch
};

__device__ __forceinline__ bool factorised_block(const GradSlice& s, int blk) {
  return __int_as_float(s.maxexp[blk]) <= 64.0f;  // the CPU's kMaxAnchorExponent
}

// Row i's products (row side) and column j = i's (column side), and the pair sums landing on token t = i, for key dl
// of the slice; nrows rows of chunk size C, NSUB blocks. Ends with a barrier.
//
// The pairs (i', j') of a diagonal block with j' < t <= i' are summed as a running total over t: the pair enters at
// t = j' + 1 (its column's part, cpart) and leaves at t = i' + 1 (its row's part, which is q_t dq_diag + beta_t k_t
// dk_diag of the row side), so a pair's term counts only for the tokens it spans.
__device__ __forceinline__ void intra_products(const GradSlice& s, const float* dP, const float* dL, int C, int nrows,
                                               int NSUB) {
  constexpr int LDK = kBwdLdk, KS = kBwdKSlice;
  auto at = [](const float* t, int r, int dl) { return t[r * LDK + dl]; };
  for (int e = threadIdx.x; e < nrows * KS; e += kBwdThreads) {
    const int i = e / KS, dl = e % KS, blk = i / 16, s0 = 16 * blk, s1 = min(nrows, s0 + 16);
    const bool fact = factorised_block(s, blk);
    const float qi = at(s.q, i, dl), ki = at(s.k, i, dl), bi = s.beta[i];
    // Row side: earlier blocks, anchored at this block's start (k_j exp(rho_j) times the totals in between).
    float acc_q = 0.f, acc_k = 0.f, emid = 1.f;
    const float el = at(s.el, i, dl);
    for (int b = blk - 1; b >= 0; --b) {
      float pq = 0.f, pk = 0.f;
      for (int j = 16 * b; j < 16 * b + 16; ++j) {
        const float opb = at(s.ker, j, dl);
        pq += dP[i * C + j] * opb;
        pk += dL[i * C + j] * opb;
      }
      pq *= emid;
      pk *= emid;
      acc_q += pq;
      acc_k += pk;
      s.wc[(i * 3 + b) * KS + dl] = el * (qi * pq + bi * ki * pk);
      emid *= s.etot[b * KS + dl];
    }
    float rq = el * acc_q, rk = el * acc_k;
    s.arow[i * LDK + dl] = qi * rq + bi * ki * rk;
    // Row side within the diagonal block (P's diagonal left out).
    float dq_diag = 0.f, dk_diag = 0.f;
    if (fact) {
      for (int j = s0; j < i; ++j) {
        const float kc = at(s.k, j, dl) * at(s.ies, j, dl);
        dq_diag += dP[i * C + j] * kc;
        dk_diag += dL[i * C + j] * kc;
      }
      const float es = at(s.es, i, dl);
      dq_diag *= es;
      dk_diag *= es;
    } else {
      float dec = 1.f;
      for (int j = i - 1; j >= s0; --j) {
        dec *= expf(at(s.g, j + 1, dl));
        const float kj = at(s.k, j, dl) * dec;
        dq_diag += dP[i * C + j] * kj;
        dk_diag += dL[i * C + j] * kj;
      }
    }
    s.dqr[i * LDK + dl] = rq + dq_diag;
    s.dkr[i * LDK + dl] = rk + dk_diag;
    s.dgp[i * LDK + dl] = qi * dq_diag + bi * ki * dk_diag;  // the row's part of its block's pairs
    // Column side of column j = i: later blocks, anchored at this block's end.
    const int j = i;
    float acc = 0.f;
    emid = 1.f;
    for (int r = blk + 1; r < NSUB; ++r) {
      const int r0 = 16 * r, r1 = min(nrows, r0 + 16);
      float part = 0.f;
      for (int ii = r0; ii < r1; ++ii) {
        part += dP[ii * C + j] * at(s.xq, ii, dl) + dL[ii * C + j] * at(s.xb, ii, dl);
      }
      acc += emid * part;
      emid *= s.etot[r * KS + dl];
    }
    const float cside = at(s.er, j, dl) * acc;
    s.bcol[j * LDK + dl] = ki * cside;
    float diag = 0.f;
    if (fact) {
      for (int ii = j + 1; ii < s1; ++ii) {
        diag += (dP[ii * C + j] * at(s.q, ii, dl) + dL[ii * C + j] * (s.beta[ii] * at(s.k, ii, dl))) *
                at(s.es, ii, dl);
      }
      diag *= at(s.ies, j, dl);
    } else {
      float dec = 1.f;
      for (int ii = j + 1; ii < s1; ++ii) {
        dec *= expf(at(s.g, ii, dl));
        diag += (dP[ii * C + j] * at(s.q, ii, dl) + dL[ii * C + j] * s.beta[ii] * at(s.k, ii, dl)) * dec;
      }
    }
    s.dkc[j * LDK + dl] = cside + diag;
    s.cpart[j * LDK + dl] = ki * diag;
  }
  __syncthreads();
  // Per (block c, key): the pairs within c (the running total), c's rows over earlier blocks (i >= t), c's columns
  // over later blocks (j < t), and the pairs between a later and an earlier block.
  for (int e = threadIdx.x; e < NSUB * KS; e += kBwdThreads) {
    const int c = e / KS, dl = e % KS, s0 = 16 * c, s1 = min(nrows, s0 + 16);
    float around = 0.f;
    for (int a_ = c + 1; a_ < NSUB; ++a_) {
      const int a0 = 16 * a_, a1 = min(nrows, a0 + 16);
      for (int b = 0; b < c; ++b) {
        float wp = 0.f;
        for (int i = a0; i < a1; ++i) wp += s.wc[(i * 3 + b) * KS + dl];
        around += wp;
      }
    }
    float pairs = 0.f;
    for (int t = s0; t < s1; ++t) {
      const float leaving = s.dgp[t * LDK + dl];
      s.dgp[t * LDK + dl] = pairs;
      pairs += s.cpart[t * LDK + dl] - leaving;
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
