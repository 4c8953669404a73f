// The chunked forward's host side: kernel arguments from the params and the call's plan, then the launches.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "cuda/backend.h"
#include "cuda/forward/args.h"
#include "kdakit/error.h"

namespace kdakit::cuda {

template <typename InT>
void launch_forward(const ForwardArgs& a, const ForwardConfig& cfg, cudaStream_t stream);
extern template void launch_forward<__nv_bfloat16>(const ForwardArgs&, const ForwardConfig&, cudaStream_t);
extern template void launch_forward<__half>(const ForwardArgs&, const ForwardConfig&, cudaStream_t);
extern template void launch_forward<float>(const ForwardArgs&, const ForwardConfig&, cudaStream_t);

ForwardArgs forward_args(const ForwardParams& p, const detail::Plan& plan, const ForwardLaunch& fp, char* ws) {
  const Problem& pr = plan.pr;
  ForwardArgs a;
  fill_kda_args(a, p.in, pr);
  a.q = token_rows(p.in.q);
  a.k = token_rows(p.in.k);
  a.v = token_rows(p.in.v);
  a.g = token_rows(p.in.g);
  a.beta = token_rows(p.in.beta);
  {
    // 16-byte pieces and aligned pairs in each tensor's own elements (g may be wider or narrower than q, k, v).
    auto aligned = [](const TensorView& t) {
      const int64_t epc = 16 / static_cast<int64_t>(dtype_size(t.dtype));
      return reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && t.strides[0] % epc == 0 && t.strides[1] % epc == 0 &&
             t.strides[2] % epc == 0;
    };
    auto whole_pieces = [](const TensorView& t, int64_t n) {
      return n % (16 / static_cast<int64_t>(dtype_size(t.dtype))) == 0;
    };
    a.vec_qk = whole_pieces(p.in.q, pr.K) && aligned(p.in.q) && aligned(p.in.k);
    a.vec_v = whole_pieces(p.in.v, pr.V) && aligned(p.in.v);
    a.vec_g = whole_pieces(p.in.g, pr.K) && aligned(p.in.g);
    auto paired = [](const TensorView& t) {
      return reinterpret_cast<uintptr_t>(t.data) % (2 * dtype_size(t.dtype)) == 0 && t.strides[0] % 2 == 0 &&
             t.strides[1] % 2 == 0 && t.strides[2] % 2 == 0;
    };
    a.pair_qk = paired(p.in.q) && paired(p.in.k);
    a.pair_g = paired(p.in.g);
    a.vec_out = p.out.dtype == DType::kBFloat16 && pr.V % 8 == 0 &&
                reinterpret_cast<uintptr_t>(p.out.data) % 16 == 0 && p.out.strides[0] % 8 == 0 &&
                p.out.strides[1] % 8 == 0 && p.out.strides[2] % 8 == 0;
  }
  a.chunk = p.chunk_size;
  a.chunk_offsets = reinterpret_cast<int64_t*>(ws + fp.off_offsets);
  a.num_slots = fp.slots;
  a.tail_slots = fp.tail_slots;
  a.ws_w = ws + fp.off_w;
  a.ws_qg = ws + fp.off_qg;
  a.ws_kg = ws + fp.off_kg;
  a.ws_u = ws + fp.off_u;
  a.ws_a = ws + fp.off_a;
  a.ws_alo = fp.esz == 2 ? ws + fp.off_alo : nullptr;
  a.ws_gam = reinterpret_cast<float*>(ws + fp.off_gam);
  a.KP = fp.cfg.KP;
  a.VP = fp.VP;
  a.num_segments = fp.segments;
  if (fp.seg_ld > 0) {  // cut sequences, or a split context-parallel call (one segment per sequence at least)
    a.seg_target = fp.seg_target;
    a.seg_min_chunks = fp.seg_min_chunks;
    a.seg_offsets = reinterpret_cast<int64_t*>(ws + fp.off_seg_offsets);
    a.ws_seg = reinterpret_cast<float*>(ws + fp.off_seg);
    a.seg_ld = fp.seg_ld;
  }
  if (fp.ordered) a.seq_order = reinterpret_cast<int32_t*>(ws + fp.off_order);
  a.cp_phase = fp.cp_phase;
  if (p.cp_summary.present()) a.cp_summary = static_cast<float*>(p.cp_summary.data);
  a.vk = p.state.layout == StateLayout::kVK;
  a.initial = state_ref(p.state.initial_state);
  a.final_state = state_ref(p.state.final_state);
  a.state_indices = dyn_ptr(p.state.state_indices);
  a.has_initial_state = dyn_ptr(p.state.has_initial_state);
  a.pad_slot_id = p.state.pad_slot_id;
  if (p.intermediate_states.present()) {
    a.inter = dyn_ptr(p.intermediate_states);
    a.inter_sb = p.intermediate_states.strides[0];
    a.inter_sc = p.intermediate_states.strides[1];
    a.inter_sh = p.intermediate_states.strides[2];
  }
  a.out = token_rows(p.out);
  return a;
}

void launch_forward_for(DType in, const ForwardArgs& a, const ForwardConfig& cfg, cudaStream_t stream) {
  switch (in) {
    case DType::kBFloat16: launch_forward<__nv_bfloat16>(a, cfg, stream); break;
    case DType::kFloat16: launch_forward<__half>(a, cfg, stream); break;
    default: launch_forward<float>(a, cfg, stream); break;
  }
}

ForwardLaunch plan_forward(const ForwardParams& p, const detail::Plan& plan) {
  return plan_forward_launch(p, plan, device_info(plan.pr.device_index), tuning());
}

void forward(const ForwardParams& p, const detail::Plan& plan, const ForwardLaunch& fp, void* workspace,
             std::size_t /*workspace_bytes*/, void* stream) {
  const Problem& pr = plan.pr;
  // No sequences: still the padded token tail's zero rows (varlen; tail_slots, or the slots' bound).
  if (pr.N == 0 && fp.slots + fp.tail_slots == 0) return;
  DeviceGuard guard(pr.device_index);
  const ForwardArgs a = forward_args(p, plan, fp, static_cast<char*>(workspace));
  launch_forward_for(p.in.q.dtype, a, fp.cfg, static_cast<cudaStream_t>(stream));
}

}  // namespace kdakit::cuda
