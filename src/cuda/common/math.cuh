// Device scalar helpers shared by every CUDA op: element conversions, bf16 packing and hi + lo splitting, the
// special function unit's exp2, warp reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace kdakit::cuda {

constexpr float kLog2e = 1.4426950408889634f;

// 2^x by the special function unit (relative error below 2^-22; results below 2^-126 flush to zero).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The storage type of float tiles whose tensor-core products keep float32 precision (three bf16 parts per operand,
// Operand<Float3Split> in sm80/mma.cuh): the element type of float32 inputs' tiles. Layout-identical to float.
struct Float3Split {
  float v;
};

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<Float3Split>(Float3Split v) { return v.v; }
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<double>(double v) { return static_cast<float>(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ Float3Split from_float<Float3Split>(float v) { return Float3Split{v}; }
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ double from_float<double>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// The two bf16 halves of a 32-bit word (element 0 in the low half), widened.
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// Two floats rounded to bf16 in one 32-bit word; the first (lower address) element in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo_elem, float hi_elem) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo_elem, hi_elem);  // .x = first (lower address) element
  return *reinterpret_cast<uint32_t*>(&v);
}

// Splits two floats into hi and lo bf16 pairs: x ~= hi + lo with ~16 significant bits.
__device__ __forceinline__ void split_pack(float a, float b, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat16 ha = __float2bfloat16_rn(a), hb = __float2bfloat16_rn(b);
  const float ra = a - __bfloat162float(ha), rb = b - __bfloat162float(hb);
  __nv_bfloat162 h2, l2;
  h2.x = ha;
  h2.y = hb;
  l2 = __floats2bfloat162_rn(ra, rb);
  hi = *reinterpret_cast<uint32_t*>(&h2);
  lo = *reinterpret_cast<uint32_t*>(&l2);
}

// Stores two floats split as split_pack splits them: the hi bf16 pair at `hi`, the lo pair at `lo` (4-byte aligned
// bf16 storage).
template <typename T>
__device__ __forceinline__ void store_hi_lo(T* hi, T* lo, float a, float b) {
  uint32_t h, l;
  split_pack(a, b, h, l);
  *reinterpret_cast<uint32_t*>(hi) = h;
  *reinterpret_cast<uint32_t*>(lo) = l;
}

// Splits two floats into three bf16 pairs: x ~= hi + mid + lo with ~24 significant bits (float32's), for products
// that must keep float32 precision on bf16 tensor cores (six MMAs, Operand<Float3Split>).
__device__ __forceinline__ void split3_pack(float a, float b, uint32_t& hi, uint32_t& mid, uint32_t& lo) {
  const __nv_bfloat16 ha = __float2bfloat16_rn(a), hb = __float2bfloat16_rn(b);
  const float ra = a - __bfloat162float(ha), rb = b - __bfloat162float(hb);  // exact
  const __nv_bfloat16 ma = __float2bfloat16_rn(ra), mb = __float2bfloat16_rn(rb);
  __nv_bfloat162 h2, m2, l2;
  h2.x = ha;
  h2.y = hb;
  m2.x = ma;
  m2.y = mb;
  l2 = __floats2bfloat162_rn(ra - __bfloat162float(ma), rb - __bfloat162float(mb));
  hi = *reinterpret_cast<uint32_t*>(&h2);
  mid = *reinterpret_cast<uint32_t*>(&m2);
  lo = *reinterpret_cast<uint32_t*>(&l2);
}

// x ~= parts[0] + ... + parts[P - 1] for P = 2 (split_pack) or 3 (split3_pack).
template <int P>
__device__ __forceinline__ void split_parts(float a, float b, uint32_t (&w)[P]) {
  static_assert(P == 2 || P == 3, "two or three bf16 parts");
  if constexpr (P == 2) split_pack(a, b, w[0], w[1]);
  else split3_pack(a, b, w[0], w[1], w[2]);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace kdakit::cuda
