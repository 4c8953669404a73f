// The reverse state scan of the backward (stage 3 of src/cpu/backward_chunked.cpp) on tensor cores (mma.sync): one CTA
// per (sequence, v-head, BV value columns), serial over the sequence's chunks from the last. From dS = dht (or zero),
// per chunk: the gradient of its end state dh_c = dS, dv_new = kg dS + Aqk^T dO, dS <- gamma dS + qg^T dO - w^T dv_new
// (qg and Aqk carry the scale); after chunk 0, dS is d_initial_state. The mirror image of the forward's
// recurrence_kernel: dS [KP][BV] lives in the warps' accumulators (warp = row group w4 + 4 * column group: KP / 4
// state rows and 16 chunk rows of dv_new each) and goes through shared memory once per chunk as the B operand of
// kg dS; dv_new goes there as the B operand of w^T dv_new. The forward's prepare tiles (Elem) arrive by cp.async in a
// ring of stage slots (BwdScanLayout), dO through registers (any float dtype) one chunk ahead.
//
// Segments (BackwardArgs::seg_offsets: the forward's cut of a long sequence): CTAs per (segment, v-head, tile), the
// transpose of the forward's context parallelism. SCAN = true, the pre-scan of every segment but the first: the value
// tiles run from a zero end gradient (the last segment from dht) and give E_s, the start gradient; KP / BV extra
// transition tiles run the same scan from the identity without dO (dv_new = kg dS, dS <- gamma dS - w^T dv_new) and
// give M_s^T (every segment but the first and the last); both into ws_seg, nothing else written. A merge
// (backward/merge.cuh) chains the end gradients; then SCAN = false scans each segment from its merged end gradient
// (the last from dht), writing dh_c and dv_new, and segment 0 writes d_initial_state. Without a cut, one CTA runs
// the whole sequence as before.
//
// Precision: bf16 operands keep dS as hi + lo tiles (two MMAs for kg dS: a state rounded once to bf16 would dominate
// the error, as in the forward) and take the lo tiles of Aqk, kg and qg (kg's rounding in dv_new = kg dS would
// dominate dbeta's error, qg's in qg^T dO d_initial_state's); dO and dv_new are bf16 operands. Float operands
// (float16 and float32 inputs) are split into hi + lo everywhere (three MMAs). Accumulation is fp32 in a fixed order.
#pragma once

#include <type_traits>

#include "cuda/backward/common.cuh"
#include "cuda/backward/scan_tile.cuh"
#include "cuda/common/sm80/mma.cuh"

