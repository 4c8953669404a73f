// The decode kernels' per-token math, shared by the general and the one-token forms (their results agree to the bit):
// the sums over K, the norms and q.k, and one token's update of a thread's part of the state.
#pragma once

#include "cuda/decode/state_io.cuh"

namespace kdakit::cuda::decode_detail {

// Sum over the 8 lanes that share this thread's columns (a butterfly over the K-lane bits: lane bits 0-2 v-first,
// 2-4 [K,V]; every one of them gets the sum).
template <bool VK>
__device__ __forceinline__ float column_sum(float x) {
#pragma unroll
  for (int m = VK ? 1 : 4; m < (VK ? 8 : 32); m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
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

// One token's sums and e, both layouts: S *= exp(g); pk = k.S and pq = q.S per column, summed over K (the thread's
// keys in slot order, then the butterfly over its K-lanes); then e = finish(jj, pk, pq, store) for each of the
// thread's column slots, which also writes the output where `store` (K-lane 0: once per column).
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
  const bool leader = k_lane<VK>(lane) == 0;  // after the butterflies every lane of a column group holds the sums
#pragma unroll
  for (int jj = 0; jj < NJ; ++jj) {
    pk[jj] = column_sum<VK>(pk[jj]);
    pq[jj] = column_sum<VK>(pq[jj]);
  }
#pragma unroll
  for (int jj = 0; jj < NJ; ++jj) e[jj] = finish(jj, pk[jj], pq[jj], leader);
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

// token_sums_e's `keys` for the general form's staged key rows q, k, g (KeyL's read order, key_unit).
template <typename KeyL, bool VK>
__device__ __forceinline__ auto staged_keys(const float* q, const float* k, const float* g, int lane) {
  constexpr int GRP = KeyL::GRP;
  return [=](int dd, float (&q_)[GRP], float (&k_)[GRP], float (&g_)[GRP]) {
    const int d = key_unit<KeyL, VK>(dd, lane);
    load_keys<GRP>(g + d, g_);
    load_keys<GRP>(k + d, k_);
    load_keys<GRP>(q + d, q_);
  };
}

// One token on a thread's part of the state with its outputs through shared memory (bf16 pools): the sums, e and
// the output o = qk e + qS per column, then the update. q, k, g: the token's prepared key rows, stored in KeyL's read
// order (key_unit); v, beta: its rows of the CTA tile's columns, col(jj) the column of the thread's slot jj there; v is
// replaced by the outputs (each column's v is read only by the lanes of its column group, one warp, before the
// __syncwarp). SL: the thread's share of the state (its NJ columns and ND keys; KeyL's keys).
template <typename KeyL, typename SL, bool VK, typename Col>
__device__ __forceinline__ void token_step_smem_out(float (&S)[SL::NJ][SL::ND], const float* q, const float* k,
                                                    const float* g, float* v, const float* beta, float qk,
                                                    const Col& col) {
  constexpr int GRP = KeyL::GRP, NJ = SL::NJ;
  const int lane = threadIdx.x & 31;
  float e[NJ], out[NJ];
  bool leader = false;
  token_sums_e<SL, VK>(S, staged_keys<KeyL, VK>(q, k, g, lane), [&](int jj, float pk, float pq, bool store) {
    const int cl = col(jj);
    const float ej = beta[cl] * (v[cl] - pk);
    out[jj] = fmaf(qk, ej, pq);
    leader = store;
    return ej;
  }, e);
  __syncwarp();  // the column group's reads of v are done
  if (leader) {
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) v[col(jj)] = out[jj];
  }
  token_update<SL>(S, [&](int dd, float (&k_)[GRP]) { load_keys<GRP>(k + key_unit<KeyL, VK>(dd, lane), k_); }, e);
}

}  // namespace kdakit::cuda::decode_detail
