// The chunked forward of spec §3.1 in float32: the algorithm kdakit's GPU kernels run, one
// (sequence, v-head) per task.
//
// Exponent anchoring. All decay factors are exponentials of sums of gates over a contiguous token range,
// and every such sum is accumulated directly from the gates (never as a difference of two cumulative sums),
// so a hard reset (g = -1000) costs no precision in the tokens after it. Within a chunk, rows are grouped in
// sub-chunks of 16 with, per sub-chunk, the inclusive prefix sum `lam` (from the sub-chunk's first row),
// the exclusive suffix sum `rho` (to its last row) and the total `tot`. Then, for i in sub-chunk a and j in
// an earlier sub-chunk b,
//     G_i - G_j = lam_i + (sum of tot over the sub-chunks strictly between b and a) + rho_j,
// and each factor exp(lam_i), exp(mid + rho_j) is <= 1: the off-diagonal blocks are exact products of
// bounded factors (matrix products on the GPU). Diagonal 16x16 blocks are factorised around their middle
// row m, exp(G_i - G_m) * exp(G_m - G_j), when every such exponent stays within +-kMaxAnchorExponent
// (always true for bounded gates); otherwise each pair's decay is a running product of per-token decays.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "cpu/backend.h"
#include "cpu/inputs.h"
#include "cpu/parallel.h"
#include "cpu/state.h"

namespace kdakit::cpu {
namespace {

constexpr int kSub = 16;                     // sub-chunk rows
constexpr float kMaxAnchorExponent = 64.0f;  // e^64 ~ 6e27: products of factors stay well inside fp32
std::atomic<int> g_diagonal_mode{static_cast<int>(DiagonalBlocks::kAuto)};

struct Scratch {
  float *S, *q, *k, *v, *g, *beta, *lam, *rho, *tot, *sigma;
  float *qg, *kbg, *kg, *fa, *fb, *fc, *P, *L, *Tm, *w, *u, *vnew, *o;

