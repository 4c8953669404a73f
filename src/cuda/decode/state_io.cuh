// The decode kernels' state tile: which state elements a thread holds (Tile, its key and column slots), their loads
// and stores in 16-byte vectors (evict-first: state traffic is streamed, read once and written once per call), the
// tile staged in shared memory by cp.async, and the L2 prefetch of a later CTA's tile.
#pragma once

#include <type_traits>

#include "cuda/common/sm80/cp_async.cuh"
#include "cuda/decode/args.h"
#include "cuda/decode/tile_size.h"

namespace kdakit::cuda::decode_detail {

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

// The general form's staged key rows (q, k, exp(gate) per token in shared memory) are stored in the order the
// threads read them: the thread's key group g (GRP consecutive keys from slot g GRP on) of K-lane kl (the lanes that
// span K: lane & 7 v-first, lane / LV [K,V]) at 16-byte unit g LANES_K + kl. A warp's reads of one group are then
// consecutive 16-byte units (no bank conflicts), where in key order they lie VEC or ND keys apart.
template <typename L, bool VK>
__device__ __forceinline__ int key_unit(int dd, int lane) {
  const int kl = VK ? (lane & 7) : lane / (VK ? 1 : L::LV);
  return ((dd / L::GRP) * L::LANES_K + kl) * L::GRP + dd % L::GRP;
}
// The position of key d in that order (the inverse of key_of, then key_unit).
template <typename L, bool VK>
__device__ __forceinline__ int key_pos(int d) {
  int kl, dd;
  if constexpr (VK) {
    kl = (d / L::VEC) % 8;
    dd = (d / (8 * L::VEC)) * L::VEC + d % L::VEC;
  } else {
    kl = d / L::ND;
    dd = d % L::ND;
  }
  return ((dd / L::GRP) * L::LANES_K + kl) * L::GRP + dd % L::GRP;
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

// ---- [K,V] staged tiles by whole row segments ---------------------------------------------------------------
// In the [K,V] layout a warp's own vectors lie on 16 (fp32) or 32 (bf16) rows, 32 or 16 bytes of each, so copies and
// stores by owner touch four to eight times the cache lines per instruction that v-first ones do, and the L1/L2
// request rate, not DRAM, bounded the kernel. The staged one-token form therefore copies a pass tile (KP rows of bv
// columns) by row segments -- consecutive threads, consecutive 16-byte pieces of a row -- into shared memory in row
// order, and writes the updated tile back the same way; each direction costs a barrier (threads read what others
// wrote). Row order with one 16-byte unit of padding after every ND rows: an owner's lanes then read distinct banks
// (lane l's rows start l units further), and a pass tile takes kDecodeKvRowPad more bytes. Whole tiles only.
// Piece c of row d (cpr pieces per row) at 16-byte unit d * cpr + c + (d / ND) * LV.
template <typename L>
struct KvRows {
  static_assert(L::LANES_K % L::ND == 0, "rows d0 + i LANES_K are ND-row groups apart");
  static_assert(L::LANES_K * L::LV * 16 == kDecodeKvRowPad, "the padding of a pass tile");
  int cpr;        // 16-byte pieces per row segment of a pass tile
  int copy0, copy_step, unit0, unit_step;  // copy order: this thread's vector i at global row row0 + i LANES_K
  int row0, piece;
  __device__ __forceinline__ explicit KvRows(int nthreads) {
    cpr = (nthreads >> 5) * L::LV;
    const int cpr_shift = __ffs(cpr) - 1;
    const int tid = static_cast<int>(threadIdx.x);
    row0 = tid >> cpr_shift;
    piece = tid & (cpr - 1);
    copy0 = (row0 * cpr + piece + (row0 / L::ND) * L::LV) * 16;
    copy_step = (L::LANES_K * cpr + (L::LANES_K / L::ND) * L::LV) * 16;
  }
  // The owner's vector vi (Tile mapping: row (lane / LV) ND + vi, piece warp LV + lane % LV).
  __device__ __forceinline__ int owned(int vi) const {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, d = (lane / L::LV) * L::ND + vi;
    return (d * cpr + warp * L::LV + lane % L::LV + (lane / L::LV) * L::LV) * 16;
  }
};

// head_c0: the state block of (slot, head) advanced to the pass tile's first column; V: its row stride.
// bytes = 0: zero-fill (no initial state) without reading.
template <typename PoolT, int KP>
__device__ __forceinline__ void issue_rows_async(const PoolT* head_c0, int V, char* sm, int nthreads, int bytes = 16) {
  using L = Tile<PoolT, false, KP>;
  const KvRows<L> r(nthreads);
  const PoolT* from = bytes > 0 ? head_c0 + size_t(r.row0) * V + r.piece * L::VEC : head_c0;
#pragma unroll
  for (int i = 0; i < L::NVEC; ++i) {
    cp_async16(sm + r.copy0 + i * r.copy_step, bytes > 0 ? from + size_t(i) * L::LANES_K * V : from, bytes);
  }
}

template <typename PoolT, int KP>
__device__ __forceinline__ void load_rows_staged(float (&S)[Tile<PoolT, false, KP>::NJ][Tile<PoolT, false, KP>::ND],
                                                 const char* sm, int nthreads) {
  using L = Tile<PoolT, false, KP>;
  const KvRows<L> r(nthreads);
#pragma unroll
  for (int vi = 0; vi < L::NVEC; ++vi) {
    const uint4 u = *reinterpret_cast<const uint4*>(sm + r.owned(vi));
    if constexpr (std::is_same<PoolT, float>::value) {
      S[0][vi] = __uint_as_float(u.x); S[1][vi] = __uint_as_float(u.y);
      S[2][vi] = __uint_as_float(u.z); S[3][vi] = __uint_as_float(u.w);
    } else {
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        S[2 * i][vi] = bf16_lo(w[i]);
        S[2 * i + 1][vi] = bf16_hi(w[i]);
      }
    }
  }
}

template <typename PoolT, int KP>
__device__ __forceinline__ void stage_block_out(const float (&S)[Tile<PoolT, false, KP>::NJ][Tile<PoolT, false, KP>::ND],
                                                char* sm, int nthreads) {
  using L = Tile<PoolT, false, KP>;
  const KvRows<L> r(nthreads);
#pragma unroll
  for (int vi = 0; vi < L::NVEC; ++vi) {
    uint4 u;
    if constexpr (std::is_same<PoolT, float>::value) {
      u = make_uint4(__float_as_uint(S[0][vi]), __float_as_uint(S[1][vi]), __float_as_uint(S[2][vi]),
                     __float_as_uint(S[3][vi]));
    } else {
      u = make_uint4(pack_bf16(S[0][vi], S[1][vi]), pack_bf16(S[2][vi], S[3][vi]), pack_bf16(S[4][vi], S[5][vi]),
                     pack_bf16(S[6][vi], S[7][vi]));
    }
    *reinterpret_cast<uint4*>(sm + r.owned(vi)) = u;
  }
}

template <typename PoolT, int KP>
__device__ __forceinline__ void store_rows(PoolT* head_c0, int V, const char* sm, int nthreads) {
  using L = Tile<PoolT, false, KP>;
  const KvRows<L> r(nthreads);
  PoolT* to = head_c0 + size_t(r.row0) * V + r.piece * L::VEC;
#pragma unroll
  for (int i = 0; i < L::NVEC; ++i) {
    __stcs(reinterpret_cast<uint4*>(to + size_t(i) * L::LANES_K * V),
           *reinterpret_cast<const uint4*>(sm + r.copy0 + i * r.copy_step));
  }
}

// The thread's part of a tile to global memory by row segments through `sm` (a pass tile's region, free): owners'
// vectors in, a barrier, row segments out, a barrier (the region may be written again next).
template <typename PoolT, int KP>
__device__ __forceinline__ void store_tile_rows(const float (&S)[Tile<PoolT, false, KP>::NJ][Tile<PoolT, false, KP>::ND],
                                                PoolT* head_c0, int V, char* sm, int nthreads) {
  stage_block_out<PoolT, KP>(S, sm, nthreads);
  __syncthreads();
  store_rows<PoolT, KP>(head_c0, V, sm, nthreads);
  __syncthreads();
}

// L2 prefetch of the state tile that the CTA o.prefetch_ahead places later in launch order will stage (blocks are
// dispatched in linear order; the host sets one place per SM, so that CTA starts a fraction of a CTA's lifetime
// later, after about one CTA per SM has ended). Its copies then hit L2, and the state reads in flight are no longer
// bounded by the shared memory of the resident CTAs (docs/perf-notes.md). Bulk prefetches (sm_90): a tile that is one
// contiguous range (v-first, or [K,V] tiles of whole rows) by thread 0; otherwise one row of the tile's columns per
// key (thread k). The later CTA's slot is loaded first (`locate`, beside this CTA's own scalars), the prefetch issued
// after this CTA's own copies. The later CTA's grid place is this one's advanced by prefetch_ahead in mixed radix
// (x fastest): a carry, not a division, where prefetch_ahead < gridDim.x (every staged launch the host makes).
// This CTA's grid place advanced by `ahead` in launch order (x fastest, a mixed-radix add); false past the grid's end.
__device__ __forceinline__ bool later_place(unsigned ahead, unsigned& x, unsigned& y, unsigned& z) {
  const unsigned X = gridDim.x;
  x = blockIdx.x + ahead;  // < 2^31 + 2^16
  y = blockIdx.y;
  z = blockIdx.z;
  if (x >= X) {
    if (ahead < X) {
      x -= X;
      ++y;
    } else {
      y += x / X;
      x %= X;
    }
    if (y >= gridDim.y) {
      z += y / gridDim.y;
      y %= gridDim.y;
    }
    if (z >= gridDim.z) return false;
  }
  return true;
}

// The bulk L2 prefetch of a later CTA's tile: `tile_cols` columns from column z tile_cols of the state block `head`
// (KP x V elements); one range by the calling thread, or (one_range false: [K,V] tiles of part of the rows) the row
// of key threadIdx.x.
template <typename PoolT, int KP>
__device__ __forceinline__ void prefetch_tile_l2(const PoolT* head, int V, unsigned z, int tile_cols, bool one_range) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const PoolT* from = one_range ? head + size_t(z) * tile_cols * KP
                                : head + size_t(threadIdx.x) * V + size_t(z) * tile_cols;
  const unsigned bytes = unsigned(tile_cols) * unsigned(sizeof(PoolT)) * (one_range ? KP : 1);
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(from), "r"(bytes) : "memory");
#else
  (void)head;
  (void)V;
  (void)z;
  (void)tile_cols;
  (void)one_range;
