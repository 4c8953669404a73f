// The CUDA decode / speculative-verify kernel: the token recurrence of src/cpu/recurrent.cpp for a few tokens per
// sequence against a state pool, in one launch.
//
// Grid: one CTA per (sequence, v-head, V tile); a CTA has 1, 2 or 4 warps and every warp owns 8 value columns
// of the state over all K per pass; a CTA makes 1, 2 or 4 passes (run time), so the V tile is 8 * warps * passes
// columns. Warps never exchange data during the token math: the reductions over K stay inside a warp. A pass's
// fp32 state lives in registers from its first token to its last (read once, written once; per-token states only
// where asked).
//
// State loads: the whole tile (every pass) is issued up front as 16-byte cp.async copies into shared memory, one
// commit group per pass, each thread copying exactly the vectors it later reads (no barrier: cp.async.wait_group
// orders them). The loads in flight are then bounded by shared memory (a 32 KB tile per CTA), not by the 32 state
// registers of a thread (128 B fp32 / 64 B bf16 in flight each).
//
// Thread mapping (a template flag, chosen so that global accesses are 16-byte vectors and each instruction of a
// warp covers whole 128-byte lines where the layout allows):
//   v-first [V,K] (VK):  lane = 8 * jr + lk. Lanes lk = 0..7 span K in VEC-element vectors (VEC = 4 fp32 or
//                        8 bf16); lanes jr = 0..3 take 4 value rows; a thread holds 2 rows x KP/8 keys.
//                        One load covers 4 rows x 8 consecutive vectors (128 contiguous bytes per row).
//   [K,V] (KV):          lane = LV * dr + lv. The LV = 8 / VEC lanes lv (2 fp32, 1 bf16) take VEC consecutive
//                        value columns each (one 16-byte vector); the 32 / LV lanes dr span K; a thread holds
//                        KP * LV / 32 keys x VEC columns. One load covers 16 (32) rows x 32 (16) bytes.
// The reduction over K is a butterfly over the lanes that share columns (3 steps for VK; 4 or 5 for KV).
//
// Per token: S *= exp(g) (per key); kS and qS from the decayed state in one pass; e = beta (v - kS);
// o = qS + (q.k) e, which equals q.(S + k e^T) without a second pass over the state; S += k e^T.
// q, k, g, v and beta of up to `tb` tokens are staged in shared memory once per CTA (once for all passes when the
// sequence fits one batch), where one warp per token computes the L2 norms, q.k, the gate and the beta activation
// (rsqrtf and the special function unit: ex2.approx, as the CUDA forward's gate).
//
// The one-token form (ONE, decode_one_token) serves calls whose sequences have at most one token: every thread
// loads and prepares its own inputs in registers, with no barrier; its state goes straight to registers (one pass)
// or, at large batches (STAGED), through the thread's own slots of a staged tile (docs/ARCHITECTURE.md).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/kda_math.h"
#include "cuda/decode/args.h"

// Latency analysis builds only (-DKDAKIT_DECODE_STAMPS): thread 0 of every 16th CTA prints the SM clock at each
// phase of its first pass (tools/gpu/decode_stamps.py reads them).
#ifdef KDAKIT_DECODE_STAMPS
#include <cstdio>
#define KDAKIT_STAMP(i) \
  do { if (threadIdx.x == 0) asm volatile("mov.u64 %0, %%clock64;" : "=l"(stamp_[i])::"memory"); } while (0)
// The clock once the float `val` has landed (an instruction that reads it, then the clock).
#define KDAKIT_STAMP_AFTER(i, val)                                                                           \
  do {                                                                                                       \
    if (threadIdx.x == 0) {                                                                                  \
      float d_;                                                                                              \
      asm volatile("{add.f32 %1, %2, 0f00000000;\n mov.u64 %0, %%clock64;}" : "=l"(stamp_[i]), "=f"(d_) : "f"(val) \
                   : "memory");                                                                              \
      stamp_[i] += d_ == 123.25f;                                                                            \
    }                                                                                                        \
  } while (0)
#define KDAKIT_STAMP_PARAM , long long* stamp_
#define KDAKIT_STAMP_ARG , stamp_
// A kernel's stamp array and global start time.
#define KDAKIT_STAMPS_BEGIN                                             \
  long long stamp_[11] = {};                                            \
  unsigned long long gt0_;                                              \
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt0_)::"memory")
#else
#define KDAKIT_STAMP(i) \
  do {                  \
  } while (0)
#define KDAKIT_STAMP_AFTER(i, val) \
  do {                           \
  } while (0)
#define KDAKIT_STAMP_PARAM
#define KDAKIT_STAMP_ARG
#define KDAKIT_STAMPS_BEGIN \
  do {                      \
  } while (0)
#endif

