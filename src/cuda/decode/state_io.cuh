// The decode kernels' state tile: which state elements a thread holds (Tile, its key and column slots), their loads
// and stores in 16-byte vectors (evict-first: state traffic is streamed, read once and written once per call), the
// tile staged in shared memory by cp.async, and the L2 prefetch of a later CTA's tile.
#pragma once

#include <type_traits>

#include "cuda/common/sm80/cp_async.cuh"
#include "cuda/decode/args.h"
#include "cuda/decode/tile_size.h"

namespace kdakit::cuda::decode_detail {

// Which state elements a thread holds. v-first: lanes 8 r + kl; the 8 lanes kl span K (16-byte vectors of
// consecutive keys), lane bits 3-4 pick 2 of the warp's 8 columns. [K,V]: lanes 4 kl + c; the 8 lanes kl span K, each
// with ND consecutive keys, and c (lane bits 0-1) picks 2 of the warp's 8 columns: adjacent (bf16: one 32-bit piece
// of a row) or 4 apart (fp32: one float in each 16-byte half of the warp's 32 bytes of a row). Both layouts then
// sum a column over the 8 lanes kl (3 butterfly levels), and the [K,V] staged tile reaches this mapping from row order
// by ldmatrix (state_io.cuh, KvRows), with no shuffles.
template <typename PoolT, bool VK, int KP>
struct Tile {
  static constexpr int VEC = 16 / static_cast<int>(sizeof(PoolT));  // elements per 16-byte state vector
  static constexpr int LANES_K = 8;                                  // lanes sharing columns, spanning K
  static constexpr int ND = KP / LANES_K;                            // keys per thread
  static constexpr int NJ = 2;                                       // value columns per thread
  static constexpr int GRP = ND < 4 ? ND : 4;                        // keys per shared-memory vector read
  static constexpr int KL = KP / 32;                                 // keys per lane in the preparation
  static constexpr int NVEC = NJ * ND / VEC;                         // 16-byte state vectors per thread and pass
  static constexpr int UPW = kDecodeWarpCols * static_cast<int>(sizeof(PoolT)) / 16;  // [K,V]: a warp's 16-byte units of a row
  static_assert(ND % GRP == 0 && (!VK || ND % VEC == 0), "keys per thread come in whole vectors");
  static_assert(NJ * ND == KP / 4, "decode_state_tile_bytes: KP / 4 state elements per thread and pass");
  static_assert(NJ * 4 == kDecodeWarpCols, "a warp owns kDecodeWarpCols value columns");
  static_assert(kDecodeMaxWarps * kDecodeWarpCols <= 32, "the preparation widens one CTA column per lane");
};

// The K-lane of a thread (which of the 8 lanes sharing its columns it is).
template <bool VK>
__device__ __forceinline__ int k_lane(int lane) { return VK ? (lane & 7) : (lane >> 2); }

// Column (relative to the warp's first) of this thread's value slot jj.
template <typename L, bool VK>
__device__ __forceinline__ int col_of(int jj, int lane) {
  if constexpr (VK) return jj * 4 + (lane >> 3);
  else if constexpr (L::VEC == 8) return (lane & 3) * 2 + jj;
  else return (lane & 3) + 4 * jj;
}

// Key index of this thread's key slot dd. Groups of GRP consecutive dd map to GRP consecutive keys.
template <typename L, bool VK>
__device__ __forceinline__ int key_of(int dd, int lane) {
  if constexpr (VK) return ((dd / L::VEC) * 8 + (lane & 7)) * L::VEC + dd % L::VEC;
  else return (lane >> 2) * L::ND + dd;
}

// The general form's staged key rows (q, k, exp(gate) per token in shared memory) are stored in the order the
// threads read them: the thread's key group g (GRP consecutive keys from slot g GRP on) of K-lane kl (k_lane) at
// 16-byte unit g LANES_K + kl. A warp's reads of one group are then consecutive 16-byte units (no bank conflicts), where in key order they lie VEC or ND keys apart.
template <typename L, bool VK>
__device__ __forceinline__ int key_unit(int dd, int lane) {
  return ((dd / L::GRP) * L::LANES_K + k_lane<VK>(lane)) * L::GRP + dd % L::GRP;
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
// State traffic is streamed: reads evict-first (each state is read once per call). Stores too (STREAM) where a call
// writes a state several times (the multi-token forms: the lines leave L2 to the reads); the one-token form, which
// writes each state once, stores with the default policy (docs/perf-notes.md).
template <bool STREAM, typename V>
__device__ __forceinline__ void put_state(V* p, const V& x) {
  if constexpr (STREAM) __stcs(p, x);
  else *p = x;
}

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

template <typename T, int N, bool STREAM = true>
__device__ __forceinline__ void store_state_vec(T* p, int64_t off, int valid, bool vec, const float* x) {
  if (vec && valid >= N) {
    if constexpr (std::is_same<T, float>::value) {
#pragma unroll
      for (int i = 0; i < N; i += 4) {
        put_state<STREAM>(reinterpret_cast<float4*>(p + off + i), make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]));
      }
    } else if constexpr (N == 8) {
      put_state<STREAM>(reinterpret_cast<uint4*>(p + off), make_uint4(pack_bf16(x[0], x[1]), pack_bf16(x[2], x[3]),
                                                                     pack_bf16(x[4], x[5]), pack_bf16(x[6], x[7])));
    } else {
      static_assert(N == 4, "bf16 state vectors hold 4 or 8 elements");
      put_state<STREAM>(reinterpret_cast<uint2*>(p + off), make_uint2(pack_bf16(x[0], x[1]), pack_bf16(x[2], x[3])));
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

// Where this thread's elements lie in a state block (computed once; offsets within a block fit in 32 bits).
//   VK: vector (jj, r) at off + jj * step + r * 8 * VEC; it exists if jj * 4 < lim_j, with lim_k - r * 8 * VEC
//       elements inside K.
//   KV: key slot dd's row at off + dd * step (its columns col_of(jj) - col_of(0) further); it exists if dd < lim_k,
//       and column slot jj if col_of(jj) - col_of(0) < lim_j.
struct Place {
  int off, step, lim_j, lim_k;
};

template <typename L, bool VK>
__device__ __forceinline__ Place place_of(int K, int V, int wcol0, int lane) {
  const int j = wcol0 + col_of<L, VK>(0, lane), d = key_of<L, VK>(0, lane);
  if constexpr (VK) return Place{j * K + d, 4 * K, V - j, K - d};
  else return Place{d * V + j, V, V - j, K - d};
}

// [K,V]: the distance of column slot 1 from slot 0 (adjacent for bf16 pools, 4 apart for fp32 ones).
template <typename L>
constexpr int kv_col_step() { return L::VEC == 8 ? 1 : 4; }

// Two [K,V] elements of one row (column slots 0 and 1, `dj` apart) with `valid` columns of slot 0's inside V; one
// 32-bit piece where both are adjacent 16-bit elements and `vec` (the pool's 16-byte alignment, so 4-byte too).
template <typename T, int DJ>
__device__ __forceinline__ void load_kv_pair(const T* p, int valid, bool vec, float& x0, float& x1) {
  if constexpr (!std::is_same<T, float>::value && DJ == 1) {
    if (vec && valid >= 2) {
      const uint32_t w = __ldcs(reinterpret_cast<const unsigned int*>(p));
      x0 = bf16_lo(w);
      x1 = bf16_hi(w);
      return;
    }
  }
  auto at = [&](int i) {
    if constexpr (std::is_same<T, float>::value) return __ldcs(p + i);
    else return __bfloat162float(p[i]);
  };
  x0 = valid > 0 ? at(0) : 0.f;
  x1 = valid > DJ ? at(DJ) : 0.f;
}

template <typename T, int DJ, bool STREAM = true>
__device__ __forceinline__ void store_kv_pair(T* p, int valid, bool vec, float x0, float x1) {
  if constexpr (!std::is_same<T, float>::value && DJ == 1) {
    if (vec && valid >= 2) {
      put_state<STREAM>(reinterpret_cast<unsigned int*>(p), pack_bf16(x0, x1));
      return;
    }
  }
  if constexpr (std::is_same<T, float>::value && DJ == 1) {
    if (vec && valid >= 2) {
      put_state<STREAM>(reinterpret_cast<float2*>(p), make_float2(x0, x1));
      return;
    }
  }
  auto put = [&](int i, float x) {
    if constexpr (std::is_same<T, float>::value) put_state<STREAM>(p + i, x);
    else p[i] = __float2bfloat16_rn(x);
  };
  if (valid > 0) put(0, x0);
  if (valid > DJ) put(DJ, x1);
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
      load_kv_pair<PoolT, kv_col_step<L>()>(p + pl.off + dd * pl.step, dd < pl.lim_k ? pl.lim_j : 0, vec, S[0][dd],
                                            S[1][dd]);
    }
  }
}

template <typename T, typename L, bool VK, bool STREAM = true>
__device__ __forceinline__ void store_block_t(const float (&S)[L::NJ][L::ND], T* p, const Place& pl, bool vec) {
  if constexpr (VK) {
#pragma unroll
    for (int jj = 0; jj < L::NJ; ++jj) {
#pragma unroll
      for (int dd = 0; dd < L::ND; dd += L::VEC) {
        const int r8 = (dd / L::VEC) * 8 * L::VEC;
        store_state_vec<T, L::VEC, STREAM>(p + pl.off + jj * pl.step + r8, 0, jj * 4 < pl.lim_j ? pl.lim_k - r8 : 0,
                                           vec, &S[jj][dd]);
      }
    }
  } else {
#pragma unroll
    for (int dd = 0; dd < L::ND; ++dd) {
      store_kv_pair<T, kv_col_step<L>(), STREAM>(p + pl.off + dd * pl.step, dd < pl.lim_k ? pl.lim_j : 0, vec,
                                                 S[0][dd], S[1][dd]);
    }
  }
}

// ---- the staged state tile ----------------------------------------------------------------------------------
// v-first: a thread copies exactly the 16-byte vectors it later reads (those load_block would read as vectors) into
// its own slots of shared memory: vector vi of pass p at ((p * NVEC + vi) * nthreads + tid) * 16. So
// cp.async.wait_group alone orders them (no barrier), and a warp's shared-memory reads are consecutive 16-byte pieces
// (no bank conflicts). Vectors that cannot be copied whole (K or V tails, unaligned pools) are read from global
// memory, element by element, when the pass starts. ([K,V] tiles are staged by rows: KvRows below.)

// Vector vi of the thread's tile part: its element offset from pl.off and the number of its elements inside K/V.
template <typename L>
__device__ __forceinline__ void vector_of(int vi, const Place& pl, int& off, int& valid) {
  constexpr int PER_J = L::ND / L::VEC;
  const int jj = vi / PER_J, r8 = (vi % PER_J) * 8 * L::VEC;
  off = jj * pl.step + r8;
  valid = jj * 4 < pl.lim_j ? pl.lim_k - r8 : 0;
}

// bytes = 0: zero-fill (no initial state) without reading the pool.
template <typename PoolT, int KP>
__device__ __forceinline__ void issue_block_async(const PoolT* p, const Place& pl, char* sm, int nthreads,
                                                  int bytes = 16) {
  using L = Tile<PoolT, true, KP>;
#pragma unroll
  for (int vi = 0; vi < L::NVEC; ++vi) {
    int off, valid;
    vector_of<L>(vi, pl, off, valid);
    if (valid >= L::VEC) cp_async16(sm + size_t(vi) * nthreads * 16, p + pl.off + off, bytes);
  }
}

template <typename PoolT, int KP>
__device__ __forceinline__ void load_block_staged(float (&S)[Tile<PoolT, true, KP>::NJ][Tile<PoolT, true, KP>::ND],
                                                  const PoolT* p, const Place& pl, const char* sm, int nthreads) {
  using L = Tile<PoolT, true, KP>;
  constexpr int PER_J = L::ND / L::VEC;
#pragma unroll
  for (int vi = 0; vi < L::NVEC; ++vi) {
    int off, valid;
    vector_of<L>(vi, pl, off, valid);
    float* x = &S[vi / PER_J][(vi % PER_J) * L::VEC];
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
  }
}

// ---- [K,V] staged tiles by whole row segments ---------------------------------------------------------------
// A [K,V] tile -- KP rows of `tp` passes' columns: one pass (the general form) or all of a CTA's passes (the
// one-token form, whose tile is then whole rows of the pool) -- is copied by row segments (consecutive threads,
// consecutive 16-byte pieces of a row) into shared memory in row order, and written back the same way (each
// direction costs a barrier: threads read what others wrote). A thread's elements (Tile: ND consecutive keys of
// K-lane kl, 2 columns of lane bits 0-1) are 8x8 matrices of 16-bit pairs: key slot dd of the 8 K-lanes, at one
// 16-byte unit of their rows. ldmatrix reads four such matrices per instruction straight into the Tile mapping
// (thread 4 kl + c gets row kl's 32-bit word c), and stmatrix writes them back, so the transposition costs no
// shuffles; a thread's words are its own in both directions, so a pass needs no barrier of its own. One 16-byte
// unit of padding after every ND rows: a matrix's 8 rows (ND apart) then lie in distinct banks. Piece u of row d
// (cpr units per row) at unit d cpr + u + d / ND; a tile takes kDecodeKvRowPad more bytes. Whole tiles only.
template <typename L>
struct KvRows {
  static_assert(L::LANES_K * 16 == kDecodeKvRowPad, "the padding of a tile: one unit per K-lane");
  static constexpr int NMAT = L::ND * L::UPW / 4;  // ldmatrix.x4 instructions per pass
  static_assert(NMAT * 4 == L::ND * L::UPW && L::NJ == 2, "whole x4 instructions; two column slots");
  int cpr;             // 16-byte units per row of the tile (powers of two)
  int row0, piece;     // this thread's copy i: piece `piece` of row row0 + i rstep
  int rstep;
  int mat0, mat_step;  // the row address this lane gives to ldmatrix / stmatrix instruction i of pass 0
  int pass_step;       // bytes from a pass's units to the next's
  __device__ __forceinline__ KvRows(int nthreads, int tp) {
    const int pass_units = (nthreads >> 5) * L::UPW;
    cpr = pass_units * tp;
    const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
    const int cpr_shift = __ffs(cpr) - 1;
    row0 = tid >> cpr_shift;
    piece = tid & (cpr - 1);
    rstep = nthreads >> cpr_shift;
    // Lane 8 m + r gives row r of matrix m: key slot matrix_dd(i, m) of K-lane r, the warp's unit matrix_unit(m).
    const int m = lane >> 3, r = lane & 7;
    mat0 = unit(r * L::ND + matrix_dd(0, m), warp * L::UPW + matrix_unit(m)) * 16;
    mat_step = (matrix_dd(1, 0) - matrix_dd(0, 0)) * cpr * 16;
    pass_step = pass_units * 16;
  }
  // Piece u of row d: padding after every ND rows.
  __device__ __forceinline__ int unit(int d, int u) const { return d * cpr + u + d / L::ND; }
  __device__ __forceinline__ int copy_at(int i) const { return unit(row0 + i * rstep, piece) * 16; }
  // bf16: the four matrices of instruction i are key slots 4 i .. 4 i + 3 (the warp's one unit of a row); fp32: key
  // slots 2 i, 2 i + 1, each at the warp's two units (columns c and c + 4).
  __device__ __forceinline__ static constexpr int matrix_dd(int i, int m) {
    return L::UPW == 1 ? 4 * i + m : 2 * i + (m >> 1);
  }
  __device__ __forceinline__ static constexpr int matrix_unit(int m) { return L::UPW == 1 ? 0 : (m & 1); }
};

__device__ __forceinline__ void ldmatrix_x4(const char* p, uint32_t (&r)[4]) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// stmatrix is sm_90's; before it, each lane stores its own four 32-bit words (at byte offsets `mine` of `tile`).
__device__ __forceinline__ void stmatrix_x4(char* p, char* tile, const uint32_t (&r)[4], const int (&mine)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  (void)tile;
  (void)mine;
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
#else
  (void)p;
#pragma unroll
  for (int m = 0; m < 4; ++m) *reinterpret_cast<uint32_t*>(tile + mine[m]) = r[m];
#endif
}

// head_c0: the state block of (slot, head) advanced to the tile's first column; V: its row stride; tp: the passes
// the tile spans. bytes = 0: zero-fill (no initial state) without reading.
template <typename PoolT, int KP>
__device__ __forceinline__ void issue_rows_async(const PoolT* head_c0, int V, char* sm, int nthreads, int bytes,
                                                 int tp) {
  using L = Tile<PoolT, false, KP>;
  const KvRows<L> r(nthreads, tp);
  const PoolT* from = bytes > 0 ? head_c0 + size_t(r.row0) * V + r.piece * L::VEC : head_c0;
  const size_t step = bytes > 0 ? size_t(r.rstep) * V : 0;
#pragma unroll 4
  for (int i = 0; i < L::NVEC * tp; ++i) cp_async16(sm + r.copy_at(i), from + i * step, bytes);
}

// Pass p's 32-bit words of the tile into the Tile mapping: reg m of instruction i is key slot matrix_dd(i, m),
// column slot matrix_unit(m) (fp32) or both column slots (bf16: a pair).
template <typename PoolT, int KP>
__device__ __forceinline__ void load_rows_staged(float (&S)[Tile<PoolT, false, KP>::NJ][Tile<PoolT, false, KP>::ND],
                                                 const char* sm, int nthreads, int p, int tp) {
  using L = Tile<PoolT, false, KP>;
  using R = KvRows<L>;
  const R r(nthreads, tp);
  const char* base = sm + r.mat0 + p * r.pass_step;
#pragma unroll
  for (int i = 0; i < R::NMAT; ++i) {
    uint32_t w[4];
    ldmatrix_x4(base + i * r.mat_step, w);
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int dd = R::matrix_dd(i, m);
      if constexpr (std::is_same<PoolT, float>::value) {
        S[R::matrix_unit(m)][dd] = __uint_as_float(w[m]);
      } else {
        S[0][dd] = bf16_lo(w[m]);
        S[1][dd] = bf16_hi(w[m]);
      }
    }
  }
}

