// The recurrence with value rows per warp (K <= 128): the chunk step of recurrence_kernel with the state transposed.
// Warp w of a CTA owns value rows [16 w, 16 w + 16) of the CTA's BV columns for every key (S^T: 16 x KP fp32
// accumulators). An accumulator tile pair (m16 x n8, n8) is laid out as an m16 x k16 A fragment, so each product takes
// the state or v_new as its A operand straight from registers and only the workspace tiles (w, qg, kg, Aqk) are B
// operands from shared memory:
//   v_new^T = u^T - S^T w^T,   o^T = S^T qg^T + v_new^T Aqk^T,   S^T = S^T diag(gamma) + v_new^T kg.
// The warps share nothing within a chunk step: no state tiles in shared memory, no barrier but the stage hand-over.
// Products, roundings and their k order are those of recurrence_kernel (bf16 operands: the chunk-start state as
// hi + lo, v_new rounded once, Aqk as hi + lo), so both kernels give the same bits.
//
// The products are the architecture's: VrowsStep<..., WG = false> issues them as mma.sync (recurrence_sm80.cuh),
// VrowsStep<..., WG = true> as warpgroup MMAs on Hopper (recurrence_sm90.cuh). The kernel around them is this file.
#pragma once

#include <type_traits>

#include "cuda/forward/recurrence_common.cuh"

