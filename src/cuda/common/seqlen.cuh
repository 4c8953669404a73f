// Sequences and their chunks on the device: one implementation for every op.
#pragma once

#include <cstdint>

#include "cuda/common/args.h"

namespace kdakit::cuda {

// Sequence n: its batch row, first token and length (fixed length: row n, tokens [0, T)). A negative length from
// device-side cu_seqlens, which the host could not check, reads as an empty sequence.
__device__ __forceinline__ void sequence(const KdaArgs& a, int n, int64_t& b, int64_t& t0, int64_t& len) {
  if (a.cu_seqlens.present()) {
    b = 0;
    t0 = a.cu_seqlens.load_int(n * a.cu_stride);
    len = a.cu_seqlens.load_int((n + 1) * a.cu_stride) - t0;
    if (len < 0) len = 0;
  } else {
    b = n;
    t0 = 0;
    len = a.T;
  }
}

// The n in [0, N) with offsets[n] <= x < offsets[n + 1], for non-decreasing offsets [N + 1] with offsets[0] <= x
// (the sequence of a chunk slot or of a segment slot).
__device__ __forceinline__ int owner_of(const int64_t* offsets, int N, int64_t x) {
  int lo = 0, hi = N;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (offsets[mid] <= x) lo = mid; else hi = mid;
  }
  return lo;
}

}  // namespace kdakit::cuda
