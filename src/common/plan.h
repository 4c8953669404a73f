// A validated call's problem plus the host-side facts every backend needs (sequence boundaries, chunk offsets).
// Made by src/core/validate.cpp, read by the backends: it sits below both, so dependencies run one way.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kdakit/error.h"
#include "kdakit/kdakit.h"

namespace kdakit::detail {

struct Plan {
  Problem pr;
  // Sequence boundaries [N+1] on the host. Always known for fixed-length inputs and for CPU tensors;
  // for CUDA tensors only when cu_seqlens_host was given.
  bool cu_known = false;
  std::vector<int64_t> cu;
  // Prefix sum of chunks per sequence [N+1] (forward/backward only, when cu_known).
  std::vector<int64_t> chunk_offsets;
  int64_t max_len = 0;  // longest sequence (when cu_known)
};

Plan plan_forward(const ForwardParams& p);
Plan plan_backward(const BackwardParams& p);
Plan plan_decode(const DecodeParams& p);

// Reads one element of an integer or bool tensor that lives on the host.
inline int64_t read_int(const TensorView& t, int64_t i0) {
  const char* base = static_cast<const char*>(t.data);
  const int64_t off = i0 * t.strides[0];
  switch (t.dtype) {
    case DType::kInt32: return reinterpret_cast<const int32_t*>(base)[off];
    case DType::kInt64: return reinterpret_cast<const int64_t*>(base)[off];
    case DType::kBool:
    case DType::kUInt8: return reinterpret_cast<const uint8_t*>(base)[off];
    default: throw InvalidArgument("tensor", std::string("expected an integer tensor, got ") + dtype_name(t.dtype));
  }
}

inline int64_t read_int(const TensorView& t, int64_t i0, int64_t i1) {
  const char* base = static_cast<const char*>(t.data);
  const int64_t off = i0 * t.strides[0] + i1 * t.strides[1];
  switch (t.dtype) {
    case DType::kInt32: return reinterpret_cast<const int32_t*>(base)[off];
    case DType::kInt64: return reinterpret_cast<const int64_t*>(base)[off];
    default: throw InvalidArgument("tensor", std::string("expected an integer tensor, got ") + dtype_name(t.dtype));
  }
}

}  // namespace kdakit::detail