  static std::size_t floats(int64_t C, int64_t K, int64_t V) {
    return K * V + C * K * 13 + C * V * 4 + C + (C / kSub) * K + 3 * C * C;
  }
  Scratch(float* p, int64_t C, int64_t K, int64_t V) {
    auto take = [&p](int64_t n) { float* r = p; p += n; return r; };
    S = take(K * V);
    q = take(C * K); k = take(C * K); v = take(C * V); g = take(C * K); beta = take(C);
    lam = take(C * K); rho = take(C * K); tot = take((C / kSub) * K); sigma = take(C * K);
    qg = take(C * K); kbg = take(C * K); kg = take(C * K); fa = take(C * K); fb = take(C * K); fc = take(C * K);
    P = take(C * C); L = take(C * C); Tm = take(C * C);
    w = take(C * K); u = take(C * V); vnew = take(C * V); o = take(C * V);
  }
};

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// One chunk of `rows` (<= C) tokens whose inputs are loaded in sc; updates sc.S and writes sc.o.
void chunk_step(Scratch& sc, int64_t rows, int64_t K, int64_t V, float scale, DiagonalBlocks diag_mode) {
  const int64_t nsub = (rows + kSub - 1) / kSub;
  // Per sub-chunk sums (see the header comment).
  for (int64_t a = 0; a < nsub; ++a) {
    const int64_t s0 = a * kSub, s1 = std::min(rows, s0 + kSub);
    for (int64_t d = 0; d < K; ++d) {
      float acc = 0.f;
      for (int64_t r = s0; r < s1; ++r) { acc += sc.g[r * K + d]; sc.lam[r * K + d] = acc; }
      sc.tot[a * K + d] = acc;
      acc = 0.f;
      for (int64_t r = s1 - 1; r >= s0; --r) { sc.rho[r * K + d] = acc; acc += sc.g[r * K + d]; }
    }
  }
  // Chunk-level factors: qg = q*exp(G_r), kbg = beta*k*exp(G_r), kg = k*exp(G_last - G_r), gamma = exp(G_last).
  std::vector<float> before(K), after(K), gamma(K);
  for (int64_t a = 0; a < nsub; ++a) {
    const int64_t s0 = a * kSub, s1 = std::min(rows, s0 + kSub);
    for (int64_t d = 0; d < K; ++d) {
      float bsum = 0.f, asum = 0.f;
      for (int64_t c = 0; c < a; ++c) bsum += sc.tot[c * K + d];
      for (int64_t c = a + 1; c < nsub; ++c) asum += sc.tot[c * K + d];
      before[d] = bsum;
      after[d] = asum;
    }
    for (int64_t r = s0; r < s1; ++r) {
      for (int64_t d = 0; d < K; ++d) {
        const float e_head = std::exp(sc.lam[r * K + d] + before[d]);
        sc.qg[r * K + d] = sc.q[r * K + d] * e_head;
        sc.kbg[r * K + d] = sc.beta[r] * sc.k[r * K + d] * e_head;
        sc.kg[r * K + d] = sc.k[r * K + d] * std::exp(sc.rho[r * K + d] + after[d]);
      }
    }
  }
  for (int64_t d = 0; d < K; ++d) {
    float t = 0.f;
    for (int64_t a = 0; a < nsub; ++a) t += sc.tot[a * K + d];
    gamma[d] = std::exp(t);
  }

  // Intra-chunk matrices P (q.k with decay, j <= i) and L (beta_i k_i.k_j with decay, j < i).
  std::fill(sc.P, sc.P + rows * rows, 0.f);
  std::fill(sc.L, sc.L + rows * rows, 0.f);
  for (int64_t a = 0; a < nsub; ++a) {
    const int64_t s0 = a * kSub, s1 = std::min(rows, s0 + kSub);
    // Off-diagonal blocks (b < a), anchored at the start of sub-chunk a: fa = q*exp(lam), fb = k*exp(lam).
    for (int64_t i = s0; i < s1; ++i) {
      for (int64_t d = 0; d < K; ++d) {
        const float e = std::exp(sc.lam[i * K + d]);
        sc.fa[i * K + d] = sc.q[i * K + d] * e;
        sc.fb[i * K + d] = sc.k[i * K + d] * e;
      }
    }
    std::vector<float> mid(K, 0.f);  // sum of tot over sub-chunks strictly between b and a
    for (int64_t b = a - 1; b >= 0; --b) {
      const int64_t t0 = b * kSub, t1 = t0 + kSub;
      for (int64_t j = t0; j < t1; ++j) {
        for (int64_t d = 0; d < K; ++d) sc.fc[j * K + d] = sc.k[j * K + d] * std::exp(sc.rho[j * K + d] + mid[d]);
      }
      for (int64_t i = s0; i < s1; ++i) {
        for (int64_t j = t0; j < t1; ++j) {
          sc.P[i * rows + j] = dot(sc.fa + i * K, sc.fc + j * K, K);
          sc.L[i * rows + j] = sc.beta[i] * dot(sc.fb + i * K, sc.fc + j * K, K);
        }
      }
      for (int64_t d = 0; d < K; ++d) mid[d] += sc.tot[b * K + d];
    }
    // Diagonal block: sigma_i = G_i - G_m, summed outward from the anchor row m.
    const int64_t m = s0 + std::min<int64_t>(8, s1 - s0 - 1);
    float max_abs = 0.f;
    for (int64_t d = 0; d < K; ++d) {
      sc.sigma[m * K + d] = 0.f;
      float acc = 0.f;
      for (int64_t i = m + 1; i < s1; ++i) { acc += sc.g[i * K + d]; sc.sigma[i * K + d] = acc; }
      max_abs = std::max(max_abs, -acc);
      acc = 0.f;
      for (int64_t i = m - 1; i >= s0; --i) { acc -= sc.g[(i + 1) * K + d]; sc.sigma[i * K + d] = acc; }
      max_abs = std::max(max_abs, acc);
    }
    const bool factorise = diag_mode == DiagonalBlocks::kFactorised ||
                           (diag_mode == DiagonalBlocks::kAuto && max_abs <= kMaxAnchorExponent);
    if (factorise) {
      // fa = q*exp(sigma), fb = k*exp(sigma), fc = k*exp(-sigma)
      for (int64_t i = s0; i < s1; ++i) {
        for (int64_t d = 0; d < K; ++d) {
          const float e = std::exp(sc.sigma[i * K + d]);
          sc.fa[i * K + d] = sc.q[i * K + d] * e;
          sc.fb[i * K + d] = sc.k[i * K + d] * e;
          sc.fc[i * K + d] = sc.k[i * K + d] * std::exp(-sc.sigma[i * K + d]);
        }
      }
      for (int64_t i = s0; i < s1; ++i) {
        for (int64_t j = s0; j <= i; ++j) {
          sc.P[i * rows + j] = dot(sc.fa + i * K, sc.fc + j * K, K);
          if (j < i) sc.L[i * rows + j] = sc.beta[i] * dot(sc.fb + i * K, sc.fc + j * K, K);
        }
      }
    } else {
      // Running product of per-token decays: decay(i, j) = prod_{s=j+1..i} exp(g_s), exact for any g <= 0.
      std::vector<float> r(K);
      for (int64_t i = s0; i < s1; ++i) {
        std::fill(r.begin(), r.end(), 1.f);
        for (int64_t j = i; j >= s0; --j) {
          if (j < i) {
            for (int64_t d = 0; d < K; ++d) r[d] *= std::exp(sc.g[(j + 1) * K + d]);
          }
          float p = 0.f, l = 0.f;
          for (int64_t d = 0; d < K; ++d) {
            const float kr = sc.k[j * K + d] * r[d];
            p += sc.q[i * K + d] * kr;
            l += sc.k[i * K + d] * kr;
          }
          sc.P[i * rows + j] = p;
          if (j < i) sc.L[i * rows + j] = sc.beta[i] * l;
        }
      }
    }
  }

  // Tm = (I + L)^-1 by forward substitution: Tm[i,:] = e_i - sum_{j<i} L[i,j] Tm[j,:].
  std::fill(sc.Tm, sc.Tm + rows * rows, 0.f);
  for (int64_t i = 0; i < rows; ++i) {
    float* ti = sc.Tm + i * rows;
    ti[i] = 1.f;
    for (int64_t j = 0; j < i; ++j) {
      const float lij = sc.L[i * rows + j];
      if (lij == 0.f) continue;
      const float* tj = sc.Tm + j * rows;
      for (int64_t c = 0; c <= j; ++c) ti[c] -= lij * tj[c];
    }
  }
  // w = Tm (beta k exp(G)), u = Tm (beta v).
  for (int64_t i = 0; i < rows; ++i) {
    float* wi = sc.w + i * K;
    float* ui = sc.u + i * V;
    std::fill(wi, wi + K, 0.f);
    std::fill(ui, ui + V, 0.f);
    for (int64_t j = 0; j <= i; ++j) {
      const float t = sc.Tm[i * rows + j];
      if (t == 0.f) continue;
      for (int64_t d = 0; d < K; ++d) wi[d] += t * sc.kbg[j * K + d];
      const float tb = t * sc.beta[j];
      for (int64_t c = 0; c < V; ++c) ui[c] += tb * sc.v[j * V + c];
    }
  }
  // v_new = u - w S;  o = scale (qg S + tril(P) v_new).
  for (int64_t i = 0; i < rows; ++i) {
    float* vn = sc.vnew + i * V;
    float* oi = sc.o + i * V;
    for (int64_t c = 0; c < V; ++c) { vn[c] = sc.u[i * V + c]; oi[c] = 0.f; }
    for (int64_t d = 0; d < K; ++d) {
      const float wd = sc.w[i * K + d], qd = sc.qg[i * K + d];
      const float* Sd = sc.S + d * V;
      for (int64_t c = 0; c < V; ++c) { vn[c] -= wd * Sd[c]; oi[c] += qd * Sd[c]; }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    float* oi = sc.o + i * V;
    for (int64_t j = 0; j <= i; ++j) {
      const float pij = sc.P[i * rows + j];
      const float* vn = sc.vnew + j * V;
      for (int64_t c = 0; c < V; ++c) oi[c] += pij * vn[c];
    }
    for (int64_t c = 0; c < V; ++c) oi[c] *= scale;
  }
  // S <- diag(gamma) S + kg^T v_new.
  for (int64_t d = 0; d < K; ++d) {
    float* Sd = sc.S + d * V;
    for (int64_t c = 0; c < V; ++c) Sd[c] *= gamma[d];
    for (int64_t i = 0; i < rows; ++i) {
      const float kd = sc.kg[i * K + d];
      const float* vn = sc.vnew + i * V;
      for (int64_t c = 0; c < V; ++c) Sd[c] += kd * vn[c];
    }
  }
}

}  // namespace

void set_diagonal_blocks(DiagonalBlocks mode) { g_diagonal_mode = static_cast<int>(mode); }

std::size_t forward_workspace_size(const ForwardParams& p, const detail::Plan& plan) {
  const Problem& pr = plan.pr;
  return static_cast<std::size_t>(workers_for(pr.N * pr.HV)) * Scratch::floats(p.chunk_size, pr.K, pr.V) *
         sizeof(float);
}

void forward_chunked(const ForwardParams& p, const detail::Plan& plan) {
  const Problem& pr = plan.pr;
  const int64_t K = pr.K, V = pr.V, C = p.chunk_size;
  const std::size_t per_worker = Scratch::floats(C, K, V);
  const auto diag_mode = static_cast<DiagonalBlocks>(g_diagonal_mode.load());
  InputReader<float> rd(p.in, pr);
  const StateIO& st = p.state;
  float* ws = static_cast<float*>(p.workspace);
  parallel_for(pr.N * pr.HV, [&](int64_t task, int worker) {
    const int64_t n = task / pr.HV, hv = task % pr.HV, h = hv / pr.group;
    Scratch sc(ws + worker * per_worker, C, K, V);
    const SeqRange seq = seq_range(plan, n);
    const SlotPlan slots = plan_slots(st, nullptr, n);
    if (slots.padding) {  // no state read or written; zero outputs and chunk states
      zero_token_rows<float>(p.out, seq, hv);
      if (p.intermediate_states.present()) {
        const TensorView& hs = p.intermediate_states;
        for (int64_t c0 = 0; c0 < seq.len; c0 += C) {
          const int64_t c = pr.varlen ? plan.chunk_offsets[n] + c0 / C : c0 / C;
          store_zero_block<float>(hs, seq.b * hs.strides[0] + c * hs.strides[1] + hv * hs.strides[2], K, V);
        }
      }
      return;
    }
    std::fill(sc.S, sc.S + K * V, 0.f);
    if (slots.read >= 0) {
      load_state_block<float>(st.initial_state, state_offset(st.initial_state, slots.read, hv), st.layout, K, V, sc.S);
    }
    for (int64_t c0 = 0; c0 < seq.len; c0 += C) {
      const int64_t rows = std::min(C, seq.len - c0);
      if (p.intermediate_states.present()) {
        const TensorView& hs = p.intermediate_states;
        const int64_t c = pr.varlen ? plan.chunk_offsets[n] + c0 / C : c0 / C;
        store_state_block<float>(hs, seq.b * hs.strides[0] + c * hs.strides[1] + hv * hs.strides[2], st.layout, K, V,
                                 sc.S);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t s = seq.t0 + c0 + r;
        rd.q(seq.b, s, h, sc.q + r * K);
        rd.k(seq.b, s, h, sc.k + r * K);
        rd.v(seq.b, s, hv, sc.v + r * V);
        rd.gate(seq.b, s, hv, sc.g + r * K);
        sc.beta[r] = rd.beta(seq.b, s, hv);
      }
      chunk_step(sc, rows, K, V, p.in.scale, diag_mode);
      for (int64_t r = 0; r < rows; ++r) {
        store_row<float>(p.out, offset4(p.out, seq.b, seq.t0 + c0 + r, hv), V, p.out.strides[3], sc.o + r * V);
      }
    }
    if (slots.write >= 0) {
      store_state_block<float>(st.final_state, state_offset(st.final_state, slots.write, hv), st.layout, K, V, sc.S);
    }
  });
  const SeqRange tail = tail_range(plan);
  for (int64_t hv = 0; hv < pr.HV && tail.len > 0; ++hv) zero_token_rows<float>(p.out, tail, hv);
}

}  // namespace kdakit::cpu
