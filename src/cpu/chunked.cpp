// The chunked forward of spec §3.1 in float32: the algorithm kdakit's GPU kernels run, one
// (sequence, v-head) per task.
//
// The state-independent part of a chunk (sums, decay factors, P, L, the inverse, w, u) is src/cpu/chunk_prepare.cpp,
// shared with the chunked backward; this file runs the recurrence over it.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/backend.h"
#include "cpu/chunk_prepare.h"
#include "cpu/inputs.h"
#include "cpu/parallel.h"
#include "cpu/state.h"

namespace kdakit::cpu {
namespace {

struct Scratch {
  float *S, *vnew, *o;
  ChunkTiles t;

  static std::size_t floats(int64_t C, int64_t K, int64_t V) {
    return K * V + C * V * 2 + ChunkTiles::floats(C, K, V);
  }
  Scratch(float* p, int64_t C, int64_t K, int64_t V)
      : S(p), vnew(p + K * V), o(p + K * V + C * V), t(p + K * V + 2 * C * V, C, K, V) {}
};

// One chunk of `rows` (<= C) tokens whose inputs are loaded in sc.t; updates sc.S and writes sc.o.
void chunk_step(Scratch& sc, int64_t rows, int64_t K, int64_t V, float scale, DiagonalBlocks diag_mode) {
  ChunkTiles& t = sc.t;
  prepare_chunk(t, rows, K, V, diag_mode);
  // v_new = u - w S;  o = scale (qg S + tril(P) v_new).
  for (int64_t i = 0; i < rows; ++i) {
    float* vn = sc.vnew + i * V;
    float* oi = sc.o + i * V;
    for (int64_t c = 0; c < V; ++c) { vn[c] = t.u[i * V + c]; oi[c] = 0.f; }
    for (int64_t d = 0; d < K; ++d) {
      const float wd = t.w[i * K + d], qd = t.qg[i * K + d];
      const float* Sd = sc.S + d * V;
      for (int64_t c = 0; c < V; ++c) { vn[c] -= wd * Sd[c]; oi[c] += qd * Sd[c]; }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    float* oi = sc.o + i * V;
    for (int64_t j = 0; j <= i; ++j) {
      const float pij = t.P[i * rows + j];
      const float* vn = sc.vnew + j * V;
      for (int64_t c = 0; c < V; ++c) oi[c] += pij * vn[c];
    }
    for (int64_t c = 0; c < V; ++c) oi[c] *= scale;
  }
  // S <- diag(gamma) S + kg^T v_new.
  for (int64_t d = 0; d < K; ++d) {
    float* Sd = sc.S + d * V;
    for (int64_t c = 0; c < V; ++c) Sd[c] *= t.gamma[d];
    for (int64_t i = 0; i < rows; ++i) {
      const float kd = t.kg[i * K + d];
      const float* vn = sc.vnew + i * V;
      for (int64_t c = 0; c < V; ++c) Sd[c] += kd * vn[c];
    }
  }
}

}  // namespace

std::size_t forward_workspace_size(const ForwardParams& p, const detail::Plan& plan) {
  const Problem& pr = plan.pr;
  return static_cast<std::size_t>(workers_for(pr.N * pr.HV)) * Scratch::floats(p.chunk_size, pr.K, pr.V) *
         sizeof(float);
}

void forward_chunked(const ForwardParams& p, const detail::Plan& plan) {
  const Problem& pr = plan.pr;
  const int64_t K = pr.K, V = pr.V, C = p.chunk_size;
  const std::size_t per_worker = Scratch::floats(C, K, V);
  const DiagonalBlocks diag_mode = diagonal_blocks();
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
        rd.q(seq.b, s, h, sc.t.q + r * K);
        rd.k(seq.b, s, h, sc.t.k + r * K);
        rd.v(seq.b, s, hv, sc.t.v + r * V);
        rd.gate(seq.b, s, hv, sc.t.g + r * K);
        sc.t.beta[r] = rd.beta(seq.b, s, hv);
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
