// The chunked backward of spec §4.2 in float32: the algorithm kdakit's CUDA backward kernels run, stage by stage,
// each stage a loop over the grid its kernel has, communicating through the workspace only.
//
//   1. prepare, per (chunk, v-head): the forward's state-independent tiles w, u, qg, kg, Aqk = scale P, gamma, and Tm
//      (src/cpu/chunk_prepare.cpp, the forward's exponent anchoring).
//   2. state pass, per (sequence, v-head): the chunk-start states h_c by the forward's recurrence (skipped when the
//      caller passes the forward's states, BackwardParams::chunk_states).
//   3. reverse state scan, per (sequence, v-head): from dS = dht (or zero), per chunk backwards: dh_c = dS (the gradient
//      of the chunk's end state), dv_new = kg dS + Aqk^T dO, dS <- gamma dS + scale qg^T dO - w^T dv_new; after chunk 0
//      dS is d_initial_state. The scan is linear in dS, so a long sequence may be cut into segments (spec §7.2,
//      transposed): each segment but the last scans from zero (E_s) and gives its transition M_s^T (the same scan of
//      the identity without dO); a serial merge dS_end(s-1) = M_s^T dS_end(s) + E_s; then every segment scans from its
//      end gradient. set_backward_segment_chunks() sets the cut (the tests cut short sequences).
//   4. gradients, per (chunk, v-head): v_new = u - w h_c, then src/cpu/chunk_gradients.cpp from the recomputed sums,
//      Tm, the states, v_new and dv_new; then the beta activation's and the gate's chains (per-chunk partial sums of
//      dA_log and ddt_bias).
//   5. reductions: dq and dk of each GVA group summed over its v-heads in order, then the L2 norm's backward; dA_log
//      and ddt_bias summed over chunks in order. No sum depends on which thread ran what, nor on a sequence's batch
//      neighbours (except dA_log and ddt_bias, sums over the batch by definition).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "cpu/backend.h"
#include "cpu/chunk_gradients.h"
#include "cpu/chunk_prepare.h"
#include "cpu/inputs.h"
#include "cpu/parallel.h"
#include "cpu/state.h"

namespace kdakit::cpu {
namespace {

std::atomic<int> g_segment_chunks{0};

// A chunk's prepared tiles in the workspace (what the CUDA prepare kernel writes).
struct Prepared {
  float *w, *u, *qg, *kg, *aqk, *tm, *gam;  // [C][K], [C][V], [C][K], [C][K], [C][C] scale P (j <= i), [C][C] Tm, [K]
  static int64_t floats(int64_t C, int64_t K, int64_t V) { return 3 * C * K + C * V + 2 * C * C + K; }
  Prepared(float* p, int64_t C, int64_t K, int64_t V)
      : w(p), u(w + C * K), qg(u + C * V), kg(qg + C * K), aqk(kg + C * K), tm(aqk + C * C), gam(tm + C * C) {}
};

// The workspace: per (chunk, v-head) tiles and states, per (token, v-head) q/k gradients, per-chunk partial sums,
// then every worker's scratch.
struct Workspace {
  int64_t C, K, V, HV, NT, rows;  // rows: B * T token rows
  int64_t prep_floats, scratch_floats, fixed_floats;
  float *prep, *h, *dh, *dvnew, *dq, *dk, *dA, *ddt, *scratch;