namespace kdakit::cuda {
namespace decode_detail {

template <typename PoolT, bool VK, int KP>
struct Tile {
  static constexpr int VEC = 16 / static_cast<int>(sizeof(PoolT));  // elements per 16-byte state vector
  static constexpr int LV = VK ? 0 : 8 / VEC;                        // [K,V]: lanes across a warp's 8 columns
  static constexpr int LANES_K = VK ? 8 : 32 / LV;                   // lanes sharing columns, spanning K
  static constexpr int ND = KP / LANES_K;                            // keys per thread
  static constexpr int NJ = VK ? 2 : VEC;                            // value columns per thread
  static constexpr int GRP = ND < 4 ? ND : 4;                        // keys per shared-memory vector read
  static constexpr int KL = KP / 32;                                 // keys per lane in the preparation
  static constexpr int NVEC = NJ * ND / VEC;                         // 16-byte state vectors per thread and pass
  static_assert(ND % GRP == 0 && (!VK || ND % VEC == 0), "keys per thread come in whole vectors");
  static_assert(NJ * ND == KP / 4, "decode_state_tile_bytes: KP / 4 state elements per thread and pass");
  static_assert(NJ * (VK ? 4 : LV) == kDecodeWarpCols, "a warp owns kDecodeWarpCols value columns");
  static_assert(kDecodeMaxWarps * kDecodeWarpCols <= 32, "the preparation widens one CTA column per lane");
};

// Column (relative to the warp's first) of this thread's value slot jj.
template <typename L, bool VK>
__device__ __forceinline__ int col_of(int jj, int lane) {
  if constexpr (VK) return jj * 4 + (lane >> 3);
  else return (lane % L::LV) * L::VEC + jj;
}

// Key index of this thread's key slot dd. Groups of GRP consecutive dd map to GRP consecutive keys.
template <typename L, bool VK>
__device__ __forceinline__ int key_of(int dd, int lane) {
  if constexpr (VK) return ((dd / L::VEC) * 8 + (lane & 7)) * L::VEC + dd % L::VEC;
  else return (lane / L::LV) * L::ND + dd;
}

// Sum over the lanes that share this thread's columns (a butterfly: every one of them gets the sum).
template <typename L, bool VK>
__device__ __forceinline__ float column_sum(float x) {
#pragma unroll
  for (int m = VK ? 1 : L::LV; m < (VK ? 8 : 32); m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// ---- token inputs ------------------------------------------------------------------------------------------

// 16 bytes global -> shared, asynchronously; bytes past `src_bytes` are zero-filled (masking K and V tails).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most `pending` (0..kDecodeMaxPasses) of this thread's most recent cp.async groups are in flight.
__device__ __forceinline__ void cp_async_wait_pending(int pending) {
  switch (pending) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 4;\n" ::: "memory"); break;
  }
}
static_assert(kDecodeMaxPasses <= 4, "cp_async_wait_pending covers up to 4 pending groups");

// ---- fast math (the special function unit) -------------------------------------------------------------------

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The gate in log2 units (as GateLog2 of the CUDA forward): x = raw gate + dt_bias (modes 1, 2) or the natural-log
// gate itself (mode 0); exp(A_log) is computed once per warp task, not per element.
struct DecodeGate {
  int mode;
  float a, coef;  // a = exp(A_log) (1 without); coef: mode 1 -exp(A_log) log2 e, mode 2 lower_bound log2 e
  __device__ __forceinline__ DecodeGate(int m, float A_log, bool has_A_log, float lower_bound) : mode(m) {
    a = has_A_log ? expf(A_log) : 1.f;
    coef = mode == 1 ? -a * kLog2e : lower_bound * kLog2e;
  }
  template <int M>
  __device__ __forceinline__ float log2_gate_of(float x) const {
    if constexpr (M == 0) return x * kLog2e;
    if constexpr (M == 1) return coef * (x > 20.f ? x : log1pf(fast_exp2(x * kLog2e)));  // softplus, FLA's threshold
    return __fdividef(coef, 1.f + fast_exp2(-a * kLog2e * x));  // coef * sigmoid(a x); 0 when the exponent overflows
  }
  __device__ __forceinline__ float log2_gate(float x) const {
    return mode == 0 ? log2_gate_of<0>(x) : mode == 1 ? log2_gate_of<1>(x) : log2_gate_of<2>(x);
  }
  // exp(gate) of n raw values (+ bias): one branch on the mode for all of them, not one per value.
  template <int NV>
  __device__ __forceinline__ void exp_gates(const float* x, const float* bias, float* out) const {
    if (mode == 0) {
#pragma unroll
      for (int i = 0; i < NV; ++i) out[i] = fast_exp2(log2_gate_of<0>(x[i] + bias[i]));
    } else if (mode == 1) {
#pragma unroll
      for (int i = 0; i < NV; ++i) out[i] = fast_exp2(log2_gate_of<1>(x[i] + bias[i]));
    } else {
#pragma unroll
      for (int i = 0; i < NV; ++i) out[i] = fast_exp2(log2_gate_of<2>(x[i] + bias[i]));
    }
  }
};

// math::beta_value with the special function unit: identity, sigmoid or 2 * sigmoid.
__device__ __forceinline__ float fast_beta(float raw, bool use_sigmoid, bool neg_eigval) {
  if (!use_sigmoid) return raw;
  return (neg_eigval ? 2.f : 1.f) * __frcp_rn(1.f + fast_exp2(-raw * kLog2e));  // 1 / inf = 0
}

// Copies columns [c0, c0 + ncols) of nb token rows of head `head` into the tails of nb float rows of shared
// memory (raw dtype of es bytes at byte offset (4 - es) * ncols of each row), zero past column `limit`. 16-byte
// asynchronous copies where the tensor allows (t.vec), element copies otherwise. `lane` of `nlanes` threads share
// the copies (one warp per tensor: the four tensors' address arithmetic runs in parallel, not one after the
// other). ncols is a power of two (KP, or the CTA tile's 8 * warps * passes columns), so rows and columns of a
// copy index are a shift and a mask.
__device__ __forceinline__ void stage_rows(char* dst, const DecodeRows t, int es, int head, int64_t b, int64_t s0,
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

// ---- state vectors -----------------------------------------------------------------------------------------
// State traffic is streamed (read once, written once per call): evict-first cache hints.

template <typename T, int N>
__device__ __forceinline__ void load_state_vec(const T* p, int64_t off, int valid, bool vec, float* x) {
  if (vec && valid >= N) {
    if constexpr (std::is_same<T, float>::value) {
#pragma unroll
      for (int i = 0; i < N; i += 4) {
        const float4 v = __ldcs(reinterpret_cast<const float4*>(p + off + i));
        x[i] = v.x; x[i + 1] = v.y; x[i + 2] = v.z; x[i + 3] = v.w;
      }
    } else if constexpr (N == 8) {
      const uint4 u = __ldcs(reinterpret_cast<const uint4*>(p + off));
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[2 * i] = bf16_lo(w[i]);
        x[2 * i + 1] = bf16_hi(w[i]);
      }
    } else {
      static_assert(N == 4, "bf16 state vectors hold 4 or 8 elements");
      const uint2 u = __ldcs(reinterpret_cast<const uint2*>(p + off));
      x[0] = bf16_lo(u.x); x[1] = bf16_hi(u.x); x[2] = bf16_lo(u.y); x[3] = bf16_hi(u.y);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      float v = 0.f;
      if (i < valid) {
        if constexpr (std::is_same<T, float>::value) v = p[off + i];
        else v = __bfloat162float(p[off + i]);
      }
      x[i] = v;
    }
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_state_vec(T* p, int64_t off, int valid, bool vec, const float* x) {
  if (vec && valid >= N) {
    if constexpr (std::is_same<T, float>::value) {
#pragma unroll
      for (int i = 0; i < N; i += 4) __stcs(reinterpret_cast<float4*>(p + off + i), make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]));
    } else if constexpr (N == 8) {
      __stcs(reinterpret_cast<uint4*>(p + off), make_uint4(pack_bf16(x[0], x[1]), pack_bf16(x[2], x[3]),
                                                          pack_bf16(x[4], x[5]), pack_bf16(x[6], x[7])));
    } else {
      static_assert(N == 4, "bf16 state vectors hold 4 or 8 elements");
      __stcs(reinterpret_cast<uint2*>(p + off), make_uint2(pack_bf16(x[0], x[1]), pack_bf16(x[2], x[3])));
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (i < valid) {
        if constexpr (std::is_same<T, float>::value) p[off + i] = x[i];
        else p[off + i] = __float2bfloat16_rn(x[i]);
      }
    }
  }
}

// N consecutive floats of shared memory (N = 4 or 2, aligned).
template <int N>
__device__ __forceinline__ void load_keys(const float* p, float (&x)[N]) {
  if constexpr (N == 4) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    x[0] = v.x; x[1] = v.y; x[2] = v.z; x[3] = v.w;
  } else {
    static_assert(N == 2, "2 or 4 keys");
    const float2 v = *reinterpret_cast<const float2*>(p);
    x[0] = v.x; x[1] = v.y;
  }
}

// Where this thread's vectors lie in a state block (computed once; offsets within a block fit in 32 bits).
//   VK: vector (jj, r) at off + jj * step + r * 8 * VEC; it exists if jj * 4 < lim_j, with lim_k - r * 8 * VEC
//       elements inside K.
//   KV: vector dd at off + dd * step; it exists if dd < lim_k, with lim_j elements inside V.
struct Place {
  int off, step, lim_j, lim_k;
};

template <typename L, bool VK>
__device__ __forceinline__ Place place_of(int K, int V, int wcol0, int lane) {
  const int j = wcol0 + col_of<L, VK>(0, lane), d = key_of<L, VK>(0, lane);
  if constexpr (VK) return Place{j * K + d, 4 * K, V - j, K - d};
  else return Place{d * V + j, V, V - j, K - d};
}

// The thread's part of one state block (the block of one (slot, v-head)), in the layout's native order.
template <typename PoolT, bool VK, int KP>
__device__ __forceinline__ void load_block(float (&S)[Tile<PoolT, VK, KP>::NJ][Tile<PoolT, VK, KP>::ND], const PoolT* p,
                                           const Place& pl, bool vec) {
  using L = Tile<PoolT, VK, KP>;
  if constexpr (VK) {
#pragma unroll
    for (int jj = 0; jj < L::NJ; ++jj) {
#pragma unroll
      for (int dd = 0; dd < L::ND; dd += L::VEC) {
        const int r8 = (dd / L::VEC) * 8 * L::VEC;
        load_state_vec<PoolT, L::VEC>(p + pl.off + jj * pl.step + r8, 0, jj * 4 < pl.lim_j ? pl.lim_k - r8 : 0, vec,
                                      &S[jj][dd]);
      }
    }
  } else {
#pragma unroll
    for (int dd = 0; dd < L::ND; ++dd) {
      float x[L::VEC];
      load_state_vec<PoolT, L::VEC>(p + pl.off + dd * pl.step, 0, dd < pl.lim_k ? pl.lim_j : 0, vec, x);
#pragma unroll
      for (int jj = 0; jj < L::NJ; ++jj) S[jj][dd] = x[jj];
    }
  }
}

template <typename T, typename L, bool VK>
__device__ __forceinline__ void store_block_t(const float (&S)[L::NJ][L::ND], T* p, const Place& pl, bool vec) {
  if constexpr (VK) {
#pragma unroll
    for (int jj = 0; jj < L::NJ; ++jj) {
#pragma unroll
      for (int dd = 0; dd < L::ND; dd += L::VEC) {
        const int r8 = (dd / L::VEC) * 8 * L::VEC;
        store_state_vec<T, L::VEC>(p + pl.off + jj * pl.step + r8, 0, jj * 4 < pl.lim_j ? pl.lim_k - r8 : 0, vec,
                                   &S[jj][dd]);
      }
    }
  } else {
#pragma unroll
    for (int dd = 0; dd < L::ND; ++dd) {
      float x[L::VEC];
#pragma unroll
      for (int jj = 0; jj < L::NJ; ++jj) x[jj] = S[jj][dd];
      store_state_vec<T, L::VEC>(p + pl.off + dd * pl.step, 0, dd < pl.lim_k ? pl.lim_j : 0, vec, x);
    }
  }
}

// ---- the staged state tile ----------------------------------------------------------------------------------
// A thread copies exactly the 16-byte vectors it later reads (those load_block would read as vectors) into its own
// slots of shared memory: vector vi of pass p at ((p * NVEC + vi) * nthreads + tid) * 16. So cp.async.wait_group
// alone orders them (no barrier), and a warp's shared-memory reads are consecutive 16-byte pieces (no bank
// conflicts). Vectors that cannot be copied whole (K or V tails, unaligned pools) are read from global memory, element
// by element, when the pass starts.

// Vector vi of the thread's tile part: its element offset from pl.off and the number of its elements inside K/V.
template <typename L, bool VK>
__device__ __forceinline__ void vector_of(int vi, const Place& pl, int& off, int& valid) {
  if constexpr (VK) {
    constexpr int PER_J = L::ND / L::VEC;
    const int jj = vi / PER_J, r8 = (vi % PER_J) * 8 * L::VEC;
    off = jj * pl.step + r8;
    valid = jj * 4 < pl.lim_j ? pl.lim_k - r8 : 0;
  } else {
    off = vi * pl.step;
    valid = vi < pl.lim_k ? pl.lim_j : 0;
  }
}

// bytes = 0: zero-fill (no initial state) without reading the pool.
template <typename PoolT, bool VK, int KP>
__device__ __forceinline__ void issue_block_async(const PoolT* p, const Place& pl, char* sm, int nthreads,
                                                  int bytes = 16) {
  using L = Tile<PoolT, VK, KP>;
#pragma unroll
  for (int vi = 0; vi < L::NVEC; ++vi) {
    int off, valid;
    vector_of<L, VK>(vi, pl, off, valid);
    if (valid >= L::VEC) cp_async16(sm + size_t(vi) * nthreads * 16, p + pl.off + off, bytes);
  }
}

template <typename PoolT, bool VK, int KP>
__device__ __forceinline__ void load_block_staged(float (&S)[Tile<PoolT, VK, KP>::NJ][Tile<PoolT, VK, KP>::ND],
                                                  const PoolT* p, const Place& pl, const char* sm, int nthreads) {
  using L = Tile<PoolT, VK, KP>;
#pragma unroll
  for (int vi = 0; vi < L::NVEC; ++vi) {
    int off, valid;
    vector_of<L, VK>(vi, pl, off, valid);
    float x[L::VEC];
    if (valid >= L::VEC) {
      const uint4 u = *reinterpret_cast<const uint4*>(sm + size_t(vi) * nthreads * 16);
      if constexpr (std::is_same<PoolT, float>::value) {
        x[0] = __uint_as_float(u.x); x[1] = __uint_as_float(u.y); x[2] = __uint_as_float(u.z); x[3] = __uint_as_float(u.w);
      } else {
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          x[2 * i] = bf16_lo(w[i]);
          x[2 * i + 1] = bf16_hi(w[i]);
        }
      }
    } else {
      load_state_vec<PoolT, L::VEC>(p + pl.off + off, 0, valid, false, x);
    }
    if constexpr (VK) {
      constexpr int PER_J = L::ND / L::VEC;
#pragma unroll
      for (int i = 0; i < L::VEC; ++i) S[vi / PER_J][(vi % PER_J) * L::VEC + i] = x[i];
    } else {
#pragma unroll
      for (int jj = 0; jj < L::NJ; ++jj) S[jj][vi] = x[jj];
    }
  }
}

// L2 prefetch of the state tile that the CTA o.prefetch_ahead places later in launch order will stage (blocks are
// dispatched in linear order; the host sets one place per SM, so that CTA starts a fraction of a CTA's lifetime
// later, after about one CTA per SM has ended). Its copies then hit L2, and the state reads in flight are no longer
// bounded by the shared memory of the resident CTAs (docs/perf-notes.md). Bulk prefetches (sm_90): v-first, the tile
// is one contiguous block (thread 0); [K,V], one row of the tile's columns per key (thread k). The later CTA's slot is
// loaded first (`locate`, beside this CTA's own scalars), the prefetch issued after this CTA's own copies.
struct LaterTile {
  int slot = -1;
  unsigned z = 0, hv = 0;
  template <bool VK, int KP>
  __device__ __forceinline__ void locate(const DecodeOneArgs& o) {
    if (o.prefetch_ahead <= 0 || threadIdx.x >= (VK ? 1u : unsigned(KP))) return;
    // 64-bit: N * HV * vtiles may pass 2^32.
    const uint64_t per_z = uint64_t(gridDim.x) * gridDim.y;
    const uint64_t target =
        blockIdx.x + uint64_t(gridDim.x) * blockIdx.y + per_z * blockIdx.z + uint64_t(o.prefetch_ahead);
    if (target >= per_z * gridDim.z) return;
    z = static_cast<unsigned>(target / per_z);
    const uint64_t rem = target - uint64_t(z) * per_z;
    hv = static_cast<unsigned>(rem / gridDim.x);
    const int n = static_cast<int>(rem - uint64_t(hv) * gridDim.x);
    slot = o.state_indices != nullptr ? __ldg(o.state_indices + n * int(o.idx_stride)) : n;
  }
  template <typename PoolT, bool VK, int KP>
  __device__ __forceinline__ void prefetch(const DecodeOneArgs& o, int tile_cols) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (slot < 0 || slot >= o.initial_slots) return;
    const PoolT* head = static_cast<const PoolT*>(o.initial) + int64_t(slot) * o.initial_slot_stride +
                        size_t(hv) * KP * o.V;
    const PoolT* from =
        VK ? head + size_t(z) * tile_cols * KP : head + size_t(threadIdx.x) * o.V + size_t(z) * tile_cols;
    const unsigned bytes = unsigned(tile_cols) * unsigned(sizeof(PoolT)) * (VK ? KP : 1);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(from), "r"(bytes) : "memory");
#else
    (void)o;
    (void)tile_cols;
#endif
  }
};

