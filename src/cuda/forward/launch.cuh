// Kernel selection and launch of the chunked forward for one input dtype (instantiated per dtype in
// forward_<dtype>.cu so the three compile in parallel).
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "cuda/forward/kernels.cuh"
#include "kdakit/error.h"

namespace kdakit::cuda {

inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw CudaError(std::string("kdakit: ") + what + " launch failed: " + cudaGetErrorString(err));
}

template <typename Kernel>
inline void set_smem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (err != cudaSuccess) {
      cudaGetLastError();  // do not leave the error for the next launch check
      throw CudaError(std::string("kdakit: shared memory request of ") + std::to_string(bytes) +
                      " bytes failed: " + cudaGetErrorString(err));
    }
  }
}

// The compile-time shapes a configuration runs as, for launch_forward and forward_smem alike: f(KP) for cfg.KP
// (64, 128, else 256), and f(BV) for the recurrence tile cfg.BV (128 only for bf16 operands with KP <= 128; 64 where
// KP <= 128 and 32 at KP = 256 otherwise).
template <typename F>
void with_kp(int KP, F&& f) {
  switch (KP) {
    case 64: f(std::integral_constant<int, 64>()); break;
    case 128: f(std::integral_constant<int, 128>()); break;
    default: f(std::integral_constant<int, 256>()); break;
  }
}

template <typename Elem, int KP, typename F>
void with_bv(int BV, F&& f) {
  switch (BV) {
    case 16: f(std::integral_constant<int, 16>()); break;
    case 32: f(std::integral_constant<int, 32>()); break;
    case 128:
      if constexpr (KP <= 128 && sizeof(Elem) == 2) {
        f(std::integral_constant<int, 128>());
        break;
      }
      [[fallthrough]];
    default:
      if constexpr (KP <= 128) f(std::integral_constant<int, 64>());
      else f(std::integral_constant<int, 32>());
  }
}

template <typename InT, typename Elem, int C, int KP>
void launch_prepare(const ForwardArgs& a, cudaStream_t stream) {
  using L = PrepareLayout<InT, Elem, C, KP>;
  auto kernel = prepare_kernel<InT, Elem, C, KP>;
  set_smem(kernel, L::bytes());
  const dim3 grid(static_cast<unsigned>(a.num_slots), static_cast<unsigned>(a.HV));
  kernel<<<grid, kPrepareThreads, L::bytes(), stream>>>(a);
  check_launch("prepare_kernel");
}

// 128-column tiles (bf16 operands, K <= 128): recurrence_vrows_kernel, eight warps of independent value rows per
// CTA; narrower tiles: recurrence_kernel, whose warps split the keys as well (16 warps per 64 columns; the value-row
// kernel's four warps at 64 columns wait on their own instruction chains: docs/perf-notes.md). With warpgroup MMAs
// (WG: Hopper, ForwardConfig::wgmma) the value-row kernel takes 64-column tiles as well (one warpgroup).
template <int KP, int BV, bool WG = false>
constexpr bool kVrows = KP <= 128 && (BV == 128 || (WG && BV == 64));

// Where the warpgroup-MMA variant exists: bf16 operands, K <= 128, whole warpgroups of value rows.
template <typename Elem, int KP, int BV>
constexpr bool kHasWgmma = sizeof(Elem) == 2 && KP <= 128 && (BV == 64 || BV == 128);

template <typename Elem, int KP, int BV, bool ONE_STAGE = false, bool WG = false>
constexpr size_t recurrence_bytes() {
  if constexpr (kVrows<KP, BV, WG>) return VrowsLayout<Elem, KP, BV, ONE_STAGE, WG>::bytes();
  else return RecurrenceLayout<Elem, KP, BV, ONE_STAGE>::bytes();
}

template <typename Elem, int KP, int BV, bool SCAN, bool ONE_STAGE, bool WG>
void launch_recurrence_kind(const ForwardArgs& a, cudaStream_t stream) {
  const int64_t tiles = (a.V + BV - 1) / BV + (SCAN ? KP / BV : 0);
  const int64_t ctas = a.num_segments * a.HV * tiles;
  const size_t bytes = recurrence_bytes<Elem, KP, BV, ONE_STAGE, WG>();
  if constexpr (kVrows<KP, BV, WG>) {
    auto kernel = recurrence_vrows_kernel<Elem, KP, BV, SCAN, ONE_STAGE, WG>;
    set_smem(kernel, bytes);
    kernel<<<static_cast<unsigned>(ctas), VrowsLayout<Elem, KP, BV>::THREADS, bytes, stream>>>(a);
  } else {
    auto kernel = recurrence_kernel<Elem, KP, BV, SCAN, ONE_STAGE>;
    set_smem(kernel, bytes);
    kernel<<<static_cast<unsigned>(ctas), RecurrenceWarps<BV>::THREADS, bytes, stream>>>(a);
  }
  check_launch(SCAN ? "recurrence kernel (segment scan)" : "recurrence kernel");
}

