// The reverse state scan on Hopper warpgroup MMAs: scan_sm80.cuh's arithmetic with the gradient state transposed, as
// forward/recurrence_vrows.cuh transposes the forward's recurrence. bf16 operands, chunk 64, K <= 128. One CTA per
// (sequence or segment, v-head, 64 value columns) of two warpgroups: warpgroup 0 runs the products, warp w owning value
// rows [16 w, 16 w + 16) of the tile for every key (dS^T: 16 x KP fp32 accumulators); warpgroup 1 issues the copies of
// the next chunk's stage (the products' warps issue nothing but their own work). Per chunk, from the last:
//   dh_c = dS (to the workspace),
//   dv_new^T = dS^T kg^T + dO^T Aqk      (dS^T as hi + lo A fragments, then dS^T's hi part times kg's lo tile; Aqk's
//                                         lo tile, then Aqk),
//   dS^T <- dS^T diag(gamma) + dO^T qg - dv_new^T w   (qg, then its lo tile; -dv_new^T as hi + lo A fragments).
// Every product takes the state or dv_new (or dO) as its A operand from registers, so the warps share nothing within a
// chunk: only the stage tiles (kg, qg, w, Aqk, the lo tiles of kg, qg and Aqk, gamma; the next chunk's copied during
// this one) and dO come through shared memory, handed over by one barrier per chunk. The products' k-steps, splits
// and order are scan_sm80.cuh's (the blocks of Aqk above its diagonal, which that kernel skips, are zeros: exact), so
// both kernels give the same bits. Segments and transition tiles as there (scan_tile.cuh).
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/backward/common.cuh"
#include "cuda/backward/scan_tile.cuh"
#include "cuda/common/sm90/gmma.cuh"
#include "cuda/forward/recurrence_common.cuh"

