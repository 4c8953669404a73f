// Kernel selection and launch of the decode for one pool dtype (instantiated per dtype in decode/instantiations/ so
// the two compile in parallel).
#pragma once

#include <cuda_runtime.h>

#include "cuda/decode/general.cuh"
#include "cuda/decode/one_token.cuh"
#include "cuda/common/static_switch.h"
#include "cuda/decode/plan.h"
#include "cuda/device.h"

namespace kdakit::cuda {

template <typename PoolT, bool VK, int KP>
void launch_decode_kernel(const DecodeArgs& a, const DecodeConfig& cfg, cudaStream_t stream) {
  const unsigned rows = static_cast<unsigned>(a.N) + (a.tail_cta ? 1u : 0u);
  const dim3 grid(a.one.vt_shift() > 0 ? rows << a.one.vt_shift() : rows, static_cast<unsigned>(a.HV),
                  a.one.vt_shift() > 0 ? 1u : static_cast<unsigned>(a.vtiles));
  if constexpr (KP <= 128) {
    if (cfg.one) {
      auto one = cfg.one_staged ? (cfg.one_multi ? decode_one_kernel<PoolT, VK, KP, true, true>
                                                 : decode_one_kernel<PoolT, VK, KP, true, false>)
                                : (cfg.one_multi ? decode_one_kernel<PoolT, VK, KP, false, true>
                                                 : decode_one_kernel<PoolT, VK, KP, false, false>);
      one<<<grid, 32 * cfg.warps, cfg.smem, stream>>>(a.one);
      check_launch("decode_one_kernel");
      return;
    }
  }
  auto kernel = cfg.full ? decode_kernel<PoolT, VK, KP, true> : decode_kernel<PoolT, VK, KP, false>;
  if constexpr (!VK && KP == 128 && std::is_same<PoolT, __nv_bfloat16>::value) {
    if (cfg.wide_kv == 8) kernel = decode_kernel<PoolT, VK, KP, true, 8>;
    if (cfg.wide_kv == 4) kernel = decode_kernel<PoolT, VK, KP, true, 4>;
  }
  kernel<<<grid, 32 * cfg.warps, cfg.smem, stream>>>(a);
  check_launch("decode_kernel");
}

template <typename PoolT>
void launch_decode(const DecodeArgs& a, const DecodeConfig& cfg, cudaStream_t stream) {
  with_bool(cfg.vk, [&](auto vk_tag) {
    constexpr bool VK = decltype(vk_tag)::value;
    with_kp(cfg.KP, [&](auto kp_tag) { launch_decode_kernel<PoolT, VK, decltype(kp_tag)::value>(a, cfg, stream); });
  });
}

}  // namespace kdakit::cuda