// The thread's words of pass p back into the tile (the places load_rows_staged read them from).
template <typename PoolT, int KP>
__device__ __forceinline__ void stage_block_out(const float (&S)[Tile<PoolT, false, KP>::NJ][Tile<PoolT, false, KP>::ND],
                                                char* sm, int nthreads, int p, int tp) {
  using L = Tile<PoolT, false, KP>;
  using R = KvRows<L>;
  const R r(nthreads, tp);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  char* base = sm + r.mat0 + p * r.pass_step;
#pragma unroll
  for (int i = 0; i < R::NMAT; ++i) {
    uint32_t w[4];
    int mine[4];  // this lane's own words (the stores before stmatrix)
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int dd = R::matrix_dd(i, m);
      if constexpr (std::is_same<PoolT, float>::value) w[m] = __float_as_uint(S[R::matrix_unit(m)][dd]);
      else w[m] = pack_bf16(S[0][dd], S[1][dd]);
      mine[m] = p * r.pass_step +
                r.unit((lane >> 2) * L::ND + dd, warp * L::UPW + R::matrix_unit(m)) * 16 + (lane & 3) * 4;
    }
    stmatrix_x4(base + i * r.mat_step, sm, w, mine);
  }
}

template <typename PoolT, int KP, bool STREAM = true>
__device__ __forceinline__ void store_rows(PoolT* head_c0, int V, const char* sm, int nthreads, int tp) {
  using L = Tile<PoolT, false, KP>;
  const KvRows<L> r(nthreads, tp);
  PoolT* to = head_c0 + size_t(r.row0) * V + r.piece * L::VEC;
  const size_t step = size_t(r.rstep) * V;
#pragma unroll 4
  for (int i = 0; i < L::NVEC * tp; ++i) {
    put_state<STREAM>(reinterpret_cast<uint4*>(to + i * step), *reinterpret_cast<const uint4*>(sm + r.copy_at(i)));
  }
}

// A one-pass tile to global memory by row segments through `sm` (the pass's region, free): owners' words in, a
// barrier, row segments out, a barrier (the region may be written again next).
template <typename PoolT, int KP>
__device__ __forceinline__ void store_tile_rows(const float (&S)[Tile<PoolT, false, KP>::NJ][Tile<PoolT, false, KP>::ND],
                                                PoolT* head_c0, int V, char* sm, int nthreads) {
  stage_block_out<PoolT, KP>(S, sm, nthreads, 0, 1);
  __syncthreads();
  store_rows<PoolT, KP>(head_c0, V, sm, nthreads, 1);
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
    const unsigned row = x >> o.vt_shift();  // the later CTA's sequence row and V tile (DecodeOneArgs::vt_shift)
    z = o.vt_shift() > 0 ? x & ((1u << o.vt_shift()) - 1) : zz;
    hv = y;
    if (o.tokens > 0 && row == unsigned(o.grid_rows()) - 1) return;  // the padded token tail's row: no state
    slot = o.state_indices != nullptr ? o.slot_of(static_cast<int>(row)) : static_cast<int>(row);
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
