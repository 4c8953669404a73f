// What the backward's kernels share: a chunk slot's sequence and rows, the forward's workspace tiles as floats, the
// gate in natural-log units (the CPU's functions, spec §2.2), and a deterministic block sum.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/kda_math.h"
#include "cuda/backward/args.h"
#include "cuda/backward/tile_size.h"
#include "cuda/common/math.cuh"
#include "cuda/common/seqlen.cuh"

namespace kdakit::cuda {

// Chunk slot `slot`: its sequence n (batch row b, first token t0, length len), its index ci in the sequence, its first
// token row0 and its rows. False past the last chunk.
struct ChunkOf {
  int n = 0, nrows = 0;
  int64_t b = 0, t0 = 0, len = 0, ci = 0, row0 = 0;
};
__device__ __forceinline__ bool chunk_of(const BackwardArgs& a, int64_t slot, ChunkOf& c) {
  int64_t first;
  c.n = chunk_owner(a, a.chunk_offsets, a.chunk, slot, first);
  if (c.n < 0) return false;
  sequence(a, c.n, c.b, c.t0, c.len);
  c.ci = slot - first;
  c.row0 = c.t0 + c.ci * a.chunk;
  c.nrows = static_cast<int>(min(static_cast<int64_t>(a.chunk), c.len - c.ci * a.chunk));
  return true;
}

// Token rows that may be copied in 16-byte pieces of epc elements: aligned base and strides, whole pieces per row.
__device__ __forceinline__ bool rows_vec(const TokenRows& t, int epc, int cols) {
  return cols % epc == 0 && reinterpret_cast<uintptr_t>(t.p) % 16 == 0 && t.sb % epc == 0 && t.st % epc == 0 &&
         t.sh % epc == 0;
}

// Element i of a forward workspace tile of Elem (bf16 or float).
template <typename Elem>
__device__ __forceinline__ float tile_at(const void* p, int64_t i) {
  return to_float(static_cast<const Elem*>(p)[i]);
}

// Element (row, col) of a token tensor of element type T at row offset `off` (TokenRows::offset).
template <typename T>
__device__ __forceinline__ float token_at(const TokenRows& t, int64_t off, int col) {
  return to_float(static_cast<const T*>(t.p)[off + col]);
}

// The gate of key d at token (b, t) of v-head hv in natural-log units, and x = g + dt_bias (the raw input of the
// in-kernel gate).
__device__ __forceinline__ float gate_at(const KdaArgs& a, const TokenRows& g, int64_t b, int64_t t, int hv, int d,
                                         float* x_out = nullptr) {
  const float raw = g.load(g.offset(b, t, hv) + d);
  if (a.gate_mode == GateMode::kPreGated) {
    if (x_out) *x_out = raw;
    return raw;
  }
  const float x = raw + (a.dt_bias.present() ? a.dt_bias.load(int64_t(hv) * a.K + d) : 0.f);
  if (x_out) *x_out = x;
  const float A = a.A_log.present() ? a.A_log.load(hv) : 0.f;
  return math::gate_value<float>(static_cast<int>(a.gate_mode), x, A, a.A_log.present(), a.lower_bound);
}

// Scans and sums over the 16 lanes of a half-warp, position p = lane & 15; every lane of the warp calls them (full-warp
// shuffles), each half-warp scanning its own values. Fixed shuffle trees, so the same bits on every run.
namespace half_warp {
constexpr unsigned kAll = 0xffffffffu;
__device__ __forceinline__ int position() { return threadIdx.x & 15; }
// Inclusive: the sum over positions <= p.
__device__ __forceinline__ float prefix(float v) {
#pragma unroll
  for (int d = 1; d < 16; d <<= 1) {
    const float u = __shfl_up_sync(kAll, v, d, 16);
    if (position() >= d) v += u;
  }
  return v;
}
// Inclusive: the sum over positions >= p.
__device__ __forceinline__ float suffix(float v) {
#pragma unroll
  for (int d = 1; d < 16; d <<= 1) {
    const float u = __shfl_down_sync(kAll, v, d, 16);
    if (position() + d < 16) v += u;
  }
  return v;
}
// Position p's value moved to p + 1 (zero at 0), or to p - 1 (zero at 15): an inclusive scan made exclusive, or a
// row's successor.
__device__ __forceinline__ float from_previous(float v) {
  const float u = __shfl_up_sync(kAll, v, 1, 16);
  return position() > 0 ? u : 0.f;
}
__device__ __forceinline__ float from_next(float v) {
  const float u = __shfl_down_sync(kAll, v, 1, 16);
  return position() < 15 ? u : 0.f;
}
// The sum over the 16 positions, in every lane (the same bits: each butterfly step adds the same two values).
__device__ __forceinline__ float sum(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(kAll, v, o, 16);
  return v;
}
}  // namespace half_warp

// The sum of every thread's v over the block, the same bits on every run (warp butterflies, then the warps in order);
// every thread gets it. `scratch` holds kBwdRowGroups floats; the call ends with a barrier.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int warp = threadIdx.x >> 5;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[warp] = v;
  __syncthreads();
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < kBwdRowGroups; ++w) s += scratch[w];
  __syncthreads();
  return s;
}

}  // namespace kdakit::cuda
