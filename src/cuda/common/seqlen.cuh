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

// x / d for x >= 0, d > 0: a 32-bit division where both fit (64-bit division is a long call).
__device__ __forceinline__ int64_t div_nonneg(int64_t x, int64_t d) {
  return x <= UINT32_MAX && d <= UINT32_MAX ? static_cast<int64_t>(static_cast<uint32_t>(x) / static_cast<uint32_t>(d))
                                            : x / d;
}

// The sequence of chunk slot `slot` (chunk_offsets: [N + 1], the chunks of the sequences before n, as
// chunk_offsets_kernel writes them) and the slot of that sequence's first chunk; -1 past the last chunk. Fixed-length
// batches by arithmetic (every sequence has ceil(T / chunk) chunks, so offsets[n] = n ceil(T / chunk)) with no load
// on the kernel's first dependent chain; varlen batches by a binary search of the offsets.
__device__ __forceinline__ int chunk_owner(const KdaArgs& a, const int64_t* chunk_offsets, int chunk, int64_t slot,
                                           int64_t& first) {
  if (a.cu_seqlens.present()) {
    if (slot >= chunk_offsets[a.N]) return -1;
    const int n = owner_of(chunk_offsets, a.N, slot);
    first = chunk_offsets[n];
    return n;
  }
  const int64_t nch = div_nonneg(static_cast<int64_t>(a.T) + chunk - 1, chunk);
  if (slot >= a.N * nch) return -1;
  const int64_t n = div_nonneg(slot, nch);
  first = n * nch;
  return static_cast<int>(n);
}

}  // namespace kdakit::cuda