// Outputs may differ in dtype from the pool (e.g. float32 token states next to a bf16 pool): run-time switch, except
// for FULL tiles (every state output is in the pool's dtype, vector-aligned).
template <typename PoolT, typename L, bool VK, bool FULL>
__device__ __forceinline__ void store_block(const float (&S)[L::NJ][L::ND], const DecodeState st, int64_t block,
                                            const Place& pl) {
  if constexpr (FULL) {
    store_block_t<PoolT, L, VK>(S, static_cast<PoolT*>(st.p) + block, pl, true);
  } else if (st.dtype == DType::kBFloat16) {
    store_block_t<__nv_bfloat16, L, VK>(S, static_cast<__nv_bfloat16*>(st.p) + block, pl, st.vec);
  } else {
    store_block_t<float, L, VK>(S, static_cast<float*>(st.p) + block, pl, st.vec);
  }
}


// The squared norms of q and k and q.k over K, from lane l's raw values at keys l + 32 i (i < KP / 32): sums in i
// order, then a butterfly over the warp. Both forms of the kernel reduce in this order, so that their results agree
// to the bit.
template <int KL>
__device__ __forceinline__ void norm_sums(const float (&xq)[KL], const float (&xk)[KL], float& sq, float& sk, float& qk) {
  sq = sk = qk = 0.f;
#pragma unroll
  for (int i = 0; i < KL; ++i) {
    sq = fmaf(xq[i], xq[i], sq);
    sk = fmaf(xk[i], xk[i], sk);
    qk = fmaf(xq[i], xk[i], qk);
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    sq += __shfl_xor_sync(0xffffffffu, sq, m);
    sk += __shfl_xor_sync(0xffffffffu, sk, m);
    qk += __shfl_xor_sync(0xffffffffu, qk, m);
  }
}

