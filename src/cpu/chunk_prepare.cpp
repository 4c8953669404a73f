// The state-independent part of one chunk (chunk_prepare.h has the anchoring scheme).
#include "cpu/chunk_prepare.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace kdakit::cpu {
namespace {
std::atomic<int> g_diagonal_mode{static_cast<int>(DiagonalBlocks::kAuto)};
}  // namespace

void set_diagonal_blocks(DiagonalBlocks mode) { g_diagonal_mode = static_cast<int>(mode); }
DiagonalBlocks diagonal_blocks() { return static_cast<DiagonalBlocks>(g_diagonal_mode.load()); }

std::size_t ChunkTiles::floats(int64_t C, int64_t K, int64_t V) {
  return C * K * 14 + C * V * 2 + C + K + (C / kSub) * K + 3 * C * C;
}

ChunkTiles::ChunkTiles(float* p, int64_t C, int64_t K, int64_t V) {
  auto take = [&p](int64_t n) { float* r = p; p += n; return r; };
  q = take(C * K); k = take(C * K); v = take(C * V); g = take(C * K); beta = take(C);
  lam = take(C * K); rho = take(C * K); tot = take((C / kSub) * K); sigma = take(C * K);
  qg = take(C * K); kbg = take(C * K); kg = take(C * K); gamma = take(K);
  fa = take(C * K); fb = take(C * K); fc = take(C * K);
  P = take(C * C); L = take(C * C); Tm = take(C * C);
  w = take(C * K); u = take(C * V);
  std::fill(factorised, factorised + 8, true);
}

void chunk_sums(ChunkTiles& t, int64_t rows, int64_t K, DiagonalBlocks diag_mode) {
  const int64_t nsub = (rows + kSub - 1) / kSub;
  for (int64_t a = 0; a < nsub; ++a) {
    const int64_t s0 = a * kSub, s1 = std::min(rows, s0 + kSub);
    for (int64_t d = 0; d < K; ++d) {
      float acc = 0.f;
      for (int64_t r = s0; r < s1; ++r) { acc += t.g[r * K + d]; t.lam[r * K + d] = acc; }
      t.tot[a * K + d] = acc;
      acc = 0.f;
      for (int64_t r = s1 - 1; r >= s0; --r) { t.rho[r * K + d] = acc; acc += t.g[r * K + d]; }
    }
    // Diagonal block: sigma_i = G_i - G_m, summed outward from the anchor row m.
    const int64_t m = s0 + std::min<int64_t>(8, s1 - s0 - 1);
    float max_abs = 0.f;
    for (int64_t d = 0; d < K; ++d) {
      t.sigma[m * K + d] = 0.f;
      float acc = 0.f;
      for (int64_t i = m + 1; i < s1; ++i) { acc += t.g[i * K + d]; t.sigma[i * K + d] = acc; }
      max_abs = std::max(max_abs, -acc);
      acc = 0.f;
      for (int64_t i = m - 1; i >= s0; --i) { acc -= t.g[(i + 1) * K + d]; t.sigma[i * K + d] = acc; }
      max_abs = std::max(max_abs, acc);
    }
    t.factorised[a] = diag_mode == DiagonalBlocks::kFactorised ||
                      (diag_mode == DiagonalBlocks::kAuto && max_abs <= kMaxAnchorExponent);
  }
}

void totals_around(const ChunkTiles& t, int64_t rows, int64_t K, int64_t a, float* before, float* after) {
  const int64_t nsub = (rows + kSub - 1) / kSub;
  for (int64_t d = 0; d < K; ++d) {
    float bsum = 0.f, asum = 0.f;
    for (int64_t c = 0; c < a; ++c) bsum += t.tot[c * K + d];
    for (int64_t c = a + 1; c < nsub; ++c) asum += t.tot[c * K + d];
    before[d] = bsum;
    after[d] = asum;
  }
}

void chunk_factors(ChunkTiles& t, int64_t rows, int64_t K) {
  const int64_t nsub = (rows + kSub - 1) / kSub;
  // Chunk-level factors: qg = q*exp(G_r), kbg = beta*k*exp(G_r), kg = k*exp(G_last - G_r), gamma = exp(G_last).
  std::vector<float> before(K), after(K);
  for (int64_t a = 0; a < nsub; ++a) {
    const int64_t s0 = a * kSub, s1 = std::min(rows, s0 + kSub);
    totals_around(t, rows, K, a, before.data(), after.data());
    for (int64_t r = s0; r < s1; ++r) {
      for (int64_t d = 0; d < K; ++d) {
        const float e_head = std::exp(t.lam[r * K + d] + before[d]);
        t.qg[r * K + d] = t.q[r * K + d] * e_head;
        t.kbg[r * K + d] = t.beta[r] * t.k[r * K + d] * e_head;
        t.kg[r * K + d] = t.k[r * K + d] * std::exp(t.rho[r * K + d] + after[d]);
      }
    }
  }
  for (int64_t d = 0; d < K; ++d) {
    float s = 0.f;
    for (int64_t a = 0; a < nsub; ++a) s += t.tot[a * K + d];
    t.gamma[d] = std::exp(s);
  }
}

