// The general decode form's wide [K,V] tiles (DecodeConfig::wide_kv): bf16 [K,V] pools, K = 128, sequences of
// several tokens. Each thread holds NJ (4 or 8) adjacent columns of its 16 keys, so a row piece of the state is one
// 8- or 16-byte vector in the pool and a CTA of 4 warps owns 16 NJ columns: the tile is loaded, and every state
// output stored, by the thread that holds it (no staging, no barriers), and the state stays fp32 in registers across
// tokens.
// The keys of a thread and the order of its sums are those of Tile (state_io.cuh), so the numbers are the other
// forms' to the bit.
#pragma once

#include <type_traits>

#include "cuda/decode/token_math.cuh"

namespace kdakit::cuda::decode_detail {

template <int KP, int NJ_>
struct WideKvTile {
  static constexpr int ND = KP / 8;  // keys per thread: K-lane (lane >> 2) holds keys [ND kl, ND kl + ND)
  static constexpr int NJ = NJ_;     // adjacent value columns per thread
  static_assert(NJ == 4 || NJ == 8, "8- or 16-byte row pieces");
  using Raw = std::conditional_t<NJ == 8, uint4, uint2>;  // a row piece in the pool's bf16
  static constexpr int GRP = 4;      // keys per shared-memory vector read (Tile's, so key_unit is shared)
  static_assert(Tile<__nv_bfloat16, false, KP>::ND == ND && Tile<__nv_bfloat16, false, KP>::GRP == GRP,
                "the wide tile's keys are Tile's");
};

// The thread's first column within the CTA tile.
template <int NJ>
__device__ __forceinline__ int wide_kv_col(int warp, int lane) { return (warp * 4 + (lane & 3)) * NJ; }

// The thread's row pieces of a state block (`rows`: the block's first element plus the CTA's first column,
// V elements per row): issued here, widened by wide_kv_widen once they are needed.
template <int KP, int NJ>
__device__ __forceinline__ void wide_kv_load(const __nv_bfloat16* rows, int V, int c, int lane,
                                             typename WideKvTile<KP, NJ>::Raw (&raw)[KP / 8]) {
  using Raw = typename WideKvTile<KP, NJ>::Raw;
  const __nv_bfloat16* p = rows + (lane >> 2) * (KP / 8) * V + c;
#pragma unroll
  for (int dd = 0; dd < KP / 8; ++dd) raw[dd] = __ldcs(reinterpret_cast<const Raw*>(p + dd * V));
}

// The loaded pieces as fp32 (`loaded`: CTA-uniform), or zeros (no initial state).
template <int KP, int NJ>
__device__ __forceinline__ void wide_kv_widen(const typename WideKvTile<KP, NJ>::Raw (&raw)[KP / 8], bool loaded,
                                              float (&S)[NJ][KP / 8]) {
  if (!loaded) {
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) {
#pragma unroll
      for (int dd = 0; dd < KP / 8; ++dd) S[jj][dd] = 0.f;
    }
    return;
  }
#pragma unroll
  for (int dd = 0; dd < KP / 8; ++dd) {
    uint32_t w[4];
    w[0] = raw[dd].x;
    w[1] = raw[dd].y;
    if constexpr (NJ == 8) {
      w[2] = raw[dd].z;
      w[3] = raw[dd].w;
    }
#pragma unroll
    for (int i = 0; i < NJ / 2; ++i) {
      S[2 * i][dd] = bf16_lo(w[i]);
      S[2 * i + 1][dd] = bf16_hi(w[i]);
    }
  }
}

template <int KP, int NJ>
__device__ __forceinline__ void wide_kv_store(__nv_bfloat16* rows, int V, int c, int lane,
                                              const float (&S)[NJ][KP / 8]) {
  __nv_bfloat16* p = rows + (lane >> 2) * (KP / 8) * V + c;
#pragma unroll
  for (int dd = 0; dd < KP / 8; ++dd) {
    if constexpr (NJ == 8) {
      __stcs(reinterpret_cast<uint4*>(p + dd * V),
             make_uint4(pack_bf16(S[0][dd], S[1][dd]), pack_bf16(S[2][dd], S[3][dd]), pack_bf16(S[4][dd], S[5][dd]),
                        pack_bf16(S[6][dd], S[7][dd])));
    } else {
      __stcs(reinterpret_cast<uint2*>(p + dd * V), make_uint2(pack_bf16(S[0][dd], S[1][dd]), pack_bf16(S[2][dd], S[3][dd])));
    }
  }
}

// One token on the thread's part of the state (token_step_smem_out; c: the thread's first column in the CTA tile).
template <int KP, int NJ>
__device__ __forceinline__ void wide_kv_token(float (&S)[NJ][KP / 8], const float* q, const float* k, const float* g,
                                              float* v, const float* beta, float qk, int c) {
  token_step_smem_out<Tile<__nv_bfloat16, false, KP>, WideKvTile<KP, NJ>, false>(S, q, k, g, v, beta, qk,
                                                                                 [c](int jj) { return c + jj; });
}

}  // namespace kdakit::cuda::decode_detail
