// The token recurrence of spec §1.4, one (sequence, v-head) per task. In float64 it is the specification
// (reference_forward); in float32 it is the CPU decode/verify path.
#include <vector>

#include "cpu/backend.h"
#include "cpu/inputs.h"
#include "cpu/parallel.h"
#include "cpu/state.h"

namespace kdakit::cpu {
namespace {

struct RecurrenceOutputs {
  const TensorView* out = nullptr;
  const TensorView* token_states = nullptr;         // [B*T,HV,*,*]: state after every token
  const TensorView* chunk_states = nullptr;         // [B|1,NT,HV,*,*]: state before every chunk
  int chunk_size = 64;
  const TensorView* num_accepted = nullptr;
};

// The outputs of padding: zero output rows and zero per-token states over `rows`, and zero chunk states for the
// chunks of a padded sequence n (n < 0: the token tail, which has no chunks).
template <class Acc>
void write_padding(const Problem& pr, const detail::Plan& plan, const RecurrenceOutputs& io, const SeqRange& rows,
                   int64_t n, int64_t hv) {
  zero_token_rows<Acc>(*io.out, rows, hv);
  if (io.token_states) {
    const TensorView& ts = *io.token_states;
    for (int64_t s = rows.t0; s < rows.t0 + rows.len; ++s) {
      store_zero_block<Acc>(ts, state_offset(ts, rows.b * pr.T + s, hv), pr.K, pr.V);
    }
  }
  if (io.chunk_states && n >= 0) {
    const TensorView& hs = *io.chunk_states;
    for (int64_t i = 0; i < rows.len; i += io.chunk_size) {
      const int64_t c = pr.varlen ? plan.chunk_offsets[n] + i / io.chunk_size : i / io.chunk_size;
      store_zero_block<Acc>(hs, rows.b * hs.strides[0] + c * hs.strides[1] + hv * hs.strides[2], pr.K, pr.V);
    }
  }
}

template <class Acc>
void run_recurrence(const KdaInputs& in, const StateIO& st, const detail::Plan& plan, const RecurrenceOutputs& io) {
  const Problem& pr = plan.pr;
  const int64_t K = pr.K, V = pr.V;
  InputReader<Acc> rd(in, pr);
  parallel_for(pr.N * pr.HV, [&](int64_t task, int) {
    const int64_t n = task / pr.HV, hv = task % pr.HV, h = hv / pr.group;
    const SeqRange seq = seq_range(plan, n);
    const SlotPlan slots = plan_slots(st, io.num_accepted, n);
    if (slots.padding) {
      write_padding<Acc>(pr, plan, io, seq, n, hv);
      return;
    }
    std::vector<Acc> S(K * V, Acc(0)), q(K), k(K), g(K), v(V), e(V), betas(V), o(V);
    if (slots.read >= 0) {
      load_state_block<Acc>(st.initial_state, state_offset(st.initial_state, slots.read, hv), st.layout, K, V, S.data());
    }
    for (int64_t i = 0; i < seq.len; ++i) {
      const int64_t s = seq.t0 + i;
      if (io.chunk_states && i % io.chunk_size == 0) {
        const TensorView& hs = *io.chunk_states;
        const int64_t c = pr.varlen ? plan.chunk_offsets[n] + i / io.chunk_size : i / io.chunk_size;
        store_state_block<Acc>(hs, seq.b * hs.strides[0] + c * hs.strides[1] + hv * hs.strides[2], st.layout, K, V,
                               S.data());
      }
      rd.q(seq.b, s, h, q.data());
      rd.k(seq.b, s, h, k.data());
      rd.gate(seq.b, s, hv, g.data());
      rd.v(seq.b, s, hv, v.data());
      if (rd.headwise_beta()) {
        rd.beta_columns(seq.b, s, hv, betas.data());
      } else {
        const Acc bt = rd.beta(seq.b, s, hv);
        for (int64_t j = 0; j < V; ++j) betas[j] = bt;
      }
      // 1. decay; 2. delta residual against the decayed state; 3. write; 4. read with the updated state.
      for (int64_t d = 0; d < K; ++d) {
        const Acc a = std::exp(g[d]);
        for (int64_t j = 0; j < V; ++j) S[d * V + j] *= a;
      }
      for (int64_t j = 0; j < V; ++j) e[j] = v[j];
      for (int64_t d = 0; d < K; ++d) {
        for (int64_t j = 0; j < V; ++j) e[j] -= k[d] * S[d * V + j];
      }
      for (int64_t j = 0; j < V; ++j) e[j] *= betas[j];
      for (int64_t d = 0; d < K; ++d) {
        for (int64_t j = 0; j < V; ++j) S[d * V + j] += k[d] * e[j];
      }
      for (int64_t j = 0; j < V; ++j) o[j] = 0;
      for (int64_t d = 0; d < K; ++d) {
        for (int64_t j = 0; j < V; ++j) o[j] += q[d] * S[d * V + j];
      }
      for (int64_t j = 0; j < V; ++j) o[j] *= static_cast<Acc>(in.scale);
      store_row<Acc>(*io.out, offset4(*io.out, seq.b, s, hv), V, io.out->strides[3], o.data());
      if (io.token_states) {
        const TensorView& ts = *io.token_states;
        store_state_block<Acc>(ts, state_offset(ts, seq.b * pr.T + s, hv), st.layout, K, V, S.data());
      }
      if (slots.per_token) {
        const int64_t w = detail::read_int(st.state_indices, n, i);
        if (!is_padding_slot(w, st.pad_slot_id)) {
          store_state_block<Acc>(st.final_state, state_offset(st.final_state, w, hv), st.layout, K, V, S.data());
        }
      }
    }
    if (slots.write >= 0) {
      store_state_block<Acc>(st.final_state, state_offset(st.final_state, slots.write, hv), st.layout, K, V, S.data());
    }
  });
  const SeqRange tail = tail_range(plan);
  for (int64_t hv = 0; hv < pr.HV && tail.len > 0; ++hv) write_padding<Acc>(pr, plan, io, tail, -1, hv);
}

}  // namespace

void reference_forward(const ForwardParams& p, const detail::Plan& plan) {
  RecurrenceOutputs io;
  io.out = &p.out;
  io.chunk_states = p.intermediate_states.present() ? &p.intermediate_states : nullptr;
  io.chunk_size = p.chunk_size;
  run_recurrence<double>(p.in, p.state, plan, io);
}

void decode(const DecodeParams& p, const detail::Plan& plan) {
  RecurrenceOutputs io;
  io.out = &p.out;
  io.token_states = p.token_states.present() ? &p.token_states : nullptr;
  io.num_accepted = &p.num_accepted_tokens;
  run_recurrence<float>(p.in, p.state, plan, io);
}

}  // namespace kdakit::cpu
