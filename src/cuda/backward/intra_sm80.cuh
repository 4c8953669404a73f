// The intra-chunk products of the gradient kernel (intra_products of src/cpu/chunk_gradients.cpp, whose comment has
// the anchoring and the gate's pair sums), over one 16-key slice: the row side (dq_row, dk_row against the earlier
// blocks and within the diagonal block), the column side (dk_col against the later blocks and within the block) and
// the pairs' part of the gate gradient (dgp). dP and dL come from the workspace (the WY pass's) or from the kernel's
// split copy (DplSource), everything else from the slice tiles in shared memory. The anchored exponentials are the
// slice's tiles (exp(lam), exp(rho), exp(sigma), whose reciprocal is exp(-sigma), exp(total)); the factors q e^lam,
// beta k e^lam and k e^rho are formed as the fragments are built. A product over blocks b < c < a is a product of
// exp(total)s, never an exponential of a difference.
//
// The 16 x 16 block products run on tensor cores (mma.sync m16n8k16, every operand split hi + lo: three MMAs, fp32
// accumulation), a warp per (16-row block, 8 keys): an off-diagonal block's product needs no factor inside the sum
// (the anchors make its scale a per-key factor, applied to the accumulator), and a factorised diagonal block's is a
// masked product with the row and column factors exp(+-sigma) taken out. A diagonal block that is not factorised
// (huge gates) keeps the running products, per accumulator element.
#pragma once

#include <type_traits>

#include "cuda/backward/common.cuh"
#include "cuda/common/sm80/mma.cuh"

namespace kdakit::cuda {

// The gradient kernel's slice tiles ([C][kBwdLdk] unless noted).
struct GradSlice {
  float *q, *k, *g;                    // normalised q, k; gates (natural log)
  float *el, *er, *es;                 // exp(lam), exp(rho), exp(sigma) (the sub-chunk sums)
  float *dG, *kgt;                     // the gate gradient's chunk-start terms (reverse sum) and kg terms (forward)
  float* xin;                          // the in-kernel gate's raw input g + dt_bias (for its chain)
  float *dqr, *dkr, *dkc, *arow, *bcol, *dgp;  // intra-chunk products (over the value tiles' bytes)
  float* cpart;                        // a column's pairs within its diagonal block, k_j times their sum
  float* wc;                           // [C][3][kBwdKSlice]: a row's pair sums with each earlier block
  float *beta, *rq, *rk;               // [C]
  float *tot, *etot;                   // [4][kBwdKSlice] sub-chunk totals and their exponentials
  float *ebefore, *eafter;             // [4][kBwdKSlice] products of exp(total) over the blocks before, after
  float *bias, *pdiag;                 // [kMaxHeadDim] dt_bias of the v-head (zero without it); [C] P's diagonal
  float *gam, *dgam;                   // [kBwdKSlice]
  int* maxexp;                         // [4] a diagonal block's largest anchor exponent in the slice (float bits)
  float* red;                          // [kBwdRowGroups] block_sum scratch
};

__device__ __forceinline__ bool factorised_block(const GradSlice& s, int blk) {
  return __int_as_float(s.maxexp[blk]) <= 64.0f;  // the CPU's kMaxAnchorExponent
}

namespace intra {

// A 16 x 16 A fragment (split into P bf16 parts: hi + lo, or hi + mid + lo for float32 inputs) of the values
// f(r, c), r and c the tile's row and column (the layouts in mma.cuh). f returns zero outside the products' range, so
// the rows past the chunk's end (the workspace and slice rows there are not written) never enter a sum, not even as
// 0 * NaN.
template <int P, typename F>
__device__ __forceinline__ void build_a(FragA (&a)[P], F&& f) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int x = 0; x < 4; ++x) {
    const int r = g + 8 * (x & 1), c = 2 * t + 8 * (x >> 1);
    SplitOperand<P>::put(a, x, f(r, c), f(r, c + 1));
  }
}

// A 16 x 8 B fragment (k x n, split into P parts) of the values f(k, n).
template <int P, typename F>
__device__ __forceinline__ void build_b(FragB (&b)[P], F&& f) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int x = 0; x < 2; ++x) SplitOperand<P>::put(b, x, f(2 * t + 8 * x, g), f(2 * t + 8 * x + 1, g));
}

