// The CUDA decode / speculative-verify kernel: the token recurrence of src/cpu/recurrent.cpp for a few tokens per
// sequence against a state pool, in one launch.
//
// Grid: one CTA per (sequence, v-head, V tile); a CTA has 1, 2 or 4 warps and every warp owns 8 value columns
// of the state over all K, so the V tile is 8 * warps columns. Warps never exchange data during the token math:
// the reductions over K stay inside a warp. The fp32 state tile lives in registers for the whole call (read
// once, written once; per-token states only where asked).
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
// q, k, g, v and beta of up to `tb` tokens are staged in shared memory once per CTA, where one warp per token
// computes the L2 norms, q.k, the gate and the beta activation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/kda_math.h"
#include "cuda/decode/args.h"

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
  static_assert(ND % GRP == 0 && (!VK || ND % VEC == 0), "keys per thread come in whole vectors");
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

// Copies columns [c0, c0 + ncols) of nb token rows of head `head` into the tails of nb float rows of shared
// memory (raw dtype of es bytes at byte offset (4 - es) * ncols of each row), zero past column `limit`. 16-byte
// asynchronous copies where the tensor allows (t.vec), element copies otherwise.
__device__ __forceinline__ void stage_rows(char* dst, const DecodeRows t, int es, int head, int64_t b, int64_t s0,
                                           int nb, int c0, int ncols, int limit, int tid, int nthreads) {
  const char* src = static_cast<const char*>(t.p);
  dst += (4 - es) * ncols;
  const size_t row = 4 * size_t(ncols);
  if (t.vec) {
    const int epc = 16 / es, cpr = ncols / epc;  // elements per copy, copies per row
    for (int e = tid; e < nb * cpr; e += nthreads) {
      const int tt = e / cpr, c = c0 + (e - tt * cpr) * epc;
      const int n_el = limit - c < 0 ? 0 : (limit - c < epc ? limit - c : epc);
      const char* from = n_el > 0 ? src + (t.offset(b, s0 + tt, head) + c) * es : src;
      cp_async16(dst + tt * row + size_t(c - c0) * es, from, n_el * es);
    }
  } else {
    for (int e = tid; e < nb * ncols; e += nthreads) {
      const int tt = e / ncols, c = c0 + (e - tt * ncols);
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

// Outputs may differ in dtype from the pool (e.g. float32 token states next to a bf16 pool): run-time switch.
template <typename L, bool VK>
__device__ __forceinline__ void store_block(const float (&S)[L::NJ][L::ND], const DecodeState st, int64_t block,
                                            const Place& pl) {
  if (st.dtype == DType::kBFloat16) {
    store_block_t<__nv_bfloat16, L, VK>(S, static_cast<__nv_bfloat16*>(st.p) + block, pl, st.vec);
  } else {
    store_block_t<float, L, VK>(S, static_cast<float*>(st.p) + block, pl, st.vec);
  }
}

}  // namespace decode_detail

// Registers: with KP <= 128 five CTAs of 4 warps fit an SM (<= 96 registers) without spills, which keeps enough
// state loads in flight; the [K,V] bf16 tile (8 columns per thread, 16 sums per butterfly) needs up to 128 at
// KP = 128 (four CTAs); KP = 256 holds twice the state per thread.
template <typename L, bool VK, int KP>
constexpr int decode_min_blocks() { return KP > 128 ? 2 : (!VK && L::NJ == 8 && KP == 128 ? 4 : 5); }

// The kernel takes its arguments by value (not __grid_constant__): ptxas then reads them from the constant bank at
// every use instead of holding them in registers across the token loop.
template <typename PoolT, bool VK, int KP>
__global__ void __launch_bounds__(kDecodeMaxWarps * 32, (decode_min_blocks<decode_detail::Tile<PoolT, VK, KP>, VK, KP>()))
    decode_kernel(const DecodeArgs a) {
  using namespace decode_detail;
  using L = Tile<PoolT, VK, KP>;
  constexpr int ND = L::ND, NJ = L::NJ, KL = L::KL, GRP = L::GRP;
  const int nthreads = blockDim.x, nw = nthreads >> 5, bv = nw * kDecodeWarpCols;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  int64_t bid = blockIdx.x;
  const int vt = static_cast<int>(bid % a.vtiles);
  bid /= a.vtiles;
  const int hv = static_cast<int>(bid % a.HV);
  const int n = static_cast<int>(bid / a.HV);
  const int h = hv / a.group;
  const int col0 = vt * bv;                          // the CTA's first value column
  const int wcol0 = col0 + warp * kDecodeWarpCols;  // this warp's first value column

  extern __shared__ __align__(16) char smem[];
  const int tb = a.tb;
  const int es = a.q.dtype == DType::kFloat32 ? 4 : 2, bes = a.beta.dtype == DType::kFloat32 ? 4 : 2;
  const DecodeSmem lay(KP, tb, bv);
  float* sQ = reinterpret_cast<float*>(smem + lay.q);     // [tb][KP] q * scale / |q|
  float* sK = reinterpret_cast<float*>(smem + lay.k);     // [tb][KP] k / |k|
  float* sA = reinterpret_cast<float*>(smem + lay.a);     // [tb][KP] exp(gate)
  float* sV = reinterpret_cast<float*>(smem + lay.v);     // [tb][bv] v of the CTA's columns
  float* sB = reinterpret_cast<float*>(smem + lay.beta);  // [tb][bv] beta of the CTA's columns
  float* sQK = reinterpret_cast<float*>(smem + lay.qk);   // [tb] q.k (normalised, scaled)
  int* sSlot = reinterpret_cast<int*>(smem + lay.slot);   // [tb] per-token slot (2-D indices)
  const DType in_dt = a.q.dtype;

  // Per-sequence scalars: every load is issued before any is used. Slot rules: src/cpu/state.h (plan_slots).
  const bool idx2d = a.state_indices.present() && a.idx_2d;
  const bool per_token = idx2d && a.final_state.present();  // 2-D indices write the state after every token
  const int64_t slot1 = a.state_indices.present() && !idx2d ? a.state_indices.load_int(n * a.idx_s0) : n;
  const int64_t acc = idx2d && a.num_accepted.present() ? a.num_accepted.load_int(n * a.acc_stride) : 1;
  const int64_t has = a.has_initial_state.present() ? a.has_initial_state.load_int(n * a.has_stride) : 1;
  int64_t b, t0, len;
  a.sequence(n, b, t0, len);

  // Step 1 of a token batch: raw inputs into shared memory by asynchronous copies, all in flight at once. The
  // scalars (headwise beta, per-token slots) go through registers; `commit` stores them once they are needed.
  float beta_raw = 0.f;
  int tok_slot = -1;
  auto stage = [&](int64_t i0, int nb) {
    const int64_t s0 = t0 + i0;
    stage_rows(smem + lay.q, a.q, es, h, b, s0, nb, 0, KP, a.K, tid, nthreads);
    stage_rows(smem + lay.k, a.k, es, h, b, s0, nb, 0, KP, a.K, tid, nthreads);
    stage_rows(smem + lay.a, a.g, es, hv, b, s0, nb, 0, KP, a.K, tid, nthreads);
    stage_rows(smem + lay.v, a.v, es, hv, b, s0, nb, col0, bv, a.V, tid, nthreads);
    if (a.beta_cols) {
      stage_rows(smem + lay.beta, a.beta, bes, hv, b, s0, nb, col0, bv, a.V, tid, nthreads);
    } else if (tid < nb) {  // one value per head, activated in step 2
      beta_raw = load_scalar(a.beta.p, a.beta.dtype, a.beta.offset(b, s0 + tid, hv));
    }
    if (per_token && tid < nb) {
      const int64_t t = i0 + tid;  // ids outside the pool: no write (as -1)
      const int64_t w = t < a.idx_cols ? a.state_indices.load_int(n * a.idx_s0 + t * a.idx_s1) : -1;
      tok_slot = w >= 0 && w < a.final_state.slots ? static_cast<int>(w) : -1;
    }
  };
  auto commit = [&](int nb) {
    if (!a.beta_cols && tid < nb) sB[tid * bv] = beta_raw;
    if (per_token && tid < nb) sSlot[tid] = tok_slot;
    cp_async_wait_all();
    __syncthreads();
  };
  if (len > 0) stage(0, static_cast<int>(len < tb ? len : tb));  // before the state: it does not wait for the slots

  // The slots. Ids outside the pool are treated like -1 (no read, no write): the host cannot check device-side
  // indices without a synchronisation.
  int64_t rslot = slot1, wslot = idx2d ? -1 : slot1;
  if (idx2d) rslot = acc >= 1 && acc <= a.idx_cols ? a.state_indices.load_int(n * a.idx_s0 + (acc - 1) * a.idx_s1) : -1;
  if (!a.initial.present() || rslot < 0 || rslot >= a.initial.slots || has == 0) rslot = -1;
  if (!a.final_state.present() || wslot < 0 || wslot >= a.final_state.slots) wslot = -1;

  // The state tile: every load is issued here and stays in flight while the token inputs are prepared.
  const Place pl = place_of<L, VK>(a.K, a.V, wcol0, lane);
  float S[NJ][ND];
  if (rslot >= 0) {
    load_block<PoolT, VK, KP>(S, static_cast<const PoolT*>(a.initial.p) + a.initial.block(rslot, hv), pl, a.initial.vec);
  } else {
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) {
#pragma unroll
      for (int dd = 0; dd < ND; ++dd) S[jj][dd] = 0.f;
    }
  }

  // The head's gate parameters, to shared memory (read by step 2 of every batch); these loads wait, the state's
  // are in flight.
  float* sBias = reinterpret_cast<float*>(smem + lay.bias);
  float* sAlog = reinterpret_cast<float*>(smem + lay.a_log);
  for (int d = tid; d < KP; d += nthreads) {
    sBias[d] = (a.gate_mode != 0 && a.dt_bias.present() && d < a.K) ? a.dt_bias.load(int64_t(hv) * a.K + d) : 0.f;
  }
  if (tid == 0) *sAlog = a.A_log.present() ? a.A_log.load(hv) : 0.f;

  for (int64_t i0 = 0; i0 < len; i0 += tb) {
    const int nb = static_cast<int>(len - i0 < tb ? len - i0 : tb);
    if (i0 > 0) {
      __syncthreads();  // the previous batch's readers are done
      stage(i0, nb);
    }
    commit(nb);

    // 2. Per token, one warp each for (a) the L2 norms and q.k and (b) the gate, v and the beta activation.
    //    A warp reads its raw values into registers before widening them in place (__syncwarp between).
    for (int task = warp; task < 2 * nb; task += nw) {
      const int tt = task >> 1;
      if ((task & 1) == 0) {
        float* q = sQ + tt * KP;
        float* k = sK + tt * KP;
        const char* rq = reinterpret_cast<const char*>(q) + (4 - es) * KP;
        const char* rk = reinterpret_cast<const char*>(k) + (4 - es) * KP;
        float xq[KL], xk[KL];
        float sq = 0.f, sk = 0.f, qk = 0.f;
#pragma unroll
        for (int i = 0; i < KL; ++i) {
          xq[i] = raw_at(rq, in_dt, lane + 32 * i);
          xk[i] = raw_at(rk, in_dt, lane + 32 * i);
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
        const float eps = static_cast<float>(math::kL2NormEps);
        const float nq = a.l2norm ? 1.f / sqrtf(sq + eps) : 1.f;
        const float nk = a.l2norm ? 1.f / sqrtf(sk + eps) : 1.f;
        const float qs = nq * a.scale;
        __syncwarp();  // every lane has read its raw values
#pragma unroll
        for (int i = 0; i < KL; ++i) {
          q[lane + 32 * i] = xq[i] * qs;
          k[lane + 32 * i] = xk[i] * nk;
        }
        if (lane == 0) sQK[tt] = qk * qs * nk;
      } else {
        float* g = sA + tt * KP;
        const char* rg = reinterpret_cast<const char*>(g) + (4 - es) * KP;
        float x[KL];
#pragma unroll
        for (int i = 0; i < KL; ++i) x[i] = raw_at(rg, in_dt, lane + 32 * i);
        float* v = sV + tt * bv;
        float* bt = sB + tt * bv;
        const int c = lane < bv ? lane : bv - 1;  // bv <= 32: one column per lane
        const float xv = raw_at(reinterpret_cast<const char*>(v) + (4 - es) * bv, in_dt, c);
        const float xb = a.beta_cols ? raw_at(reinterpret_cast<const char*>(bt) + (4 - bes) * bv, a.beta.dtype, c) : bt[0];
        __syncwarp();
#pragma unroll
        for (int i = 0; i < KL; ++i) {
          const int d = lane + 32 * i;
          float decay = 0.f;  // keys past K hold zero state; any finite factor works
          if (d < a.K) {
            float y = x[i];
            if (a.gate_mode != 0) y = math::gate_value<float>(a.gate_mode, y + sBias[d], *sAlog, a.A_log.present(), a.lower_bound);
            decay = expf(y);
          }
          g[d] = decay;
        }
        if (lane < bv) {
          v[lane] = xv;
          bt[lane] = math::beta_value<float>(xb, a.beta_sigmoid, a.neg_eigval);
        }
      }
    }
    __syncthreads();

    // 3. The tokens, state in registers.
    for (int tt = 0; tt < nb; ++tt) {
      const float* q = sQ + tt * KP;
      const float* k = sK + tt * KP;
      const float* g = sA + tt * KP;
      float pk[NJ], pq[NJ];
#pragma unroll
      for (int jj = 0; jj < NJ; ++jj) pk[jj] = pq[jj] = 0.f;
#pragma unroll
      for (int dd = 0; dd < ND; dd += GRP) {
        const int d = key_of<L, VK>(dd, lane);
        float gv[GRP], kv[GRP], qv[GRP];
        load_keys<GRP>(g + d, gv);
        load_keys<GRP>(k + d, kv);
        load_keys<GRP>(q + d, qv);
#pragma unroll
        for (int i = 0; i < GRP; ++i) {
#pragma unroll
          for (int jj = 0; jj < NJ; ++jj) {
            const float s = S[jj][dd + i] * gv[i];
            S[jj][dd + i] = s;
            pk[jj] = fmaf(kv[i], s, pk[jj]);
            pq[jj] = fmaf(qv[i], s, pq[jj]);
          }
        }
      }
#pragma unroll
      for (int jj = 0; jj < NJ; ++jj) {
        pk[jj] = column_sum<L, VK>(pk[jj]);
        pq[jj] = column_sum<L, VK>(pq[jj]);
      }
      const int64_t s = t0 + i0 + tt;
      const float qk = sQK[tt];
      // After the butterfly every lane of a column group holds the sums; the group's first lane stores o.
      const bool leader = VK ? (lane & 7) == 0 : lane < L::LV;
      const int64_t orow = b * a.out_sb + s * a.out_st + int64_t(hv) * a.out_sh + col0;
      float e[NJ];
#pragma unroll
      for (int jj = 0; jj < NJ; ++jj) {
        const int cl = warp * kDecodeWarpCols + col_of<L, VK>(jj, lane);  // column within the CTA tile
        e[jj] = sB[tt * bv + cl] * (sV[tt * bv + cl] - pk[jj]);
        if (leader && col0 + cl < a.V) a.out.store(orow + cl, fmaf(qk, e[jj], pq[jj]));
      }
#pragma unroll
      for (int dd = 0; dd < ND; dd += GRP) {
        float kv[GRP];
        load_keys<GRP>(k + key_of<L, VK>(dd, lane), kv);
#pragma unroll
        for (int i = 0; i < GRP; ++i) {
#pragma unroll
          for (int jj = 0; jj < NJ; ++jj) S[jj][dd + i] = fmaf(kv[i], e[jj], S[jj][dd + i]);
        }
      }
      if (a.token_states.present()) {
        store_block<L, VK>(S, a.token_states, a.token_states.block(b * a.T + s, hv), pl);
      }
      if (per_token) {
        const int w = sSlot[tt];
        if (w >= 0) store_block<L, VK>(S, a.final_state, a.final_state.block(w, hv), pl);
      }
    }
  }
  if (wslot >= 0) store_block<L, VK>(S, a.final_state, a.final_state.block(wslot, hv), pl);
}

}  // namespace kdakit::cuda
