// Building blocks of the prepare kernel (forward/prepare_sm80.cuh): staging token rows into operand tiles, paired
// element loads, g read by its width, the padded token tail's zero rows, and one doubling level of the triangular
// inverse.
#pragma once

#include <type_traits>

#include "cuda/common/math.cuh"
#include "cuda/common/sm80/mma.cuh"
#include "cuda/forward/args.h"
#include "cuda/forward/tile_size.h"

namespace kdakit::cuda {

// Diagonal blocks are factorised around their middle row while every exponent stays within +-64 nats.
constexpr float kMaxAnchorLog2 = 64.0f * kLog2e;

template <typename Elem>
__device__ __forceinline__ Elem to_elem(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 to_elem<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ float to_elem<float>(float v) { return v; }
template <>
__device__ __forceinline__ Float3Split to_elem<Float3Split>(float v) { return Float3Split{v}; }

// Bump allocation of dynamic shared memory with 16-byte alignment.
struct SmemCursor {
  char* p;
  template <typename T>
  __device__ __forceinline__ T* take(int count) {
    T* r = reinterpret_cast<T*>(p);
    p += (static_cast<size_t>(count) * sizeof(T) + 15) & ~size_t(15);
    return r;
  }
};

// Copies rows [0, nrows) x cols [0, cols) of a token tensor into columns [0, WIDTH) of a smem tile [C][ld] (InT),
// zero elsewhere. vec: 16-byte copies are legal (aligned base, strides and cols). Each thread keeps one 16-byte
// column piece and walks a compile-time number of rows by pointer increments (the 64-bit offset arithmetic per piece
// was ~10 instructions).
template <typename InT, int C, int WIDTH>
__device__ __forceinline__ void stage_rows(InT* dst, int ld, const InT* src, const TokenRows& t, int64_t b,
                                           int64_t row0, int h, int nrows, int cols, bool vec) {
  constexpr int EPC = 16 / sizeof(InT), PIECES = WIDTH / EPC, STEP = kPrepareThreads / PIECES;
  static_assert(WIDTH % EPC == 0 && kPrepareThreads % PIECES == 0 && C % STEP == 0,
                "whole pieces, a fixed piece per thread, whole row steps");
  const int c0 = (threadIdx.x % PIECES) * EPC, r0 = threadIdx.x / PIECES;
  const InT* s = src + t.offset(b, row0 + r0, h) + c0;
  InT* d = dst + r0 * ld + c0;
  const int64_t step = STEP * t.st;
  if (vec) {
    const int rows = c0 < cols ? nrows : 0;  // a piece is wholly inside K or wholly past it
#pragma unroll
    for (int i = 0; i < C / STEP; ++i, s += step, d += STEP * ld) {
      if (r0 + i * STEP < rows) cp_async16(d, s);
      else *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
    }
  } else {
#pragma unroll 1
    for (int i = 0; i < C / STEP; ++i, s += step, d += STEP * ld) {
      const bool in = r0 + i * STEP < nrows;
#pragma unroll
      for (int j = 0; j < EPC; ++j) d[j] = in && c0 + j < cols ? s[j] : InT(0.f);
    }
  }
}

// Elements d and d + 1 of a row (p points at element d) as floats: one paired load where `pair` (an aligned pair,
// both elements present), else element loads with absent elements (ok0 / ok1 false: past K) reading zero.
template <typename InT>
__device__ __forceinline__ float2 load_pair(const InT* p, bool ok0, bool ok1, bool pair) {
  if (pair) {
    if constexpr (std::is_same<InT, float>::value) {
      return *reinterpret_cast<const float2*>(p);
    } else if constexpr (std::is_same<InT, __nv_bfloat16>::value) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
      return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
    } else {
      return __half22float2(*reinterpret_cast<const __half2*>(p));
    }
  }
  return make_float2(ok0 ? to_float(p[0]) : 0.f, ok1 ? to_float(p[1]) : 0.f);
}

// g by its width GB (ForwardArgs::g): float32 (4), or 16 bits (2), bfloat16 or float16 as a.g.dtype says. GRaw is the
// storage type of its raw copies (16-bit g staged as bits). with_g_type calls f(TypeTag<T>) with g's element type T:
// one uniform branch per call site for 16-bit g, outside the row loops, so g of q's dtype costs nothing and the other
// 16-bit type is read as it is too.
template <int GB>
using GRaw = typename std::conditional<GB == 4, float, uint16_t>::type;
template <typename T>
struct TypeTag {
  using type = T;
};
template <int GB, typename F>
__device__ __forceinline__ void with_g_type(const TokenRows& g, F&& f) {
  static_assert(GB == 2 || GB == 4, "g is read as float32 or as a 16-bit float");
  if constexpr (GB == 4) {
    f(TypeTag<float>());
  } else {
    if (g.dtype == DType::kBFloat16) f(TypeTag<__nv_bfloat16>());
    else f(TypeTag<__half>());
  }
}
// Element i of g as a float (the exact path's scattered reads).
template <int GB>
__device__ __forceinline__ float load_g(const TokenRows& g, int64_t i) {
  if constexpr (GB == 4) {
    return static_cast<const float*>(g.p)[i];
  } else {
    const uint16_t bits = static_cast<const uint16_t*>(g.p)[i];
    return g.dtype == DType::kBFloat16 ? __uint_as_float(uint32_t(bits) << 16) : __half2float(__ushort_as_half(bits));
  }
}

// Output rows [cu_seqlens[N] + j C, + C) of v-head hv, clipped to T, set to zero: tokens past the last sequence are
// padding (StateIO's contract, spec §1.7). Tail slot j of the prepare grid (the CTAs past the chunks); every thread
// of the CTA calls it.
template <int C>
__device__ __forceinline__ void zero_tail_rows(const ForwardArgs& a, int64_t j, int hv) {
  if (!a.cu_seqlens.present()) return;  // fixed length: no tail
  const int64_t end = a.cu_seqlens.load_int(int64_t(a.N) * a.cu_stride);
  if (end < 0) return;  // invalid device boundaries (unchecked without a synchronisation): nothing to zero
  const int64_t r0 = end + j * C;
  if (r0 >= a.T) return;
  const int rows = static_cast<int>(min(static_cast<int64_t>(C), a.T - r0));
  with_typed(a.out, [&](auto* op) {
    using OutT = std::remove_pointer_t<decltype(op)>;
    for (int e = threadIdx.x; e < rows * a.V; e += blockDim.x) {
      const int r = e / a.V, v = e - r * a.V;
      op[a.out.offset(0, r0 + r, hv) + v] = from_float<OutT>(0.f);
    }
  });
}

__device__ __forceinline__ float2 operator+(float2 x, float2 y) { return make_float2(x.x + y.x, x.y + y.y); }
__device__ __forceinline__ float2 operator-(float2 x, float2 y) { return make_float2(x.x - y.x, x.y - y.y); }
__device__ __forceinline__ float2 operator*(float2 x, float2 y) { return make_float2(x.x * y.x, x.y * y.y); }
__device__ __forceinline__ float2 operator*(float2 x, float s) { return make_float2(x.x * s, x.y * s); }
__device__ __forceinline__ float2 exp2_2(float2 x) { return make_float2(fast_exp2(x.x), fast_exp2(x.y)); }
// Sum of squares of the elements in 16 bytes of InT.
template <typename InT>
__device__ __forceinline__ float sum_squares16(const uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same<InT, float>::value) {
      const float x = __uint_as_float(w[i]);
      s += x * x;
    } else if constexpr (std::is_same<InT, __nv_bfloat16>::value) {
      const float lo = __uint_as_float(w[i] << 16), hi = __uint_as_float(w[i] & 0xffff0000u);
      s += lo * lo + hi * hi;
    } else {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      s += f.x * f.x + f.y * f.y;
    }
  }
  return s;
}


