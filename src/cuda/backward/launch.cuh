// The launches of the backward's own kernels for one input dtype (instantiated per dtype in backward/instantiations/),
// after the forward's prepare and state pass (backward/run.cu): the reverse state scan, the WY pass, the products with
// the states, the gradient kernel and the reductions. bf16 inputs read the forward's bf16 tiles, float16 and float32
// inputs its float tiles.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "cuda/backward/grad_sm80.cuh"
#include "cuda/backward/merge.cuh"
#include "cuda/backward/plan.h"
#include "cuda/backward/reduce.cuh"
#include "cuda/backward/scan_sm80.cuh"
#include "cuda/backward/scan_sm90.cuh"
#include "cuda/backward/state_products_sm80.cuh"
#include "cuda/backward/wy_sm80.cuh"
#include "cuda/backward/wy_states_sm90.cuh"
#include "cuda/common/static_switch.h"
#include "cuda/device.h"

namespace kdakit::cuda {

// The reverse state scan: on warpgroup MMAs where the plan says (scan_sm90), else at the plan's value tile
// (BwdScanLayout) and stage ring; where the forward cut sequences,
// first the segments' pre-scan and the merge of their end gradients (a context-parallel finish: the merge alone, on
// its summary's pre-scan).
template <typename Elem>
void launch_backward_scan(const BackwardArgs& a, const BackwardLaunch& bl, cudaStream_t stream) {
  with_kp(a.KP, [&](auto kp_tag) {
    constexpr int KP = decltype(kp_tag)::value;
    // kernel(scan_tag): the scan kernel of the plan's tile, its pre-scan form for std::true_type; go(kernel, ctas)
    // launches one.
    auto run = [&](auto kernel, auto go, int BV) {
      const int64_t rows = a.seg_offsets != nullptr ? a.num_segments : a.N;  // CTA rows: segments, or sequences
      if (a.seg_offsets != nullptr) {
        if (a.cp_phase != kCpFinish) go(kernel(std::true_type()), rows * a.HV * (bl.vt + segment_transition_tiles(KP, BV)));
        // A summary without d_initial: the pre-scan alone (its merge and scan serve d_initial only).
        if (a.cp_phase == kCpSummary && !a.d_initial.present()) return;
        auto merge = backward_segment_merge_kernel<KP>;
        set_dynamic_smem(reinterpret_cast<const void*>(merge), bl.smem.merge);
        const int64_t mctas = int64_t(a.N) * a.HV * ((a.V + kMergeCols - 1) / kMergeCols);
        merge<<<static_cast<unsigned>(mctas), kMergeThreads, bl.smem.merge, stream>>>(a);
        check_launch("backward_segment_merge_kernel");
      }
      // A cut summary: d_initial is the merge's fold.
      if (a.cp_phase == kCpSummary && (a.seg_offsets != nullptr || !a.d_initial.present())) return;
      go(kernel(std::false_type()), rows * a.HV * bl.vt);
    };
    if constexpr (std::is_same<Elem, __nv_bfloat16>::value && KP <= 128) {
      if (bl.scan_sm90) {  // the planner sets it for bf16 tiles and K <= 128 only
        run([](auto scan) { return backward_scan_sm90_kernel<KP, decltype(scan)::value>; },
            [&](auto k, int64_t ctas) {
              set_dynamic_smem(reinterpret_cast<const void*>(k), bl.smem.scan);
              k<<<static_cast<unsigned>(ctas), kBwdScanSm90Threads, bl.smem.scan, stream>>>(a);
              check_launch("backward_scan_sm90_kernel");
            },
            64);
        return;
      }
    }
    auto sm80 = [&](auto bv_tag) {
      constexpr int BV = decltype(bv_tag)::value;
      run([](auto scan) { return backward_scan_kernel<Elem, KP, BV, decltype(scan)::value>; },
          [&](auto k, int64_t ctas) {
            set_dynamic_smem(reinterpret_cast<const void*>(k), bl.smem.scan);
            k<<<static_cast<unsigned>(ctas), bwd_scan_threads(BV), bl.smem.scan, stream>>>(a, bl.scan_ring);
            check_launch("backward_scan_kernel");
          },
          BV);
    };
    switch (bl.scan_bv) {
      case 16: sm80(std::integral_constant<int, 16>()); break;
      case 32: sm80(std::integral_constant<int, 32>()); break;
      default:
        if constexpr (bwd_scan_max_bv(KP) >= 64) sm80(std::integral_constant<int, 64>());
        else sm80(std::integral_constant<int, 32>());
    }
  });
}

template <typename InT>
void launch_backward(const BackwardArgs& a, const BackwardLaunch& bl, cudaStream_t stream) {
  using Elem = TileElem<InT>;
  if (a.N > 0) launch_backward_scan<Elem>(a, bl, stream);
  if (bl.d_initial_only || a.cp_phase == kCpSummary) return;  // d_initial_state is the scan's
  constexpr bool kBf16 = std::is_same<InT, __nv_bfloat16>::value;
  if (kBf16 && bl.slots > 0 && bl.ws_sm90) {  // the planner sets ws_sm90 for bf16 inputs only
    auto ws = backward_wy_states_sm90_kernel<__nv_bfloat16>;
    set_dynamic_smem(reinterpret_cast<const void*>(ws), bl.smem.wy);
    ws<<<dim3(static_cast<unsigned>(bl.slots), static_cast<unsigned>(a.HV)), kWsSm90Threads, bl.smem.wy, stream>>>(a);
    check_launch("backward_wy_states_sm90_kernel");
  } else if (bl.slots > 0) {
    auto wy = a.chunk == 32 ? backward_wy_kernel<InT, Elem, 32> : backward_wy_kernel<InT, Elem, 64>;
    set_dynamic_smem(reinterpret_cast<const void*>(wy), bl.smem.wy);
    wy<<<dim3(static_cast<unsigned>(bl.slots), static_cast<unsigned>(a.HV)), kBwdThreads, bl.smem.wy, stream>>>(a);
    check_launch("backward_wy_kernel");
    auto state = backward_state_products_kernel<InT>;
    set_dynamic_smem(reinterpret_cast<const void*>(state), bl.smem.state);
    state<<<dim3(static_cast<unsigned>(bl.slots), static_cast<unsigned>(a.HV),
                 static_cast<unsigned>((a.K + kBwdStateKeys - 1) / kBwdStateKeys)),
            kBwdStateThreads, bl.smem.state, stream>>>(a);
    check_launch("backward_state_products_kernel");
  }
  if (bl.slots > 0) {
    auto grad = a.chunk == 32
                    ? (bl.grad_cache ? backward_grad_kernel<InT, true, 32> : backward_grad_kernel<InT, false, 32>)
                    : (bl.grad_cache ? backward_grad_kernel<InT, true, 64> : backward_grad_kernel<InT, false, 64>);
    set_dynamic_smem(reinterpret_cast<const void*>(grad), bl.smem.grad);
    grad<<<dim3(static_cast<unsigned>(bl.slots), static_cast<unsigned>(a.HV)), kBwdThreads, bl.smem.grad, stream>>>(a);
    check_launch("backward_grad_kernel");
  }
  if (bl.rows > 0) {
    auto tokens = a.K <= 128 ? backward_tokens_kernel<InT, 1> : backward_tokens_kernel<InT, 2>;
    tokens<<<static_cast<unsigned>(bl.rows), kBwdThreads, 0, stream>>>(a);
    check_launch("backward_tokens_kernel");
  }
  if (a.dA_log.present() || a.ddt_bias.present()) {
    backward_params_kernel<InT><<<static_cast<unsigned>(a.HV), kBwdThreads, 0, stream>>>(a);
    check_launch("backward_params_kernel");
  }
}

}  // namespace kdakit::cuda
