// The decode kernels' token inputs: rows staged into shared memory (general form), scalars, and the one-token form's
// register loads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common/sm80/cp_async.cuh"
#include "cuda/decode/args.h"

namespace kdakit::cuda::decode_detail {


// Copies columns [c0, c0 + ncols) of nb token rows of head `head` into the tails of nb float rows of shared
// memory (raw dtype of es bytes at byte offset (4 - es) * ncols of each row), zero past column `limit`. 16-byte
// asynchronous copies where the tensor allows (t.vec), element copies otherwise. `lane` of `nlanes` threads share
// the copies (one warp per tensor: the four tensors' address arithmetic runs in parallel, not one after the
// other). ncols is a power of two (KP, or the CTA tile's 8 * warps * passes columns), so rows and columns of a
// copy index are a shift and a mask.
__device__ __forceinline__ void stage_rows(char* dst, const TokenRows t, int es, int head, int64_t b, int64_t s0,
                                           int nb, int c0, int ncols, int limit, int lane, int nlanes) {
  const char* src = static_cast<const char*>(t.p);
  dst += (4 - es) * ncols;
  const size_t row = 4 * size_t(ncols);
  if (t.vec) {
    const int epc = 16 / es, cpr = ncols / epc, sh = __ffs(cpr) - 1;  // elements per copy, copies per row (2^sh)
    for (int e = lane; e < nb * cpr; e += nlanes) {
      const int tt = e >> sh, c = c0 + (e & (cpr - 1)) * epc;
      const int n_el = limit - c < 0 ? 0 : (limit - c < epc ? limit - c : epc);
      const char* from = n_el > 0 ? src + (t.offset(b, s0 + tt, head) + c) * es : src;
      cp_async16(dst + tt * row + size_t(c - c0) * es, from, n_el * es);
    }
  } else {
    const int sh = __ffs(ncols) - 1;
    for (int e = lane; e < nb * ncols; e += nlanes) {
      const int tt = e >> sh, c = c0 + (e & (ncols - 1));
      const int64_t off = t.offset(b, s0 + tt, head) + c;
      char* to = dst + tt * row + size_t(c - c0) * es;
      if (es == 4) *reinterpret_cast<uint32_t*>(to) = c < limit ? __ldg(reinterpret_cast<const uint32_t*>(src) + off) : 0u;
      else *reinterpret_cast<uint16_t*>(to) = c < limit ? __ldg(reinterpret_cast<const unsigned short*>(src) + off) : 0;
    }
  }
}

__device__ __forceinline__ float load_scalar(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::kBFloat16: return __bfloat162float(__ldg(static_cast<const __nv_bfloat16*>(p) + i));
    case DType::kFloat16: return __half2float(__ldg(static_cast<const __half*>(p) + i));
    default: return __ldg(static_cast<const float*>(p) + i);
  }
}

// Element i of a raw staged row (bf16, fp16 or fp32).
__device__ __forceinline__ float raw_at(const char* base, DType dt, int i) {
  switch (dt) {
    case DType::kBFloat16: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(base)[i]);
    case DType::kFloat16: return __half2float(reinterpret_cast<const __half*>(base)[i]);
    default: return reinterpret_cast<const float*>(base)[i];
  }
}

// ---- one token per sequence: the preparation in registers -----------------------------------------------------
// Serving decode (every sequence has at most one token): each thread loads and prepares exactly the inputs it uses
// -- q, k and the gate at its keys, v and beta at its columns -- in registers. No shared memory and no barrier, so
// the warps never wait for each other, and a thread's chain is: slot -> state loads -> token math, with the loads
// of the inputs in flight beside the slot's and their preparation under the state's latency.

// RUN consecutive elements at p, widened. Aligned: the host checked that the tensor's 16-bit rows take 8-element
// and its fp32 rows 4-element vectors, and RUN (2, 4 or 8) divides those runs.
template <int RUN, typename In>
__device__ __forceinline__ void load_run(const In* p, float* x) {
  if constexpr (std::is_same<In, float>::value) {
    if constexpr (RUN % 4 == 0) {
#pragma unroll
      for (int i = 0; i < RUN; i += 4) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(p + i));
        x[i] = v.x; x[i + 1] = v.y; x[i + 2] = v.z; x[i + 3] = v.w;
      }
    } else {
      static_assert(RUN == 2, "runs of 2, 4 or 8 keys");
      const float2 v = __ldg(reinterpret_cast<const float2*>(p));
      x[0] = v.x; x[1] = v.y;
    }
  } else {
    uint32_t w[RUN / 2];
    if constexpr (RUN == 8) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
      w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else if constexpr (RUN == 4) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
      w[0] = v.x; w[1] = v.y;
    } else {
      static_assert(RUN == 2, "runs of 2, 4 or 8 keys");
      w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
    }
#pragma unroll
    for (int i = 0; i < RUN / 2; ++i) {
      if constexpr (std::is_same<In, __nv_bfloat16>::value) {
        x[2 * i] = bf16_lo(w[i]);
        x[2 * i + 1] = bf16_hi(w[i]);
      } else {
        x[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)));
        x[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
      }
    }
  }
}

}  // namespace kdakit::cuda::decode_detail