#endif
}

struct LaterTile {
  int slot = -1;
  unsigned z = 0, hv = 0;
  template <bool VK, int KP>
  __device__ __forceinline__ void locate(const DecodeOneArgs& o, bool one_range) {
    if (o.prefetch_ahead <= 0 || threadIdx.x >= (one_range ? 1u : unsigned(KP))) return;
    unsigned x, y, zz;
    if (!later_place(o.prefetch_ahead, x, y, zz)) return;
    z = zz;
    hv = y;
    if (o.tokens > 0 && x == gridDim.x - 1) return;  // the padded token tail's row: no state
    slot = o.state_indices != nullptr ? o.slot_of(static_cast<int>(x)) : static_cast<int>(x);
  }
  template <typename PoolT, bool VK, int KP>
  __device__ __forceinline__ void prefetch(const DecodeOneArgs& o, int tile_cols, bool one_range) const {
    if (slot < 0 || slot >= o.slots || slot == o.pad_slot) return;
    const PoolT* head = static_cast<const PoolT*>(o.initial) + int64_t(slot) * o.slot_stride + size_t(hv) * KP * o.V;
    prefetch_tile_l2<PoolT, KP>(head, o.V, z, tile_cols, one_range);
  }
};

// Outputs may differ in dtype from the pool (e.g. float32 token states next to a bf16 pool): run-time switch, except
// for FULL tiles (every state output is in the pool's dtype, vector-aligned).
template <typename PoolT, typename L, bool VK, bool FULL>
__device__ __forceinline__ void store_block(const float (&S)[L::NJ][L::ND], const StateRef st, int64_t block,
                                            const Place& pl) {
  if constexpr (FULL) {
    store_block_t<PoolT, L, VK>(S, static_cast<PoolT*>(st.p) + block, pl, true);
  } else if (st.dtype == DType::kBFloat16) {
    store_block_t<__nv_bfloat16, L, VK>(S, static_cast<__nv_bfloat16*>(st.p) + block, pl, st.vec);
  } else {
    store_block_t<float, L, VK>(S, static_cast<float*>(st.p) + block, pl, st.vec);
  }
}

}  // namespace kdakit::cuda::decode_detail