// ---- the token math, shared by both forms -------------------------------------------------------------------
// One token on the thread's state part, in the order both forms use (their results agree to the bit). `keys(dd, q,
// k, g)` gives q, k and exp(gate) of the thread's GRP consecutive keys from key slot dd on (shared memory in the
// general form, registers in the one-token form).
//   token_sums: S *= exp(g); kS and qS from the decayed state, summed over K (every lane of a column group gets
//               the sums).
//   token_update: S += k e^T.
template <typename L, bool VK, typename Keys>
__device__ __forceinline__ void token_sums(float (&S)[L::NJ][L::ND], const Keys& keys, float (&pk)[L::NJ],
                                           float (&pq)[L::NJ]) {
  constexpr int GRP = L::GRP;
#pragma unroll
  for (int jj = 0; jj < L::NJ; ++jj) pk[jj] = pq[jj] = 0.f;
#pragma unroll
  for (int dd = 0; dd < L::ND; dd += GRP) {
    float qv[GRP], kv[GRP], gv[GRP];
    keys(dd, qv, kv, gv);
#pragma unroll
    for (int i = 0; i < GRP; ++i) {
#pragma unroll
      for (int jj = 0; jj < L::NJ; ++jj) {
        const float s = S[jj][dd + i] * gv[i];
        S[jj][dd + i] = s;
        pk[jj] = fmaf(kv[i], s, pk[jj]);
        pq[jj] = fmaf(qv[i], s, pq[jj]);
      }
    }
  }
#pragma unroll
  for (int jj = 0; jj < L::NJ; ++jj) {
    pk[jj] = column_sum<L, VK>(pk[jj]);
    pq[jj] = column_sum<L, VK>(pq[jj]);
  }
}