// The A fragments of dP and dL blocks (mat 0: dP, 1: dL), in P parts: rows(a, mat, a0, c0, diag) is A(r, c) =
// M[a0 + r][c0 + c], cols(a, mat, r0, c0, diag) is A(m, k) = M[r0 + k][c0 + m]; a diagonal block keeps its strictly
// lower part, and rows past the chunk's end are zero. CACHE = false rebuilds them from the workspace's fp32 matrices;
// CACHE = true loads the kernel's split copy of those parts (ldmatrix, `kBwdDplLd` row stride). dP and dL themselves
// stay readable for the running products of blocks that are not factorised.
template <bool CACHE, int P>
struct DplSource {
  const float *dP, *dL;
  const __nv_bfloat16* cache;  // [2 P][C][kBwdDplLd]: dP's parts, then dL's, largest first
  int C, nrows;
  __device__ __forceinline__ const float* mat(int m) const { return m == 0 ? dP : dL; }
  __device__ __forceinline__ const __nv_bfloat16* part(int m, int hl) const {
    return cache + (P * m + hl) * C * kBwdDplLd;
  }
  __device__ __forceinline__ void rows(FragA (&a)[P], int m, int a0, int c0, bool diag) const {
    if constexpr (CACHE) {
      const int lane = threadIdx.x & 31, r = a0 + (lane & 7) + ((lane >> 3) & 1) * 8, c = c0 + (lane >> 4) * 8;
#pragma unroll
      for (int i = 0; i < P; ++i) ldsm_x4(a[i].x, part(m, i) + r * kBwdDplLd + c);
    } else {
      const float* M = mat(m);
      const int n = nrows, ld = C;
      build_a(a, [=](int r, int c) { return (!diag || c < r) && a0 + r < n ? M[(a0 + r) * ld + c0 + c] : 0.f; });
    }
  }
  __device__ __forceinline__ void cols(FragA (&a)[P], int m, int r0, int c0, bool diag) const {
    if constexpr (CACHE) {
      const int lane = threadIdx.x & 31, k = r0 + (lane & 7) + (lane >> 4) * 8, mm = c0 + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int i = 0; i < P; ++i) ldsm_x4_t(a[i].x, part(m, i) + k * kBwdDplLd + mm);
    } else {
      const float* M = mat(m);
      const int n = nrows, ld = C;
      build_a(a, [=](int mm, int k) { return (!diag || k > mm) && r0 + k < n ? M[(r0 + k) * ld + c0 + mm] : 0.f; });
    }
  }
};

// The accumulator element x of this lane: its tile row (0..15) and column (0..7).
__device__ __forceinline__ int acc_row(int x) { return ((threadIdx.x & 31) >> 2) + 8 * (x >> 1); }
__device__ __forceinline__ int acc_col(int x) { return 2 * (threadIdx.x & 3) + (x & 1); }

// The row side of row block `blk`, keys n0..n0+7 of the slice: dqr, dkr, arow, wc and the rows' part of dgp.
template <bool CACHE, int P>
__device__ __forceinline__ void row_side(const GradSlice& s, const DplSource<CACHE, P>& src, int C, int nrows, int blk,
                                         int n0) {
  constexpr int LDK = kBwdLdk, KS = kBwdKSlice;
  using Op = SplitOperand<P>;
  const int a0 = 16 * blk, kc = n0 + acc_col(0);  // the lane's keys kc, kc + 1
  const float *dP = src.dP, *dL = src.dL;
  // Earlier blocks, anchored at this block's start: (dP or dL) times k exp(rho), scaled per key by the totals of the
  // blocks in between.
  float acc_q[4] = {0.f, 0.f, 0.f, 0.f}, acc_k[4] = {0.f, 0.f, 0.f, 0.f}, emid[2] = {1.f, 1.f};
  for (int b = blk - 1; b >= 0; --b) {
    FragB kb[P];
    build_b(kb, [&](int k, int n) {  // k e^rho
      const int o = (16 * b + k) * LDK + n0 + n;
      return s.k[o] * s.er[o];
    });
    FragC pq, pk;
    pq.zero();
    pk.zero();
    {
      FragA ap[P];
      src.rows(ap, 0, a0, 16 * b, false);
      Op::mma(pq, ap, kb);
    }
    {
      FragA al[P];
      src.rows(al, 1, a0, 16 * b, false);
      Op::mma(pk, al, kb);
    }
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int i = a0 + acc_row(x), dl = kc + (x & 1);
      const float vq = pq.x[x] * emid[x & 1], vk = pk.x[x] * emid[x & 1];
      acc_q[x] += vq;
      acc_k[x] += vk;
      if (i < nrows) {
        const int o = i * LDK + dl;
        s.wc[(i * 3 + b) * KS + dl] = s.el[o] * (s.q[o] * vq + s.beta[i] * s.k[o] * vk);
      }
    }
    emid[0] *= s.etot[b * KS + kc];
    emid[1] *= s.etot[b * KS + kc + 1];
  }
  // Within the diagonal block (P's diagonal left out).
  float dq_diag[4], dk_diag[4];
  if (factorised_block(s, blk)) {  // es_i sum_{j < i} (dP or dL)[i][j] k_j ies_j
    FragA ap[P], al[P];
    FragB kb[P];
    src.rows(ap, 0, a0, a0, true);
    src.rows(al, 1, a0, a0, true);
    build_b(kb, [&](int k, int n) {
      const int o = (a0 + k) * LDK + n0 + n;
      return a0 + k < nrows ? __fdividef(s.k[o], s.es[o]) : 0.f;  // k exp(-sigma); |sigma| <= 64 here
    });
    FragC pq, pk;
    pq.zero();
    pk.zero();
    Op::mma(pq, ap, kb);
    Op::mma(pk, al, kb);
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int i = a0 + acc_row(x), o = min(i, nrows - 1) * LDK + kc + (x & 1);
      dq_diag[x] = pq.x[x] * s.es[o];
      dk_diag[x] = pk.x[x] * s.es[o];
    }
  } else {
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int i = min(a0 + acc_row(x), nrows - 1), dl = kc + (x & 1);
      float dq = 0.f, dk = 0.f, dec = 1.f;
      for (int j = i - 1; j >= a0; --j) {
        dec *= expf(s.g[(j + 1) * LDK + dl]);
        const float kj = s.k[j * LDK + dl] * dec;
        dq += dP[i * C + j] * kj;
        dk += dL[i * C + j] * kj;
      }
      dq_diag[x] = dq;
      dk_diag[x] = dk;
    }
  }
