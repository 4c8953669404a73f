// Intra-card context parallelism, the merge of the segments' start states (spec §7.5; cp/segments.h).
#pragma once

#include <cstddef>

#include "cuda/common/seqlen.cuh"
#include "cuda/forward/args.h"

namespace kdakit::cuda {

// Per (sequence, v-head, 8 value columns), in order over the sequence's segments: S_start(s+1) = M_s S_start(s) + E_s
// in fp32, written over E_s (segment s + 1 reads its start state from slot s). S_start(1) = E_0 is already in place
// (the scan of segment 0 starts from the caller's state). Narrow column blocks: the chain over segments is serial,
// so the CTAs of one step should fill the SMs and each do little.
constexpr int kMergeThreads = 256;
constexpr int kMergeCols = 8;   // state columns per CTA
constexpr int kMergeKeys = 32;  // keys of M staged at a time

template <int KP>
struct MergeLayout {
  static constexpr int LDS = kMergeCols + 1, LDM = kMergeKeys + 1;
  static constexpr size_t bytes() { return sizeof(float) * (KP * LDS + KP * LDM); }
};

// acc[i] += (M X)[rg + RG i] for this thread's rows, M's rows from row(d) at columns [m_col0, m_col0 + K), staged
// kMergeKeys keys at a time in sM; X is the CTA's columns in sS, written by the caller and made visible by the first
// barrier here. The merge's step and the fold's share it.
template <int KP, typename Row>
__device__ __forceinline__ void add_transition_product(const float* sS, float* sM, int K, int m_col0, Row&& row,
                                                       float (&acc)[KP / (kMergeThreads / kMergeCols)]) {
  using L = MergeLayout<KP>;
  constexpr int RG = kMergeThreads / kMergeCols, RPT = KP / RG;  // row groups; rows per thread
  const int tid = threadIdx.x, j = tid % kMergeCols, rg = tid / kMergeCols;
  for (int e0 = 0; e0 < K; e0 += kMergeKeys) {
    __syncthreads();  // sS written; the previous block of M consumed
    for (int x = tid; x < KP * kMergeKeys; x += kMergeThreads) {
      const int d = x / kMergeKeys, e = x % kMergeKeys;  // a warp reads one row's 32 keys (128 bytes)
      sM[d * L::LDM + e] = d < K && e0 + e < K ? row(d)[m_col0 + e0 + e] : 0.f;
    }
    __syncthreads();
#pragma unroll 8
    for (int e = 0; e < kMergeKeys; ++e) {
      const float sv = sS[(e0 + e) * L::LDS + j];
#pragma unroll
      for (int i = 0; i < RPT; ++i) acc[i] = fmaf(sM[(rg + RG * i) * L::LDM + e], sv, acc[i]);
    }
  }
}

// One fold step for this thread's rows (the fold keeps X in registers, acc): X to sS, then acc = E + M X, E's rows
// from e_of(d), M's rows from row(d) at columns [m_col0, m_col0 + K). The forward's fold and the backward's share it.
template <int KP, typename EOf, typename Row>
__device__ __forceinline__ void fold_step(float* sS, float* sM, int K, int m_col0, EOf&& e_of, Row&& row,
                                          float (&acc)[KP / (kMergeThreads / kMergeCols)]) {
  using L = MergeLayout<KP>;
  constexpr int RG = kMergeThreads / kMergeCols, RPT = KP / RG;
  const int j = static_cast<int>(threadIdx.x) % kMergeCols, rg = static_cast<int>(threadIdx.x) / kMergeCols;
  __syncthreads();  // the previous step's reads of sS are done
#pragma unroll
  for (int i = 0; i < RPT; ++i) sS[(rg + RG * i) * L::LDS + j] = acc[i];
#pragma unroll
  for (int i = 0; i < RPT; ++i) acc[i] = e_of(rg + RG * i);
  add_transition_product<KP>(sS, sM, K, m_col0, row, acc);
}

// One merge step for this CTA's column `col`: Y = M X + E over keys [0, K), X's rows e < K from x_of(e), E's and M's
// rows from row(d) (E at column col, M at columns [m_col0, m_col0 + K)), Y written over E. sS and sM are the
// MergeLayout tiles, sS free on entry; the step ends with a barrier (Y visible to the CTA). The forward's
// merge and the backward's (whose slots hold transposed transitions) share it.
template <int KP, typename XOf, typename Row>
__device__ __forceinline__ void merge_step(float* sS, float* sM, int K, int m_col0, int col, bool col_in, XOf&& x_of,
                                           Row&& row) {
  using L = MergeLayout<KP>;
  constexpr int RG = kMergeThreads / kMergeCols, RPT = KP / RG;
  const int tid = threadIdx.x, j = tid % kMergeCols, rg = tid / kMergeCols;
  for (int e = rg; e < KP; e += RG) sS[e * L::LDS + j] = col_in && e < K ? x_of(e) : 0.f;
  float acc[RPT];
#pragma unroll
  for (int i = 0; i < RPT; ++i) {
    const int d = rg + RG * i;
    acc[i] = col_in && d < K ? row(d)[col] : 0.f;
  }
  add_transition_product<KP>(sS, sM, K, m_col0, row, acc);
#pragma unroll
  for (int i = 0; i < RPT; ++i) {
    const int d = rg + RG * i;
    if (col_in && d < K) row(d)[col] = acc[i];
  }
  __syncthreads();  // Y visible to the CTA before it is read as the next X
}

// A merge CTA's place: blockIdx.x over (sequence n, v-head hv, column block cb of CB), and the sequence's segments.
// The forward's merge and the backward's share it.
struct MergeCta {
  int cb = 0, hv = 0, n = 0;
  int64_t nseg = 0;
};
template <typename Args>
__device__ __forceinline__ MergeCta merge_cta(const Args& a, int CB) {
  MergeCta m;
  int64_t idx = blockIdx.x;
  m.cb = static_cast<int>(idx % CB);
  idx /= CB;
  m.hv = static_cast<int>(idx % a.HV);
  m.n = static_cast<int>(idx / a.HV);
  int64_t b, t0, len, per;
  sequence(a, m.n, b, t0, len);
  m.nseg = a.segments_of((len + a.chunk - 1) / a.chunk, per);
  return m;
}

template <int KP>
__global__ void __launch_bounds__(kMergeThreads) segment_merge_kernel(const ForwardArgs a) {
  using L = MergeLayout<KP>;
  const int VT_cols = a.seg_ld - KP;  // value columns of a slot
  const MergeCta m = merge_cta(a, (VT_cols + kMergeCols - 1) / kMergeCols);
  const int cb = m.cb, hv = m.hv, n = m.n;
  const int64_t nseg = m.nseg;
  // Nothing to merge: one segment (two without a seed: the first's end is in place), or a padding sequence.
  if (nseg <= (a.cp_phase == kCpFinish ? 1 : 2) || a.state_slot(n) < 0) return;
  extern __shared__ __align__(16) char smem_raw[];
  float* sS = reinterpret_cast<float*>(smem_raw);  // [KP][LDS] S_start(s), this CTA's columns
  float* sM = sS + KP * L::LDS;                     // [KP][LDM] M_s, keys e0 .. e0 + kMergeKeys - 1
  const int col = cb * kMergeCols + static_cast<int>(threadIdx.x) % kMergeCols;
  const bool col_in = col < a.V;
  auto row = [&](int64_t g, int d) { return a.ws_seg + ((g * a.HV + hv) * KP + d) * a.seg_ld; };
  const int64_t g0 = a.seg_offsets[n];
  // A context-parallel finish (seed): segment 0 was scanned from zero, so the chain starts one step earlier, from the
  // handed-over state (initial, or zero): S_start(1) = M_0 S_start(0) + E_0.
  const bool seed = a.cp_phase == kCpFinish;
  for (int64_t s = seed ? 0 : 1; s + 1 < nseg; ++s) {
    const int64_t g = g0 + s;
    auto x_of = [&](int e) {
      if (s > 0) return row(g - 1, e)[col];
      return a.initial.present() ? a.initial.load(a.initial.offset(0, hv, e, col, a.K, a.V, a.vk)) : 0.f;
    };
    merge_step<KP>(sS, sM, a.K, VT_cols, col, col_in, x_of, [&](int d) { return row(g, d); });
  }
}

// A context-parallel summary (ForwardArgs::cp_phase, one sequence): the segments' scans (every segment, from zero)
// folded into the sequence's contribution, per v-head and 8 of the V + K columns: X = [E_0 | M_0], then
// X <- M_s X + [E_s | 0] over the later segments, written to cp_summary [HV][K][V + K] (end state, then transition).
template <int KP>
__global__ void __launch_bounds__(kMergeThreads) segment_fold_kernel(const ForwardArgs a) {
  using L = MergeLayout<KP>;
  constexpr int RG = kMergeThreads / kMergeCols, RPT = KP / RG;
  const int VT_cols = a.seg_ld - KP, W = a.V + a.K;
  const int CB = (W + kMergeCols - 1) / kMergeCols;
  const int cb = static_cast<int>(blockIdx.x % CB), hv = static_cast<int>(blockIdx.x / CB);
  int64_t b, t0, len, per;
  sequence(a, 0, b, t0, len);
  const int64_t nseg = a.segments_of((len + a.chunk - 1) / a.chunk, per);
  extern __shared__ __align__(16) char smem_raw[];
  float* sS = reinterpret_cast<float*>(smem_raw);  // [KP][LDS] X, this CTA's columns
  float* sM = sS + KP * L::LDS;                     // [KP][LDM] M_s, keys e0 .. e0 + kMergeKeys - 1
  const int tid = threadIdx.x, j = tid % kMergeCols, rg = tid / kMergeCols;
  const int col = cb * kMergeCols + j;  // < V: a value column; else transition column col - V
  const bool col_in = col < W, value = col < a.V;
  const int ws_col = value ? col : VT_cols + (col - a.V);
  auto row = [&](int64_t g, int d) { return a.ws_seg + ((g * a.HV + hv) * KP + d) * a.seg_ld; };
  const int64_t g0 = a.seg_offsets[0];
  float acc[RPT];
#pragma unroll
  for (int i = 0; i < RPT; ++i) {
    const int d = rg + RG * i;
    acc[i] = col_in && d < a.K ? row(g0, d)[ws_col] : 0.f;
  }
  for (int64_t s = 1; s < nseg; ++s) {
    const int64_t g = g0 + s;
    fold_step<KP>(
        sS, sM, a.K, VT_cols, [&](int d) { return col_in && value && d < a.K ? row(g, d)[col] : 0.f; },
        [&](int d) { return row(g, d); }, acc);
  }
#pragma unroll
  for (int i = 0; i < RPT; ++i) {
    const int d = rg + RG * i;
    if (col_in && d < a.K) a.cp_summary[(int64_t(hv) * a.K + d) * W + col] = acc[i];
  }
}

}  // namespace kdakit::cuda