// A padding sequence's chunk (ForwardArgs::state_slot < 0; spec §1.7): output rows [row0, row0 + nrows) of v-head hv
// and the chunk's start state in the intermediate states set to zero, in place of its workspace tiles (the recurrence
// skips the sequence). Every thread of the CTA calls it.
__device__ __forceinline__ void zero_padding_chunk(const ForwardArgs& a, int64_t b, int64_t row0, int nrows,
                                                   int64_t slot, int64_t c, int hv) {
  with_typed(a.out, [&](auto* op) {
    using OutT = std::remove_pointer_t<decltype(op)>;
    for (int e = threadIdx.x; e < nrows * a.V; e += blockDim.x) {
      const int r = e / a.V, v = e - r * a.V;
      op[a.out.offset(b, row0 + r, hv) + v] = from_float<OutT>(0.f);
    }
  });
  if (a.inter.present()) {
    with_typed(a.inter, [&](auto* ip) {
      using IT = std::remove_pointer_t<decltype(ip)>;
      IT* blk = ip + (a.cu_seqlens.present() ? slot * a.inter_sc : b * a.inter_sb + c * a.inter_sc) + hv * a.inter_sh;
      for (int e = threadIdx.x; e < a.K * a.V; e += blockDim.x) blk[e] = from_float<IT>(0.f);  // a dense block
    });
  }
}

