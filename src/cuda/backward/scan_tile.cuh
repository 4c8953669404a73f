// The work of one reverse-scan CTA (scan_sm80.cuh, scan_sm90.cuh): blockIdx.x = (sequence or segment slot, v-head,
// tile), tiles fastest; value tiles of BV columns, then, in the segments' pre-scan (SCAN), KP / BV transition tiles
// whose columns are keys (they give M_s^T). The sequence, this CTA's chunks in its segment, and whether it has work.
#pragma once

#include <cstdint>

#include "cuda/backward/args.h"
#include "cuda/cp/segments.h"
#include "cuda/common/seqlen.cuh"

namespace kdakit::cuda {

struct ScanTile {
  int n = 0, hv = 0, vt = 0;       // sequence, v-head, value (or transition) tile
  bool trans = false, last = false;  // a transition tile; the sequence's last segment (its end gradient is dht)
  int64_t gseg = 0, seg = 0, nseg = 1;  // segment slot (the sequence where uncut), index in the sequence, count
  int64_t b = 0, t0 = 0, len = 0, base = 0;  // batch row, first token, length, first chunk slot
  int c_begin = 0, c_end = 0;      // chunks [c_begin, c_end), scanned from the last
};

// False where the CTA has nothing to do: past the last segment; in the pre-scan, segment 0 (its start gradient is the
// final scan's) and M of the last segment (it starts from dht, which needs no merge), except that a context-parallel
// summary starts the last segment from zero too (its finish merges dht through M^T) and scans segment 0 where it folds
// d_initial (BackwardArgs::cp_phase).
template <int KP, int BV, bool SCAN>
__device__ __forceinline__ bool scan_tile(const BackwardArgs& a, ScanTile& s) {
  const int VT = (a.V + BV - 1) / BV;
  constexpr int XT = SCAN ? segment_transition_tiles(KP, BV) : 0;
  int64_t idx = blockIdx.x;
  const int tile = static_cast<int>(idx % (VT + XT));
  idx /= VT + XT;
  s.hv = static_cast<int>(idx % a.HV);
  s.gseg = idx / a.HV;
  const bool segmented = a.seg_offsets != nullptr;
  s.n = static_cast<int>(s.gseg);
  if (segmented) {
    if (s.gseg >= a.seg_offsets[a.N]) return false;
    s.n = owner_of(a.seg_offsets, a.N, s.gseg);
    s.seg = s.gseg - a.seg_offsets[s.n];
  }
  sequence(a, s.n, s.b, s.t0, s.len);
  const int nch = static_cast<int>((s.len + a.chunk - 1) / a.chunk);
  s.c_end = nch;
  if (segmented) {
    int64_t per;
    s.nseg = a.segments_of(nch, per);
    s.c_begin = static_cast<int>(s.seg * per);
    s.c_end = static_cast<int>(min(static_cast<int64_t>(nch), s.c_begin + per));
  }
  s.trans = SCAN && tile >= VT;
  s.last = s.seg == s.nseg - 1;
  const bool summary = a.cp_phase == kCpSummary;
  if (SCAN && !summary && (s.seg == 0 || (s.trans && s.last))) return false;
  if (SCAN && summary && s.seg == 0 && !a.d_initial.present()) return false;
  s.vt = s.trans ? tile - VT : tile;
  s.base = a.chunk_offsets[s.n];
  return true;
}

}  // namespace kdakit::cuda