namespace kdakit::cuda {

// The chunk step's products for one architecture (specialised in recurrence_sm80.cuh and recurrence_sm90.cuh):
//   before_handover()                   what the stage hand-over needs before its barrier
//   state_products(S, t, NCC, vn, o, decay)  vn = S^T w^T, o = S^T qg^T (not NO_OUT); `decay` (S *= gamma) runs
//                                       where the architecture overlaps it, or is left to update_state
//   value_products(S, va, t, NCC, o)    o += v_new^T Aqk^T (not NO_OUT), and S += v_new^T kg where it goes with it
//   store_outputs(...)                  true where the architecture stored the outputs itself
//   update_state(S, va, t, NCC, decay)  S = S diag(gamma) + v_new^T kg, where value_products did not
template <typename Elem, int KP, int BV, bool NO_OUT, bool ONE_STAGE, bool WG>
struct VrowsStep;

// SCAN as in recurrence_kernel (the context-parallel pre-scan: E from value tiles, M from transition tiles).
// STATES_ONLY (ForwardArgs::states_only): the chunk-start states without the outputs.
template <typename Elem, int KP, int BV, bool SCAN, bool ONE_STAGE = false, bool WG = false, bool STATES_ONLY = false>
__global__ void __launch_bounds__(VrowsLayout<sizeof(Elem), KP, BV, ONE_STAGE, WG>::LAUNCH_THREADS)
    recurrence_vrows_kernel(const ForwardArgs a) {
  constexpr bool NO_OUT = SCAN || STATES_ONLY;  // no output products, tiles or stores
  using L = VrowsLayout<sizeof(Elem), KP, BV, ONE_STAGE, WG>;
  using Step = VrowsStep<Elem, KP, BV, NO_OUT, ONE_STAGE, WG>;
  static_assert(KP <= 128, "the transposed state holds KP / 2 registers per thread");
  constexpr int NT = L::THREADS;
  constexpr int ND = KP / 8;   // state n-tiles (keys)
  constexpr int NC = 64 / 8;   // chunk-row n-tiles at the 64-row maximum
  constexpr int VP = Step::VP;  // v_new as an A operand: split like the float operands, or rounded once (bf16)
  const int C = a.chunk;
  RecurrenceTile rt;
  if (!recurrence_tile<KP, BV, SCAN>(a, rt)) return;
  const int VT = rt.VT, hv = rt.hv, n = rt.n, vt = rt.vt, ncols = rt.ncols;
  const int64_t gseg = rt.gseg, seg = rt.seg, b = rt.b, t0 = rt.t0, len = rt.len, nch_all = rt.nch_all;
  const int64_t c_begin = rt.c_begin, c_end = rt.c_end, base = rt.base;
  const bool trans = rt.trans;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int r0 = 16 * warp;     // this warp's first row within the tile
  const int v0 = vt * BV + r0;  // ... as a value (or key, for transition tiles) index
  auto seg_row = [&](int64_t g, int d) { return a.ws_seg + ((g * a.HV + hv) * KP + d) * a.seg_ld; };
  const int seg_col0 = trans ? VT * BV : 0;

  extern __shared__ __align__(16) char smem_raw[];
  char* const smem = smem_raw + ((L::ALIGN - (smem_addr(smem_raw) & (L::ALIGN - 1))) & (L::ALIGN - 1));
  using Stage = RecurrenceStage<Elem>;
  auto stage = [&](int st) {
    Stage t;
    char* p = smem + st * L::stage_stride();
    t.w = reinterpret_cast<Elem*>(p);
    t.q = t.w + 64 * L::LDK;
    t.k = t.q + 64 * L::LDK;
    t.u = t.k + 64 * L::LDK;
    t.a = t.u + 64 * L::LDB;
    t.alo = t.a + 64 * L::LDA;  // SPLIT_A only
    t.gam = reinterpret_cast<float*>(t.a + (L::SPLIT_A ? 2 : 1) * 64 * L::LDA);
    return t;
  };
  Elem* const sO = reinterpret_cast<Elem*>(smem + L::STAGES * L::stage_stride());  // WG: [64][LDB] outputs

  const int64_t slot = rt.slot;  // padding (-1): no state read or written, no chunks (recurrence_tile)
  const bool read = seg == 0 && a.initial.present() && slot >= 0 &&
                    (!a.has_initial_state.present() || a.has_initial_state.load_int(n) != 0);
  const bool write = !SCAN && c_end == nch_all && a.final_state.present() && slot >= 0;

  // COPIER: warpgroup 1 issues every stage's copies (the NT threads past the products' NT), and one named barrier of
  // both warpgroups a chunk hands a stage over; otherwise the products' threads copy and a CTA barrier hands over.
  constexpr bool COPIER = L::COPIER;
  const bool copier = COPIER && static_cast<int>(threadIdx.x) >= NT;
  auto issue = [&](int64_t ci, int st) {
    const int tid = static_cast<int>(threadIdx.x) - (COPIER ? NT : 0);
    issue_chunk<Elem, KP, BV, NT, L::LDK, L::LDB, L::LDA, L::SPLIT_A, false, NO_OUT, WG>(a, rt, ci, stage(st), tid);
  };
  auto handover = [] { sm90::handover_barrier<L::LAUNCH_THREADS>(); };
  if (copier) {
    for (int64_t ci = c_begin; ci < c_end; ++ci) {
      const int st = static_cast<int>((ci - c_begin) & 1);
      if (ci == c_begin) issue(ci, 0);
      cp_async_wait<0>();
      Step::before_handover();
      handover();  // chunk ci visible; the products are done with chunk ci - 1's stage
      if (ci + 1 < c_end) issue(ci + 1, st ^ 1);
    }
    return;
  }

  // S^T: accumulator (nd, e) holds value row v0 + row, key col (for_each_acc coordinates). State accesses switch on
  // the dtype once (with_typed), not per element: this code runs once per CTA from a cold instruction cache, and a
  // switch per element made it many times larger.
  FragC S[ND];
  auto state_at = [&](int d, int v) { return a.vk ? int64_t(v) * a.K + d : int64_t(d) * a.V + v; };
  if (!trans && read) {
    with_typed(a.initial, [&](const auto* sp) {
      sp += a.initial.block(slot, hv);
      for_each_acc<1, ND>([&](int, int nd, int e, int row, int d) {
        const int v = v0 + row;
        S[nd].x[e] = d < a.K && v < a.V ? static_cast<float>(sp[state_at(d, v)]) : 0.f;
      });
    });
  } else {
    for_each_acc<1, ND>([&](int, int nd, int e, int row, int d) {
      const int v = v0 + row;
      float x = 0.f;
      if (trans) x = d == v && d < a.K ? 1.f : 0.f;
      else if (!SCAN && seg > 0 && d < a.K && v < a.V) x = seg_row(gseg - 1, d)[v];
      S[nd].x[e] = x;
    });
  }

  auto decay = [&](const Stage& t) { decay_keys(S, t.gam); };  // S^T = S^T diag(gamma)

  const int NCC = C / 8;  // chunk-row n-tiles of this chunk size (WG: 8)
  if (!COPIER && c_begin < c_end) issue(c_begin, 0);
  for (int64_t ci = c_begin; ci < c_end; ++ci) {
    const int st = L::STAGES == 2 ? static_cast<int>((ci - c_begin) & 1) : 0;
    if constexpr (COPIER) {
      handover();
    } else {
      cp_async_wait<0>();
      Step::before_handover();
      __syncthreads();  // chunk ci visible; every warp is done with chunk ci-1's stage
      if (L::STAGES == 2 && ci + 1 < c_end) issue(ci + 1, st ^ 1);
    }
    const Stage t = stage(st);
    const int nrows = static_cast<int>(min(static_cast<int64_t>(C), len - ci * C));

    if (!SCAN && a.inter.present()) {  // the chunk-start state
      const int64_t inter_base =
          a.cu_seqlens.present() ? (base + ci) * a.inter_sc : b * a.inter_sb + ci * a.inter_sc;
      with_typed(a.inter, [&](auto* ip) {
        using IT = std::remove_pointer_t<decltype(ip)>;
        ip += inter_base + hv * a.inter_sh;
        if (!a.vk) {
          store_acc_key_rows(ip, S, v0, a.K, a.V);
        } else {
          for_each_acc<1, ND>([&](int, int nd, int e, int row, int d) {
            const int v = v0 + row;
            if (d < a.K && v < a.V) ip[state_at(d, v)] = from_float<IT>(S[nd].x[e]);
          });
        }
      });
    }

    // v_new^T = u^T - S^T w^T and o^T = S^T qg^T: the state's A fragment split once per key step, both products.
    FragC vn[NC], o[NC];
#pragma unroll
    for (int i = 0; i < NC; ++i) { vn[i].zero(); o[i].zero(); }
    Step::state_products(S, t, NCC, vn, o, [&] { decay(t); });
    for_each_acc<1, NC>([&](int, int nt, int e, int row, int r) {  // r: chunk row
      float u = 0.f;
      if (!trans && r < C) u = to_float(t.u[r * L::LDB + r0 + row]);
      vn[nt].x[e] = r < C ? u - vn[nt].x[e] : 0.f;
    });
    FragA va[NC / 2][VP];  // v_new^T as A fragments (k = chunk rows)
#pragma unroll
    for (int kt = 0; kt < NC / 2; ++kt) acc_to_parts<VP>(vn[2 * kt], vn[2 * kt + 1], va[kt]);
    Step::value_products(S, va, t, NCC, o);

    const int64_t orow0 = a.out.offset(b, t0 + ci * C, hv);
    if (!NO_OUT && !Step::store_outputs(a, o, sO, orow0, nrows, r0, v0)) {
      with_typed(a.out, [&](auto* op) {
        using OutT = std::remove_pointer_t<decltype(op)>;
        for_each_acc<1, NC>([&](int, int nt, int e, int row, int r) {
          const int v = v0 + row;
          if (r < nrows && v < a.V) op[orow0 + r * a.out.st + v] = from_float<OutT>(o[nt].x[e]);
        });
      });
    }
    Step::update_state(S, va, t, NCC, [&] { decay(t); });
    if (L::STAGES == 1 && ci + 1 < c_end) {
      __syncthreads();
      issue(ci + 1, 0);
    }
  }
  if (SCAN) {  // E (value tiles) or M (transition tiles) of this segment
    for_each_acc<1, ND>([&](int, int nd, int e, int row, int d) {
      const int v = v0 + row;
      if (d < KP && v < ncols) seg_row(gseg, d)[seg_col0 + v] = S[nd].x[e];
    });
  }
  if (write) {
    with_typed(a.final_state, [&](auto* sp) {
      using ST = std::remove_pointer_t<decltype(sp)>;
      sp += a.final_state.block(slot, hv);
      for_each_acc<1, ND>([&](int, int nd, int e, int row, int d) {
        const int v = v0 + row;
        if (d < a.K && v < a.V) sp[state_at(d, v)] = from_float<ST>(S[nd].x[e]);
      });
    });
  }
}

}  // namespace kdakit::cuda
