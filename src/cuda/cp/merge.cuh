// Intra-card context parallelism, the merge of the segments' start states (spec §7.5; cp/segments.h).
// Per (sequence, v-head, 8 value columns), in order over the sequence's segments: S_start(s+1) = M_s S_start(s) + E_s
// in fp32, written over E_s (segment s + 1 reads its start state from slot s). S_start(1) = E_0 is already in place
// (the scan of segment 0 starts from the caller's state). Narrow column blocks: the chain over segments is serial,
// so the CTAs of one step should fill the SMs and each do little.
#pragma once

#include <cstddef>

#include "cuda/common/seqlen.cuh"
#include "cuda/common/sm80/cp_async.cuh"
#include "cuda/cp/merge_layout.h"
#include "cuda/forward/args.h"

namespace kdakit::cuda {

// acc[i] += (M X)[rg + RG i] for this thread's rows, M's rows from row(d) at columns [m_col0, m_col0 + K), staged
// kMergeKeys keys at a time in sM; X is the CTA's columns in sS, written by the caller and made visible by the first
// barrier here. The folds' steps (forward and backward) use it.
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

// The serial merge of one CTA's columns over `steps` steps: Y_t = M_t X_t + E_t, X_0[e] = x0_of(e), X_{t+1} = Y_t;
// step t's rows are row(g_of(t), d): E at column col (Y written over it), M at columns [m_col0, m_col0 + K). M does
// not depend on the chain, so its key blocks stream through the ring by cp.async, RING - 1 blocks ahead across step
// boundaries, and the next step's E is loaded a step ahead; X stays in shared memory. The products run in
// add_transition_product's order (each row's fma chain over the keys in order), so the bits are the same.
template <int KP, typename X0Of, typename GOf, typename Row>
__device__ __forceinline__ void merge_chain(char* smem, int K, int m_col0, int col, bool col_in, int64_t steps,
                                            X0Of&& x0_of, GOf&& g_of, Row&& row) {
  using L = MergeChainLayout<KP>;
  constexpr int RG = kMergeThreads / kMergeCols, RPT = KP / RG, Q = kMergeKeys / 4;  // Q: 16-byte pieces a block row
  const int tid = threadIdx.x, j = tid % kMergeCols, rg = tid / kMergeCols;
  float* sX = reinterpret_cast<float*>(smem);
  float* sM = sX + 2 * kMergeCols * L::LDX;
  const int KB = (K + kMergeKeys - 1) / kMergeKeys;
  // The block issued next (step it, key block ikb, ring slot islot): counters, not divisions of a 64-bit block index.
  int64_t it = 0;
  int ikb = 0, islot = 0;
  auto issue = [&]() {  // the next block's copies as one commit group (empty past the last step)
    if (it < steps) {
      const int64_t g = g_of(it);
      const int e0 = ikb * kMergeKeys;
      float* dst = sM + islot * L::BLOCK;
      for (int p = tid; p < KP * Q; p += kMergeThreads) {
        const int d = p / Q, c = 4 * (p % Q), key = e0 + c;
        const int bytes = d < K ? 4 * max(0, min(4, K - key)) : 0;  // zeros past K (rows and keys)
        cp_async16(dst + d * L::LDB + c, row(g, bytes > 0 ? d : 0) + (bytes > 0 ? m_col0 + key : 0), bytes);
      }
      if (++ikb == KB) ikb = 0, ++it;
      if (++islot == L::RING) islot = 0;
    }
    cp_async_commit();
  };
  auto load_e = [&](int64_t t, float(&e)[RPT]) {
    const int64_t g = g_of(t);
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int d = rg + RG * i;
      e[i] = col_in && d < K ? row(g, d)[col] : 0.f;
    }
  };
  for (int e = rg; e < KP; e += RG) sX[j * L::LDX + e] = col_in && e < K ? x0_of(e) : 0.f;
  for (int b = 0; b < L::RING - 1; ++b) issue();
  float acc[RPT], e_next[RPT];
  load_e(0, acc);
  if (steps > 1) load_e(1, e_next);
  int slot = 0;
  for (int64_t t = 0; t < steps; ++t) {
    const float* xs = sX + static_cast<int>(t & 1) * kMergeCols * L::LDX + j * L::LDX;
    for (int kb = 0; kb < KB; ++kb) {
      cp_async_wait<L::RING - 2>();
      __syncthreads();  // this block and X visible to all; every thread done with the previous block, whose slot is
                        // refilled now
      issue();
      const float* ms = sM + slot * L::BLOCK + rg * L::LDB;
      if (++slot == L::RING) slot = 0;
#pragma unroll
      for (int e = 0; e < kMergeKeys; e += 4) {
        const float4 x = *reinterpret_cast<const float4*>(xs + kb * kMergeKeys + e);
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
          const float4 m = *reinterpret_cast<const float4*>(ms + RG * i * L::LDB + e);
          acc[i] = fmaf(m.x, x.x, acc[i]);
          acc[i] = fmaf(m.y, x.y, acc[i]);
          acc[i] = fmaf(m.z, x.z, acc[i]);
          acc[i] = fmaf(m.w, x.w, acc[i]);
        }
      }
    }
    // Y_t, written over E_t and kept as X_{t+1} (read after the next block's barrier)
    const int64_t g = g_of(t);
    float* xn = sX + static_cast<int>((t + 1) & 1) * kMergeCols * L::LDX + j * L::LDX;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int d = rg + RG * i;
      if (col_in && d < K) row(g, d)[col] = acc[i];
      xn[d] = acc[i];
      acc[i] = e_next[i];
    }
    if (t + 2 < steps) load_e(t + 2, e_next);
  }
  cp_async_wait<0>();  // only empty groups are left; none in flight past the kernel's end
}

template <int KP>
__global__ void __launch_bounds__(kMergeThreads) segment_merge_kernel(const ForwardArgs a) {
  const int VT_cols = a.seg_ld - KP;  // value columns of a slot
  const MergeCta m = merge_cta(a, (VT_cols + kMergeCols - 1) / kMergeCols);
  const int cb = m.cb, hv = m.hv, n = m.n;
  const int64_t nseg = m.nseg;
  // Nothing to merge: one segment (two without a seed: the first's end is in place), or a padding sequence.
  if (nseg <= (a.cp_phase == kCpFinish ? 1 : 2) || a.state_slot(n) < 0) return;
  extern __shared__ __align__(16) char smem_raw[];
  const int col = cb * kMergeCols + static_cast<int>(threadIdx.x) % kMergeCols;
  const bool col_in = col < a.V;
  auto row = [&](int64_t g, int d) { return a.ws_seg + ((g * a.HV + hv) * KP + d) * a.seg_ld; };
  const int64_t g0 = a.seg_offsets[n];
  // Steps s = s0 .. nseg - 2: S_start(s + 1) = M_s S_start(s) + E_s over slot s. Without a seed S_start(1) = E_0 is
  // in place; a context-parallel finish (seed) scanned segment 0 from zero, so the chain starts one step earlier, from
  // the handed-over state (initial, or zero).
  const bool seed = a.cp_phase == kCpFinish;
  const int64_t s0 = seed ? 0 : 1;
  auto x0_of = [&](int e) {
    if (!seed) return row(g0, e)[col];
    return a.initial.present() ? a.initial.load(a.initial.offset(0, hv, e, col, a.K, a.V, a.vk)) : 0.f;
  };
  merge_chain<KP>(smem_raw, a.K, VT_cols, col, col_in, nseg - 1 - s0, x0_of, [&](int64_t t) { return g0 + s0 + t; },
                  row);
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