namespace kdakit::cuda {

// Rows [0, C) of a [C][KP] workspace tile into a stage tile of row stride LDK, 16 bytes a thread and step. Not
// unrolled: unrolled steps keep their addresses in registers across the chunk loop.
template <typename Elem, int KP, int LDK, int NT>
__device__ __forceinline__ void copy_scan_tile(Elem* dst, const Elem* src, int C) {
  constexpr int EPC = 16 / sizeof(Elem), KC = KP / EPC;
#pragma unroll 1
  for (int e = threadIdx.x; e < C * KC; e += NT) {
    const int r = e / KC, c = (e % KC) * EPC;
    cp_async16(dst + r * LDK + c, src + r * KP + c);
  }
}

constexpr int bwd_scan_threads(int BV) { return BwdScanLayout{2, 64, BV}.threads(); }

template <typename Elem, int KP, int BV, bool SCAN = false>
__global__ void __launch_bounds__(bwd_scan_threads(BV), 1) backward_scan_kernel(const BackwardArgs a, const int ring) {
  constexpr BwdScanLayout L{static_cast<int>(sizeof(Elem)), KP, BV};
  using Op = Operand<Elem>;
  constexpr int NT = L.threads(), HB = L.cols_per_warp(), NTV = HB / 8, NP = NTV > 1 ? NTV / 2 : 1;
  constexpr int MT = KP / 64, ROWS = KP / 4, P = L.phases();
  constexpr int LDK = L.ldk(), LDB = L.ldb(), LDA = L.lda();
  constexpr bool SPLIT = L.split();
  constexpr std::size_t SLOT = L.slot_bytes();
  constexpr int DO_PER = kBwdMaxChunk * BV / NT;  // dO elements per thread
  static_assert(NT % BV == 0 && DO_PER * NT == kBwdMaxChunk * BV, "dO rows in whole passes of the CTA");
  const int C = a.chunk, K = a.K, V = a.V;
  ScanTile st;
  if (!scan_tile<KP, BV, SCAN>(a, st)) return;
  const int n = st.n, hv = st.hv, vt = st.vt, c_begin = st.c_begin, c_end = st.c_end;
  const int64_t gseg = st.gseg, seg = st.seg, b = st.b, t0 = st.t0, len = st.len, base = st.base;
  const bool trans = st.trans, last = st.last;
  const int tid = threadIdx.x, warp = tid >> 5, w4 = warp & 3, cb = (warp >> 2) * HB;
  const int v0 = vt * BV + cb;  // this warp's first value column (key column of M^T in transition tiles)
  auto seg_row = [&](int64_t g, int d) { return a.ws_seg + ((g * a.HV + hv) * KP + d) * a.seg_ld; };
  const bool dv_rows = 16 * w4 < C;
  const bool even_v = (V & 1) == 0;  // adjacent columns as one 8-byte store

  extern __shared__ __align__(16) char smem_raw[];
  Elem* sdO = reinterpret_cast<Elem*>(smem_raw + ring * SLOT);  // [2][64][LDB]: chunk ci in ci & 1
  Elem* sDv = sdO + 2 * kBwdMaxChunk * LDB;                      // [64][LDB]: -dv_new
  Elem* sS = sDv + kBwdMaxChunk * LDB;                           // [KP][LDB]: dS (its hi part if SPLIT)
  Elem* sSlo = sS + KP * LDB;                                    // [KP][LDB]: dS's lo part (SPLIT)
  Elem* sDvlo = sSlo + KP * LDB;                                 // [64][LDB]: -dv_new's lo part (SPLIT)

  // Stage slot of phase h (the phases' tiles: BwdScanLayout::phases): t0, t1 beside it; Aqk, its lo tile and gamma at
  // t0 for bf16 operands, beside kg (at t1) for float ones.
  struct Slot {
    Elem *t0, *t1, *aqk, *alo;
    float* gam;
  };
  auto slot = [&](int h) {
    Slot s;
    s.t0 = reinterpret_cast<Elem*>(smem_raw + (h % ring) * SLOT);
    s.t1 = s.t0 + kBwdMaxChunk * LDK;
    s.aqk = SPLIT ? s.t0 : s.t1;
    s.alo = s.aqk + kBwdMaxChunk * LDA;
    s.gam = reinterpret_cast<float*>(s.aqk + (SPLIT ? 2 : 1) * kBwdMaxChunk * LDA);
    return s;
  };
  // The phases of a chunk with bf16 operands (paired tiles, or one a phase).
  constexpr bool PR = L.paired();
  constexpr int KLO_P = PR ? 0 : 1, A_P = PR ? 1 : 2, QG_P = PR ? 2 : 3, QLO_P = PR ? 2 : 4, W_P = P - 1;
  // Phase h's tiles (chunk c_end - 1 - h / P) as one commit group; an empty group past chunk c_begin, so that every
  // phase waits for the same count. Transition tiles take neither Aqk nor qg.
  auto issue = [&](int h) {
    const int ci = c_end - 1 - h / P, p = h % P;
    if (ci >= c_begin) {
      constexpr int EPC = 16 / sizeof(Elem);
      const int64_t tile = a.tile(base + ci, hv);
      const Slot s = slot(h);
      auto ws_tile = [&](const void* ws) { return static_cast<const Elem*>(ws) + tile * C * KP; };
      auto copy_aqk = [&] {  // Aqk (and its lo tile) and gamma
        const Elem* ga = static_cast<const Elem*>(a.ws_a) + tile * C * C;
        const Elem* galo = static_cast<const Elem*>(a.ws_alo) + tile * C * C;
        const int AC = C / EPC;
        for (int e = tid; e < (trans ? 0 : C * AC); e += NT) {
          const int r = e / AC, c = (e % AC) * EPC;
          cp_async16(s.aqk + r * LDA + c, ga + r * C + c);
          if constexpr (SPLIT) cp_async16(s.alo + r * LDA + c, galo + r * C + c);
        }
        const float* gg = a.ws_gam + tile * KP;
        for (int e = tid; e < KP / 4; e += NT) cp_async16(s.gam + 4 * e, gg + 4 * e);
      };
      if constexpr (SPLIT) {
        if (p == 0) copy_scan_tile<Elem, KP, LDK, NT>(s.t0, ws_tile(a.ws_kg), C);
        if (p == KLO_P) copy_scan_tile<Elem, KP, LDK, NT>(PR ? s.t1 : s.t0, ws_tile(a.ws_kglo), C);
        if (p == A_P) copy_aqk();
        if (p == QG_P && !trans) copy_scan_tile<Elem, KP, LDK, NT>(s.t0, ws_tile(a.ws_qg), C);
        if (p == QLO_P && !trans) copy_scan_tile<Elem, KP, LDK, NT>(PR ? s.t1 : s.t0, ws_tile(a.ws_qglo), C);
        if (p == W_P) copy_scan_tile<Elem, KP, LDK, NT>(s.t0, ws_tile(a.ws_w), C);
      } else if (p == 0) {
        copy_scan_tile<Elem, KP, LDK, NT>(s.t0, ws_tile(a.ws_kg), C);
        copy_aqk();
      } else if (P == 2) {
        if (!trans) copy_scan_tile<Elem, KP, LDK, NT>(s.t0, ws_tile(a.ws_qg), C);
        copy_scan_tile<Elem, KP, LDK, NT>(s.t1, ws_tile(a.ws_w), C);
      } else if (p == 2 || !trans) {
        copy_scan_tile<Elem, KP, LDK, NT>(s.t0, ws_tile(p == 1 ? a.ws_qg : a.ws_w), C);
      }
    }
    cp_async_commit();
  };
  // The start of phase h: its slot has landed and every warp is done with phase h - 1, whose slot then takes phase
  // h + ring - 1's tiles. One slot: copy, wait, and no overlap.
  auto begin_phase = [&](int h) {
    if (ring == 1) {
      __syncthreads();
      issue(h);
      cp_async_wait<0>();
    } else {
      cp_async_wait(ring - 2);
    }
    __syncthreads();
    if (ring > 1) issue(h + ring - 1);
    return slot(h);
  };

  // dO of chunk ci (zero past its rows and V): loaded into registers while a chunk computes, stored after it.
  float dov[DO_PER];
  const int do_c = tid % BV, do_r = tid / BV;  // each thread keeps one column
  auto load_dO = [&](int ci) {
    const int64_t row0 = t0 + int64_t(ci) * C;
    const int nrows = static_cast<int>(min(static_cast<int64_t>(C), len - int64_t(ci) * C));
    const int v = vt * BV + do_c;
    with_typed(a.d_out, [&](auto* p) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(p)>>;
#pragma unroll
      for (int i = 0; i < DO_PER; ++i) {
        const int r = do_r + i * (NT / BV);
        float x = 0.f;
        if (r < nrows && v < V) {
          const T y = p[a.d_out.offset(b, row0 + r, hv) + v];
          if constexpr (std::is_same_v<T, double>) x = static_cast<float>(y);
          else x = to_float(y);
        }
        dov[i] = x;
      }
    });
  };
  auto store_dO = [&](int ci) {
    Elem* dst = sdO + (ci & 1) * kBwdMaxChunk * LDB;
#pragma unroll
    for (int i = 0; i < DO_PER; ++i) Op::store(dst + (do_r + i * (NT / BV)) * LDB + do_c, dov[i]);
  };
  // Columns v, v + 1 of a workspace row (fp32).
  auto store_pair = [&](float* row, int v, float x0, float x1) {
    if (even_v && v < V) {
      *reinterpret_cast<float2*>(row + v) = make_float2(x0, x1);
    } else {
      if (v < V) row[v] = x0;
      if (v + 1 < V) row[v + 1] = x1;
    }
  };

