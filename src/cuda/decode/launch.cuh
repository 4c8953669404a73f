// Kernel selection and launch of the decode kernel for one pool dtype (instantiated per dtype in
// decode_<dtype>.cu so the two compile in parallel).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "cuda/decode/kernels.cuh"
#include "kdakit/error.h"

namespace kdakit::cuda {

template <typename PoolT, bool VK, int KP>
void launch_decode_kernel(const DecodeArgs& a, const DecodeConfig& cfg, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.N), static_cast<unsigned>(a.HV), static_cast<unsigned>(a.vtiles));
  auto kernel = cfg.full ? decode_kernel<PoolT, VK, KP, true, false> : decode_kernel<PoolT, VK, KP, false, false>;
  bool one_entry = false;
  if constexpr (KP <= 128) {
    one_entry = cfg.one_entry;
    if (one_entry) {
      auto one = cfg.passes > 1 ? decode_one_kernel<PoolT, VK, KP, true> : decode_one_kernel<PoolT, VK, KP, false>;
      one<<<grid, 32 * cfg.warps, cfg.smem, stream>>>(a.one);
    } else if (cfg.one) {
      kernel = decode_kernel<PoolT, VK, KP, false, true>;
    }
  }
  if (!one_entry) kernel<<<grid, 32 * cfg.warps, cfg.smem, stream>>>(a);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw CudaError(std::string("kdakit: decode_kernel launch failed: ") + cudaGetErrorString(err));
}

template <typename PoolT>
void launch_decode(const DecodeArgs& a, const DecodeConfig& cfg, cudaStream_t stream) {
  auto by_kp = [&](auto vk_tag) {
    constexpr bool VK = decltype(vk_tag)::value;
    switch (cfg.KP) {
      case 64: launch_decode_kernel<PoolT, VK, 64>(a, cfg, stream); break;
      case 128: launch_decode_kernel<PoolT, VK, 128>(a, cfg, stream); break;
      default: launch_decode_kernel<PoolT, VK, 256>(a, cfg, stream); break;
    }
  };
  if (cfg.vk) by_kp(std::true_type());
  else by_kp(std::false_type());
}

}  // namespace kdakit::cuda
