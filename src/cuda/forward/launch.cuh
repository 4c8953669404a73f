// Kernel selection and launch of the chunked forward for one input dtype (instantiated per dtype in
// forward/instantiations/ so the three compile in parallel).
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "cuda/cp/merge.cuh"
#include "cuda/device.h"
#include "cuda/forward/prepare_sm80.cuh"
#include "cuda/forward/recurrence_sm80.cuh"
#include "cuda/forward/recurrence_sm90.cuh"

namespace kdakit::cuda {

// chunk_offsets[n] = number of chunks of the sequences before n, and the longest-first order (forward/chunk_offsets.cu).
// One block of kMaxOrdered threads; sequences split over threads.
__global__ void chunk_offsets_kernel(const ForwardArgs a);

template <typename Kernel>
void set_smem(Kernel kernel, size_t bytes) {
  set_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes);
}

// The backward's prepare with bf16 operands (ForwardArgs::ws_kglo set) writes the lo parts too (prepare_kernel's LO).
template <typename InT, typename Elem, int C, int KP, int GB>
void launch_prepare(const ForwardArgs& a, cudaStream_t stream) {
  using L = PrepareLayout<sizeof(InT), sizeof(Elem), C, KP, GB>;
  auto kernel = prepare_kernel<InT, Elem, C, KP, GB>;
  if constexpr (sizeof(Elem) == 2) {
    if (a.ws_kglo != nullptr) kernel = prepare_kernel<InT, Elem, C, KP, GB, true>;
  }
  set_smem(kernel, L::bytes());
  const dim3 grid(static_cast<unsigned>(a.num_slots + a.tail_slots), static_cast<unsigned>(a.HV));
  kernel<<<grid, kPrepareThreads, L::bytes(), stream>>>(a);
  check_launch("prepare_kernel");
}

template <typename Elem, int KP, int BV, bool SCAN, bool ONE_STAGE, bool WG>
void launch_recurrence_kind(const ForwardArgs& a, cudaStream_t stream) {
  constexpr int EB = sizeof(Elem);
  const int64_t tiles = (a.V + BV - 1) / BV + (SCAN ? segment_transition_tiles(KP, BV) : 0);
  const int64_t ctas = a.num_segments * a.HV * tiles;
  const size_t bytes = recurrence_bytes<EB, KP, BV, ONE_STAGE, WG>();
  if constexpr (kVrows<KP, BV, WG>) {
    auto kernel = recurrence_vrows_kernel<Elem, KP, BV, SCAN, ONE_STAGE, WG>;
    if constexpr (!SCAN) {
      if (a.states_only) kernel = recurrence_vrows_kernel<Elem, KP, BV, false, ONE_STAGE, WG, true>;
    }
    set_smem(kernel, bytes);
    kernel<<<static_cast<unsigned>(ctas), VrowsLayout<EB, KP, BV, ONE_STAGE, WG>::LAUNCH_THREADS, bytes, stream>>>(a);
  } else {
    auto kernel = recurrence_kernel<Elem, KP, BV, SCAN, ONE_STAGE>;
    set_smem(kernel, bytes);
    kernel<<<static_cast<unsigned>(ctas), RecurrenceWarps<BV>::THREADS, bytes, stream>>>(a);
  }
  check_launch(SCAN ? "recurrence kernel (segment scan)" : "recurrence kernel");
}

