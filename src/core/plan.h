// Validated problem plus the host-side facts the backends need (sequence boundaries, chunk offsets).
#pragma once

#include <cstdint>
#include <vector>

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
int64_t read_int(const TensorView& t, int64_t i0);
int64_t read_int(const TensorView& t, int64_t i0, int64_t i1);

}  // namespace kdakit::detail
