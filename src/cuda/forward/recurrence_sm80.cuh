// The chunked forward's recurrence on sm_80+ (mma.sync): recurrence_kernel (16 warps splitting keys and value
// columns, for tiles of 16 to 64 columns) and the value-row kernel's products (VrowsStep, WG = false).
#pragma once

#include <type_traits>

#include "cuda/forward/recurrence_common.cuh"
#include "cuda/forward/recurrence_vrows.cuh"

namespace kdakit::cuda {

// SCAN = false: the recurrence of one segment (the whole sequence unless it is cut) for one V tile: outputs,
// intermediate states, and the final state from the last segment; the start state is the caller's (segment 0) or the
// merged one. SCAN = true: the context-parallel pre-scan of a segment that is not a sequence's last: no outputs; the
// value tiles run from zero (segment 0: from the caller's state) and give E; the K / BV extra "transition" tiles
// run the same recurrence with u = 0 from the identity and give M. Both end in ws_seg.
template <typename Elem, int KP, int BV, bool SCAN, bool ONE_STAGE = false>
__global__ void __launch_bounds__(RecurrenceWarps<BV>::THREADS) recurrence_kernel(const ForwardArgs a) {
  using L = RecurrenceLayout<sizeof(Elem), KP, BV, ONE_STAGE>;
  using Op = Operand<Elem>;
  constexpr int NT = RecurrenceWarps<BV>::THREADS;
  constexpr int HB = RecurrenceWarps<BV>::COLS;  // columns per warp
  constexpr int MT = KP / 64, NTV = HB / 8, ROWS = KP / 4;
  const int C = a.chunk;
  RecurrenceTile rt;
  if (!recurrence_tile<KP, BV, SCAN>(a, rt)) return;
  const int VT = rt.VT, hv = rt.hv, n = rt.n, vt = rt.vt, ncols = rt.ncols;
  const int64_t gseg = rt.gseg, seg = rt.seg, b = rt.b, t0 = rt.t0, len = rt.len, nch_all = rt.nch_all;
  const int64_t c_begin = rt.c_begin, c_end = rt.c_end, base = rt.base;
  const bool trans = rt.trans;
  const int tid = threadIdx.x, warp = tid >> 5, w4 = warp & 3, cb = (warp >> 2) * HB;
  const int v0 = vt * BV + cb;  // this warp's first value (or key, for transition tiles) column
  // ws_seg rows of a segment slot: columns [0, VT*BV) values, then the K transition columns.
  auto seg_row = [&](int64_t g, int d) { return a.ws_seg + ((g * a.HV + hv) * KP + d) * a.seg_ld; };
  const int seg_col0 = trans ? VT * BV : 0;

  extern __shared__ __align__(16) char smem_raw[];
  using Stage = RecurrenceStage<Elem>;
  auto stage = [&](int st) {
    Stage t;
    char* p = smem_raw + st * L::stage_stride();
    t.w = reinterpret_cast<Elem*>(p);
    t.q = L::ONE_TILE ? t.w : t.w + 64 * L::LDK;
    t.k = L::ONE_TILE ? t.w : t.q + 64 * L::LDK;
    t.u = t.w + L::TILES * 64 * L::LDK;
    t.a = t.u + 64 * L::LDB;
    t.alo = t.a + 64 * L::LDA;  // SPLIT_A only
    t.gam = reinterpret_cast<float*>(t.a + (L::SPLIT_A ? 2 : 1) * 64 * L::LDA);
    return t;
  };
  Elem* sS = reinterpret_cast<Elem*>(smem_raw + L::STAGES * L::stage_stride());  // [KP][LDB]
  Elem* sSlo = sS + KP * L::LDB;                                                 // [KP][LDB] (SPLIT_S)
  Elem* sVn = sS + (L::SPLIT_S ? 2 : 1) * KP * L::LDB;                           // [64][LDB]

  // Slots: read initial_state[slot] and write final_state[slot]; padding (-1) neither (recurrence_tile).
  const int64_t slot = rt.slot;
  const bool read = seg == 0 && a.initial.present() && slot >= 0 &&
                    (!a.has_initial_state.present() || a.has_initial_state.load_int(n) != 0);
  const bool write = !SCAN && c_end == nch_all && a.final_state.present() && slot >= 0;

  // The start state: the caller's (segment 0), the merged one (later segments: S_start(s) sits in slot g - 1), zero
  // (scan value tiles of later segments) or the identity (transition tiles).
  FragC S[MT][NTV];
  for_each_acc<MT, NTV>([&](int mt, int nt, int e, int row, int col) {
    const int d = w4 * ROWS + row, v = v0 + col;
    float x = 0.f;
    if (trans) {
      x = d == v && d < a.K ? 1.f : 0.f;
    } else if (d < a.K && v < a.V) {
      if (read) x = a.initial.load(a.initial.offset(slot, hv, d, v, a.K, a.V, a.vk));
      else if (!SCAN && seg > 0) x = seg_row(gseg - 1, d)[v];
    }
    S[mt][nt].x[e] = x;
  });

  auto issue = [&](int64_t ci, int st) {  // in ONE_TILE mode only w of the three [C][KP] tiles
    issue_chunk<Elem, KP, BV, NT, L::LDK, L::LDB, L::LDA, L::SPLIT_A, L::ONE_TILE, SCAN>(a, rt, ci, stage(st), tid);
  };
  auto reload = [&](Elem* dst, void* ws, int64_t ci) {  // ONE_TILE: swap the next tile in
    __syncthreads();
    copy_ws_tile<Elem, KP, L::LDK, NT>(dst, static_cast<const Elem*>(ws) + ((base + ci) * a.HV + hv) * C * KP, C, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
  };

  if (c_begin < c_end) issue(c_begin, 0);
  for (int64_t ci = c_begin; ci < c_end; ++ci) {
    const int st = L::STAGES == 2 ? static_cast<int>((ci - c_begin) & 1) : 0;
    cp_async_wait<0>();
    __syncthreads();  // chunk ci visible; every warp is done with chunk ci-1
    if (L::STAGES == 2 && ci + 1 < c_end) issue(ci + 1, st ^ 1);
    const Stage t = stage(st);
    const int nrows = static_cast<int>(min(static_cast<int64_t>(C), len - ci * C));

    // The chunk-start state: to the intermediate states, to shared memory (B operand), then decayed.
    const bool inter = !SCAN && a.inter.present();
    const int64_t inter_base = a.cu_seqlens.present() ? (base + ci) * a.inter_sc : b * a.inter_sb + ci * a.inter_sc;
    if (inter) {  // one dtype branch and one layout branch a chunk, not a switch per element
      with_typed(a.inter, [&](auto* ip) {
        using IT = std::remove_pointer_t<decltype(ip)>;
        ip += inter_base + hv * a.inter_sh;
        const int K = a.K, V = a.V;
        if (a.vk) {
          for_each_acc<MT, NTV>([&](int mt, int nt, int e, int row, int col) {
            const int d = w4 * ROWS + row, v = v0 + col;
            if (d < K && v < V) ip[int64_t(v) * K + d] = from_float<IT>(S[mt][nt].x[e]);
          });
        } else {
          for_each_acc<MT, NTV>([&](int mt, int nt, int e, int row, int col) {
            const int d = w4 * ROWS + row, v = v0 + col;
            if (d < K && v < V) ip[int64_t(d) * V + v] = from_float<IT>(S[mt][nt].x[e]);
          });
        }
      });
    }
    for_each_acc<MT, NTV>([&](int mt, int nt, int e, int row, int col) {
      const int d = w4 * ROWS + row;
      if ((e & 1) == 0) {
        const float x0 = S[mt][nt].x[e], x1 = S[mt][nt].x[e + 1];
        if constexpr (L::SPLIT_S) {
          store_hi_lo(sS + d * L::LDB + cb + col, sSlo + d * L::LDB + cb + col, x0, x1);
        } else {
          Op::store2(sS + d * L::LDB + cb + col, x0, x1);
        }
      }
    });
    {
      // A thread's accumulators cover 2 * MT state rows: load each row's decay once.
      const int g = (threadIdx.x & 31) >> 2;
      float gam[MT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        gam[mt][0] = t.gam[w4 * ROWS + 16 * mt + g];
        gam[mt][1] = t.gam[w4 * ROWS + 16 * mt + g + 8];
      }
      for_each_acc<MT, NTV>([&](int mt, int nt, int e, int, int) { S[mt][nt].x[e] *= gam[mt][e >> 1]; });
    }
    __syncthreads();

    // v_new = u - w S and o = qg S for this warp's 16 rows and columns.
    FragC vn[1][NTV], o[1][NTV];
#pragma unroll
    for (int i = 0; i < NTV; ++i) { vn[0][i].zero(); o[0][i].zero(); }
    const bool rows_here = 16 * w4 < C;
    if (rows_here) {
      constexpr int NP = NTV > 1 ? NTV / 2 : 1;
      warp_gemm<Elem, 1, NTV, false, true, L::SPLIT_S>(vn, t.w, L::LDK, 16 * w4, sS + cb, L::LDB, 0, 0, KP / 16, NP,
                                                       sSlo + cb);
      if constexpr (!L::ONE_TILE && !SCAN) {
        warp_gemm<Elem, 1, NTV, false, true, L::SPLIT_S>(o, t.q, L::LDK, 16 * w4, sS + cb, L::LDB, 0, 0, KP / 16, NP,
                                                         sSlo + cb);
      }
      for_each_acc<1, NTV>([&](int, int nt, int e, int row, int col) {
        if ((e & 1) == 0) {
          const int r = 16 * w4 + row, c = cb + col;
          float u0 = 0.f, u1 = 0.f;
          if (!trans) u0 = to_float(t.u[r * L::LDB + c]), u1 = to_float(t.u[r * L::LDB + c + 1]);
          Op::store2(sVn + r * L::LDB + c, u0 - vn[0][nt].x[e], u1 - vn[0][nt].x[e + 1]);
        }
      });
    }
    if constexpr (L::ONE_TILE && !SCAN) {
      reload(t.w, a.ws_qg, ci);
      if (rows_here) warp_gemm<Elem, 1, NTV, false, true>(o, t.w, L::LDK, 16 * w4, sS + cb, L::LDB, 0, 0, KP / 16);
    } else {
      __syncthreads();
    }
    if (!SCAN && rows_here) {
      if constexpr (L::SPLIT_A) {
        warp_gemm<Elem, 1, NTV, false, true>(o, t.alo, L::LDA, 16 * w4, sVn + cb, L::LDB, 0, 0, w4 + 1);
      }
      warp_gemm<Elem, 1, NTV, false, true>(o, t.a, L::LDA, 16 * w4, sVn + cb, L::LDB, 0, 0, w4 + 1);
      const int64_t orow0 = a.out.offset(b, t0 + ci * C, hv);
      with_typed(a.out, [&](auto* op) {
        using OutT = std::remove_pointer_t<decltype(op)>;
        for_each_acc<1, NTV>([&](int, int nt, int e, int row, int col) {
          const int r = 16 * w4 + row, v = v0 + col;
          if (r < nrows && v < a.V) op[orow0 + r * a.out.st + v] = from_float<OutT>(o[0][nt].x[e]);
        });
      });
    }
    // S += kg^T v_new for this warp's state rows and columns.
    if constexpr (L::ONE_TILE) reload(t.w, a.ws_kg, ci);
    warp_gemm<Elem, MT, NTV, true, true>(S, t.k, L::LDK, w4 * ROWS, sVn + cb, L::LDB, 0, 0, C / 16);
    if (L::STAGES == 1 && ci + 1 < c_end) {
      __syncthreads();
      issue(ci + 1, 0);
    }
  }
  if (SCAN) {  // E (value tiles) or M (transition tiles) of this segment
    for_each_acc<MT, NTV>([&](int mt, int nt, int e, int row, int col) {
      const int d = w4 * ROWS + row, v = v0 + col;
      if (d < KP && v < ncols) seg_row(gseg, d)[seg_col0 + v] = S[mt][nt].x[e];
    });
  }
  if (write) {
    for_each_acc<MT, NTV>([&](int mt, int nt, int e, int row, int col) {
      const int d = w4 * ROWS + row, v = v0 + col;
      if (d < a.K && v < a.V) {
        a.final_state.store(a.final_state.offset(slot, hv, d, v, a.K, a.V, a.vk), S[mt][nt].x[e]);
      }
    });
  }
}

// c += A B with A split (the state, FloatOperand<Elem>'s parts): bf16 operands B in one part (lo product first), float
// operands B split alike (Operand<Elem>::mma: three MMAs, six for Float3Split).
template <typename Elem>
__device__ __forceinline__ void mma_split_a(FragC& c, const FragA (&a)[FloatOperand<Elem>::kSplit],
                                            const FragB (&b)[Operand<Elem>::kSplit]) {
  if constexpr (sizeof(Elem) == 2) {
    mma_bf16(c, a[1], b[0]);
    mma_bf16(c, a[0], b[0]);
  } else {
    Operand<Elem>::mma(c, a, b);
  }
}


// The value-row kernel's products by mma.sync (recurrence_vrows.cuh), B fragments by ldmatrix from padded tiles.
template <typename Elem, int KP, int BV, bool NO_OUT, bool ONE_STAGE>
struct VrowsStep<Elem, KP, BV, NO_OUT, ONE_STAGE, false> {
  using L = VrowsLayout<sizeof(Elem), KP, BV, ONE_STAGE, false>;
  using Op = Operand<Elem>;
  using Stage = RecurrenceStage<Elem>;
  static constexpr int ND = KP / 8, NC = 64 / 8, SP = Op::kSplit;
  static constexpr int SA = FloatOperand<Elem>::kSplit;  // the state's parts as an A operand
  static constexpr int VP = sizeof(Elem) == 4 ? SP : 1;  // v_new's: split like the float operands, or rounded once

  __device__ __forceinline__ static void before_handover() {}

  template <typename Decay>
  __device__ __forceinline__ static void state_products(FragC (&S)[ND], const Stage& t, int NCC, FragC (&vn)[NC],
                                                        FragC (&o)[NC], Decay&&) {
#pragma unroll
    for (int kd = 0; kd < KP / 16; ++kd) {
      FragA sa[SA];
      acc_to_parts<SA>(S[2 * kd], S[2 * kd + 1], sa);
      FragB bw[NC / 2][2][SP], bq[NC / 2][2][SP];
#pragma unroll
      for (int p = 0; p < NC / 2; ++p) {
        if (2 * p < NCC) {
          Op::load_b_nk(bw[p], t.w, L::LDK, 16 * kd, 16 * p);
          if constexpr (!NO_OUT) Op::load_b_nk(bq[p], t.q, L::LDK, 16 * kd, 16 * p);
        }
      }
      // In-order issue: every accumulator's lo product, then every hi product, so that no MMA waits for the one
      // just before it (bf16 operands; float operands take their three MMAs per accumulator in turn).
#pragma unroll
      for (int part = 0; part < (sizeof(Elem) == 2 ? 2 : 1); ++part) {
#pragma unroll
        for (int p = 0; p < NC / 2; ++p) {
          if (2 * p < NCC) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              if constexpr (sizeof(Elem) == 2) {
                mma_bf16(vn[2 * p + j], sa[1 - part], bw[p][j][0]);
                if constexpr (!NO_OUT) mma_bf16(o[2 * p + j], sa[1 - part], bq[p][j][0]);
              } else {
                mma_split_a<Elem>(vn[2 * p + j], sa, bw[p][j]);
                if constexpr (!NO_OUT) mma_split_a<Elem>(o[2 * p + j], sa, bq[p][j]);
              }
            }
          }
        }
      }
    }
  }