void intra_matrices(ChunkTiles& t, int64_t rows, int64_t K, bool want_P) {
  const int64_t nsub = (rows + kSub - 1) / kSub;
  // Intra-chunk matrices P (q.k with decay, j <= i) and L (beta_i k_i.k_j with decay, j < i).
  std::fill(t.P, t.P + rows * rows, 0.f);
  std::fill(t.L, t.L + rows * rows, 0.f);
  for (int64_t a = 0; a < nsub; ++a) {
    const int64_t s0 = a * kSub, s1 = std::min(rows, s0 + kSub);
    // Off-diagonal blocks (b < a), anchored at the start of sub-chunk a: fa = q*exp(lam), fb = k*exp(lam).
    for (int64_t i = s0; i < s1; ++i) {
      for (int64_t d = 0; d < K; ++d) {
        const float e = std::exp(t.lam[i * K + d]);
        t.fa[i * K + d] = t.q[i * K + d] * e;
        t.fb[i * K + d] = t.k[i * K + d] * e;
      }
    }
    std::vector<float> mid(K, 0.f);  // sum of tot over sub-chunks strictly between b and a
    for (int64_t b = a - 1; b >= 0; --b) {
      const int64_t t0 = b * kSub, t1 = t0 + kSub;
      for (int64_t j = t0; j < t1; ++j) {
        for (int64_t d = 0; d < K; ++d) t.fc[j * K + d] = t.k[j * K + d] * std::exp(t.rho[j * K + d] + mid[d]);
      }
      for (int64_t i = s0; i < s1; ++i) {
        for (int64_t j = t0; j < t1; ++j) {
          if (want_P) t.P[i * rows + j] = dot(t.fa + i * K, t.fc + j * K, K);
          t.L[i * rows + j] = t.beta[i] * dot(t.fb + i * K, t.fc + j * K, K);
        }
      }
      for (int64_t d = 0; d < K; ++d) mid[d] += t.tot[b * K + d];
    }
    if (t.factorised[a]) {
      // fa = q*exp(sigma), fb = k*exp(sigma), fc = k*exp(-sigma)
      for (int64_t i = s0; i < s1; ++i) {
        for (int64_t d = 0; d < K; ++d) {
          const float e = std::exp(t.sigma[i * K + d]);
          t.fa[i * K + d] = t.q[i * K + d] * e;
          t.fb[i * K + d] = t.k[i * K + d] * e;
          t.fc[i * K + d] = t.k[i * K + d] * std::exp(-t.sigma[i * K + d]);
        }
      }
      for (int64_t i = s0; i < s1; ++i) {
        for (int64_t j = s0; j <= i; ++j) {
          if (want_P) t.P[i * rows + j] = dot(t.fa + i * K, t.fc + j * K, K);
          if (j < i) t.L[i * rows + j] = t.beta[i] * dot(t.fb + i * K, t.fc + j * K, K);
        }
      }
    } else {
      // Running product of per-token decays: decay(i, j) = prod_{s=j+1..i} exp(g_s), exact for any g <= 0.
      std::vector<float> r(K);
      for (int64_t i = s0; i < s1; ++i) {
        std::fill(r.begin(), r.end(), 1.f);
        for (int64_t j = i; j >= s0; --j) {
          if (j < i) {
            for (int64_t d = 0; d < K; ++d) r[d] *= std::exp(t.g[(j + 1) * K + d]);
          }
          float p = 0.f, l = 0.f;
          for (int64_t d = 0; d < K; ++d) {
            const float kr = t.k[j * K + d] * r[d];
            p += t.q[i * K + d] * kr;
            l += t.k[i * K + d] * kr;
          }
          if (want_P) t.P[i * rows + j] = p;
          if (j < i) t.L[i * rows + j] = t.beta[i] * l;
        }
      }
    }
  }
}

void invert(ChunkTiles& t, int64_t rows) {
  // Tm = (I + L)^-1 by forward substitution: Tm[i,:] = e_i - sum_{j<i} L[i,j] Tm[j,:].
  std::fill(t.Tm, t.Tm + rows * rows, 0.f);
  for (int64_t i = 0; i < rows; ++i) {
    float* ti = t.Tm + i * rows;
    ti[i] = 1.f;
    for (int64_t j = 0; j < i; ++j) {
      const float lij = t.L[i * rows + j];
      if (lij == 0.f) continue;
      const float* tj = t.Tm + j * rows;
      for (int64_t c = 0; c <= j; ++c) ti[c] -= lij * tj[c];
    }
  }
}

void wy(ChunkTiles& t, int64_t rows, int64_t K, int64_t V) {
  // w = Tm (beta k exp(G)), u = Tm (beta v).
  for (int64_t i = 0; i < rows; ++i) {
    float* wi = t.w + i * K;
    float* ui = t.u + i * V;
    std::fill(wi, wi + K, 0.f);
    std::fill(ui, ui + V, 0.f);
    for (int64_t j = 0; j <= i; ++j) {
      const float tij = t.Tm[i * rows + j];
      if (tij == 0.f) continue;
      for (int64_t d = 0; d < K; ++d) wi[d] += tij * t.kbg[j * K + d];
      const float tb = tij * t.beta[j];
      for (int64_t c = 0; c < V; ++c) ui[c] += tb * t.v[j * V + c];
    }
  }
}

void prepare_chunk(ChunkTiles& t, int64_t rows, int64_t K, int64_t V, DiagonalBlocks diag_mode) {
  chunk_sums(t, rows, K, diag_mode);
  chunk_factors(t, rows, K);
  intra_matrices(t, rows, K, /*want_P=*/true);
  invert(t, rows);
  wy(t, rows, K, V);
}

}  // namespace kdakit::cpu