template <typename L, typename KeysK>
__device__ __forceinline__ void token_update(float (&S)[L::NJ][L::ND], const KeysK& keys_k, const float (&e)[L::NJ]) {
  constexpr int GRP = L::GRP;
#pragma unroll
  for (int dd = 0; dd < L::ND; dd += GRP) {
    float kv[GRP];
    keys_k(dd, kv);
#pragma unroll
    for (int i = 0; i < GRP; ++i) {
#pragma unroll
      for (int jj = 0; jj < L::NJ; ++jj) S[jj][dd + i] = fmaf(kv[i], e[jj], S[jj][dd + i]);
    }
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

// The whole call for this CTA's tile (all its passes) when its sequence has at most one token; false (nothing done) when
// it has more (varlen calls whose lengths the host could not read), for the general path to take over. Needs what
// the host checked (DecodeConfig::one): K == KP, whole V tiles, vector-aligned token rows and states in the pool's
// dtype, 1-D or no slot indices, no per-token states, q, k, v, g, beta and out of one dtype (In), dt_bias and A_log
// float32. Element types are compile-time here: at small batches a CTA's time is mostly the fetch of the
// instructions it runs (docs/perf-notes.md), and run-time dtype switches per load multiply them.
// A sequence's scalars for the one-token form, loaded before anything waits (int32 slot ids and cu_seqlens: the
// host checked). The slot's load starts the chain slot -> state -> token math, so it is the kernel's first load.
// row: the token tensors' row of its token (OneRows): the token with cu_seqlens, the batch row n otherwise.
struct OneTokenSeq {
  int slot1, has, row, len;
  __device__ __forceinline__ explicit OneTokenSeq(const DecodeOneArgs& o) {
    const int n = static_cast<int>(blockIdx.x);
    slot1 = o.state_indices != nullptr ? __ldg(o.state_indices + n * int(o.idx_stride)) : n;
    has = 1;
    if (o.has_initial_state != nullptr) {
      has = static_cast<int>(
          DynPtr{const_cast<void*>(o.has_initial_state), o.has_dtype()}.load_int(n * int(o.has_stride)));
    }
    if (o.cu_seqlens != nullptr) {
      row = __ldg(o.cu_seqlens + n * int(o.cu_stride));
      len = __ldg(o.cu_seqlens + (n + 1) * int(o.cu_stride)) - row;
    } else {
      row = n;
      len = o.T();
    }
  }
};

template <typename PoolT, bool VK, int KP, bool STAGED, typename In>
__device__ __forceinline__ bool decode_one_token(const DecodeOneArgs& o, const OneTokenSeq& sq_ KDAKIT_STAMP_PARAM) {
  using L = Tile<PoolT, VK, KP>;
  constexpr int ND = L::ND, NJ = L::NJ, KL = L::KL;
  constexpr int RUN = VK ? L::VEC : ND;  // consecutive keys of a thread
  // The gate: VK threads that differ only in their value rows (lane bits 3, 4) hold the same keys; each computes a
  // quarter of them and takes the rest by shuffles (the softplus is the preparation's longest part).
  constexpr int QN = VK ? ND / 4 : ND;
  static_assert(!VK || QN <= L::VEC, "a quarter of a thread's keys lies in one run");
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int hv = static_cast<int>(blockIdx.y);
  const int h = o.group_shift >= 0 ? hv >> o.group_shift : hv / o.group;
  // The CTA tile: `passes` column groups of bv = 8 * warps columns (STAGED; one otherwise); this warp's columns of
  // pass p start at wcol0 + p * bv. The thread's keys, and so its q, k and gate, are the same in every pass.
  const int passes = STAGED ? o.passes : 1, bv = (blockDim.x >> 5) * kDecodeWarpCols;
  const int wcol0 = static_cast<int>(blockIdx.z) * bv * passes + warp * kDecodeWarpCols;

  // Token inputs: every load is issued before any is used (the inputs' offsets do not depend on the slot; with
  // cu_seqlens they wait for the sequence's start).
  const int slot1 = sq_.slot1, has = sq_.has, row = sq_.row, len = sq_.len;
  LaterTile later;
  if constexpr (STAGED) later.locate<VK, KP>(o);
  if (len > 1) return false;
  KDAKIT_STAMP(1);
  const bool tok = len == 1;
  float xq[ND], xk[ND], xg[QN], bias[QN], xv[NJ], xb[NJ], nq_raw[KL], nk_raw[KL];
  const int dd0 = VK ? (lane >> 3) * QN : 0;  // the first of this thread's gate keys (slot index)
  const int gkey = key_of<L, VK>(dd0, lane);
  float alog = 0.f;
  const In *v = nullptr, *bt = nullptr;
  // v and beta at this thread's columns of pass p (loaded one pass ahead of their use).
  auto load_v_beta = [&](int p, float (&xv_)[NJ], float (&xb_)[NJ]) {
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) {
      const int c = p * bv + col_of<L, VK>(jj, lane);
      xv_[jj] = to_float(__ldg(v + c));
      xb_[jj] = to_float(__ldg(bt + (o.beta_cols() ? c : 0)));
    }
  };
  if (tok) {
    // Offsets in 32 bits (the host checked that every token tensor's do), pointers advanced by compile-time steps.
    const In* q = static_cast<const In*>(o.q.p) + o.q.offset(row, h);
    const In* k = static_cast<const In*>(o.k.p) + o.k.offset(row, h);
    const int d0 = key_of<L, VK>(0, lane);
#pragma unroll
    for (int r = 0; r < ND / RUN; ++r) {
      const int dr = key_of<L, VK>(r * RUN, 0) - key_of<L, VK>(0, 0);  // compile-time
      load_run<RUN>(q + d0 + dr, &xq[r * RUN]);
      load_run<RUN>(k + d0 + dr, &xk[r * RUN]);
    }
#pragma unroll
    for (int i = 0; i < KL; ++i) {  // the norms' keys (norm_sums): loaded beside the thread's own, in flight together
      nq_raw[i] = to_float(__ldg(q + lane + 32 * i));
      nk_raw[i] = to_float(__ldg(k + lane + 32 * i));
    }
    load_run<QN>(static_cast<const In*>(o.g.p) + o.g.offset(row, hv) + gkey, xg);
    if (o.gate_mode() != 0 && o.dt_bias != nullptr) {
      load_run<QN>(o.dt_bias + hv * KP + gkey, bias);
    } else {
#pragma unroll
      for (int i = 0; i < QN; ++i) bias[i] = 0.f;
    }
    alog = o.A_log != nullptr ? __ldg(o.A_log + hv) : 0.f;
    v = static_cast<const In*>(o.v.p) + o.v.offset(row, hv) + wcol0;
    bt = static_cast<const In*>(o.beta.p) + o.beta.offset(row, hv) + (o.beta_cols() ? wcol0 : 0);
    load_v_beta(0, xv, xb);
  }
  KDAKIT_STAMP(2);

  // The slot (ids outside the pool: neither read nor written), then the state's loads. One pass: straight into
  // registers. Several (large batches): every pass's 16-byte vectors are issued now as cp.async copies
  // into this thread's own slots of shared memory (one group per pass), so the bytes in flight are bounded by
  // shared memory rather than registers, and cp.async.wait_group alone orders them (the general form's staged
  // tile, without its barrier).
  const int rslot = o.initial == nullptr || slot1 < 0 || slot1 >= o.initial_slots || has == 0 ? -1 : slot1;
  const int wslot = o.final_state == nullptr || slot1 < 0 || slot1 >= o.final_slots ? -1 : slot1;
  const Place pf = place_of<L, VK>(KP, o.V, wcol0, lane);
  auto place = [&](int p) {  // pass p: bv columns further (VK: rows of K elements; [K,V]: elements)
    return Place{pf.off + p * bv * (VK ? KP : 1), pf.step, 1 << 20, 1 << 20};
  };
  const size_t head_block = size_t(hv) * KP * o.V;  // dense heads (the host checked)
  const PoolT* src =
      rslot >= 0 ? static_cast<const PoolT*>(o.initial) + int64_t(rslot) * o.initial_slot_stride + head_block : nullptr;
  extern __shared__ __align__(16) char one_smem[];
  char* staged = one_smem + size_t(tid) * 16;  // this thread's slots
  const int pass_bytes = L::NVEC * static_cast<int>(blockDim.x) * 16;
  float S[NJ][ND];
  auto zero_state = [&]() {
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) {
#pragma unroll
      for (int dd = 0; dd < ND; ++dd) S[jj][dd] = 0.f;
    }
  };
  if (STAGED) {
    if (rslot >= 0) {
      for (int p = 0; p < passes; ++p) {
        issue_block_async<PoolT, VK, KP>(src, place(p), staged + size_t(p) * pass_bytes, blockDim.x);
        cp_async_commit();
      }
    }
    later.prefetch<PoolT, VK, KP>(o, passes * bv);
  } else if (rslot >= 0) {
    load_block<PoolT, VK, KP>(S, src, place(0), true);
  } else {
    zero_state();
  }
  KDAKIT_STAMP(3);

  // The preparation, once for all passes: the same operations in the same order as the general path (norm_sums,
  // its preparation and token math), so that a sequence's bits do not depend on which form ran it.
  float gv[ND], qkn = 0.f;
  if (tok) {
    KDAKIT_STAMP_AFTER(4, xq[ND - 1] + nq_raw[KL - 1] + xg[QN - 1]);
    float sq, sk, qk;
    norm_sums<KL>(nq_raw, nk_raw, sq, sk, qk);
    const float eps = static_cast<float>(math::kL2NormEps);
    const bool l2 = o.l2norm();
    const float qs = (l2 ? rsqrtf(sq + eps) : 1.f) * o.scale, nk = l2 ? rsqrtf(sk + eps) : 1.f;
    qkn = qk * qs * nk;
    KDAKIT_STAMP_AFTER(5, qkn);
#pragma unroll
    for (int dd = 0; dd < ND; ++dd) {
      xq[dd] *= qs;
      xk[dd] *= nk;
    }
    const DecodeGate gate(o.gate_mode(), alog, o.A_log != nullptr, o.lower_bound);
    float gq[QN];
    gate.exp_gates<QN>(xg, bias, gq);
#pragma unroll
    for (int dd = 0; dd < ND; ++dd) {
      if constexpr (VK) gv[dd] = __shfl_sync(0xffffffffu, gq[dd % QN], (dd / QN) * 8 + (lane & 7));
      else gv[dd] = gq[dd];
    }
    KDAKIT_STAMP_AFTER(6, gv[ND - 1]);
  }
  const bool leader = VK ? (lane & 7) == 0 : lane < L::LV;
  const int orow = tok ? o.out.offset(row, hv) + wcol0 : 0;

  for (int p = 0; p < passes; ++p) {
    if (STAGED) {  // this pass's copies are complete once at most the later passes' groups are in flight
      if (rslot >= 0) {
        cp_async_wait_pending(passes - 1 - p);
        load_block_staged<PoolT, VK, KP>(S, src, place(p), staged + size_t(p) * pass_bytes, blockDim.x);
      } else {
        zero_state();
      }
    }
    float nv[NJ], nb[NJ];
    if (tok && p + 1 < passes) load_v_beta(p + 1, nv, nb);
    if (tok) {
      KDAKIT_STAMP_AFTER(7, S[NJ - 1][ND - 1]);
      // The token: S *= exp(g); kS and qS in one pass; e = beta (v - kS); o = qS + (q.k) e; S += k e^T.
      constexpr int GRP = L::GRP;
      float pk[NJ], pq[NJ];
      token_sums<L, VK>(S, [&](int dd, float (&q_)[GRP], float (&k_)[GRP], float (&g_)[GRP]) {
#pragma unroll
        for (int i = 0; i < GRP; ++i) {
          q_[i] = xq[dd + i];
          k_[i] = xk[dd + i];
          g_[i] = gv[dd + i];
        }
      }, pk, pq);
      float e[NJ];
#pragma unroll
      for (int jj = 0; jj < NJ; ++jj) {
        e[jj] = fast_beta(xb[jj], o.beta_sigmoid(), o.neg_eigval()) * (xv[jj] - pk[jj]);
        if (leader) {
          static_cast<In*>(o.out.p)[orow + p * bv + col_of<L, VK>(jj, lane)] = from_float<In>(fmaf(qkn, e[jj], pq[jj]));
        }
      }
      token_update<L>(S, [&](int dd, float (&k_)[GRP]) {
#pragma unroll
        for (int i = 0; i < GRP; ++i) k_[i] = xk[dd + i];
      }, e);
      KDAKIT_STAMP_AFTER(8, S[NJ - 1][ND - 1]);
    }
    if (wslot >= 0) {
      store_block_t<PoolT, L, VK>(S, static_cast<PoolT*>(o.final_state) + int64_t(wslot) * o.final_slot_stride +
                                         head_block, place(p), true);
    }
    if (tok && p + 1 < passes) {
#pragma unroll
      for (int jj = 0; jj < NJ; ++jj) {
        xv[jj] = nv[jj];
        xb[jj] = nb[jj];
      }
    }
  }
  KDAKIT_STAMP(9);
  return true;
}

