// The backward's merge of the segments' end gradients (the transpose of the forward's segment merge, cp/merge.cuh):
// per (sequence, v-head, 8 value columns), from the sequence's last segment down, dS_end(s - 1) = M_s^T dS_end(s)
// + E_s in fp32, written over E_s, so that slot s then holds the end gradient of segment s - 1. Slot nseg - 1's E
// (the last segment's scan from dht) is that gradient already; segment 0 has no slot content (its start gradient is
// the caller's d_initial_state, from the final scan).
//
// Context-parallel halves (BackwardArgs::cp_phase), where every segment was pre-scanned from zero with its M_s^T: the
// summary folds them, from a zero dht, into the sequence's start gradient d_initial = E_0 + M_0^T (E_1 + ...),
// leaving the slots as they are for the finish; the finish merges in place as above, but from dht through the last
// segment's M^T.
#pragma once

#include "cuda/backward/args.h"
#include "cuda/common/seqlen.cuh"
#include "cuda/cp/merge.cuh"

namespace kdakit::cuda {

template <int KP>
__global__ void __launch_bounds__(kMergeThreads) backward_segment_merge_kernel(const BackwardArgs a) {
  using L = MergeLayout<KP>;
  const int VT_cols = a.seg_ld - KP;  // value columns of a slot; M^T after them
  const MergeCta m = merge_cta(a, (a.V + kMergeCols - 1) / kMergeCols);
  const int cb = m.cb, hv = m.hv, n = m.n;
  const int64_t nseg = m.nseg;
  const bool summary = a.cp_phase == kCpSummary, finish = a.cp_phase == kCpFinish;
  if (nseg <= (finish ? 1 : 2) && !summary) return;  // one segment; or two, and the last segment's E is in place
  extern __shared__ __align__(16) char smem_raw[];
  float* sS = reinterpret_cast<float*>(smem_raw);  // [KP][LDS] dS_end(s), this CTA's columns
  float* sM = sS + KP * L::LDS;                     // [KP][LDM] M_s^T, keys e0 .. e0 + kMergeKeys - 1
  const int col = cb * kMergeCols + static_cast<int>(threadIdx.x) % kMergeCols;
  const bool col_in = col < a.V;
  auto row = [&](int64_t g, int d) { return a.ws_seg + ((g * a.HV + hv) * KP + d) * a.seg_ld; };
  const int64_t g0 = a.seg_offsets[n];
  if (summary) {  // registers hold X = E_{nseg-1}; then X <- E_s + M_s^T X for s = nseg - 2 .. 0 (sS: X)
    constexpr int RG = kMergeThreads / kMergeCols, RPT = KP / RG;
    const int rg = static_cast<int>(threadIdx.x) / kMergeCols;
    float acc[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int d = rg + RG * i;
      acc[i] = col_in && d < a.K ? row(g0 + nseg - 1, d)[col] : 0.f;
    }
    for (int64_t s = nseg - 2; s >= 0; --s) {
      const int64_t g = g0 + s;
      fold_step<KP>(
          sS, sM, a.K, VT_cols, [&](int d) { return col_in && d < a.K ? row(g, d)[col] : 0.f; },
          [&](int d) { return row(g, d); }, acc);
    }
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int d = rg + RG * i;
      if (col_in && d < a.K) a.d_initial.store(a.d_initial.offset(n, hv, d, col, a.K, a.V, a.vk), acc[i]);
    }
    return;
  }
  // Steps s = s1 .. 1: slot s <- M_s^T X + E_s, X the gradient just merged into slot s + 1; the finish's first step
  // (s1 = nseg - 1, a zero-end pre-scan there) starts from dht.
  const int64_t s1 = finish ? nseg - 1 : nseg - 2;
  auto x0_of = [&](int e) {
    if (!finish) return row(g0 + nseg - 1, e)[col];
    return a.d_final.present() ? a.d_final.load(a.d_final.offset(n, hv, e, col, a.K, a.V, a.vk)) : 0.f;
  };
  merge_chain<KP>(smem_raw, a.K, VT_cols, col, col_in, s1, x0_of, [&](int64_t t) { return g0 + s1 - t; }, row);
}

}  // namespace kdakit::cuda