// The recurrence; with context parallelism first the segment scan and the merge of the segments' start states.
// A split context-parallel call (ForwardArgs::cp_phase): the summary scans and folds, and stops there; the finish
// call skips the scan (the summary call's segments are in the workspace) and seeds the merge with its start state.
template <typename Elem, int KP, int BV, bool ONE_STAGE, bool WG>
void launch_recurrence_staged(const ForwardArgs& a, cudaStream_t stream) {
  if (a.seg_offsets != nullptr) {
    if (a.cp_phase != kCpFinish) launch_recurrence_kind<Elem, KP, BV, true, ONE_STAGE, WG>(a, stream);
    if (a.cp_phase == kCpSummary) {
      auto fold = segment_fold_kernel<KP>;
      set_smem(fold, MergeLayout<KP>::bytes());
      const int64_t ctas = int64_t(a.HV) * ((a.V + a.K + kMergeCols - 1) / kMergeCols);
      fold<<<static_cast<unsigned>(ctas), kMergeThreads, MergeLayout<KP>::bytes(), stream>>>(a);
      check_launch("segment_fold_kernel");
      return;
    }
    auto merge = segment_merge_kernel<KP>;
    set_smem(merge, MergeChainLayout<KP>::bytes());
    const int64_t ctas = int64_t(a.N) * a.HV * ((a.seg_ld - KP + kMergeCols - 1) / kMergeCols);
    merge<<<static_cast<unsigned>(ctas), kMergeThreads, MergeChainLayout<KP>::bytes(), stream>>>(a);
    check_launch("segment_merge_kernel");
  }
  launch_recurrence_kind<Elem, KP, BV, false, ONE_STAGE, WG>(a, stream);
}

// ONE_STAGE variants exist only where the default layout has two stages.
template <typename Elem, int KP, int BV, bool WG>
void launch_recurrence_wg(const ForwardArgs& a, bool one_stage, cudaStream_t stream) {
  if constexpr (kHasOneStage<sizeof(Elem), KP, BV, WG>) {
    if (one_stage) {
      launch_recurrence_staged<Elem, KP, BV, true, WG>(a, stream);
      return;
    }
  }
  launch_recurrence_staged<Elem, KP, BV, false, WG>(a, stream);
}

template <typename Elem, int KP, int BV>
void launch_recurrence(const ForwardArgs& a, const ForwardConfig& cfg, cudaStream_t stream) {
  if constexpr (kHasWgmma<sizeof(Elem), KP, BV>) {
    if (cfg.wgmma) {
      launch_recurrence_wg<Elem, KP, BV, true>(a, cfg.one_stage, stream);
      return;
    }
  }
  launch_recurrence_wg<Elem, KP, BV, false>(a, cfg.one_stage, stream);
}

// The three launches (five with context-parallel cuts) for input dtype InT: bf16 inputs take bf16 operands, float16
// and float32 inputs float operands (split into hi + lo bf16 in the products). The prepare kernel reads g by its
// width, GB = 4 (float32) or 2 (bfloat16 or float16, told apart at run time), so every dtype of g is read as it is
// and the serving form, float32 g beside 16-bit q, k, v, as fast as g of q's dtype.
template <typename InT>
void launch_forward(const ForwardArgs& a, const ForwardConfig& cfg, cudaStream_t stream) {
  using Elem = TileElem<InT>;  // float32 inputs: three-part operands, as the backward's recompute needs
  chunk_offsets_kernel<<<1, kMaxOrdered, 0, stream>>>(a);
  check_launch("chunk_offsets_kernel");
  if (a.num_slots + a.tail_slots > 0 && a.cp_phase != kCpFinish) {  // kCpFinish: the summary call's prepare
    with_kp(cfg.KP, [&](auto kp_tag) {
      constexpr int KP = decltype(kp_tag)::value;
      with_bool(a.g.dtype == DType::kFloat32, [&](auto g32) {
        constexpr int GB = decltype(g32)::value ? 4 : 2;
        if (cfg.chunk == 32) launch_prepare<InT, Elem, 32, KP, GB>(a, stream);
        else launch_prepare<InT, Elem, 64, KP, GB>(a, stream);
      });
    });
  }
  if (a.N == 0 || cfg.prepare_only) return;
  with_kp(cfg.KP, [&](auto kp_tag) {
    constexpr int KP = decltype(kp_tag)::value;
    with_bv<sizeof(Elem), KP>(cfg.BV, [&](auto bv_tag) {
      launch_recurrence<Elem, KP, decltype(bv_tag)::value>(a, cfg, stream);
    });
  });
}

}  // namespace kdakit::cuda
