// What the recurrence kernels share (forward/recurrence_sm80.cuh, recurrence_vrows.cuh): the work of a CTA (segment,
// v-head, V tile), the stage tiles in shared memory and their asynchronous copies from the workspace, and the
// accumulator-to-A-fragment conversion of the value-row kernels.
#pragma once

#include "cuda/common/seqlen.cuh"
#include "cuda/common/sm80/mma.cuh"
#include "cuda/common/sm90/gmma.cuh"
#include "cuda/cp/segments.h"
#include "cuda/forward/args.h"
#include "cuda/forward/tile_size.h"

namespace kdakit::cuda {

// Finds the sequence of segment slot g (seg_offsets[n] <= g < seg_offsets[n+1]; without cuts the g-th sequence of
// seq_order where it is given); false past the last segment.
__device__ __forceinline__ bool segment_sequence(const ForwardArgs& a, int64_t g, int& n, int64_t& s) {
  if (a.seg_offsets == nullptr) {
    n = a.seq_order != nullptr ? a.seq_order[g] : static_cast<int>(g);
    s = 0;
    return true;
  }
  if (g >= a.seg_offsets[a.N]) return false;
  n = owner_of(a.seg_offsets, a.N, g);
  s = g - a.seg_offsets[n];
  return true;
}

// A recurrence CTA's work: blockIdx.x = (segment slot, v-head, tile), tiles fastest; the sequence and its state slot,
// its chunks in this segment, and whether the tile is a transition tile (SCAN: the KP / BV extra tiles, at least one,
// that give M).
// False when the CTA has nothing to do (past the last segment; the scan of a sequence's last segment; M of segment 0).
// A padding sequence (slot -1) gets no chunks: its outputs and chunk states are the prepare kernel's zeros, and it
// reads and writes no state. (No early exit for it: that cost the hot kernels registers and spills.)
struct RecurrenceTile {
  int VT, tile, hv, n, vt, ncols;  // ncols: valid columns (value rows) of this tile's kind
  int64_t gseg, seg, b, t0, len, nch_all, c_begin, c_end, base;
  int64_t slot;  // ForwardArgs::state_slot: -1 for padding
  bool trans;
};
template <int KP, int BV, bool SCAN>
__device__ __forceinline__ bool recurrence_tile(const ForwardArgs& a, RecurrenceTile& w) {
  const int C = a.chunk;
  w.VT = (a.V + BV - 1) / BV;
  const int TILES = SCAN ? w.VT + segment_transition_tiles(KP, BV) : w.VT;
  int64_t idx = blockIdx.x;
  w.tile = static_cast<int>(idx % TILES);
  idx /= TILES;
  w.hv = static_cast<int>(idx % a.HV);
  w.gseg = idx / a.HV;  // segment slot
  if (!segment_sequence(a, w.gseg, w.n, w.seg)) return false;
  sequence(a, w.n, w.b, w.t0, w.len);
  w.nch_all = (w.len + C - 1) / C;
  int64_t per;
  const int64_t nseg = a.segments_of(w.nch_all, per);
  w.c_begin = w.seg * per;
  w.c_end = min(w.nch_all, w.c_begin + per);  // this segment's chunks
  w.trans = SCAN && w.tile >= w.VT;
  // No scan of last segments, no M of first ones: except for a context-parallel summary, which takes every segment.
  if (SCAN && a.cp_phase != kCpSummary && (w.seg == nseg - 1 || (w.trans && w.seg == 0))) return false;
  w.vt = w.trans ? w.tile - w.VT : w.tile;
  w.ncols = w.trans ? a.K : a.V;
  w.base = a.chunk_offsets[w.n];
  w.slot = a.state_slot(w.n);
  if (w.slot < 0) w.c_end = w.c_begin;
  return true;
}

// A recurrence stage in shared memory: one chunk's workspace tiles, laid out by each kernel's layout.
template <typename Elem>
struct RecurrenceStage {
  Elem *w, *q, *k, *u, *a, *alo;
  float* gam;
};

// Rows [0, C) of a [C][KP] workspace tile into a stage tile of row stride LDK: a compile-time number of steps over the
// 64-row maximum (unrolled, constant address steps).
template <typename Elem, int KP, int LDK, int NT>
__device__ __forceinline__ void copy_ws_tile(Elem* dst, const Elem* src, int C, int tid) {
  constexpr int EPC = 16 / sizeof(Elem), KC = KP / EPC;
#pragma unroll
  for (int i = 0; i < (64 * KC + NT - 1) / NT; ++i) {
    const int e = tid + i * NT, r = e / KC, c = (e % KC) * EPC;
    if (r < C) cp_async16(dst + r * LDK + c, src + r * KP + c);
  }
}

// Chunk ci's workspace tiles into stage t as one commit group of the NT threads that copy (tid: this thread among
// them): w; qg (not NO_OUT) and kg unless ONE_TILE (they take turns in w's buffer later); the tile's BV columns of u
// (transition tiles have u = 0); Aqk and its lo tile (not NO_OUT: the kernel makes no outputs); gamma. SWIZZLED: w,
// qg, kg, Aqk in the swizzled layout of the warpgroup MMAs (chunk 64), else row-major with row strides LDK / LDA.
template <typename Elem, int KP, int BV, int NT, int LDK, int LDB, int LDA, bool SPLIT_A, bool ONE_TILE, bool NO_OUT,
          bool SWIZZLED = false>
__device__ __forceinline__ void issue_chunk(const ForwardArgs& a, const RecurrenceTile& rt, int64_t ci,
                                            const RecurrenceStage<Elem>& t, int tid) {
  constexpr int EPC = 16 / sizeof(Elem);
  const int C = a.chunk;
  const int64_t wtile = (rt.base + ci) * a.HV + rt.hv;
  auto tile_of = [&](void* ws) { return static_cast<const Elem*>(ws) + wtile * C * KP; };
  if constexpr (SWIZZLED) {
    sm90::copy_ws_swizzled<Elem, KP, NT>(t.w, tile_of(a.ws_w), C, tid);
    if constexpr (!NO_OUT) sm90::copy_ws_swizzled<Elem, KP, NT>(t.q, tile_of(a.ws_qg), C, tid);
    sm90::copy_ws_swizzled<Elem, KP, NT>(t.k, tile_of(a.ws_kg), C, tid);
  } else {
    copy_ws_tile<Elem, KP, LDK, NT>(t.w, tile_of(a.ws_w), C, tid);
    if constexpr (!ONE_TILE) {
      if constexpr (!NO_OUT) copy_ws_tile<Elem, KP, LDK, NT>(t.q, tile_of(a.ws_qg), C, tid);
      copy_ws_tile<Elem, KP, LDK, NT>(t.k, tile_of(a.ws_kg), C, tid);
    }
  }
  if (!rt.trans) {
    const Elem* gu = static_cast<const Elem*>(a.ws_u) + wtile * C * a.VP + rt.vt * BV;
    constexpr int BC = BV / EPC;
#pragma unroll
    for (int i = 0; i < (64 * BC + NT - 1) / NT; ++i) {
      const int e = tid + i * NT, r = e / BC, c = (e % BC) * EPC;
      if (r < C) cp_async16(t.u + r * LDB + c, gu + r * a.VP + c);
    }
  }
  if constexpr (!NO_OUT && SWIZZLED) {
    sm90::copy_ws_swizzled<Elem, 64, NT>(t.a, static_cast<const Elem*>(a.ws_a) + wtile * C * C, C, tid);
    sm90::copy_ws_swizzled<Elem, 64, NT>(t.alo, static_cast<const Elem*>(a.ws_alo) + wtile * C * C, C, tid);
  } else if constexpr (!NO_OUT) {
    const Elem* ga = static_cast<const Elem*>(a.ws_a) + wtile * C * C;
    const Elem* galo = static_cast<const Elem*>(a.ws_alo) + wtile * C * C;
    const int AC = C / EPC;
    for (int e = tid; e < C * AC; e += NT) {
      const int r = e / AC, c = (e % AC) * EPC;
      cp_async16(t.a + r * LDA + c, ga + r * C + c);
      if constexpr (SPLIT_A) cp_async16(t.alo + r * LDA + c, galo + r * C + c);
    }
  }
  const float* gg = a.ws_gam + wtile * KP;
  for (int e = tid; e < KP / 4; e += NT) cp_async16(t.gam + 4 * e, gg + 4 * e);
  cp_async_commit();
}


// S^T = S^T diag(gamma) for a transposed state in accumulators (value rows by keys: key d of n-tile nd at column
// 8 nd + 2 t + (e & 1)), gamma the keys' decays in shared memory.
template <int ND>
__device__ __forceinline__ void decay_keys(FragC (&S)[ND], const float* gam) {
  const int t2 = 2 * (threadIdx.x & 3);
#pragma unroll
  for (int nd = 0; nd < ND; ++nd) {
    const float2 gm = *reinterpret_cast<const float2*>(gam + 8 * nd + t2);
    S[nd].x[0] *= gm.x;
    S[nd].x[1] *= gm.y;
    S[nd].x[2] *= gm.x;
    S[nd].x[3] *= gm.y;
  }
}

// The A fragment (m16 x k16) of accumulator n-tiles c0 (k 0..7) and c1 (k 8..15): rounded once to bf16 (P = 1), or
// split into P bf16 parts (a[0] the largest).
template <int P>
__device__ __forceinline__ void acc_to_parts(const FragC& c0, const FragC& c1, FragA (&a)[P]) {
  if constexpr (P == 1) {
    a[0].x[0] = pack_bf16(c0.x[0], c0.x[1]);
    a[0].x[1] = pack_bf16(c0.x[2], c0.x[3]);
    a[0].x[2] = pack_bf16(c1.x[0], c1.x[1]);
    a[0].x[3] = pack_bf16(c1.x[2], c1.x[3]);
  } else {
    SplitOperand<P>::put(a, 0, c0.x[0], c0.x[1]);
    SplitOperand<P>::put(a, 1, c0.x[2], c0.x[3]);
    SplitOperand<P>::put(a, 2, c1.x[0], c1.x[1]);
    SplitOperand<P>::put(a, 3, c1.x[2], c1.x[3]);
  }
}

}  // namespace kdakit::cuda