  // The end gradient: dht (the sequence's last segment), the merged one (later segments: slot gseg + 1 holds it),
  // zero (pre-scan value tiles of other segments) or the identity (transition tiles).
  FragC dS[MT][NTV];
  for_each_acc<MT, NTV>([&](int mt, int nt, int e, int row, int col) {
    const int d = w4 * ROWS + row, v = v0 + col;
    float x = 0.f;
    if (trans) {
      x = d == v && d < K ? 1.f : 0.f;
    } else if (d < K && v < V) {
      if (last) x = a.d_final.present() ? a.d_final.load(a.d_final.offset(n, hv, d, v, K, V, a.vk)) : 0.f;
      else if (!SCAN) x = seg_row(gseg + 1, d)[v];
    }
    dS[mt][nt].x[e] = x;
  });

  if (c_end > c_begin && !trans) {
    load_dO(c_end - 1);
    store_dO(c_end - 1);
  }
  for (int h = 0; h < ring - 1; ++h) issue(h);
  for (int ci = c_end - 1; ci >= c_begin; --ci) {
    const int h0 = (c_end - 1 - ci) * P;
    const int64_t tile = a.tile(base + ci, hv);
    const int nrows = static_cast<int>(min(static_cast<int64_t>(C), len - int64_t(ci) * C));
    const Elem* dO = sdO + (ci & 1) * kBwdMaxChunk * LDB + cb;

    // dh_c = dS: to the workspace, and to shared memory as the B operand of kg dS. Every warp is past the barrier
    // that began the last phase of chunk ci + 1, so nobody reads sS any more.
    {
      float* dh = a.ws_dh + tile * K * V;
      for_each_acc<MT, NTV>([&](int mt, int nt, int e, int row, int col) {
        if ((e & 1) == 0) {
          const int d = w4 * ROWS + row;
          const float x0 = dS[mt][nt].x[e], x1 = dS[mt][nt].x[e + 1];
          if constexpr (SPLIT) {
            store_hi_lo(sS + d * LDB + cb + col, sSlo + d * LDB + cb + col, x0, x1);
          } else {
            Op::store2(sS + d * LDB + cb + col, x0, x1);
          }
          if (!SCAN && a.scan_writes && d < K) store_pair(dh + int64_t(d) * V, v0 + col, x0, x1);
        }
      });
    }

    // dS <- gamma dS in the accumulators (its copy above feeds kg dS).
    auto decay = [&](const Slot& s) {
      const int g = (tid & 31) >> 2;
      float gam[MT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        gam[mt][0] = s.gam[w4 * ROWS + 16 * mt + g];
        gam[mt][1] = s.gam[w4 * ROWS + 16 * mt + g + 8];
      }
      for_each_acc<MT, NTV>([&](int mt, int nt, int e, int, int) { dS[mt][nt].x[e] *= gam[mt][e >> 1]; });
    };
    // dv_new = kg dS + Aqk^T dO for this warp's 16 rows (Aqk is lower triangular: rows i take dO rows j >= i, from
    // i's block on): kg dS in dv, then the Aqk products; rows past the chunk are zero, and -dv_new goes to shared
    // memory as the B operand of the update (an exact negation).
    FragC dv[1][NTV];
#pragma unroll
    for (int i = 0; i < NTV; ++i) dv[0][i].zero();
    auto finish_dv = [&](const Slot& s) {
      const int ks = trans ? 0 : C / 16 - w4;
      if constexpr (SPLIT) warp_gemm<Elem, 1, NTV, true, true>(dv, s.alo, LDA, 16 * w4, dO, LDB, 0, 16 * w4, ks);
      warp_gemm<Elem, 1, NTV, true, true>(dv, s.aqk, LDA, 16 * w4, dO, LDB, 0, 16 * w4, ks);
      float* dvn = a.ws_dvnew + tile * C * V;
      for_each_acc<1, NTV>([&](int, int nt, int e, int row, int col) {
        if ((e & 1) == 0) {
          const int r = 16 * w4 + row;
          const float x0 = r < nrows ? dv[0][nt].x[e] : 0.f, x1 = r < nrows ? dv[0][nt].x[e + 1] : 0.f;
          if constexpr (SPLIT) {
            store_hi_lo(sDv + r * LDB + cb + col, sDvlo + r * LDB + cb + col, -x0, -x1);
          } else {
            Op::store2(sDv + r * LDB + cb + col, -x0, -x1);
          }
          if (!SCAN && a.scan_writes) store_pair(dvn + int64_t(r) * V, v0 + col, x0, x1);
        }
      });
    };
    const int qsteps = trans ? 0 : C / 16;  // transition tiles: no dO
    if constexpr (SPLIT) {
      // kg dS with dS as hi + lo, then kg's lo part times dS's hi part (kg = hi + lo, exact in fp32; its rounding
      // alone would dominate dbeta's error); likewise qg^T dO then qg's lo part. The order of scan_sm90.cuh.
      Slot s = begin_phase(h0);
      if (ci > c_begin && !trans) load_dO(ci - 1);
      if (dv_rows) {
        warp_gemm<Elem, 1, NTV, false, true, true>(dv, s.t0, LDK, 16 * w4, sS + cb, LDB, 0, 0, KP / 16, NP, sSlo + cb);
      }
      if constexpr (!PR) s = begin_phase(h0 + KLO_P);
      if (dv_rows) {
        warp_gemm<Elem, 1, NTV, false, true>(dv, PR ? s.t1 : s.t0, LDK, 16 * w4, sS + cb, LDB, 0, 0, KP / 16, NP);
      }
      s = begin_phase(h0 + A_P);
      decay(s);
      if (dv_rows) finish_dv(s);
      s = begin_phase(h0 + QG_P);
      warp_gemm<Elem, MT, NTV, true, true>(dS, s.t0, LDK, w4 * ROWS, dO, LDB, 0, 0, qsteps);
      if constexpr (!PR) s = begin_phase(h0 + QLO_P);
      warp_gemm<Elem, MT, NTV, true, true>(dS, PR ? s.t1 : s.t0, LDK, w4 * ROWS, dO, LDB, 0, 0, qsteps);
      // dS += w^T (-dv_new), -dv_new as hi + lo.
      s = begin_phase(h0 + W_P);
      warp_gemm<Elem, MT, NTV, true, true, true>(dS, s.t0, LDK, w4 * ROWS, sDv + cb, LDB, 0, 0, C / 16, NP, sDvlo + cb);
    } else {
      // Phase 0: the decay, and dv_new; phase 1 (and 2): the update's products for this warp's state rows,
      // dS += qg^T dO, then dS += w^T (-dv_new).
      Slot s = begin_phase(h0);
      if (ci > c_begin && !trans) load_dO(ci - 1);
      decay(s);
      if (dv_rows) {
        warp_gemm<Elem, 1, NTV, false, true>(dv, s.t0, LDK, 16 * w4, sS + cb, LDB, 0, 0, KP / 16, NP);
        finish_dv(s);
      }
      s = begin_phase(h0 + 1);
      warp_gemm<Elem, MT, NTV, true, true>(dS, s.t0, LDK, w4 * ROWS, dO, LDB, 0, 0, qsteps);
      if constexpr (P == 3) s = begin_phase(h0 + 2);
      warp_gemm<Elem, MT, NTV, true, true>(dS, P == 2 ? s.t1 : s.t0, LDK, w4 * ROWS, sDv + cb, LDB, 0, 0, C / 16);
    }
    // Chunk ci + 1 read the other dO buffer up to its qg phases, before the barrier that began this chunk.
    if (ci > c_begin && !trans) store_dO(ci - 1);
  }

  if (SCAN) {  // E_s (value tiles) or M_s^T (transition tiles, after the value columns)
    const int col0 = trans ? a.seg_ld - KP : 0, ncols = trans ? K : V;
    for_each_acc<MT, NTV>([&](int mt, int nt, int e, int row, int col) {
      const int d = w4 * ROWS + row, v = v0 + col;
      if (d < K && v < ncols) seg_row(gseg, d)[col0 + v] = dS[mt][nt].x[e];
    });
  } else if (seg == 0 && a.d_initial.present()) {
    for_each_acc<MT, NTV>([&](int mt, int nt, int e, int row, int col) {
      const int d = w4 * ROWS + row, v = v0 + col;
      if (d < K && v < V) a.d_initial.store(a.d_initial.offset(n, hv, d, v, K, V, a.vk), dS[mt][nt].x[e]);
    });
  }
}

}  // namespace kdakit::cuda