// The recurrence; with context parallelism first the segment scan and the merge of the segments' start states.
// ONE_STAGE variants exist only where the default layout has two stages.
template <typename Elem, int KP, int BV, bool WG = false>
constexpr bool kHasOneStage =
    kVrows<KP, BV, WG> ? VrowsLayout<Elem, KP, BV>::STAGES == 2 : RecurrenceLayout<Elem, KP, BV>::STAGES == 2;

template <typename Elem, int KP, int BV, bool ONE_STAGE, bool WG>
void launch_recurrence_staged(const ForwardArgs& a, cudaStream_t stream) {
  if (a.seg_offsets != nullptr) {
    launch_recurrence_kind<Elem, KP, BV, true, ONE_STAGE, WG>(a, stream);
    auto merge = segment_merge_kernel<KP>;
    set_smem(merge, MergeLayout<KP>::bytes());
    const int64_t ctas = int64_t(a.N) * a.HV * ((a.seg_ld - KP + kMergeCols - 1) / kMergeCols);
    merge<<<static_cast<unsigned>(ctas), kMergeThreads, MergeLayout<KP>::bytes(), stream>>>(a);
    check_launch("segment_merge_kernel");
  }
  launch_recurrence_kind<Elem, KP, BV, false, ONE_STAGE, WG>(a, stream);
}

template <typename Elem, int KP, int BV, bool WG>
void launch_recurrence_wg(const ForwardArgs& a, bool one_stage, cudaStream_t stream) {
  if constexpr (kHasOneStage<Elem, KP, BV, WG>) {
    if (one_stage) {
      launch_recurrence_staged<Elem, KP, BV, true, WG>(a, stream);
      return;
    }
  }
  launch_recurrence_staged<Elem, KP, BV, false, WG>(a, stream);
}

template <typename Elem, int KP, int BV>
void launch_recurrence(const ForwardArgs& a, const ForwardConfig& cfg, cudaStream_t stream) {
  if constexpr (kHasWgmma<Elem, KP, BV>) {
    if (cfg.wgmma) {
      launch_recurrence_wg<Elem, KP, BV, true>(a, cfg.one_stage, stream);
      return;
    }
  }
  launch_recurrence_wg<Elem, KP, BV, false>(a, cfg.one_stage, stream);
}

// Shared memory per block of prepare_kernel<InT, Elem, C, KP> and of the recurrence for a configuration, as launched
// (the same dispatch as launch_forward): lets the host pick tiles that fit the device.
template <typename InT>
ForwardSmem forward_smem(const ForwardConfig& cfg) {
  using Elem = typename std::conditional<std::is_same<InT, __nv_bfloat16>::value, __nv_bfloat16, float>::type;
  ForwardSmem r;
  with_kp(cfg.KP, [&](auto kp_tag) {
    constexpr int KP = decltype(kp_tag)::value;
    r.prepare = cfg.chunk == 32 ? PrepareLayout<InT, Elem, 32, KP>::bytes() : PrepareLayout<InT, Elem, 64, KP>::bytes();
    with_bv<Elem, KP>(cfg.BV, [&](auto bv_tag) {
      constexpr int BV = decltype(bv_tag)::value;
      r.recurrence = recurrence_bytes<Elem, KP, BV>();
      if constexpr (kHasOneStage<Elem, KP, BV>) {
        if (cfg.one_stage) r.recurrence = recurrence_bytes<Elem, KP, BV, true>();
      }
      if constexpr (kHasWgmma<Elem, KP, BV>) {
        if (cfg.wgmma) {
          r.recurrence = cfg.one_stage ? recurrence_bytes<Elem, KP, BV, true, true>()
                                       : recurrence_bytes<Elem, KP, BV, false, true>();
        }
      }
    });
  });
  return r;
}

template <typename InT>
void launch_forward(const ForwardArgs& a, const ForwardConfig& cfg, cudaStream_t stream) {
  using Elem = typename std::conditional<std::is_same<InT, __nv_bfloat16>::value, __nv_bfloat16, float>::type;
  chunk_offsets_kernel<<<1, kMaxOrdered, 0, stream>>>(a);
  check_launch("chunk_offsets_kernel");
  if (a.num_slots > 0) {
    with_kp(cfg.KP, [&](auto kp_tag) {
      constexpr int KP = decltype(kp_tag)::value;
      if (cfg.chunk == 32) launch_prepare<InT, Elem, 32, KP>(a, stream);
      else launch_prepare<InT, Elem, 64, KP>(a, stream);
    });
  }
  if (a.N == 0) return;
  with_kp(cfg.KP, [&](auto kp_tag) {
    constexpr int KP = decltype(kp_tag)::value;
    with_bv<Elem, KP>(cfg.BV, [&](auto bv_tag) {
      launch_recurrence<Elem, KP, decltype(bv_tag)::value>(a, cfg, stream);
    });
  });
}

}  // namespace kdakit::cuda
