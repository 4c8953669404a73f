// The CUDA backward's host side: the forward's prepare (with Tm) and state pass into the workspace, then the
// backward's kernels (backward/launch.cuh) with their arguments from the params and the call's plan. No allocation and
// no host synchronisation: the workspace is sized by the planned call's query.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "cuda/backend.h"
#include "cuda/backward/args.h"
#include "cuda/forward/args.h"
#include "kdakit/error.h"

namespace kdakit::cuda {

template <typename InT>
void launch_backward(const BackwardArgs& a, const BackwardLaunch& bl, cudaStream_t stream);
extern template void launch_backward<__nv_bfloat16>(const BackwardArgs&, const BackwardLaunch&, cudaStream_t);
extern template void launch_backward<__half>(const BackwardArgs&, const BackwardLaunch&, cudaStream_t);
extern template void launch_backward<float>(const BackwardArgs&, const BackwardLaunch&, cudaStream_t);

namespace {

// A dense view of workspace memory on the call's device.
TensorView ws_view(char* p, DType dtype, std::initializer_list<int64_t> shape, int device) {
  TensorView t = make_view(p, dtype, shape, Device::kCUDA, device);
  return t;
}

}  // namespace

BackwardLaunch plan_backward(const BackwardParams& p, const detail::Plan& plan) {
  return plan_backward_launch(p, plan, device_info(plan.pr.device_index), tuning());
}

void backward(const BackwardParams& p, const detail::Plan& plan, const BackwardLaunch& bl, void* workspace,
              std::size_t /*workspace_bytes*/, void* stream) {
  const Problem& pr = plan.pr;
  DeviceGuard guard(pr.device_index);
  char* ws = static_cast<char*>(workspace);
  auto s = static_cast<cudaStream_t>(stream);
  const int dev = pr.device_index;
  const bool vk = p.layout == StateLayout::kVK;
  const int64_t K = pr.K, V = pr.V;

  // 1-2. The forward's chunk offsets and prepare (with Tm), and its recurrence writing the chunk-start states in fp32
  // (its outputs go to a scratch part of the workspace), unless the caller saved the states.
  ForwardParams fwd = backward_forward_params(p);
  fwd.out = ws_view(ws + bl.off_out, p.in.q.dtype, {pr.B, pr.T, pr.HV, pr.V}, dev);
  if (bl.recompute_states && bl.slots > 0) {
    const int64_t rows = pr.varlen ? 1 : pr.B, per = bl.slots / rows;
    fwd.intermediate_states =
        ws_view(ws + bl.off_h, DType::kFloat32, {rows, per, pr.HV, vk ? V : K, vk ? K : V}, dev);
  }
  // A context-parallel finish: its summary call ran them on this workspace.
  if ((pr.N > 0 || bl.slots + bl.fwd.tail_slots > 0) && p.cp_phase != CpPhase::kFinish) {
    ForwardArgs fa = forward_args(fwd, plan, bl.fwd, ws);
    if (!bl.d_initial_only) {  // the WY pass's Tm and u's lo part
      fa.ws_tm = reinterpret_cast<float*>(ws + bl.off_tm);
      if (bl.fwd.esz == 2) fa.ws_ulo = ws + bl.off_ulo;
    }
    if (bl.fwd.esz == 2) {  // the scan's qg and kg lo parts
      fa.ws_qglo = ws + bl.off_qglo;
      fa.ws_kglo = ws + bl.off_kglo;
    }
    fa.states_only = true;  // the outputs are scratch
    launch_forward_for(p.in.q.dtype, fa, bl.fwd.cfg, s);
  }

  // 3-5. The backward's kernels.
  BackwardArgs a;
  fill_kda_args(a, p.in, pr);
  a.q = token_rows(p.in.q);
  a.k = token_rows(p.in.k);
  a.v = token_rows(p.in.v);
  a.g = token_rows(p.in.g);
  a.beta = token_rows(p.in.beta);
  a.d_out = token_rows(p.d_out);
  a.dq = token_rows(p.dq);
  a.dk = token_rows(p.dk);
  a.dv = token_rows(p.dv);
  a.dg = token_rows(p.dg);
  a.dbeta = token_rows(p.dbeta);
  a.dA_log = dyn_ptr(p.dA_log);
  a.ddt_bias = dyn_ptr(p.ddt_bias);
  a.d_final = state_ref(p.d_final_state);
  a.d_initial = state_ref(p.d_initial_state);
  a.vk = vk;
  a.chunk = p.chunk_size;
  a.KP = bl.fwd.cfg.KP;
  a.VP = bl.fwd.VP;
  a.nks = bl.nks;
  a.scan_writes = !bl.d_initial_only && p.cp_phase != CpPhase::kSummary;
  a.cp_phase = static_cast<int>(p.cp_phase);
  a.chunk_offsets = reinterpret_cast<int64_t*>(ws + bl.fwd.off_offsets);
  a.num_slots = bl.slots;
  if (bl.segments > 0) {  // the forward's chunk-offsets kernel wrote its segment table (forward_args)
    a.seg_target = bl.fwd.seg_target;
    a.seg_min_chunks = bl.fwd.seg_min_chunks;
    a.seg_offsets = reinterpret_cast<const int64_t*>(ws + bl.fwd.off_seg_offsets);
    a.num_segments = bl.segments;
    a.ws_seg = reinterpret_cast<float*>(ws + bl.off_seg);
    a.seg_ld = bl.seg_ld;
  }
  a.ws_w = ws + bl.fwd.off_w;
  a.ws_qg = ws + bl.fwd.off_qg;
  a.ws_kg = ws + bl.fwd.off_kg;
  a.ws_u = ws + bl.fwd.off_u;
  a.ws_a = ws + bl.fwd.off_a;
  a.ws_alo = bl.fwd.esz == 2 ? ws + bl.fwd.off_alo : nullptr;
  a.ws_ulo = bl.fwd.esz == 2 ? reinterpret_cast<const __nv_bfloat16*>(ws + bl.off_ulo) : nullptr;
  if (bl.fwd.esz == 2) {
    a.ws_qglo = reinterpret_cast<const __nv_bfloat16*>(ws + bl.off_qglo);
    a.ws_kglo = reinterpret_cast<const __nv_bfloat16*>(ws + bl.off_kglo);
  }
  a.ws_gam = reinterpret_cast<const float*>(ws + bl.fwd.off_gam);
  a.ws_tm = reinterpret_cast<const float*>(ws + bl.off_tm);
  const TensorView& states = bl.recompute_states ? fwd.intermediate_states : p.chunk_states;
  if (states.present()) {
    static_cast<DynPtr&>(a.h) = dyn_ptr(states);
    a.h.sb = states.strides[0];
    a.h.sc = states.strides[1];
    a.h.sh = states.strides[2];
  }
  auto f32 = [&](std::size_t off) { return reinterpret_cast<float*>(ws + off); };
  a.ws_dh = f32(bl.off_dh);
  a.ws_dvnew = f32(bl.off_dvnew);
  a.ws_vnew = f32(bl.off_vnew);
  a.ws_dbv = f32(bl.off_dbv);
  a.ws_dP = f32(bl.off_dP);
  a.ws_dL = f32(bl.off_dL);
  a.ws_dq = f32(bl.off_dq);
  a.ws_dk = f32(bl.off_dk);
  a.ws_dkg = f32(bl.off_dkg);
  a.ws_dgam = f32(bl.off_dgam);
  a.ws_dbeta = f32(bl.off_dbeta);
  a.ws_dA = f32(bl.off_dA);
  a.ws_ddt = f32(bl.off_ddt);
  switch (p.in.q.dtype) {
    case DType::kBFloat16: launch_backward<__nv_bfloat16>(a, bl, s); break;
    case DType::kFloat16: launch_backward<__half>(a, bl, s); break;
    default: launch_backward<float>(a, bl, s); break;
  }
}

}  // namespace kdakit::cuda
