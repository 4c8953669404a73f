// The per-chunk gradient pass (chunk_gradients.h), with the forward's exponent anchoring (chunk_prepare.h): every
// decay of a product is split into two factors <= 1 around a sub-chunk boundary, or around a diagonal block's middle
// row (within +-kMaxAnchorExponent), or is a running product of per-token decays (diagonal blocks past that bound).
//
// The gate's gradient. A bilinear form X_ij = sum_d a_id b_jd exp(G_id - G_jd) with gradient dX gives
// da_i = sum_j dX_ij b_j E_ij, db_j = sum_i dX_ij a_i E_ij, and d/dG_i = a_i * da_i, d/dG_j = -b_j * db_j: the gate's
// gradient comes elementwise from the products that give dq and dk, with no product of its own. Summed as B7 says
// (dG per row, then the reverse sum) these terms telescope: a pair (i, j) of P or L adds to dg_t for j < t <= i only,
// and with strong decays the near-diagonal pairs dominate, so dg_t would carry the rounding of every later row's sums.
// So each term is summed where it lands: the pairs by intra_products (dgp); the chunk-start factors (q e^G, beta k e^G)
// in reverse; the chunk-end factor k e^(G_last - G_r), "+x on the last row, -x on row r", forward over r < t; the
// state's decay gamma on every row. P's diagonal (E = 1) adds nothing to dg.
#include "cpu/chunk_gradients.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace kdakit::cpu {

std::size_t GradTiles::floats(int64_t C, int64_t K, int64_t V) { return C * V + C * K * 11 + 2 * C * C + K; }

GradTiles::GradTiles(float* p, int64_t C, int64_t K, int64_t V) {
  auto take = [&p](int64_t n) { float* r = p; p += n; return r; };
  dbv = take(C * V);
  dqg = take(C * K); dkg = take(C * K); dkbg = take(C * K);
  dq_row = take(C * K); dk_row = take(C * K); dk_col = take(C * K); opa = take(C * K); opb = take(C * K); opc = take(C * K);
  dG = take(C * K); dgp = take(C * K);
  dP = take(C * C); dL = take(C * C);
  dgam = take(K);
}

