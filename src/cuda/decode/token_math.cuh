// The decode kernels' per-token math, shared by the general and the one-token forms (their results agree to the bit):
// the sums over K, the norms and q.k, and one token's update of a thread's part of the state.
#pragma once

#include "cuda/decode/state_io.cuh"

namespace kdakit::cuda::decode_detail {

// Sum over the lanes that share this thread's columns (a butterfly: every one of them gets the sum).
template <typename L, bool VK>
__device__ __forceinline__ float column_sum(float x) {
#pragma unroll
  for (int m = VK ? 1 : L::LV; m < (VK ? 8 : 32); m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
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
//   token_sums_e: S *= exp(g); kS and qS from the decayed state, summed over K; e and the output per column.
//   token_update: S += k e^T.

// ---- [K,V] states: the sums by reduce-scatter ----------------------------------------------------------------
// In the [K,V] layout the lanes that share a thread's NJ columns span K (16 lanes for fp32 states, all 32 for bf16),
// so a butterfly per column sum costs 2 NJ log2(lanes) shuffles per token (80 for bf16 states), which bound the
// kernel. Instead the 2 NJ partial sums (pk, pq of each column) are halved at every level: a lane keeps one half and
// sends the other, so after log2(2 NJ) levels (2 NJ - 1 shuffles) each lane holds one full value, and the remaining
// levels are plain butterflies. A lane then holds pk (or pq) of column slot kv_slot(lane); one shuffle pairs it with
// pq (pk), the column's e is computed once, and every thread gathers the e of its NJ columns (NJ shuffles).
template <typename L>
struct KvScatter {
  static constexpr int NV = 2 * L::NJ;                     // values per thread: pk, pq of each column
  static constexpr int LEVELS = NV == 16 ? 4 : NV == 8 ? 3 : NV == 4 ? 2 : 1;  // log2(NV)
  static constexpr int LV_BITS = L::LV == 1 ? 0 : L::LV == 2 ? 1 : 2;          // log2(LV)
  static_assert((1 << LEVELS) == NV && (1 << LV_BITS) == L::LV, "powers of two");
  static_assert(NV * L::LV <= 32, "the halving levels fit in the lanes that share the columns");
  // Column slot (0..NJ) and kind (0: pk, 1: pq) of the value a lane holds after the halving levels: lane bit
  // LV_BITS + l chose the upper half at level l.
  __device__ __forceinline__ static int slot(int lane) {
    int jc = 0;
#pragma unroll
    for (int l = 0; l < LEVELS - 1; ++l) jc |= ((lane >> (LV_BITS + l)) & 1) << (LEVELS - 2 - l);
    return jc;
  }
  __device__ __forceinline__ static int kind(int lane) { return (lane >> (LV_BITS + LEVELS - 1)) & 1; }
  // Lanes that hold pk of a column and no copy (one per column group): they store the column's output.
  __device__ __forceinline__ static bool owner(int lane) { return (lane >> (LV_BITS + LEVELS - 1)) == 0; }
  // The lane holding pk of column slot jj among those sharing this lane's columns.
  __device__ __forceinline__ static int source(int jj, int lane) {
    int src = lane & ((L::LV - 1) | ~((1 << (LV_BITS + LEVELS)) - 1));
#pragma unroll
    for (int l = 0; l < LEVELS - 1; ++l) src |= ((jj >> (LEVELS - 2 - l)) & 1) << (LV_BITS + l);
    return src;
  }
};

// Level LEVEL of the halving and the ones after it (compile-time indices throughout: a run-time index would put w
// in local memory).
template <typename L, int LEVEL>
__device__ __forceinline__ void kv_halve(float (&w)[KvScatter<L>::NV], int lane) {
  if constexpr (LEVEL < KvScatter<L>::LEVELS) {
    constexpr int HALF = KvScatter<L>::NV >> (LEVEL + 1), M = L::LV << LEVEL;
    const bool upper = (lane & M) != 0;
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
      const float lo = w[i], hi = w[i + HALF];
      w[i] = (upper ? hi : lo) + __shfl_xor_sync(0xffffffffu, upper ? lo : hi, M);
    }
    kv_halve<L, LEVEL + 1>(w, lane);
  }
}

// One token's sums and e, both layouts: S *= exp(g); pk = k.S and pq = q.S per column, summed over K; then
// e = finish(jj, pk, pq, store) for the column slot jj, which also writes the output where `store` (once per column).
// VK: every thread calls finish for each of its NJ slots (jj compile-time). [K,V]: each lane calls it once, for
// KvScatter::slot(lane) (a run-time slot), and the e of every slot is gathered. e[jj]: the thread's columns' e.
template <typename L, bool VK, typename Keys, typename Finish>
__device__ __forceinline__ void token_sums_e(float (&S)[L::NJ][L::ND], const Keys& keys, const Finish& finish,
                                             float (&e)[L::NJ]) {
  constexpr int GRP = L::GRP, NJ = L::NJ;
  const int lane = threadIdx.x & 31;
  float pk[NJ], pq[NJ];
#pragma unroll
  for (int jj = 0; jj < NJ; ++jj) pk[jj] = pq[jj] = 0.f;
#pragma unroll
  for (int dd = 0; dd < L::ND; dd += GRP) {
    float qv[GRP], kv[GRP], gv[GRP];
    keys(dd, qv, kv, gv);
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
  if constexpr (VK) {
    const bool leader = (lane & 7) == 0;  // after the butterflies every lane of a column group holds the sums
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) {
      pk[jj] = column_sum<L, VK>(pk[jj]);
      pq[jj] = column_sum<L, VK>(pq[jj]);
    }
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) e[jj] = finish(jj, pk[jj], pq[jj], leader);
  } else {
    using X = KvScatter<L>;
    float w[X::NV];
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) {
      w[2 * jj] = pk[jj];
      w[2 * jj + 1] = pq[jj];
    }
    kv_halve<L, 0>(w, lane);
#pragma unroll
    for (int m = L::LV << X::LEVELS; m < 32; m <<= 1) w[0] += __shfl_xor_sync(0xffffffffu, w[0], m);
    const float other = __shfl_xor_sync(0xffffffffu, w[0], L::LV << (X::LEVELS - 1));
    const bool is_pk = X::kind(lane) == 0;
    const float ec = finish(X::slot(lane), is_pk ? w[0] : other, is_pk ? other : w[0], X::owner(lane));
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) e[jj] = __shfl_sync(0xffffffffu, ec, X::source(jj, lane));
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

}  // namespace kdakit::cuda::decode_detail