#pragma unroll
  for (int x = 0; x < 4; ++x) {
    const int i = a0 + acc_row(x);
    if (i >= nrows) continue;
    const int o = i * LDK + kc + (x & 1);
    const float el = s.el[o], qi = s.q[o], bki = s.beta[i] * s.k[o];
    const float rq = el * acc_q[x], rk = el * acc_k[x];
    s.arow[o] = qi * rq + bki * rk;
    s.dqr[o] = rq + dq_diag[x];
    s.dkr[o] = rk + dk_diag[x];
    s.dgp[o] = qi * dq_diag[x] + bki * dk_diag[x];  // the row's part of its block's pairs
  }
}

// The column side of column block `blk`, keys n0..n0+7: dkc, bcol and cpart.
template <bool CACHE, int P>
__device__ __forceinline__ void col_side(const GradSlice& s, const DplSource<CACHE, P>& src, int C, int nrows, int NSUB,
                                         int blk, int n0) {
  constexpr int LDK = kBwdLdk, KS = kBwdKSlice;
  using Op = SplitOperand<P>;
  const int c0 = 16 * blk, kc = n0 + acc_col(0);
  const float *dP = src.dP, *dL = src.dL;
  // part += (the dP block's columns) (q ex) + (the dL block's columns) (beta k ex) over rows a0 .. a0 + 15, ex an
  // exponent tile; `diagonal` (std::true_type for the block at rows c0: its strictly lower part) is a compile-time
  // fact, so that the fragment builds fold their masks.
  auto add_pair_products = [&](FragC& part, int a0, const float* ex, auto diagonal) {
    {
      FragA ap[P];
      FragB bq[P];
      src.cols(ap, 0, a0, c0, decltype(diagonal)::value);
      build_b(bq, [&](int k, int n) {
        const int o = (a0 + k) * LDK + n0 + n;
        return a0 + k < nrows ? s.q[o] * ex[o] : 0.f;
      });
      Op::mma(part, ap, bq);
    }
    {
      FragA al[P];
      FragB bb[P];
      src.cols(al, 1, a0, c0, decltype(diagonal)::value);
      build_b(bb, [&](int k, int n) {
        const int o = (a0 + k) * LDK + n0 + n;
        return a0 + k < nrows ? s.beta[a0 + k] * s.k[o] * ex[o] : 0.f;
      });
      Op::mma(part, al, bb);
    }
  };
  // Later blocks, anchored at this block's end: q e^lam and beta k e^lam.
  float acc[4] = {0.f, 0.f, 0.f, 0.f}, emid[2] = {1.f, 1.f};
  for (int r = blk + 1; r < NSUB; ++r) {
    FragC part;
    part.zero();
    add_pair_products(part, 16 * r, s.el, std::false_type());
#pragma unroll
    for (int x = 0; x < 4; ++x) acc[x] += emid[x & 1] * part.x[x];
    emid[0] *= s.etot[r * KS + kc];
    emid[1] *= s.etot[r * KS + kc + 1];
  }
  // Within the block: ies_j sum_{i > j} (dP[i][j] q_i + dL[i][j] beta_i k_i) es_i.
  float diag[4];
  if (factorised_block(s, blk)) {
    FragC dg;
    dg.zero();
    add_pair_products(dg, c0, s.es, std::true_type());
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      diag[x] = __fdividef(dg.x[x], s.es[min(c0 + acc_row(x), nrows - 1) * LDK + kc + (x & 1)]);  // x exp(-sigma)
    }
  } else {
    const int s1 = min(nrows, c0 + 16);
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int j = c0 + acc_row(x), dl = kc + (x & 1);
      float d = 0.f, dec = 1.f;
      for (int ii = j + 1; ii < s1; ++ii) {
        const int o = ii * LDK + dl;
        dec *= expf(s.g[o]);
        d += (dP[ii * C + j] * s.q[o] + dL[ii * C + j] * s.beta[ii] * s.k[o]) * dec;
      }
      diag[x] = d;
    }
  }