namespace {

// The products through P and L (B5) of one chunk, and the gate gradient of their pairs. Row side: dq_row = dP (k E),
// dk_row = dL (k E) (not yet times beta_i); column side: dk_col = dP^T (q E) + dL^T (beta k E); all without P's
// diagonal (added by the caller). Off-diagonal blocks: the row side anchored at the row block's start (factors e^lam_i
// and e^(mid + rho_j)), the column side at the column block's end (factors e^(lam_i + mid) and e^rho_j), so each side
// accumulates over the other blocks before one scaling.
//
// dgp: the pairs' part of dg. A pair (i, j < i) with x_ij = (dP_ij q_i + dL_ij beta_i k_i) k_j E_ij (over d) adds
// x_ij to dg_t for j < t <= i. Summing "x_ij into dG_i, -x_ij into dG_j" and then dG in reverse would telescope: with
// strong decays the near-diagonal x_ij dominate and dg_t is one of them, carrying the rounding of all later rows'
// sums. So every dg_t is summed from its own pairs: for t in block c, those within c (formed elementwise, 16 x 16 per
// block), the row sums of c's rows over earlier blocks (i >= t), the column sums of c's columns over later blocks
// (j < t), and the block totals of every (later, earlier) block pair around c.
void intra_products(const ChunkTiles& t, GradTiles& s, int64_t rows, int64_t K) {
  const int64_t nsub = (rows + kSub - 1) / kSub;
  std::fill(s.dq_row, s.dq_row + rows * K, 0.f);
  std::fill(s.dk_row, s.dk_row + rows * K, 0.f);
  std::fill(s.dk_col, s.dk_col + rows * K, 0.f);
  std::fill(s.dgp, s.dgp + rows * K, 0.f);
  std::vector<float> mid(K), acc_q(kSub * K), acc_k(kSub * K), pq(K), pk(K);
  std::vector<float> a_row(rows * K), b_col(rows * K);        // pair sums of a row over earlier blocks, a column over later
  std::vector<float> wpart(nsub * nsub * K, 0.f);             // [a][b]: sum of block a's rows' pairs with block b
  std::vector<float> x(kSub * kSub * K);                      // one diagonal block's pairs [i][j][d]
  for (int64_t a = 0; a < nsub; ++a) {
    const int64_t s0 = a * kSub, s1 = std::min(rows, s0 + kSub), n = s1 - s0;
    // Row side, blocks b < a.
    std::fill(mid.begin(), mid.end(), 0.f);
    std::fill(acc_q.begin(), acc_q.end(), 0.f);
    std::fill(acc_k.begin(), acc_k.end(), 0.f);
    for (int64_t b = a - 1; b >= 0; --b) {
      const int64_t t0 = b * kSub, t1 = t0 + kSub;
      for (int64_t j = t0; j < t1; ++j) {
        for (int64_t d = 0; d < K; ++d) s.opb[j * K + d] = t.k[j * K + d] * std::exp(t.rho[j * K + d] + mid[d]);
      }
      float* wp = wpart.data() + (a * nsub + b) * K;
      for (int64_t i = s0; i < s1; ++i) {
        std::fill(pq.begin(), pq.end(), 0.f);
        std::fill(pk.begin(), pk.end(), 0.f);
        for (int64_t j = t0; j < t1; ++j) {
          const float p = s.dP[i * rows + j], l = s.dL[i * rows + j];
          const float* kj = s.opb + j * K;
          for (int64_t d = 0; d < K; ++d) { pq[d] += p * kj[d]; pk[d] += l * kj[d]; }
        }
        float* aq = acc_q.data() + (i - s0) * K;
        float* ak = acc_k.data() + (i - s0) * K;
        for (int64_t d = 0; d < K; ++d) {
          aq[d] += pq[d];
          ak[d] += pk[d];
          const float x_ib = t.q[i * K + d] * pq[d] + t.beta[i] * t.k[i * K + d] * pk[d];
          wp[d] += std::exp(t.lam[i * K + d]) * x_ib;
        }
      }
      for (int64_t d = 0; d < K; ++d) mid[d] += t.tot[b * K + d];
    }
    for (int64_t i = s0; i < s1; ++i) {
      for (int64_t d = 0; d < K; ++d) {
        const int64_t e_ = i * K + d;
        const float e = std::exp(t.lam[e_]);
        const float rq = e * acc_q[(i - s0) * K + d], rk = e * acc_k[(i - s0) * K + d];
        s.dq_row[e_] += rq;
        s.dk_row[e_] += rk;
        a_row[e_] = t.q[e_] * rq + t.beta[i] * t.k[e_] * rk;
      }
    }
    // Column side: this block as the column block of the later row blocks.
    std::fill(mid.begin(), mid.end(), 0.f);
    std::fill(acc_k.begin(), acc_k.end(), 0.f);
    for (int64_t r = a + 1; r < nsub; ++r) {
      const int64_t r0 = r * kSub, r1 = std::min(rows, r0 + kSub);
      for (int64_t i = r0; i < r1; ++i) {
        for (int64_t d = 0; d < K; ++d) {
          const float e = std::exp(t.lam[i * K + d] + mid[d]);
          s.opa[i * K + d] = t.q[i * K + d] * e;
          s.opb[i * K + d] = t.beta[i] * t.k[i * K + d] * e;
        }
      }
      for (int64_t j = s0; j < s1; ++j) {
        float* ac = acc_k.data() + (j - s0) * K;
        for (int64_t i = r0; i < r1; ++i) {
          const float p = s.dP[i * rows + j], l = s.dL[i * rows + j];
          const float *qi = s.opa + i * K, *ki = s.opb + i * K;
          for (int64_t d = 0; d < K; ++d) ac[d] += p * qi[d] + l * ki[d];
        }
      }
      for (int64_t d = 0; d < K; ++d) mid[d] += t.tot[r * K + d];
    }
    for (int64_t j = s0; j < s1; ++j) {
      for (int64_t d = 0; d < K; ++d) {
        const int64_t e_ = j * K + d;
        const float c = std::exp(t.rho[e_]) * acc_k[(j - s0) * K + d];
        s.dk_col[e_] += c;
        b_col[e_] = t.k[e_] * c;
      }
    }
    // Diagonal block: its pairs x [i][j][d] (j < i), then the products from them.
    std::fill(x.begin(), x.end(), 0.f);
    if (t.factorised[a]) {
      // x_ij = (dP_ij q_i e^sigma_i + dL_ij beta_i k_i e^sigma_i) k_j e^-sigma_j.
      for (int64_t i = s0; i < s1; ++i) {
        for (int64_t d = 0; d < K; ++d) {
          const float e = std::exp(t.sigma[i * K + d]);
          s.opa[i * K + d] = t.q[i * K + d] * e;
          s.opb[i * K + d] = t.beta[i] * t.k[i * K + d] * e;
          s.opc[i * K + d] = t.k[i * K + d] * std::exp(-t.sigma[i * K + d]);
        }
      }
      for (int64_t i = s0; i < s1; ++i) {
        float* aq = acc_q.data() + (i - s0) * K;
        float* ak = acc_k.data() + (i - s0) * K;
        std::fill(aq, aq + K, 0.f);
        std::fill(ak, ak + K, 0.f);
        for (int64_t j = s0; j < i; ++j) {
          const float p = s.dP[i * rows + j], l = s.dL[i * rows + j];
          const float* kj = s.opc + j * K;
          float* xij = x.data() + ((i - s0) * kSub + (j - s0)) * K;
          for (int64_t d = 0; d < K; ++d) {
            aq[d] += p * kj[d];
            ak[d] += l * kj[d];
            xij[d] = (p * s.opa[i * K + d] + l * s.opb[i * K + d]) * kj[d];
          }
        }
        for (int64_t d = 0; d < K; ++d) {
          const float e = std::exp(t.sigma[i * K + d]);
          s.dq_row[i * K + d] += e * aq[d];
          s.dk_row[i * K + d] += e * ak[d];
        }
      }
      for (int64_t j = s0; j < s1; ++j) {
        float* ac = acc_k.data();
        std::fill(ac, ac + K, 0.f);
        for (int64_t i = j + 1; i < s1; ++i) {
          const float p = s.dP[i * rows + j], l = s.dL[i * rows + j];
          const float *qi = s.opa + i * K, *ki = s.opb + i * K;
          for (int64_t d = 0; d < K; ++d) ac[d] += p * qi[d] + l * ki[d];
        }
        for (int64_t d = 0; d < K; ++d) s.dk_col[j * K + d] += std::exp(-t.sigma[j * K + d]) * ac[d];
      }
    } else {
      // Running products decay(i, j) = prod_{r=j+1..i} e^g_r, exact for any g <= 0.
      std::vector<float> dec(K);
      for (int64_t i = s0; i < s1; ++i) {
        std::fill(dec.begin(), dec.end(), 1.f);
        for (int64_t j = i - 1; j >= s0; --j) {
          for (int64_t d = 0; d < K; ++d) dec[d] *= std::exp(t.g[(j + 1) * K + d]);
          const float p = s.dP[i * rows + j], l = s.dL[i * rows + j];
          float* xij = x.data() + ((i - s0) * kSub + (j - s0)) * K;
          for (int64_t d = 0; d < K; ++d) {
            const float kj = t.k[j * K + d] * dec[d];
            const float xi = p * t.q[i * K + d] + l * t.beta[i] * t.k[i * K + d];
            s.dq_row[i * K + d] += p * kj;
            s.dk_row[i * K + d] += l * kj;
            s.dk_col[j * K + d] += xi * dec[d];
            xij[d] = xi * kj;
          }
        }
      }
    }
    // dgp_t, t in this block: its pairs within the block, sum_{i >= t} sum_{j < t} x_ij.
    for (int64_t tt = n - 1; tt >= 1; --tt) {
      float* dgt = s.dgp + (s0 + tt) * K;
      for (int64_t i = tt; i < n; ++i) {
        const float* xi = x.data() + i * kSub * K;
        for (int64_t d = 0; d < K; ++d) {
          float acc = 0.f;
          for (int64_t j = 0; j < tt; ++j) acc += xi[j * K + d];
          dgt[d] += acc;
        }
      }
    }
  }
  // The block-level pairs: c's rows over earlier blocks (i >= t), c's columns over later blocks (j < t), and the
  // pairs between a later and an earlier block.
  for (int64_t c = 0; c < nsub; ++c) {
    const int64_t s0 = c * kSub, s1 = std::min(rows, s0 + kSub);
    for (int64_t d = 0; d < K; ++d) {
      float around = 0.f;
      for (int64_t a = c + 1; a < nsub; ++a) {
        for (int64_t b = 0; b < c; ++b) around += wpart[(a * nsub + b) * K + d];
      }
      float rev = 0.f;
      for (int64_t r = s1 - 1; r >= s0; --r) { rev += a_row[r * K + d]; s.dgp[r * K + d] += rev + around; }
      float fwd = 0.f;
      for (int64_t r = s0; r < s1; ++r) { s.dgp[r * K + d] += fwd; fwd += b_col[r * K + d]; }
    }
  }
}

}  // namespace

