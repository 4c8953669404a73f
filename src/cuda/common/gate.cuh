// The gate and the beta activation of spec §2 on the device, for every op.
#pragma once

#include <type_traits>

#include "cuda/common/math.cuh"
#include "kdakit/params.h"

namespace kdakit::cuda {

// The gate in log2 units, with the per-head constants (exp(A_log), lower_bound log2 e) hoisted out of the
// per-element work and the sigmoid's exponential and division on the special function unit (relative error
// ~2^-21, far below the bf16/fp32 tolerances; the precise libm path costs ~45 instructions per element).
struct GateLog2 {
  int mode = 0;      // GateMode: 0 pre-gated, 1 softplus, 2 lower bound
  float a = 1.f;     // exp(A_log) (1 without A_log)
  float ak = kLog2e; // a log2 e
  float coef = 0.f;  // mode 1: -exp(A_log) log2 e; mode 2: lower_bound log2 e
  __device__ __forceinline__ GateLog2(GateMode m, float A_log, bool has_A_log, float lower_bound)
      : mode(static_cast<int>(m)) {
    a = has_A_log ? expf(A_log) : 1.f;
    ak = a * kLog2e;
    coef = mode == 1 ? -ak : lower_bound * kLog2e;
  }
  // x = raw gate + dt_bias (modes 1, 2) or the natural-log gate itself (mode 0).
  template <int MODE>
  __device__ __forceinline__ float eval(float x) const {
    if constexpr (MODE == 0) return x * kLog2e;
    else if constexpr (MODE == 1) return coef * (x > 20.f ? x : log1pf(fast_exp2(x * kLog2e)));  // FLA's threshold
    else return __fdividef(coef, 1.f + fast_exp2(-ak * x));  // coef * sigmoid(a x); 0 when the exponent overflows
  }
  __device__ __forceinline__ float operator()(float x) const {
    return mode == 0 ? eval<0>(x) : (mode == 1 ? eval<1>(x) : eval<2>(x));
  }
  // f(std::integral_constant<int, mode>): per-element loops take the mode at compile time (one branch per call).
  template <typename F>
  __device__ __forceinline__ void dispatch(F&& f) const {
    if (mode == 0) f(std::integral_constant<int, 0>());
    else if (mode == 1) f(std::integral_constant<int, 1>());
    else f(std::integral_constant<int, 2>());
  }
  // exp(gate) of NV raw values x[i] + bias[i].
  template <int NV>
  __device__ __forceinline__ void exp_gates(const float* x, const float* bias, float* out) const {
    dispatch([&](auto m) {
      constexpr int M = decltype(m)::value;
#pragma unroll
      for (int i = 0; i < NV; ++i) out[i] = fast_exp2(eval<M>(x[i] + bias[i]));
    });
  }
};

// The beta activation (identity, sigmoid or 2 sigmoid) on the special function unit, for the per-token chain of
// decode. The chunked forward applies math::beta_value (the CPU's precise function): once per token and head, off
// its critical path. The two differ in the last bits, so each op keeps its own for bit-stable results.
__device__ __forceinline__ float beta_fast(float raw, bool use_sigmoid, bool neg_eigval) {
  if (!use_sigmoid) return raw;
  return (neg_eigval ? 2.f : 1.f) * __frcp_rn(1.f + fast_exp2(-raw * kLog2e));  // 1 / inf = 0
}

}  // namespace kdakit::cuda
