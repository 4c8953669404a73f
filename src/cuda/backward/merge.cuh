// The backward's merge of the segments' end gradients (the transpose of the forward's segment merge, cp/merge.cuh):
// per (sequence, v-head, 8 value columns), from the sequence's last segment down, dS_end(s - 1) = M_s^T dS_end(s)
// + E_s in fp32, written over E_s, so that slot s then holds the end gradient of segment s - 1. Slot nseg - 1's E
// (the last segment's scan from dht) is that gradient already; segment 0 has no slot content (its start gradient is
// the caller's d_initial_state, from the final scan).
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
  if (nseg <= 2) return;  // the last segment's E is in place
  extern __shared__ __align__(16) char smem_raw[];
  float* sS = reinterpret_cast<float*>(smem_raw);  // [KP][LDS] dS_end(s), this CTA's columns
  float* sM = sS + KP * L::LDS;                     // [KP][LDM] M_s^T, keys e0 .. e0 + kMergeKeys - 1
  const int col = cb * kMergeCols + static_cast<int>(threadIdx.x) % kMergeCols;
  const bool col_in = col < a.V;
  auto row = [&](int64_t g, int d) { return a.ws_seg + ((g * a.HV + hv) * KP + d) * a.seg_ld; };
  const int64_t g0 = a.seg_offsets[n];
  for (int64_t s = nseg - 2; s >= 1; --s) {
    const int64_t g = g0 + s;
    merge_step<KP>(
        sS, sM, a.K, VT_cols, col, col_in, [&](int e) { return row(g + 1, e)[col]; },
        [&](int d) { return row(g, d); });
  }
}

}  // namespace kdakit::cuda
