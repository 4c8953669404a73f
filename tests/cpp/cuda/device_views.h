// Views of tensors "on a CUDA device" for the planner tests: shapes, strides, dtypes and aligned fake addresses. The
// planners read only these facts (never the memory), so they run without a GPU.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "cuda/device.h"
#include "kdakit/kdakit.h"

namespace kdakit::test {

// Planning the case (its plan()) throws InvalidArgument naming `argument`, with `text` in its message.
template <typename Case>
void expect_rejected(const Case& c, const char* argument, const char* text) {
  try {
    c.plan();
    ADD_FAILURE() << "expected InvalidArgument for " << argument;
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.argument(), argument);
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

// Device facts the planner tests plan for: SMs, compute capability, opt-in shared memory per block.
inline const cuda::DeviceInfo kH200{132, 90, 227 * 1024};
inline const cuda::DeviceInfo kA100{108, 80, 163 * 1024};
inline const cuda::DeviceInfo kAda{128, 89, 99 * 1024};

// Each view gets its own 1 MB-aligned fake address (offset by `misalign` bytes).
inline TensorView device_view(DType dtype, std::initializer_list<int64_t> shape, int64_t misalign = 0) {
  static uintptr_t next = uintptr_t(1) << 40;
  next += uintptr_t(1) << 20;
  return make_view(reinterpret_cast<void*>(next + misalign), dtype, shape, Device::kCUDA, 0);
}

// KdaInputs of B sequences of T tokens (or varlen with device cu_seqlens when `varlen_n` > 0: B = 1, T tokens in
// varlen_n sequences), H q/k heads, HV value heads, head sizes K and V, the gate in kernel with lower bound.
struct DeviceInputs {
  KdaInputs in;
  DeviceInputs(int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V, DType dtype = DType::kBFloat16,
               int64_t varlen_n = 0) {
    in.q = device_view(dtype, {B, T, H, K});
    in.k = device_view(dtype, {B, T, H, K});
    in.v = device_view(dtype, {B, T, HV, V});
    in.g = device_view(dtype, {B, T, HV, K});
    in.beta = device_view(dtype, {B, T, HV});
    in.scale = default_scale(K);
    in.gate.mode = GateMode::kLowerBound;
    in.gate.lower_bound = -5.f;
    in.gate.A_log = device_view(DType::kFloat32, {HV});
    in.gate.dt_bias = device_view(DType::kFloat32, {HV * K});
    in.qk_l2norm = true;
    in.beta_sigmoid = true;
    if (varlen_n > 0) in.cu_seqlens = device_view(DType::kInt32, {varlen_n + 1});
  }
};

}  // namespace kdakit::test