void chunk_gradients(const ChunkTiles& t, GradTiles& s, int64_t rows, int64_t K, int64_t V, float scale,
                     const float* S, const float* dH, const float* vnew, const float* dvnew, const float* dO, float* dq,
                     float* dk, float* dv, float* dbeta, float* dg) {
  const int64_t nsub = (rows + kSub - 1) / kSub;
  // The WY representation backwards: dbv = Tm^T dv_new; dP = scale tril_incl(dO v_new^T), dL = -tril_strict(dbv
  // v_new^T) (header comment).
  for (int64_t j = 0; j < rows; ++j) {
    float* dbv = s.dbv + j * V;
    std::fill(dbv, dbv + V, 0.f);
    for (int64_t i = j; i < rows; ++i) {
      const float tij = t.Tm[i * rows + j];
      if (tij == 0.f) continue;
      for (int64_t c = 0; c < V; ++c) dbv[c] += tij * dvnew[i * V + c];
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < rows; ++j) {
      s.dP[i * rows + j] = j <= i ? scale * dot(dO + i * V, vnew + j * V, V) : 0.f;
      s.dL[i * rows + j] = j < i ? -dot(s.dbv + i * V, vnew + j * V, V) : 0.f;
    }
  }
  // Products with the states: dqg = scale dO S^T, dkbg = -dbv S^T, dkg = v_new dH^T; dgam = rowsum(S * dH).
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t d = 0; d < K; ++d) {
      const float *Sd = S + d * V, *dHd = dH + d * V;
      float aq = 0.f, ab = 0.f, ak = 0.f;
      for (int64_t c = 0; c < V; ++c) {
        aq += dO[i * V + c] * Sd[c];
        ab += s.dbv[i * V + c] * Sd[c];
        ak += vnew[i * V + c] * dHd[c];
      }
      s.dqg[i * K + d] = scale * aq;
      s.dkbg[i * K + d] = -ab;
      s.dkg[i * K + d] = ak;
    }
  }
  for (int64_t d = 0; d < K; ++d) s.dgam[d] = dot(S + d * V, dH + d * V, V);
  intra_products(t, s, rows, K);

  // Assembly per row: dv, dbeta, dq, dk and the gate's gradient dG (kg's terms apart, header comment).
  std::vector<float> before(K), after(K);
  for (int64_t a = 0; a < nsub; ++a) {
    const int64_t s0 = a * kSub, s1 = std::min(rows, s0 + kSub);
    totals_around(t, rows, K, a, before.data(), after.data());
    for (int64_t r = s0; r < s1; ++r) {
      const float b = t.beta[r];
      for (int64_t c = 0; c < V; ++c) dv[r * V + c] = b * s.dbv[r * V + c];
      float db = dot(s.dbv + r * V, t.v + r * V, V) + dot(t.k + r * K, s.dk_row + r * K, K);
      for (int64_t d = 0; d < K; ++d) {
        const int64_t x = r * K + d;
        const float eg = std::exp(t.lam[x] + before[d]);        // e^G_r
        const float egl = std::exp(t.rho[x] + after[d]);        // e^(G_last - G_r)
        const float kd = t.k[x];
        db += s.dkbg[x] * kd * eg;
        const float dk_kg = egl * s.dkg[x];
        const float dq_g = eg * s.dqg[x], dk_g = b * eg * s.dkbg[x];  // through qg and kbg
        const float pd = s.dP[r * rows + r];  // P's diagonal (header comment)
        dq[x] = s.dq_row[x] + dq_g + pd * kd;
        dk[x] = dk_g + b * s.dk_row[x] + s.dk_col[x] + pd * t.q[x] + dk_kg;
        s.dG[x] = t.q[x] * dq_g + kd * dk_g;
        s.opa[x] = kd * dk_kg;  // the "-x on row r, +x on the last row" terms
      }
      dbeta[r] = db;
    }
  }
  // B7: dg_r = (the pairs' part) + sum_{s >= r} dG_s + sum_{s < r} k_s dk_kg_s + gamma * dgam.
  for (int64_t d = 0; d < K; ++d) {
    float rev = 0.f;
    for (int64_t r = rows - 1; r >= 0; --r) { rev += s.dG[r * K + d]; dg[r * K + d] = s.dgp[r * K + d] + rev; }
    float fwd = 0.f;
    const float last = t.gamma[d] * s.dgam[d];
    for (int64_t r = 0; r < rows; ++r) {
      dg[r * K + d] += fwd + last;
      fwd += s.opa[r * K + d];
    }
  }
}

}  // namespace kdakit::cpu