  __device__ __forceinline__ static void value_products(FragC (&)[ND], const FragA (&va)[NC / 2][VP],
                                                        const Stage& t, int NCC, FragC (&o)[NC]) {
    if constexpr (!NO_OUT) {  // o^T += v_new^T Aqk^T (Aqk is zero above the diagonal: source rows <= target rows)
      // The lo tile's products over every source block, then the hi tile's: recurrence_kernel's order, so that both
      // kernels give the same bits (the tile width, chosen from the batch, must not change a result).
#pragma unroll
      for (int part = L::SPLIT_A ? 0 : 1; part < 2; ++part) {
        const Elem* sa_ = part == 0 ? t.alo : t.a;
#pragma unroll
        for (int kt = 0; kt < NC / 2; ++kt) {
#pragma unroll
          for (int p = kt; p < NC / 2; ++p) {
            if (2 * p < NCC) {
              FragB bb[2][SP];
              Op::load_b_nk(bb, sa_, L::LDA, 16 * kt, 16 * p);
              Op::mma(o[2 * p], va[kt], bb[0]);
              Op::mma(o[2 * p + 1], va[kt], bb[1]);
            }
          }
        }
      }
    }
  }

  __device__ __forceinline__ static bool store_outputs(const ForwardArgs&, const FragC (&)[NC], Elem*, int64_t, int,
                                                       int, int) {
    return false;
  }

  template <typename Decay>
  __device__ __forceinline__ static void update_state(FragC (&S)[ND], const FragA (&va)[NC / 2][VP],
                                                      const Stage& t, int NCC, Decay&& decay) {
    decay();
#pragma unroll
    for (int kt = 0; kt < NC / 2; ++kt) {
      if (2 * kt < NCC) {
#pragma unroll
        for (int np = 0; np < ND / 2; ++np) {
          FragB bk[2][SP];
          Op::load_b_kn(bk, t.k, L::LDK, 16 * kt, 16 * np);
          Op::mma(S[2 * np], va[kt], bk[0]);
          Op::mma(S[2 * np + 1], va[kt], bk[1]);
        }
      }
    }
  }
};

}  // namespace kdakit::cuda