// The one-token form for this CTA: the sequence's scalars, then the body for q's dtype. False: the sequence has
// more than one token (the general path takes over). STAGED: the state staged in shared memory over o.passes
// passes; a compile-time flag, so that the one-pass body (small batches, where a CTA's time follows the code it
// fetches) carries no code of the staged one.
template <typename PoolT, bool VK, int KP, bool STAGED>
__device__ __forceinline__ bool decode_one_call(const DecodeOneArgs& o KDAKIT_STAMP_PARAM) {
  const OneTokenSeq seq(o);  // before the dispatch, which waits for a kernel parameter
  const DType in_dt = o.in_dtype();
  return in_dt == DType::kBFloat16 ? decode_one_token<PoolT, VK, KP, STAGED, __nv_bfloat16>(o, seq KDAKIT_STAMP_ARG)
         : in_dt == DType::kFloat16 ? decode_one_token<PoolT, VK, KP, STAGED, __half>(o, seq KDAKIT_STAMP_ARG)
                                    : decode_one_token<PoolT, VK, KP, STAGED, float>(o, seq KDAKIT_STAMP_ARG);
}

#ifdef KDAKIT_DECODE_STAMPS
// Thread 0 of every 16th CTA prints its stamps (clock cycles after stamp 0) and its global start and end times.
static __device__ __noinline__ void print_stamps(const long long* stamp_, unsigned long long gt0, int nw, int passes) {
  const long long block_id = blockIdx.x + gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
  if (threadIdx.x == 0 && block_id % 16 == 0) {
    unsigned long long gt1;
    unsigned smid;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt1)::"memory");
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    long long d[10];
    for (int i = 0; i < 10; ++i) d[i] = stamp_[i + 1] - stamp_[0];
    printf("STAMP blk %lld sm %u warps %d passes %d gt %llu %llu clk %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld\n",
           block_id, smid, nw, passes, gt0, gt1, d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7], d[8], d[9]);
  }
}
#endif

}  // namespace decode_detail

// Registers: with KP <= 128 five CTAs of 4 warps fit an SM (<= 96 registers) without spills; the [K,V] bf16 tile
// (8 columns per thread, 16 sums per butterfly) needs up to 128 at KP = 128 (four CTAs); KP = 256 holds twice the
// state per thread. The state loads in flight are not bounded by registers: the tile is staged in shared memory.
template <typename L, bool VK, int KP>
constexpr int decode_min_blocks() { return KP > 128 ? 2 : (!VK && L::NJ == 8 && KP == 128 ? 4 : 5); }