// One doubling level of the inverse of a unit lower triangular [C][LDL] fp32 tile whose diagonal blocks of 16 rows
// already hold their inverses: for each pair of row blocks of S = 16 * MT rows (top at `top`, bottom at top + S), the
// bottom-left block B becomes -D^-1 B A^-1, where A^-1 and D^-1 are the pair's (already inverted) diagonal blocks.
// Warps [0, (C / 2S) * (S / 8)) each compute 8 columns; every thread of the CTA must call it (two barriers).
template <int C, int LDL, int LDY, int MT>
__device__ __forceinline__ void inverse_level(float* sT, float* sY) {
  constexpr int S = 16 * MT, TILES = S / 8, TASKS = (C / (2 * S)) * TILES;
  static_assert(TASKS <= kPrepareThreads / 32 && TASKS <= 4, "one task per warp, four scratch tiles");
  const int warp = threadIdx.x >> 5;
  FragC t[MT][1];
  int r0 = 0, c0 = 0;
  if (warp < TASKS) {
    const int top = 2 * S * (warp / TILES), nt = warp % TILES;
    r0 = top + S;
    c0 = top + 8 * nt;
    float* y = sY + warp * 32 * LDY;
    // Y = B A^-1 (columns c0..c0 + 7); A^-1 is lower triangular, so rows above the column's 16-block are zero.
    FragC acc[MT][1];
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m][0].zero();
    const int kskip = (8 * nt) / 16;
    warp_gemm<float, MT, 1, false, true>(acc, sT, LDL, r0, sT, LDL, c0, top + 16 * kskip, MT - kskip);
    for_each_acc<MT, 1>([&](int m, int, int e, int row, int col) {
      if ((e & 1) == 0) *reinterpret_cast<float2*>(y + row * LDY + col) = make_float2(acc[m][0].x[e], acc[m][0].x[e + 1]);
    });
    __syncwarp();
    // -D^-1 Y (the A tile starts at D^-1's first column, so that k indexes both D^-1's columns and Y's rows)
#pragma unroll
    for (int m = 0; m < MT; ++m) t[m][0].zero();
    warp_gemm<float, MT, 1, false, true>(t, sT + r0, LDL, r0, y, LDY, 0, 0, MT);
  }
  __syncthreads();  // every reader of B (and of the diagonal blocks) is done
  if (warp < TASKS) {
    for_each_acc<MT, 1>([&](int m, int, int e, int row, int col) {
      if ((e & 1) == 0) {
        *reinterpret_cast<float2*>(sT + (r0 + row) * LDL + c0 + col) = make_float2(-t[m][0].x[e], -t[m][0].x[e + 1]);
      }
    });
  }
  __syncthreads();
}

}  // namespace kdakit::cuda
