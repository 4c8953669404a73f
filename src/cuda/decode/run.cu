// The decode's host side: kernel arguments from the params and the call's plan, then the launch.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/backend.h"
#include "cuda/decode/args.h"

namespace kdakit::cuda {

template <typename PoolT>
void launch_decode(const DecodeArgs& a, const DecodeConfig& cfg, cudaStream_t stream);
extern template void launch_decode<float>(const DecodeArgs&, const DecodeConfig&, cudaStream_t);
extern template void launch_decode<__nv_bfloat16>(const DecodeArgs&, const DecodeConfig&, cudaStream_t);

namespace {

TokenRows rows(const TensorView& t, bool vec) {
  TokenRows r = token_rows(t);
  r.vec = vec;
  return r;
}

StateRef state(const TensorView& t, bool vec) {
  StateRef s = state_ref(t);
  s.vec = vec;
  return s;
}

// 32-bit strides (the plan checked that every element's offset fits); a size-1 dimension never moves the pointer.
// A row is a token with cu_seqlens (one batch row) and a batch row otherwise (at most one token).
OneRows one_rows(const TensorView& t, bool varlen) {
  auto stride = [&](int i) { return t.shape[i] > 1 ? static_cast<int>(t.strides[i]) : 0; };
  return OneRows{t.data, stride(varlen ? 1 : 0), stride(2)};
}

// The one-token form's packed arguments (the plan checked that the call fits their packing).
DecodeOneArgs one_args(const DecodeParams& p, const Problem& pr, const DecodeLaunch& d) {
  DecodeOneArgs o;
  const StateIO& st = p.state;
  const bool varlen = p.in.cu_seqlens.present();
  o.q = one_rows(p.in.q, varlen);
  o.k = one_rows(p.in.k, varlen);
  o.g = one_rows(p.in.g, varlen);
  o.v = one_rows(p.in.v, varlen);
  o.beta = one_rows(p.in.beta, varlen);
  o.out = one_rows(p.out, varlen);
  o.A_log = static_cast<const float*>(p.in.gate.A_log.data);
  o.dt_bias = static_cast<const float*>(p.in.gate.dt_bias.data);
  if (st.state_indices.present()) {
    o.state_indices = st.state_indices.data;
    o.idx_stride = static_cast<uint16_t>(st.state_indices.strides[0]);
  }
  if (varlen) {
    o.cu_seqlens = static_cast<const int*>(p.in.cu_seqlens.data);
    o.cu_stride = static_cast<uint16_t>(p.in.cu_seqlens.strides[0]);
  } else {
    o.cu_stride = 1;
  }
  // The plan checked that both states, where both are given, have one slot stride and count.
  for (const TensorView* t : {&st.final_state, &st.initial_state}) {
    if (t->present()) {
      o.slot_stride = static_cast<int>(t->strides[0]);
      o.slots = static_cast<int>(t->shape[0]);
    }
  }
  if (st.initial_state.present()) o.initial = st.initial_state.data;
  if (st.final_state.present()) o.final_state = st.final_state.data;
  o.pad_slot = static_cast<int>(st.pad_slot_id);
  if (d.tail_cta) o.tokens = static_cast<int>(pr.T);
  int has_dtype = 0;
  if (st.has_initial_state.present()) {
    o.has_initial_state = st.has_initial_state.data;
    o.has_stride = static_cast<uint16_t>(st.has_initial_state.strides[0]);
    has_dtype = static_cast<int>(st.has_initial_state.dtype);
  }
  o.V = static_cast<uint16_t>(pr.V);
  o.group = static_cast<uint16_t>(pr.group);
  for (int sh = 0; sh < 16; ++sh) {
    if ((int64_t(1) << sh) == pr.group) o.group_shift = static_cast<int8_t>(sh);
  }
  o.dtypes = static_cast<uint8_t>(static_cast<int>(p.in.q.dtype) |
                                  (p.in.g.dtype == DType::kFloat32 ? DecodeOneArgs::kSide32 : 0) |
                                  (st.state_indices.present() && st.state_indices.dtype == DType::kInt64
                                       ? DecodeOneArgs::kIdx64
                                       : 0) |
                                  has_dtype << 4);
  o.scale = p.in.scale;
  o.lower_bound = p.in.gate.lower_bound;
  o.flags = static_cast<uint8_t>(static_cast<int>(p.in.gate.mode) | (p.in.qk_l2norm ? DecodeOneArgs::kL2Norm : 0) |
                                 (p.in.beta_sigmoid ? DecodeOneArgs::kBetaSigmoid : 0) |
                                 (p.in.allow_neg_eigval ? DecodeOneArgs::kNegEigval : 0) |
                                 (p.in.beta.ndim == 4 ? DecodeOneArgs::kBetaCols : 0) |
                                 (!varlen && pr.T == 1 ? DecodeOneArgs::kOneToken : 0) |
                                 (d.cfg.one_staged ? DecodeOneArgs::kStaged : 0));
  return o;
}

}  // namespace

void decode(const DecodeParams& p, const detail::Plan& plan, void* stream) {
  const Problem& pr = plan.pr;
  const DecodeLaunch d = plan_decode_launch(p, plan, device_info(pr.device_index), tuning());
  if (pr.N == 0) return;
  const StateIO& st = p.state;
  DecodeArgs a;
  fill_kda_args(a, p.in, pr);
  a.q = rows(p.in.q, d.q_vec);
  a.k = rows(p.in.k, d.k_vec);
  a.v = rows(p.in.v, d.v_vec);
  a.g = rows(p.in.g, d.g_vec);
  a.beta = rows(p.in.beta, d.beta_vec);
  a.beta_cols = p.in.beta.ndim == 4;
  a.initial = state(st.initial_state, d.initial_vec);
  a.final_state = state(st.final_state, d.final_vec);
  a.token_states = state(p.token_states, d.token_states_vec);
  const TensorView& idx = st.state_indices;
  if (idx.present()) {
    a.state_indices = dyn_ptr(idx);
    a.idx_s0 = idx.strides[0];
    if (idx.ndim == 2) {
      a.idx_2d = true;
      a.idx_s1 = idx.strides[1];
      a.idx_cols = idx.shape[1];
    }
  }
  if (p.num_accepted_tokens.present()) {
    a.num_accepted = dyn_ptr(p.num_accepted_tokens);
    a.acc_stride = p.num_accepted_tokens.strides[0];
  }
  if (st.has_initial_state.present()) {
    a.has_initial_state = dyn_ptr(st.has_initial_state);
    a.has_stride = st.has_initial_state.strides[0];
  }
  a.out = token_rows(p.out);
  a.pad_slot = st.pad_slot_id;
  a.tail_cta = d.tail_cta;
  a.tb = d.tb;
  a.stage_state = d.stage_state;
  a.kv_regs = d.kv_regs;
  a.passes = d.cfg.passes;
  a.vtiles = d.vtiles;
  if (d.cfg.one) a.one = one_args(p, pr, d);
  a.one.set_tiling(d.cfg.passes, d.vt_shift);
  a.one.prefetch_ahead = static_cast<uint16_t>(d.prefetch_ahead);  // <= 0xffff (plan)

  DeviceGuard guard(pr.device_index);
  auto s = static_cast<cudaStream_t>(stream);
  if (d.bf16_pool) launch_decode<__nv_bfloat16>(a, d.cfg, s);
  else launch_decode<float>(a, d.cfg, s);
}

}  // namespace kdakit::cuda