namespace kdakit::cuda {
namespace scan_sm90 {

using bf16 = __nv_bfloat16;
constexpr int BV = 64, C = 64, LDO = 64 + 8;  // value columns; chunk rows; dO's row stride (conflict-free ldmatrix)

// Shared memory, byte offsets from a 1024-byte aligned base: two stages of [64][KP] kg, qg, w, kg lo, qg lo and
// [64][64] Aqk, Aqk lo tiles (swizzled, tile-aligned) and gamma [KP] (f32), then dO [2][64][LDO] (bf16: this chunk's,
// the next one's).
template <int KP>
struct Layout {
  static constexpr std::size_t TK = std::size_t(64) * KP * 2, TA = 64 * 64 * 2;
  static constexpr std::size_t kg = 0, qg = kg + TK, w = qg + TK, klo = w + TK, qlo = klo + TK, aqk = qlo + TK,
                               alo = aqk + TA, gam = alo + TA;
  static constexpr std::size_t stage = (gam + KP * 4 + 1023) / 1024 * 1024;
  static constexpr std::size_t dO = 2 * stage;
  static constexpr std::size_t bytes = dO + 2 * 64 * LDO * 2;
  static_assert(bytes + 1024 == bwd_scan_sm90_smem(KP), "the planner's size, with the alignment's slack");
};

struct Stage {
  bf16 *kg, *qg, *w, *klo, *qlo, *aqk, *alo;
  float* gam;
};

}  // namespace scan_sm90

template <int KP, bool SCAN = false>
__global__ void __launch_bounds__(kBwdScanSm90Threads, 1) backward_scan_sm90_kernel(const BackwardArgs a) {
#if KDAKIT_SM90A
  using namespace scan_sm90;
  using L = Layout<KP>;
  using Op = Operand<bf16>;
  constexpr int NT = kBwdScanSm90Threads, ND = KP / 8, NC = C / 8;  // dS^T n-tiles (keys); dv_new^T's (chunk rows)
  constexpr int PT = NT - 128;  // copying threads
  static_assert(NT == 256 && KP <= 128, "two warpgroups; the transposed state holds KP / 2 registers per thread");
  ScanTile st;
  if (!scan_tile<KP, BV, SCAN>(a, st)) return;
  const int K = a.K, V = a.V, hv = st.hv;
  const bool trans = st.trans;
  const int tid = threadIdx.x, warp = tid >> 5;
  const bool copier = tid >= 128;  // warpgroup 1
  const int ctid = tid - 128;      // ... its thread index
  const int r0 = 16 * warp, v0 = st.vt * BV + r0;  // this warp's first value row (a key of M^T in transition tiles)
  auto seg_row = [&](int64_t g, int d) { return a.ws_seg + ((g * a.HV + hv) * KP + d) * a.seg_ld; };

  extern __shared__ __align__(16) char smem_raw[];
  char* const smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  bf16* const sdO = reinterpret_cast<bf16*>(smem + L::dO);
  auto stage = [&](int s) {
    char* p = smem + s * L::stage;
    return Stage{reinterpret_cast<bf16*>(p + L::kg),  reinterpret_cast<bf16*>(p + L::qg),
                 reinterpret_cast<bf16*>(p + L::w),   reinterpret_cast<bf16*>(p + L::klo),
                 reinterpret_cast<bf16*>(p + L::qlo), reinterpret_cast<bf16*>(p + L::aqk),
                 reinterpret_cast<bf16*>(p + L::alo), reinterpret_cast<float*>(p + L::gam)};
  };
  // dO as 16-byte pieces (bf16 rows at 16-byte multiples, V a multiple of 8: a piece is within V or past it) by
  // cp.async with the stage tiles; else through registers (load_dO, store_dO below). CTA-uniform.
  const bool do_async = !trans && a.d_out.dtype == DType::kBFloat16 && rows_vec(a.d_out, 8, V);
  // Chunk ci's tiles into stage t, and with do_async its dO into its buffer, as one commit group of warpgroup 1;
  // transition tiles take neither qg nor Aqk. bf16 tiles always come with the lo tiles of Aqk, kg and qg
  // (backward/run.cu).
  auto issue = [&](int ci, const Stage& t) {
    const int64_t tile = a.tile(st.base + ci, hv);
    auto ws = [&](const void* p) { return static_cast<const bf16*>(p) + tile * C * KP; };
    sm90::copy_ws_swizzled<bf16, KP, PT>(t.kg, ws(a.ws_kg), C, ctid);
    sm90::copy_ws_swizzled<bf16, KP, PT>(t.w, ws(a.ws_w), C, ctid);
    sm90::copy_ws_swizzled<bf16, KP, PT>(t.klo, ws(a.ws_kglo), C, ctid);
    if (!trans) {
      sm90::copy_ws_swizzled<bf16, KP, PT>(t.qg, ws(a.ws_qg), C, ctid);
      sm90::copy_ws_swizzled<bf16, KP, PT>(t.qlo, ws(a.ws_qglo), C, ctid);
      sm90::copy_ws_swizzled<bf16, 64, PT>(t.aqk, static_cast<const bf16*>(a.ws_a) + tile * C * C, C, ctid);
      sm90::copy_ws_swizzled<bf16, 64, PT>(t.alo, static_cast<const bf16*>(a.ws_alo) + tile * C * C, C, ctid);
    }
    const float* gg = a.ws_gam + tile * KP;
    for (int e = ctid; e < KP / 4; e += PT) cp_async16(t.gam + 4 * e, gg + 4 * e);
    if (do_async) {
      const bf16* src = static_cast<const bf16*>(a.d_out.p);
      const int64_t row0 = st.t0 + int64_t(ci) * C;
      const int nrows = static_cast<int>(min(static_cast<int64_t>(C), st.len - int64_t(ci) * C));
      bf16* dst = sdO + (ci & 1) * 64 * LDO;
#pragma unroll
      for (int i = 0; i < 64 * 8 / PT; ++i) {
        const int e = ctid + i * PT, r = e >> 3, c = (e & 7) * 8, v = st.vt * BV + c;
        const bool in = r < nrows && v < V;
        cp_async16(dst + r * LDO + c, in ? src + a.d_out.offset(st.b, row0 + r, hv) + v : src, in ? 16 : 0);
      }
    }
    cp_async_commit();
  };

  // Without do_async, dO of chunk ci (zero past its rows and V), rounded to bf16 as scan_sm80.cuh rounds it: thread
  // (column tid % 64, rows tid / 64 + 2 j) loads it into registers (two rows a word) while a chunk computes and stores
  // it after.
  uint32_t dov[16];
  const int do_c = tid & 63, do_r = tid >> 6;
  auto load_dO = [&](int ci) {
    const int64_t row0 = st.t0 + int64_t(ci) * C;
    const int nrows = static_cast<int>(min(static_cast<int64_t>(C), st.len - int64_t(ci) * C));
    const int v = st.vt * BV + do_c;
    with_typed(a.d_out, [&](auto* p) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(p)>>;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        float x[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = do_r + 2 * (2 * i + h);
          x[h] = 0.f;
          if (r < nrows && v < V) {
            const T y = p[a.d_out.offset(st.b, row0 + r, hv) + v];
            if constexpr (std::is_same_v<T, double>) x[h] = static_cast<float>(y);
            else x[h] = to_float(y);
          }
        }
        dov[i] = pack_bf16(x[0], x[1]);
      }
    });
  };
  auto store_dO = [&](int ci) {
    bf16* dst = sdO + (ci & 1) * 64 * LDO + do_c;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int r = do_r + 4 * i;
      dst[r * LDO] = __ushort_as_bfloat16(static_cast<unsigned short>(dov[i] & 0xffffu));
      dst[(r + 2) * LDO] = __ushort_as_bfloat16(static_cast<unsigned short>(dov[i] >> 16));
    }
  };

  // dS^T: accumulator (nd, e) holds value row v0 + row, key d. The end gradient: dht (the sequence's last segment),
  // the merged one (later segments: slot gseg + 1 holds it), zero (pre-scan value tiles of other segments) or the
  // identity (transition tiles).
  FragC S[ND];
  for_each_acc<1, ND>([&](int, int nd, int e, int row, int d) {
    const int v = v0 + row;
    float x = 0.f;
    if (trans) {
      x = d == v && d < K ? 1.f : 0.f;
    } else if (d < K && v < V) {
      if (st.last) x = a.d_final.present() ? a.d_final.load(a.d_final.offset(st.n, hv, d, v, K, V, a.vk)) : 0.f;
      else if (!SCAN) x = seg_row(st.gseg + 1, d)[v];
    }
    S[nd].x[e] = x;
  });
  // One hand-over a chunk (barrier 1 of both warpgroups): chunk ci's tiles and dO are visible, and every warp is done
  // with chunk ci + 1's stage and dO buffer, which then take chunk ci - 1's.
  auto handover = [] { sm90::handover_barrier<NT>(); };
  if (copier) {
    for (int ci = st.c_end - 1; ci >= st.c_begin; --ci) {
      const int s = (st.c_end - 1 - ci) & 1;
      if (ci == st.c_end - 1) issue(ci, stage(0));
      cp_async_wait<0>();
      sm90::fence_shared_to_async();
      handover();
      if (ci > st.c_begin) issue(ci - 1, stage(s ^ 1));
    }
    return;
  }
  if (st.c_end > st.c_begin && !trans && !do_async) {
    load_dO(st.c_end - 1);
    store_dO(st.c_end - 1);
  }
  for (int ci = st.c_end - 1; ci >= st.c_begin; --ci) {
    const int s = (st.c_end - 1 - ci) & 1;
    handover();
    if (ci > st.c_begin && !trans && !do_async) load_dO(ci - 1);
    const Stage t = stage(s);
    const int64_t tile = a.tile(st.base + ci, hv);
    const int nrows = static_cast<int>(min(static_cast<int64_t>(C), st.len - int64_t(ci) * C));
    const bool writes = !SCAN && a.scan_writes;

    // dh_c = dS.
    if (writes) store_acc_key_rows(a.ws_dh + tile * K * V, S, v0, K, V);

    // dv_new^T = dS^T kg^T + dO^T Aqk (kg's lo tile after kg; Aqk's lo tile first). dS^T is split first, then decayed
    // (the compiler makes a register of an accumulator written during MMAs wait for them, so the decay goes before,
    // not under, them).
    FragA sa[KP / 16][2];
#pragma unroll
    for (int kd = 0; kd < KP / 16; ++kd) acc_to_parts<2>(S[2 * kd], S[2 * kd + 1], sa[kd]);
    decay_keys(S, t.gam);  // dS^T = dS^T diag(gamma)
    FragA da[C / 16];  // dO^T (k = chunk rows)
    if (!trans) {
#pragma unroll
      for (int j = 0; j < C / 16; ++j) {
        FragA x[1];
        Op::load_a_t(x, sdO + (ci & 1) * 64 * LDO, LDO, r0, 16 * j);
        da[j] = x[0];
      }
    }
    FragC dv[NC];
#pragma unroll
    for (int i = 0; i < NC; ++i) dv[i].zero();
#pragma unroll
    for (int kd = 0; kd < KP / 16; ++kd) sm90::fence_operands(sa[kd][0]), sm90::fence_operands(sa[kd][1]);
#pragma unroll
    for (int j = 0; j < C / 16; ++j) sm90::fence_operands(da[j]);
    sm90::fence_operands(dv);
    sm90::fence_operands(S);
    {
      const sm90::TileDescriptors<KP, true> dkg(t.kg), dklo(t.klo);
      const sm90::TileDescriptors<64, false> daqk(t.aqk), dalo(t.alo);
      const sm90::TileDescriptors<KP, false> dqg(t.qg), dqlo(t.qlo);
      sm90::arrive();
#pragma unroll
      for (int kd = 0; kd < KP / 16; ++kd) {
        sm90::mma_rs<sm90::Major::K>(dv, sa[kd][1], dkg(kd));
        sm90::mma_rs<sm90::Major::K>(dv, sa[kd][0], dkg(kd));
      }
#pragma unroll
      for (int kd = 0; kd < KP / 16; ++kd) sm90::mma_rs<sm90::Major::K>(dv, sa[kd][0], dklo(kd));
      if (!trans) {
#pragma unroll
        for (int j = 0; j < C / 16; ++j) sm90::mma_rs<sm90::Major::MN>(dv, da[j], dalo(j));
#pragma unroll
        for (int j = 0; j < C / 16; ++j) sm90::mma_rs<sm90::Major::MN>(dv, da[j], daqk(j));
      }
      sm90::commit();
      // dS^T += dO^T qg, then its lo tile: a second batch that needs nothing of dv_new, in flight while the warps
      // finish dv_new below.
      if (!trans) {
#pragma unroll
        for (int j = 0; j < C / 16; ++j) sm90::mma_rs<sm90::Major::MN>(S, da[j], dqg(j));
#pragma unroll
        for (int j = 0; j < C / 16; ++j) sm90::mma_rs<sm90::Major::MN>(S, da[j], dqlo(j));
      }
      sm90::commit();
      sm90::wait<1>();
    }
    sm90::fence_operands(dv);
#pragma unroll
    for (int kd = 0; kd < KP / 16; ++kd) sm90::fence_operands(sa[kd][0]), sm90::fence_operands(sa[kd][1]);

    // Rows past the chunk are zero; dv_new to the workspace; -dv_new^T (an exact negation) as the update's A operand.
    for_each_acc<1, NC>([&](int, int nt, int e, int, int r) {
      if (r >= nrows) dv[nt].x[e] = 0.f;
    });
    if (writes) store_acc_key_rows(a.ws_dvnew + tile * C * V, dv, v0, C, V);
    for_each_acc<1, NC>([&](int, int nt, int e, int, int) { dv[nt].x[e] = -dv[nt].x[e]; });
    FragA va[C / 16][2];
#pragma unroll
    for (int kt = 0; kt < C / 16; ++kt) acc_to_parts<2>(dv[2 * kt], dv[2 * kt + 1], va[kt]);

    // dS^T += (-dv_new^T) w (lo part first), after the qg batch.
#pragma unroll
    for (int kt = 0; kt < C / 16; ++kt) sm90::fence_operands(va[kt][0]), sm90::fence_operands(va[kt][1]);
    {
      const sm90::TileDescriptors<KP, false> dw(t.w);
      sm90::arrive();
#pragma unroll
      for (int kt = 0; kt < C / 16; ++kt) {
        sm90::mma_rs<sm90::Major::MN>(S, va[kt][1], dw(kt));
        sm90::mma_rs<sm90::Major::MN>(S, va[kt][0], dw(kt));
      }
      sm90::commit();
      // Chunk ci - 1's dO into the other buffer (chunk ci + 1 read it before the barrier that began this chunk).
      if (ci > st.c_begin && !trans && !do_async) store_dO(ci - 1);
      sm90::wait<0>();
    }
    sm90::fence_operands(S);
#pragma unroll
    for (int kt = 0; kt < C / 16; ++kt) sm90::fence_operands(va[kt][0]), sm90::fence_operands(va[kt][1]);
#pragma unroll
    for (int j = 0; j < C / 16; ++j) sm90::fence_operands(da[j]);
  }

  if (SCAN) {  // E_s (value tiles) or M_s^T (transition tiles, after the value columns)
    const int col0 = trans ? a.seg_ld - KP : 0, ncols = trans ? K : V;
    for_each_acc<1, ND>([&](int, int nd, int e, int row, int d) {
      const int v = v0 + row;
      if (d < K && v < ncols) seg_row(st.gseg, d)[col0 + v] = S[nd].x[e];
    });
  } else if (st.seg == 0 && a.d_initial.present()) {
    for_each_acc<1, ND>([&](int, int nd, int e, int row, int d) {
      const int v = v0 + row;
      if (d < K && v < V) a.d_initial.store(a.d_initial.offset(st.n, hv, d, v, K, V, a.vk), S[nd].x[e]);
    });
  }
#else
  (void)a;
  __trap();
#endif
}

}  // namespace kdakit::cuda
