// Host-side element conversion between kdakit's storage dtypes and float/double arithmetic.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kdakit/tensor.h"

namespace kdakit::cpu {

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; NaN stays NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  uint32_t bits;
  if (e == 0) {
    const float v = static_cast<float>(m) * 5.9604644775390625e-8f;  // m * 2^-24
    return sign ? -v : v;
  }
  if (e == 31) {
    bits = sign | 0x7F800000u | (m << 13);
  } else {
    bits = sign | ((e - 15 + 127) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, overflow to infinity, gradual underflow.
inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) return static_cast<uint16_t>(sign | (ax > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (ax >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to infinity
  if (ax < 0x38800000u) {                                               // below 2^-14: subnormal or zero
    float v;
    std::memcpy(&v, &ax, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(v * 16777216.0f)));
  }
  const uint32_t e = (ax >> 23) - 127 + 15;
  const uint32_t m = ax & 0x7FFFFFu;
  uint32_t h = (e << 10) | (m >> 13);
  const uint32_t rem = m & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

template <class Acc>
inline Acc load_elem(const void* base, DType dtype, int64_t off) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<Acc>(static_cast<const float*>(base)[off]);
    case DType::kFloat64: return static_cast<Acc>(static_cast<const double*>(base)[off]);
    case DType::kBFloat16: return static_cast<Acc>(bf16_to_float(static_cast<const uint16_t*>(base)[off]));
    case DType::kFloat16: return static_cast<Acc>(half_to_float(static_cast<const uint16_t*>(base)[off]));
    default: return Acc(0);
  }
}

template <class Acc>
inline void store_elem(void* base, DType dtype, int64_t off, Acc value) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(base)[off] = static_cast<float>(value); break;
    case DType::kFloat64: static_cast<double*>(base)[off] = static_cast<double>(value); break;
    case DType::kBFloat16: static_cast<uint16_t*>(base)[off] = float_to_bf16(static_cast<float>(value)); break;
    case DType::kFloat16: static_cast<uint16_t*>(base)[off] = float_to_half(static_cast<float>(value)); break;
    default: break;
  }
}

// Reads n elements starting at `off`, `stride` apart.
template <class Acc>
inline void load_row(const TensorView& t, int64_t off, int64_t n, int64_t stride, Acc* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load_elem<Acc>(t.data, t.dtype, off + i * stride);
}

template <class Acc>
inline void store_row(const TensorView& t, int64_t off, int64_t n, int64_t stride, const Acc* src) {
  for (int64_t i = 0; i < n; ++i) store_elem<Acc>(t.data, t.dtype, off + i * stride, src[i]);
}

}  // namespace kdakit::cpu