#pragma unroll
  for (int x = 0; x < 4; ++x) {
    const int j = c0 + acc_row(x);
    if (j >= nrows) continue;
    const int o = j * LDK + kc + (x & 1);
    const float cside = s.er[o] * acc[x], kj = s.k[o];
    s.bcol[o] = kj * cside;
    s.dkc[o] = cside + diag[x];
    s.cpart[o] = kj * diag[x];
  }
}

}  // namespace intra

// The products of one slice (nrows rows of chunk size C, NSUB blocks), then the pair sums landing on each token.
// Ends with a barrier.
//
// The pairs (i', j') of a diagonal block with j' < t <= i' are summed as a running total over t: the pair enters at
// t = j' + 1 (its column's part, cpart) and leaves at t = i' + 1 (its row's part, which is q_t dq_diag + beta_t k_t
// dk_diag of the row side), so a pair's term counts only for the tokens it spans.
template <bool CACHE, int P, typename Between>
__device__ __forceinline__ void intra_products(const GradSlice& s, const intra::DplSource<CACHE, P>& src, int C,
                                               int nrows, int NSUB, Between&& between) {
  constexpr int LDK = kBwdLdk, KS = kBwdKSlice;
  // A block's row side costs its earlier blocks, its column side its later ones: a warp taking both sides of one
  // block (and 8 keys) has NSUB + 1 block products whatever the block. Up to two blocks, the sides go to warps of
  // their own.
  const int warp = threadIdx.x >> 5, n0 = 8 * (warp & 1);
  const bool apart = NSUB <= 2, cols_only = apart && ((warp >> 1) & 1);
  const int blk = apart ? warp >> 2 : warp >> 1;
  if (blk < NSUB) {
    if (!cols_only) intra::row_side(s, src, C, nrows, blk, n0);
    if (!apart || cols_only) intra::col_side(s, src, C, nrows, NSUB, blk, n0);
  }
  between();  // the caller's work between the block products and the pair sums (loads in flight meanwhile)
  __syncthreads();
  // Per (block c, key): the pairs within c (the running total), c's rows over earlier blocks (i >= t), c's columns
  // over later blocks (j < t), and the pairs between a later and an earlier block. A half-warp per (c, key), position
  // p the token t = 16 c + p.
  for (int base = 0; base < NSUB * KS; base += kBwdThreads / 16) {  // the same trip count in every warp
    const int e = base + (threadIdx.x >> 4), p = half_warp::position();
    const bool pair = e < NSUB * KS;
    const int c = e / KS, dl = e % KS, t = 16 * c + p, o = t * LDK + dl;
    const bool in = pair && t < nrows;
    float w = 0.f;  // this position's rows i = 16 a + p of every later block a, with every earlier block b
    if (pair) {
      for (int a_ = c + 1; a_ < NSUB; ++a_) {
        const int i = 16 * a_ + p;
        if (i >= nrows) continue;
        for (int b = 0; b < c; ++b) w += s.wc[(i * 3 + b) * KS + dl];
      }
    }
    const float around = half_warp::sum(w);
    const float cp = in ? s.cpart[o] : 0.f, leaving = in ? s.dgp[o] : 0.f;
    const float pairs = half_warp::from_previous(half_warp::prefix(cp - leaving));  // pairs spanning t
    const float rev = half_warp::suffix(in ? s.arow[o] : 0.f);                       // rows i >= t of c
    const float fwd = half_warp::from_previous(half_warp::prefix(in ? s.bcol[o] : 0.f));  // columns j < t of c
    if (in) s.dgp[o] = pairs + (rev + around) + fwd;
  }
  __syncthreads();
}

}  // namespace kdakit::cuda