  Workspace(const BackwardParams& p, const detail::Plan& plan, int64_t max_segments, float* base) {
    const Problem& pr = plan.pr;
    C = p.chunk_size; K = pr.K; V = pr.V; HV = pr.HV; NT = pr.num_chunks; rows = pr.B * pr.T;
    prep_floats = Prepared::floats(C, K, V);
    const int64_t chunk_work =
        ChunkTiles::floats(C, K, V) + GradTiles::floats(C, K, V) + 3 * C * K + 3 * C * V + C + 2 * K * V;
    const int64_t scan_work = K * V + K * K + C * std::max(K, V) + max_segments * (K * V + K * K);
    scratch_floats = std::max(chunk_work, scan_work);
    int64_t off = 0;
    auto take = [&](int64_t n) { const int64_t r = off; off += n; return base ? base + r : nullptr; };
    prep = take(NT * HV * prep_floats);
    h = take(NT * HV * K * V);
    dh = take(NT * HV * K * V);
    dvnew = take(NT * HV * C * V);
    dq = take(rows * HV * K);
    dk = take(rows * HV * K);
    dA = take(NT * HV);
    ddt = take(NT * HV * K);
    scratch = take(0);
    fixed_floats = off;
  }
  int64_t tile(int64_t gc, int64_t hv) const { return gc * HV + hv; }
  Prepared prepared(int64_t gc, int64_t hv) const { return Prepared(prep + tile(gc, hv) * prep_floats, C, K, V); }
};

// Workers of the widest stage (parallel_for hands out worker ids below workers_for(its task count)).
int scratch_workers(const Problem& pr) {
  return workers_for(std::max({pr.num_chunks * pr.HV, pr.N * pr.HV, pr.B * pr.T * pr.H}));
}

int64_t segment_chunks(int64_t nch) {
  const int64_t per = g_segment_chunks.load();
  return per > 0 ? per : std::max<int64_t>(nch, 1);
}

int64_t max_segments(const detail::Plan& plan, int chunk) {
  int64_t most = 1;
  for (int64_t n = 0; n < plan.pr.N; ++n) {
    const int64_t nch = (plan.cu[n + 1] - plan.cu[n] + chunk - 1) / chunk;
    most = std::max(most, (nch + segment_chunks(nch) - 1) / segment_chunks(nch));
  }
  return most;
}

// Loads one chunk's inputs (L2 norm, gate and beta activations) into t; x: the raw gate input (gate in kernel),
// beta_raw: the raw beta.
void load_chunk(const InputReader<float>& rd, const SeqRange& seq, int64_t c0, int64_t rows, int64_t h, int64_t hv,
                int64_t K, int64_t V, ChunkTiles& t, float* x, float* beta_raw) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = seq.t0 + c0 + r;
    rd.q(seq.b, s, h, t.q + r * K);
    rd.k(seq.b, s, h, t.k + r * K);
    rd.v(seq.b, s, hv, t.v + r * V);
    rd.gate(seq.b, s, hv, t.g + r * K, x ? x + r * K : nullptr);
    t.beta[r] = rd.beta(seq.b, s, hv);
    if (beta_raw) beta_raw[r] = rd.beta_raw(seq.b, s, hv);
  }
}

// v_new = u - w S of one chunk, in the forward's order.
void v_new(const Prepared& pc, int64_t rows, int64_t K, int64_t V, const float* S, float* vn) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < V; ++c) vn[i * V + c] = pc.u[i * V + c];
    for (int64_t d = 0; d < K; ++d) {
      const float wd = pc.w[i * K + d];
      for (int64_t c = 0; c < V; ++c) vn[i * V + c] -= wd * S[d * V + c];
    }
  }
}

// One chunk of the reverse scan on a [K][X] block dS (X = V; or X = K for a segment's transition, without dO):
// dv [rows][X] = kg dS (+ Aqk^T dO), then dS <- gamma dS (+ scale qg^T dO) - w^T dv.
void scan_step(const Prepared& pc, int64_t rows, int64_t K, int64_t X, float scale, const float* dO, float* dS,
               float* dv) {
  for (int64_t i = 0; i < rows; ++i) {
    float* dvi = dv + i * X;
    std::fill(dvi, dvi + X, 0.f);
    for (int64_t d = 0; d < K; ++d) {
      const float kd = pc.kg[i * K + d];
      const float* dSd = dS + d * X;
      for (int64_t x = 0; x < X; ++x) dvi[x] += kd * dSd[x];
    }
    if (dO) {
      for (int64_t j = i; j < rows; ++j) {
        const float a = pc.aqk[j * rows + i];
        for (int64_t x = 0; x < X; ++x) dvi[x] += a * dO[j * X + x];
      }
    }
  }
  for (int64_t d = 0; d < K; ++d) {
    float* dSd = dS + d * X;
    for (int64_t x = 0; x < X; ++x) dSd[x] *= pc.gam[d];
    for (int64_t i = 0; i < rows; ++i) {
      const float qd = dO ? scale * pc.qg[i * K + d] : 0.f, wd = pc.w[i * K + d];
      for (int64_t x = 0; x < X; ++x) dSd[x] += (dO ? qd * dO[i * X + x] : 0.f) - wd * dv[i * X + x];
    }
  }
}

}  // namespace

