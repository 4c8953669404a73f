// Device-side element access for kdakit's storage dtypes, and state-block addressing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "kdakit/tensor.h"

namespace kdakit::cuda {

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

// A pointer whose element type is known only at run time (small or rarely touched tensors).
struct DynPtr {
  void* p = nullptr;
  DType dtype = DType::kFloat32;

  __device__ __forceinline__ bool present() const { return p != nullptr; }
  __device__ __forceinline__ float load(int64_t i) const {
    switch (dtype) {
      case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
      case DType::kFloat16: return __half2float(static_cast<const __half*>(p)[i]);
      case DType::kFloat64: return static_cast<float>(static_cast<const double*>(p)[i]);
      default: return static_cast<const float*>(p)[i];
    }
  }
  __device__ __forceinline__ void store(int64_t i, float v) const {
    switch (dtype) {
      case DType::kBFloat16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
      case DType::kFloat16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
      case DType::kFloat64: static_cast<double*>(p)[i] = v; break;
      default: static_cast<float*>(p)[i] = v;
    }
  }
  __device__ __forceinline__ int64_t load_int(int64_t i) const {
    switch (dtype) {
      case DType::kInt64: return static_cast<const int64_t*>(p)[i];
      case DType::kInt32: return static_cast<const int32_t*>(p)[i];
      default: return static_cast<const uint8_t*>(p)[i];
    }
  }
};

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ double from_float<double>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Calls f(T* p) with T the storage type of d's dtype: one branch per call site instead of one per element.
template <typename F>
__device__ __forceinline__ void with_typed(const DynPtr& d, F&& f) {
  switch (d.dtype) {
    case DType::kBFloat16: f(static_cast<__nv_bfloat16*>(d.p)); break;
    case DType::kFloat16: f(static_cast<__half*>(d.p)); break;
    case DType::kFloat64: f(static_cast<double*>(d.p)); break;
    default: f(static_cast<float*>(d.p));
  }
}

// A state tensor [P,HV,K,V] (or v-first [P,HV,V,K]) with dense per-head blocks.
struct StateRef {
  DynPtr ptr;
  int64_t slot_stride = 0, head_stride = 0;
  __device__ __forceinline__ int64_t offset(int64_t slot, int64_t hv, int d, int v, int K, int V, bool vk) const {
    return slot * slot_stride + hv * head_stride + (vk ? int64_t(v) * K + d : int64_t(d) * V + v);
  }
};

}  // namespace kdakit::cuda