// The kernel takes its arguments by value (not __grid_constant__): ptxas then reads them from the constant bank at
// every use instead of holding them in registers across the token loop.
//
// FULL (run-time facts the host checked): K == KP, the V tiles are whole, the state is staged, and every state
// output has the pool's dtype and vector alignment. The tile's places then need no K / V masks and fold to
// constants: the general form spends ~85% of its instructions on such bookkeeping (ncu, T1 N1024 H16 bf16 pool).
//
// ONE (the host checked DecodeConfig::one's conditions): sequences of one token take decode_one_token, whose
// register preparation holds q, k and the gate of a thread's keys beside its state (up to 128 registers: four CTAs
// per SM); longer ones (varlen calls whose lengths the host could not read) the general path.
template <typename PoolT, bool VK, int KP, bool FULL, bool ONE>
__global__ void __launch_bounds__(kDecodeMaxWarps * 32,
                                  (ONE ? 4 : decode_min_blocks<decode_detail::Tile<PoolT, VK, KP>, VK, KP>()))
    decode_kernel(const DecodeArgs a) {
  using namespace decode_detail;
  static_assert(!(ONE && FULL), "the one-token form falls back to the general (masked) path");
  KDAKIT_STAMPS_BEGIN;
  KDAKIT_STAMP(0);
  if constexpr (ONE) {
    if (a.one.passes > 1 ? decode_one_call<PoolT, VK, KP, true>(a.one KDAKIT_STAMP_ARG)
                         : decode_one_call<PoolT, VK, KP, false>(a.one KDAKIT_STAMP_ARG)) {
      KDAKIT_STAMP(10);
#ifdef KDAKIT_DECODE_STAMPS
      decode_detail::print_stamps(stamp_, gt0_, blockDim.x >> 5, 0);
#endif
      return;
    }
  }
  using L = Tile<PoolT, VK, KP>;
  constexpr int ND = L::ND, NJ = L::NJ, KL = L::KL, GRP = L::GRP;
  constexpr int MC = kDecodeMaxTileCols / 32;  // tile columns per lane in the preparation
  // FULL: K, V and the staging are known to the compiler (V only through "every tile is whole").
  const bool stage_state = FULL || a.stage_state;
  const int Kc = FULL ? KP : a.K, Vc = FULL ? (1 << 30) : a.V;
  const int nthreads = blockDim.x, nw = nthreads >> 5, bv = nw * kDecodeWarpCols;
  const int passes = a.passes, bvt = bv * passes;  // columns per pass; columns of the CTA tile
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // Grid (N, HV, vtiles): no divisions on the way to the slot load.
  const int n = static_cast<int>(blockIdx.x), hv = static_cast<int>(blockIdx.y), vt = static_cast<int>(blockIdx.z);
  const int h = hv / a.group;
  const int col0 = vt * bvt;  // the CTA's first value column

  extern __shared__ __align__(16) char smem[];
  const int tb = a.tb;
  const int es = a.q.dtype == DType::kFloat32 ? 4 : 2, bes = a.beta.dtype == DType::kFloat32 ? 4 : 2;
  const DecodeSmem lay(KP, tb, bvt,
                       stage_state ? decode_state_tile_bytes(KP, int(sizeof(PoolT)), nthreads, passes) : 0);
  float* sQ = reinterpret_cast<float*>(smem + lay.q);     // [tb][KP] q * scale / |q|
  float* sK = reinterpret_cast<float*>(smem + lay.k);     // [tb][KP] k / |k|
  float* sA = reinterpret_cast<float*>(smem + lay.a);     // [tb][KP] exp(gate)
  float* sV = reinterpret_cast<float*>(smem + lay.v);     // [tb][bvt] v of the CTA's columns
  float* sB = reinterpret_cast<float*>(smem + lay.beta);  // [tb][bvt] beta of the CTA's columns
  float* sQK = reinterpret_cast<float*>(smem + lay.qk);   // [tb] q.k (normalised, scaled)
  int* sSlot = reinterpret_cast<int*>(smem + lay.slot);   // [tb] per-token slot (2-D indices)
  char* sState = smem + lay.state + size_t(tid) * 16;     // this thread's staged state vectors
  const DType in_dt = a.q.dtype;
  KDAKIT_STAMP(1);

  // Per-sequence scalars: every load is issued before any is used. Slot rules: src/cpu/state.h (plan_slots).
  const bool idx2d = a.state_indices.present() && a.idx_2d;
  const bool per_token = idx2d && a.final_state.present();  // 2-D indices write the state after every token
  const int64_t slot1 = a.state_indices.present() && !idx2d ? a.state_indices.load_int(n * a.idx_s0) : n;
  const int64_t acc = idx2d && a.num_accepted.present() ? a.num_accepted.load_int(n * a.acc_stride) : 1;
  const int64_t has = a.has_initial_state.present() ? a.has_initial_state.load_int(n * a.has_stride) : 1;
  // The head's gate parameters, into registers now (they go to shared memory once the state's copies are issued):
  // in flight with the slot loads, not after them.
  constexpr int NBIAS = KP / 32;  // dt_bias values per thread (CTAs have 32 threads or more)
  float bias_r[NBIAS];
  const bool use_bias = a.gate_mode != 0 && a.dt_bias.present();
#pragma unroll
  for (int i = 0; i < NBIAS; ++i) {
    const int d = tid + i * nthreads;
    bias_r[i] = use_bias && d < Kc ? a.dt_bias.load(int64_t(hv) * Kc + d) : 0.f;
  }
  const float alog_r = tid == 0 && a.A_log.present() ? a.A_log.load(hv) : 0.f;
  int64_t b64, t064, len64;
  a.sequence(n, b64, t064, len64);
  const int b = static_cast<int>(b64), t0 = static_cast<int>(t064), len = static_cast<int>(len64);  // < 2^31
  KDAKIT_STAMP(2);

  // Step 1 of a token batch: raw inputs into shared memory by asynchronous copies, all in flight at once, committed
  // as one group. The scalars (headwise beta, per-token slots) go through registers; `commit` stores them once they
  // are needed.
  float beta_raw = 0.f;
  int tok_slot = -1;
  auto stage = [&](int i0, int nb) {
    const int64_t s0 = int64_t(t0) + i0;
    // Tensor i (q, k, g, v, then beta per column) is copied by warp i % nw: the tensors' address arithmetic runs
    // in parallel on the warps, not one after the other on every thread.
    const int ntensors = a.beta_cols ? 5 : 4;
    for (int i = warp; i < ntensors; i += nw) {
      const bool rows_k = i < 3;  // q, k, g: K columns; v, beta: the tile's columns
      const DecodeRows& t = i == 0 ? a.q : i == 1 ? a.k : i == 2 ? a.g : i == 3 ? a.v : a.beta;
      const size_t off = i == 0 ? lay.q : i == 1 ? lay.k : i == 2 ? lay.a : i == 3 ? lay.v : lay.beta;
      stage_rows(smem + off, t, i == 4 ? bes : es, i == 0 || i == 1 ? h : hv, b, s0, nb, rows_k ? 0 : col0,
                 rows_k ? KP : bvt, rows_k ? Kc : Vc, lane, 32);
    }
    KDAKIT_STAMP(3);
    if (!a.beta_cols && tid < nb) {  // one value per head, activated in step 2
      beta_raw = load_scalar(a.beta.p, a.beta.dtype, a.beta.offset(b, s0 + tid, hv));
    }
    if (per_token && tid < nb) {
      const int64_t t = i0 + tid;  // ids outside the pool: no write (as -1)
      const int64_t w = t < a.idx_cols ? a.state_indices.load_int(n * a.idx_s0 + t * a.idx_s1) : -1;
      tok_slot = w >= 0 && w < a.final_state.slots ? static_cast<int>(w) : -1;
    }
    cp_async_commit();
  };
  // `pending`: cp.async groups committed after the batch's that may stay in flight (the state tile's passes).
  auto commit = [&](int nb, int pending) {
    if (!a.beta_cols && tid < nb) sB[tid * bvt] = beta_raw;
    if (per_token && tid < nb) sSlot[tid] = tok_slot;
    cp_async_wait_pending(pending);
    __syncthreads();
  };
  if (len > 0) stage(0, static_cast<int>(len < tb ? len : tb));  // before the state: it does not wait for the slots
  KDAKIT_STAMP(4);

  // The slots. Ids outside the pool are treated like -1 (no read, no write): the host cannot check device-side
  // indices without a synchronisation.
  int64_t rslot64 = slot1, wslot64 = idx2d ? -1 : slot1;
  if (idx2d) rslot64 = acc >= 1 && acc <= a.idx_cols ? a.state_indices.load_int(n * a.idx_s0 + (acc - 1) * a.idx_s1) : -1;
  if (!a.initial.present() || rslot64 < 0 || rslot64 >= a.initial.slots || has == 0) rslot64 = -1;
  if (!a.final_state.present() || wslot64 < 0 || wslot64 >= a.final_state.slots) wslot64 = -1;
  const int rslot = static_cast<int>(rslot64), wslot = static_cast<int>(wslot64);  // -1 or a slot of the pool (int32)
  const bool has_src = rslot >= 0;
  auto src = [&]() { return static_cast<const PoolT*>(a.initial.p) + a.initial.block(rslot, hv); };

  // The state tile: with stage_state every pass's copies are issued here, one cp.async group per pass (empty ones
  // too, so that the group count is the same for every thread), and stay in flight while the token inputs are
  // prepared and while earlier passes compute.
  const int tile_vecs = L::NVEC * nthreads * 16;  // bytes of one pass in shared memory
  // Where a warp's vectors lie (FULL: K = KP and no masks, so offsets and bounds are compile-time where possible).
  auto place = [&](int wcol0) {
    if constexpr (FULL) {
      const Place pf = place_of<L, VK>(KP, a.V, wcol0, lane);  // [K,V]: V is the row stride
      return Place{pf.off, pf.step, 1 << 20, 1 << 20};
    } else {
      return place_of<L, VK>(Kc, Vc, wcol0, lane);
    }
  };
  if (stage_state) {
    for (int p = 0; p < passes; ++p) {
      // FULL without an initial state: the copies zero-fill the tile (no zeroing branch per pass).
      if (FULL || has_src) {
        issue_block_async<PoolT, VK, KP>(has_src ? src() : static_cast<const PoolT*>(a.initial.p),
                                         place(col0 + p * bv + warp * kDecodeWarpCols),
                                         sState + size_t(p) * tile_vecs, nthreads, has_src ? 16 : 0);
      }
      cp_async_commit();
    }
  }
  const int state_groups = stage_state ? passes : 0;
  KDAKIT_STAMP(5);

  // The head's gate parameters to shared memory (read by step 2 of every batch).
  float* sBias = reinterpret_cast<float*>(smem + lay.bias);
  float* sAlog = reinterpret_cast<float*>(smem + lay.a_log);
#pragma unroll
  for (int i = 0; i < NBIAS; ++i) {
    const int d = tid + i * nthreads;
    if (d < KP) sBias[d] = bias_r[i];
  }
  if (tid == 0) *sAlog = alog_r;

  // A sequence of one batch (len <= tb, every serving call) prepares its tokens once for all passes; longer ones
  // stage and prepare every batch again in every pass.
  const bool multi = len > tb;
  for (int p = 0; p < passes; ++p) {
    const int pc0 = p * bv;                                  // the pass's first column within the tile
    const int wcol0 = col0 + pc0 + warp * kDecodeWarpCols;  // this warp's first value column
    const Place pl = place(wcol0);
    float S[NJ][ND];
    // The pass's state into registers: its own copies are complete once at most the later passes' groups are in
    // flight. Without an initial state: zero.
    auto load_pass = [&]() {
      if (stage_state) {
        cp_async_wait_pending(passes - 1 - p);
        if (FULL || has_src) load_block_staged<PoolT, VK, KP>(S, src(), pl, sState + size_t(p) * tile_vecs, nthreads);
      } else if (has_src) {
        load_block<PoolT, VK, KP>(S, src(), pl, a.initial.vec);  // never FULL
      }
      if (!FULL && !has_src) {
#pragma unroll
        for (int jj = 0; jj < NJ; ++jj) {
#pragma unroll
          for (int dd = 0; dd < ND; ++dd) S[jj][dd] = 0.f;
        }
      }
    };
    if (len <= 0) load_pass();  // an empty sequence: its final state is its initial state
    for (int i0 = 0; i0 < len; i0 += tb) {
      const int nb = static_cast<int>(len - i0 < tb ? len - i0 : tb);
      if (p == 0 || multi) {
        if (p > 0 || i0 > 0) {
          __syncthreads();  // the previous batch's readers are done
          stage(i0, nb);
          commit(nb, 0);
        } else {
          commit(nb, state_groups);
          KDAKIT_STAMP(6);
        }

        // 2. Per token, one warp each for (a) the L2 norms and q.k, (b) the gate and (c) v and the beta
        //    activation (three tasks: at T = 1 three of four warps work, and the gate's chain is not followed by
        //    v's). A warp reads its raw values into registers before widening them in place (__syncwarp between).
        for (int task = warp; task < 3 * nb; task += nw) {
          const int tt = task / 3, kind = task - 3 * tt;
          if (kind == 0) {
            float* q = sQ + tt * KP;
            float* k = sK + tt * KP;
            const char* rq = reinterpret_cast<const char*>(q) + (4 - es) * KP;
            const char* rk = reinterpret_cast<const char*>(k) + (4 - es) * KP;
            float xq[KL], xk[KL];
#pragma unroll
            for (int i = 0; i < KL; ++i) {
              xq[i] = raw_at(rq, in_dt, lane + 32 * i);
              xk[i] = raw_at(rk, in_dt, lane + 32 * i);
            }
            float sq, sk, qk;
            norm_sums<KL>(xq, xk, sq, sk, qk);
            const float eps = static_cast<float>(math::kL2NormEps);
            const float nq = a.l2norm ? rsqrtf(sq + eps) : 1.f;
            const float nk = a.l2norm ? rsqrtf(sk + eps) : 1.f;
            const float qs = nq * a.scale;
            __syncwarp();  // every lane has read its raw values
#pragma unroll
            for (int i = 0; i < KL; ++i) {
              q[lane + 32 * i] = xq[i] * qs;
              k[lane + 32 * i] = xk[i] * nk;
            }
            if (lane == 0) sQK[tt] = qk * qs * nk;
          } else if (kind == 1) {
            float* g = sA + tt * KP;
            const char* rg = reinterpret_cast<const char*>(g) + (4 - es) * KP;
            float x[KL];
#pragma unroll
            for (int i = 0; i < KL; ++i) x[i] = raw_at(rg, in_dt, lane + 32 * i);
            const DecodeGate gate(a.gate_mode, *sAlog, a.A_log.present(), a.lower_bound);
            __syncwarp();
#pragma unroll
            for (int i = 0; i < KL; ++i) {
              const int d = lane + 32 * i;
              // keys past K hold zero state; any finite factor works
              g[d] = d < Kc ? fast_exp2(gate.log2_gate(a.gate_mode != 0 ? x[i] + sBias[d] : x[i])) : 0.f;
            }
          } else {  // v and beta of the tile's columns
            float* v = sV + tt * bvt;
            float* bt = sB + tt * bvt;
            const char* rv = reinterpret_cast<const char*>(v) + (4 - es) * bvt;
            const char* rb = reinterpret_cast<const char*>(bt) + (4 - bes) * bvt;
            float xv[MC], xb[MC];
#pragma unroll
            for (int i = 0; i < MC; ++i) {
              const int c = lane + 32 * i;
              xv[i] = xb[i] = 0.f;
              if (c < bvt) {
                xv[i] = raw_at(rv, in_dt, c);
                xb[i] = a.beta_cols ? raw_at(rb, a.beta.dtype, c) : bt[0];
              }
            }
            __syncwarp();
#pragma unroll
            for (int i = 0; i < MC; ++i) {
              const int c = lane + 32 * i;
              if (c < bvt) {
                v[c] = xv[i];
                bt[c] = fast_beta(xb[i], a.beta_sigmoid, a.neg_eigval);
              }
            }
          }
        }
        __syncthreads();
        if (p == 0 && i0 == 0) KDAKIT_STAMP(7);
      }

      if (i0 == 0) load_pass();  // after the first preparation, which the state's copies overlap
      if (p == 0 && i0 == 0) KDAKIT_STAMP(8);

      // 3. The tokens, state in registers.
      for (int tt = 0; tt < nb; ++tt) {
        const float* q = sQ + tt * KP;
        const float* k = sK + tt * KP;
        const float* g = sA + tt * KP;
        float pk[NJ], pq[NJ];
        token_sums<L, VK>(S, [&](int dd, float (&q_)[GRP], float (&k_)[GRP], float (&g_)[GRP]) {
          const int d = key_of<L, VK>(dd, lane);
          load_keys<GRP>(g + d, g_);
          load_keys<GRP>(k + d, k_);
          load_keys<GRP>(q + d, q_);
        }, pk, pq);
        const int64_t s = int64_t(t0) + i0 + tt;
        const float qk = sQK[tt];
        // After the butterfly every lane of a column group holds the sums; the group's first lane stores o.
        const bool leader = VK ? (lane & 7) == 0 : lane < L::LV;
        const int64_t orow = int64_t(b) * a.out_sb + s * a.out_st + int64_t(hv) * a.out_sh + col0;
        float e[NJ];
#pragma unroll
        for (int jj = 0; jj < NJ; ++jj) {
          const int cl = pc0 + warp * kDecodeWarpCols + col_of<L, VK>(jj, lane);  // column within the CTA tile
          e[jj] = sB[tt * bvt + cl] * (sV[tt * bvt + cl] - pk[jj]);
          if (leader && col0 + cl < Vc) a.out.store(orow + cl, fmaf(qk, e[jj], pq[jj]));
        }
        token_update<L>(S, [&](int dd, float (&k_)[GRP]) { load_keys<GRP>(k + key_of<L, VK>(dd, lane), k_); }, e);
        if (a.token_states.present()) {
          store_block<PoolT, L, VK, FULL>(S, a.token_states, a.token_states.block(int64_t(b) * a.T + s, hv), pl);
        }
        if (per_token) {
          const int w = sSlot[tt];
          if (w >= 0) store_block<PoolT, L, VK, FULL>(S, a.final_state, a.final_state.block(w, hv), pl);
        }
      }
    }
    if (wslot >= 0) store_block<PoolT, L, VK, FULL>(S, a.final_state, a.final_state.block(wslot, hv), pl);
    if (p == 0) KDAKIT_STAMP(9);
  }
  KDAKIT_STAMP(10);
#ifdef KDAKIT_DECODE_STAMPS
  decode_detail::print_stamps(stamp_, gt0_, nw, passes);
#endif
}

// The one-token form's own entry, for calls in which the host knows every sequence has at most one token (fixed
// T = 1, or lengths read on the host): it takes only the packed DecodeOneArgs (304 bytes instead of DecodeArgs'
// 952), so its launch carries a small argument block, and holds no general path (no fall-back to size for).
template <typename PoolT, bool VK, int KP, bool STAGED>
__global__ void __launch_bounds__(kDecodeMaxWarps * 32, 4) decode_one_kernel(const DecodeOneArgs o) {
  KDAKIT_STAMPS_BEGIN;
  KDAKIT_STAMP(0);
  decode_detail::decode_one_call<PoolT, VK, KP, STAGED>(o KDAKIT_STAMP_ARG);
  KDAKIT_STAMP(10);
#ifdef KDAKIT_DECODE_STAMPS
  decode_detail::print_stamps(stamp_, gt0_, blockDim.x >> 5, 0);
#endif
}

}  // namespace kdakit::cuda