void set_backward_segment_chunks(int chunks) { g_segment_chunks = std::max(0, chunks); }

std::size_t backward_chunked_workspace_size(const BackwardParams& p, const detail::Plan& plan) {
  const Workspace ws(p, plan, max_segments(plan, p.chunk_size), nullptr);
  return static_cast<std::size_t>(ws.fixed_floats + scratch_workers(plan.pr) * ws.scratch_floats) * sizeof(float);
}

void backward_chunked(const BackwardParams& p, const detail::Plan& plan) {
  const Problem& pr = plan.pr;
  const KdaInputs& in = p.in;
  Workspace ws(p, plan, max_segments(plan, p.chunk_size), static_cast<float*>(p.workspace));
  const int64_t C = ws.C, K = ws.K, V = ws.V, HV = pr.HV, NT = ws.NT;
  const float scale = in.scale;
  const DiagonalBlocks diag_mode = diagonal_blocks();
  InputReader<float> rd(in, pr);
  auto scratch = [&](int worker) { return ws.scratch + worker * ws.scratch_floats; };
  // The owner sequence of each chunk (the CUDA kernels search chunk_offsets).
  std::vector<int64_t> owner(NT);
  for (int64_t n = 0; n < pr.N; ++n) {
    for (int64_t gc = plan.chunk_offsets[n]; gc < plan.chunk_offsets[n + 1]; ++gc) owner[gc] = n;
  }
  // Index of chunk gc of sequence n in a [B|1, NT, HV, *, *] tensor: (batch row, chunk).
  auto chunk_row = [&](int64_t n, int64_t gc) { return pr.varlen ? gc : gc - plan.chunk_offsets[n]; };

  // 1. Prepare.
  parallel_for(NT * HV, [&](int64_t task, int worker) {
    const int64_t gc = task / HV, hv = task % HV, n = owner[gc];
    const SeqRange seq = seq_range(plan, n);
    const int64_t c0 = (gc - plan.chunk_offsets[n]) * C, rows = std::min(C, seq.len - c0);
    ChunkTiles t(scratch(worker), C, K, V);
    load_chunk(rd, seq, c0, rows, hv / pr.group, hv, K, V, t, nullptr, nullptr);
    prepare_chunk(t, rows, K, V, diag_mode);
    Prepared pc = ws.prepared(gc, hv);
    std::copy(t.w, t.w + rows * K, pc.w);
    std::copy(t.u, t.u + rows * V, pc.u);
    std::copy(t.qg, t.qg + rows * K, pc.qg);
    std::copy(t.kg, t.kg + rows * K, pc.kg);
    for (int64_t e = 0; e < rows * rows; ++e) pc.aqk[e] = scale * t.P[e];
    std::copy(t.Tm, t.Tm + rows * rows, pc.tm);
    std::copy(t.gamma, t.gamma + K, pc.gam);
  });

  // 2. The chunk-start states, by the forward's recurrence in its order (with saved states: none to compute).
  if (!p.chunk_states.present()) {
    parallel_for(pr.N * HV, [&](int64_t task, int worker) {
      const int64_t n = task / HV, hv = task % HV;
      const SeqRange seq = seq_range(plan, n);
      float* S = scratch(worker);
      float* vn = S + K * V;
      std::fill(S, S + K * V, 0.f);
      if (p.initial_state.present()) {
        load_state_block<float>(p.initial_state, state_offset(p.initial_state, n, hv), p.layout, K, V, S);
      }
      for (int64_t gc = plan.chunk_offsets[n]; gc < plan.chunk_offsets[n + 1]; ++gc) {
        const int64_t rows = std::min(C, seq.len - (gc - plan.chunk_offsets[n]) * C);
        const Prepared pc = ws.prepared(gc, hv);
        std::copy(S, S + K * V, ws.h + ws.tile(gc, hv) * K * V);
        v_new(pc, rows, K, V, S, vn);
        for (int64_t d = 0; d < K; ++d) {
          for (int64_t c = 0; c < V; ++c) S[d * V + c] *= pc.gam[d];
          for (int64_t i = 0; i < rows; ++i) {
            const float kd = pc.kg[i * K + d];
            for (int64_t c = 0; c < V; ++c) S[d * V + c] += kd * vn[i * V + c];
          }
        }
      }
    });
  }

  // 3. The reverse state scan.
  parallel_for(pr.N * HV, [&](int64_t task, int worker) {
    const int64_t n = task / HV, hv = task % HV;
    const SeqRange seq = seq_range(plan, n);
    float* dS = scratch(worker);
    float* tmp = dS + K * V;             // [K][K]: a transition
    float* dv_tmp = tmp + K * K;          // [C][max(K, V)]
    float* seg = dv_tmp + C * std::max(K, V);  // per segment: E [K][V], M^T [K][K]
    std::vector<float> dO(C * V);
    const int64_t g0 = plan.chunk_offsets[n], nch = plan.chunk_offsets[n + 1] - g0;
    auto load_dht = [&](float* dst) {
      std::fill(dst, dst + K * V, 0.f);
      if (p.d_final_state.present()) {
        load_state_block<float>(p.d_final_state, state_offset(p.d_final_state, n, hv), p.layout, K, V, dst);
      }
    };
    auto rows_of = [&](int64_t c) { return std::min(C, seq.len - c * C); };
    // Scans chunks [c0, c1) backwards from the end gradient in dS; with `store`, keeps dh_c and dv_new.
    auto scan = [&](int64_t c0, int64_t c1, bool store) {
      for (int64_t c = c1 - 1; c >= c0; --c) {
        const int64_t gc = g0 + c, rows = rows_of(c);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t s = seq.t0 + c * C + r;
          load_row<float>(p.d_out, offset4(p.d_out, seq.b, s, hv), V, p.d_out.strides[3], dO.data() + r * V);
        }
        if (store) std::copy(dS, dS + K * V, ws.dh + ws.tile(gc, hv) * K * V);
        float* dv = store ? ws.dvnew + ws.tile(gc, hv) * C * V : dv_tmp;
        scan_step(ws.prepared(gc, hv), rows, K, V, scale, dO.data(), dS, dv);
      }
    };
    const int64_t per = segment_chunks(nch), nseg = (nch + per - 1) / per;
    auto E = [&](int64_t s) { return seg + s * (K * V + K * K); };
    auto M = [&](int64_t s) { return E(s) + K * V; };
    if (nseg > 1) {
      // Each segment but the first from zero (the last from dht): its start gradient E_s; and its transition.
      for (int64_t s = nseg - 1; s >= 1; --s) {
        const int64_t c0 = s * per, c1 = std::min(nch, c0 + per);
        if (s == nseg - 1) load_dht(dS); else std::fill(dS, dS + K * V, 0.f);
        scan(c0, c1, false);
        std::copy(dS, dS + K * V, E(s));
        if (s == nseg - 1) continue;
        std::fill(tmp, tmp + K * K, 0.f);
        for (int64_t d = 0; d < K; ++d) tmp[d * K + d] = 1.f;
        for (int64_t c = c1 - 1; c >= c0; --c) scan_step(ws.prepared(g0 + c, hv), rows_of(c), K, K, scale, nullptr, tmp, dv_tmp);
        std::copy(tmp, tmp + K * K, M(s));
      }
      // The merge, in order: E(s - 1 + ...) becomes segment s - 1's end gradient.
      for (int64_t s = nseg - 2; s >= 1; --s) {
        // end(s) = start(s + 1), held in E(s + 1); start(s) = M_s^T end(s) + E_s, written over E(s).
        const float* end = E(s + 1);
        float* out = E(s);
        for (int64_t d = 0; d < K; ++d) {
          for (int64_t c = 0; c < V; ++c) {
            float acc = out[d * V + c];
            for (int64_t e = 0; e < K; ++e) acc += M(s)[d * K + e] * end[e * V + c];
            out[d * V + c] = acc;
          }
        }
      }
    }
    // Every segment from its end gradient (the last from dht), keeping dh_c and dv_new.
    for (int64_t s = nseg - 1; s >= 0; --s) {
      const int64_t c0 = s * per, c1 = std::min(nch, c0 + per);
      if (s == nseg - 1) load_dht(dS); else std::copy(E(s + 1), E(s + 1) + K * V, dS);
      scan(c0, c1, true);
    }
    if (nseg == 0) load_dht(dS);  // an empty sequence passes dht through
    if (p.d_initial_state.present()) {
      store_state_block<float>(p.d_initial_state, state_offset(p.d_initial_state, n, hv), p.layout, K, V, dS);
    }
  });

  // 4. Per-chunk gradients and the activations' chains.
  const bool gate_in_kernel = in.gate.mode != GateMode::kPreGated;
  parallel_for(NT * HV, [&](int64_t task, int worker) {
    const int64_t gc = task / HV, hv = task % HV, n = owner[gc];
    const SeqRange seq = seq_range(plan, n);
    const int64_t c0 = (gc - plan.chunk_offsets[n]) * C, rows = std::min(C, seq.len - c0);
    float* base = scratch(worker);
    ChunkTiles t(base, C, K, V);
    base += ChunkTiles::floats(C, K, V);
    GradTiles gt(base, C, K, V);
    base += GradTiles::floats(C, K, V);
    float *x = base, *dq = x + C * K, *dk = dq + C * K, *dO = dk + C * K, *dv = dO + C * V, *vn = dv + C * V;
    float *dbeta = vn + C * V, *S = dbeta + C;
    float* dg = t.fa;  // t's operand scratch, unused here
    float beta_raw[64];
    load_chunk(rd, seq, c0, rows, hv / pr.group, hv, K, V, t, x, beta_raw);
    chunk_sums(t, rows, K, diag_mode);
    chunk_factors(t, rows, K);
    const int64_t tile = ws.tile(gc, hv);
    const Prepared pc = ws.prepared(gc, hv);
    std::copy(pc.tm, pc.tm + rows * rows, t.Tm);
    const TensorView& saved = p.chunk_states;
    if (saved.present()) {
      load_state_block<float>(saved, seq.b * saved.strides[0] + chunk_row(n, gc) * saved.strides[1] +
                                         hv * saved.strides[2], p.layout, K, V, S);
    } else {
      std::copy(ws.h + tile * K * V, ws.h + (tile + 1) * K * V, S);
    }
    v_new(pc, rows, K, V, S, vn);
    for (int64_t r = 0; r < rows; ++r) {
      load_row<float>(p.d_out, offset4(p.d_out, seq.b, seq.t0 + c0 + r, hv), V, p.d_out.strides[3], dO + r * V);
    }
    chunk_gradients(t, gt, rows, K, V, scale, S, ws.dh + tile * K * V, vn, ws.dvnew + tile * C * V, dO, dq, dk, dv,
                    dbeta, dg);
    float dA = 0.f;
    float* ddt = ws.ddt + tile * K;
    std::fill(ddt, ddt + K, 0.f);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t s = seq.t0 + c0 + r;
      if (gate_in_kernel) {
        const float A = rd.A_log(hv);
        for (int64_t d = 0; d < K; ++d) {
          float d_dx, d_dA;
          math::gate_grad<float>(rd.gate_mode(), x[r * K + d], A, rd.has_A_log(), rd.lower_bound(), &d_dx, &d_dA);
          dA += dg[r * K + d] * d_dA;
          dg[r * K + d] *= d_dx;
          ddt[d] += dg[r * K + d];
        }
      }
      store_row<float>(p.dg, offset4(p.dg, seq.b, s, hv), K, p.dg.strides[3], dg + r * K);
      store_row<float>(p.dv, offset4(p.dv, seq.b, s, hv), V, p.dv.strides[3], dv + r * V);
      store_elem<float>(p.dbeta.data, p.dbeta.dtype,
                        seq.b * p.dbeta.strides[0] + s * p.dbeta.strides[1] + hv * p.dbeta.strides[2],
                        dbeta[r] * math::beta_grad<float>(beta_raw[r], in.beta_sigmoid, in.allow_neg_eigval));
      const int64_t row = seq.b * pr.T + s;
      std::copy(dq + r * K, dq + (r + 1) * K, ws.dq + (row * HV + hv) * K);
      std::copy(dk + r * K, dk + (r + 1) * K, ws.dk + (row * HV + hv) * K);
    }
    ws.dA[tile] = dA;
  });

  // 5. dq, dk: the group's v-heads in order, then the L2 norm's backward; the padded token tail is zero.
  const int64_t tail_start = pr.varlen ? plan.cu[pr.N] : pr.T;
  parallel_for(ws.rows * pr.H, [&](int64_t task, int worker) {
    const int64_t row = task / pr.H, h = task % pr.H, b = row / pr.T, s = row % pr.T;
    float* q = scratch(worker);
    float *k = q + K, *gq = k + K, *gk = gq + K;
    std::fill(gq, gq + K, 0.f);
    std::fill(gk, gk + K, 0.f);
    if (s < tail_start) {
      for (int64_t hv = h * pr.group; hv < (h + 1) * pr.group; ++hv) {
        for (int64_t d = 0; d < K; ++d) {
          gq[d] += ws.dq[(row * HV + hv) * K + d];
          gk[d] += ws.dk[(row * HV + hv) * K + d];
        }
      }
      const float rq = rd.q(b, s, h, q), rk = rd.k(b, s, h, k);
      if (in.qk_l2norm) {
        const float dot_q = dot(gq, q, K), dot_k = dot(gk, k, K);
        for (int64_t d = 0; d < K; ++d) {
          gq[d] = (gq[d] - dot_q * q[d]) * rq;
          gk[d] = (gk[d] - dot_k * k[d]) * rk;
        }
      }
    }
    store_row<float>(p.dq, offset4(p.dq, b, s, h), K, p.dq.strides[3], gq);
    store_row<float>(p.dk, offset4(p.dk, b, s, h), K, p.dk.strides[3], gk);
  });
  const SeqRange tail = tail_range(plan);
  for (int64_t hv = 0; hv < HV && tail.len > 0; ++hv) {
    zero_token_rows<float>(p.dv, tail, hv);
    zero_token_rows<float>(p.dg, tail, hv);
    zero_token_rows<float>(p.dbeta, tail, hv);
  }
  if (p.dA_log.present()) {
    for (int64_t hv = 0; hv < HV; ++hv) {
      float acc = 0.f;
      for (int64_t gc = 0; gc < NT; ++gc) acc += ws.dA[ws.tile(gc, hv)];
      store_elem<float>(p.dA_log.data, p.dA_log.dtype, hv, acc);
    }
  }
  if (p.ddt_bias.present()) {
    for (int64_t hv = 0; hv < HV; ++hv) {
      for (int64_t d = 0; d < K; ++d) {
        float acc = 0.f;
        for (int64_t gc = 0; gc < NT; ++gc) acc += ws.ddt[ws.tile(gc, hv) * K + d];
        store_elem<float>(p.ddt_bias.data, p.ddt_bias.dtype, hv * K + d, acc);
      }
    }
  }
}

}  // namespace kdakit::cpu
