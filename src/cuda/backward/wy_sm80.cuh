// The backward's WY pass (the value side of src/cpu/chunk_gradients.cpp) on tensor cores, one CTA of eight warps per
// (chunk, v-head), in two phases:
//   0. v_new = u - w h_c, the forward's product (u = hi + lo for bf16 tiles, ForwardArgs::ws_ulo; w in its prepare
//      tile's precision, h_c split hi + lo: the MMAs of recurrence_kernel in its order), in passes of kWyPassCols
//      value columns; the keys stream through three cp.async stages. v_new goes to the workspace, which the gradient
//      kernel reads and phase 1 reads back.
//   1. Over tiles of kWyCols value columns (three stages): dbv = Tm^T dv_new (to the workspace), dv = beta dbv (final),
//      beta's value-side gradient rowsum(dbv v), and, summed over the tiles in mma accumulators, the intra-chunk
//      matrices' gradients dP = scale tril_incl(dO v_new^T) and dL = -tril_strict(dbv v_new^T).
// Every fp32 operand (h_c, Tm, dv_new, v_new, dbv, and dO unless it is bf16) is split hi + lo with fp32 accumulation
// (hi + mid + lo for float32 inputs, Elem = Float3Split): rounded once to bf16 these would carry bf16's error into
// every gradient. Fixed summation orders, no atomics.
// Rows past the chunk's end and columns past V are zero in every tile (copies zero-fill them).
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/backward/common.cuh"
#include "cuda/common/sm80/mma.cuh"

namespace kdakit::cuda {
namespace wy {

// Columns [c0, c0 + kWyCols) of C rows of a [C][V] fp32 workspace tile into a tile of row stride ld; rows past nrows
// and columns past V zero. 16-byte pieces where V allows, else elements.
template <int C>
__device__ __forceinline__ void copy_ws(float* dst, int ld, const float* src, int c0, int nrows, int V) {
  if (V % 4 == 0) {
    for (int e = threadIdx.x; e < C * kWyCols / 4; e += kBwdThreads) {
      const int r = e / (kWyCols / 4), c = (e % (kWyCols / 4)) * 4;
      const bool in = r < nrows && c0 + c < V;
      cp_async16(dst + r * ld + c, src + (in ? r * V + c0 + c : 0), in ? 16 : 0);
    }
  } else {
#pragma unroll 1
    for (int e = threadIdx.x; e < C * kWyCols; e += kBwdThreads) {
      const int r = e / kWyCols, c = e % kWyCols;
      dst[r * ld + c] = r < nrows && c0 + c < V ? src[r * V + c0 + c] : 0.f;
    }
  }
}

// Columns [c0, c0 + kWyCols) of C token rows (row r at off[r]) into a [C][kWyLdRow] tile of T, in 16-byte pieces; rows
// past nrows and columns past V zero.
template <typename T, int C>
__device__ __forceinline__ void copy_rows(T* dst, const T* src, const int64_t* off, int c0, int nrows, int V) {
  constexpr int EPC = 16 / sizeof(T), PIECES = kWyCols / EPC;
  for (int e = threadIdx.x; e < C * PIECES; e += kBwdThreads) {
    const int r = e / PIECES, c = (e % PIECES) * EPC;
    const bool in = r < nrows && c0 + c < V;
    cp_async16(dst + r * kWyLdRow + c, src + (in ? off[r] + c0 + c : 0), in ? 16 : 0);
  }
}

// The same element by element, converted by load(i) (rows without aligned 16-byte pieces, other dtypes).
template <typename T, int C, typename Load>
__device__ __forceinline__ void fill_rows(T* dst, const int64_t* off, int c0, int nrows, int V, Load&& load) {
#pragma unroll 1
  for (int e = threadIdx.x; e < C * kWyCols; e += kBwdThreads) {
    const int r = e / kWyCols, c = e % kWyCols;
    dst[r * kWyLdRow + c] = r < nrows && c0 + c < V ? load(off[r] + c0 + c) : from_float<T>(0.f);
  }
}

// Elements gc and gc + 1 of an fp32 row of V columns (those below V): one 8-byte store where V is even.
__device__ __forceinline__ void store_pair(float* row, int gc, int V, float x0, float x1) {
  if ((V & 1) == 0 && gc + 1 < V) {
    *reinterpret_cast<float2*>(row + gc) = make_float2(x0, x1);
  } else {
    if (gc < V) row[gc] = x0;
    if (gc + 1 < V) row[gc + 1] = x1;
  }
}

__device__ __forceinline__ float2 pair_float(float2 x) { return x; }
__device__ __forceinline__ float2 pair_float(__nv_bfloat162 x) { return __bfloat1622float2(x); }
__device__ __forceinline__ float2 pair_float(__half2 x) { return __half22float2(x); }

template <typename T>
using Pair = std::conditional_t<std::is_same<T, float>::value || std::is_same<T, Float3Split>::value, float2,
                                std::conditional_t<std::is_same<T, __half>::value, __half2, __nv_bfloat162>>;

}  // namespace wy

template <typename InT, typename Elem, int C>
__global__ void __launch_bounds__(kBwdThreads, 2) backward_wy_kernel(const BackwardArgs a) {
  using FOp = FloatOperand<Elem>;  // the fp32 intermediates (h_c, Tm, dv_new, v_new, dbv, dO) split like the inputs
  constexpr int NV = kWyCols, PC = kWyPassCols, KR = kWyKRows, SE = Operand<Elem>::kSplit, FP = FOp::kSplit;
  constexpr int LDKN = kWyLdKN, LDR = kWyLdRow, LDS = kWyLdS, LDW = kWyLdW, LDT = C + 4;
  constexpr int RB = C / 16, WPR = 8 / RB;          // 16-row blocks; warps per row block (phase 0)
  constexpr int NT0 = PC / WPR / 8;                 // phase 0: n-tiles per warp
  constexpr int NB = RB * (RB + 1), SLOTS = (NB + 7) / 8;  // dP and dL blocks on and below the diagonal; per warp
  constexpr int S0 = static_cast<int>(bwd_wy_stage0_floats(C)), S1 = static_cast<int>(bwd_wy_stage1_floats(C));
  static_assert(kBwdThreads == 256 && NV == 16 && KR % 16 == 0 && NT0 % 2 == 0 && kWyStages0 == 3 &&
                    kWyStages1 == 3, "eight warps; the stage counts of the loops below");

  ChunkOf ch;
  if (!chunk_of(a, blockIdx.x, ch)) return;
  const int hv = blockIdx.y, V = a.V, K = a.K, nrows = ch.nrows;
  const int64_t tile = a.tile(blockIdx.x, hv), t_v = tile * C * V;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

  extern __shared__ __align__(16) float smem[];  // the phases' stages, then:
  float* sTm = smem + bwd_wy_union_floats(C);     // [C][LDT] Tm, zero outside rows [i, nrows) of column i
  float* sDbv = sTm + C * LDT;                    // [C][LDR] dbv of a tile
  float* sBeta = sDbv + C * LDR;                  // [C]
  float* sRow = sBeta + C;                        // [C] row sums of rowsum(dbv v)'s second column group
  int64_t* sOff = reinterpret_cast<int64_t*>(sRow + C);  // [3][C] token offsets of the rows of dO, v, dv
  for (int r = tid; r < C; r += kBwdThreads) {
    const bool in = r < nrows;
    sOff[r] = in ? a.d_out.offset(ch.b, ch.row0 + r, hv) : 0;
    sOff[C + r] = in ? a.v.offset(ch.b, ch.row0 + r, hv) : 0;
    sOff[2 * C + r] = in ? a.dv.offset(ch.b, ch.row0 + r, hv) : 0;
    sBeta[r] = in ? math::beta_value(a.beta.load(a.beta.offset(ch.b, ch.row0 + r, hv)), a.beta_sigmoid, a.neg_eigval)
                  : 0.f;
  }

  // ---- Phase 0: v_new. Step j: pass p = j / QS (columns [PC p, +PC)), keys [KR q, +KR) with q = j % QS; warp: rows
  // [16 rb0, +16), columns [n00, +8 NT0) of the pass.
  const int64_t hblk = a.h.block(a.cu_seqlens.present(), ch.b, ch.ci, blockIdx.x, hv);
  const bool s_vec = a.h.dtype == DType::kFloat32 && !a.vk && V % 4 == 0 &&
                     reinterpret_cast<uintptr_t>(a.h.p) % 16 == 0 && a.h.sb % 4 == 0 && a.h.sc % 4 == 0 &&
                     a.h.sh % 4 == 0;
  const int QS = (K + KR - 1) / KR, J = (V + PC - 1) / PC * QS;
  auto stage0_S = [&](int st) { return smem + st * S0; };                                  // [KR][LDS] fp32
  auto stage0_w = [&](int st) { return reinterpret_cast<Elem*>(smem + st * S0 + KR * LDS); };  // [C][LDW] Elem
  auto issue0 = [&](int j) {  // one commit group, empty past the last step
    if (j < J) {
      const int st = j % 3, k0 = (j % QS) * KR, c0 = (j / QS) * PC;
      float* sS = stage0_S(st);
      if (s_vec) {
        const float* src = static_cast<const float*>(a.h.p) + hblk;
        for (int e = tid; e < KR * PC / 4; e += kBwdThreads) {
          const int d = e / (PC / 4), c = (e % (PC / 4)) * 4;
          const bool in = k0 + d < K && c0 + c < V;
          cp_async16(sS + d * LDS + c, src + (in ? (k0 + d) * V + c0 + c : 0), in ? 16 : 0);
        }
      } else {  // any dtype or layout; [V][K] states are read along k
#pragma unroll 1
        for (int e = tid; e < KR * PC; e += kBwdThreads) {
          const int d = a.vk ? e % KR : e / PC, c = a.vk ? e / KR : e % PC, kd = k0 + d, vc = c0 + c;
          sS[d * LDS + c] =
              kd < K && vc < V ? a.h.load(hblk + (a.vk ? int64_t(vc) * K + kd : int64_t(kd) * V + vc)) : 0.f;
        }
      }
      constexpr int EPC = 16 / sizeof(Elem), PR = KR / EPC;
      const Elem* gw = static_cast<const Elem*>(a.ws_w) + tile * C * a.KP + k0;
      Elem* sw = stage0_w(st);
      for (int e = tid; e < C * PR; e += kBwdThreads) {
        const int r = e / PR, c = (e % PR) * EPC;
        cp_async16(sw + r * LDW + c, gw + r * a.KP + c);
      }
    }
    cp_async_commit();
  };
  issue0(0);
  issue0(1);
  {  // Tm while the first stages land
    const float4* gt = reinterpret_cast<const float4*>(a.ws_tm + tile * C * C);
    for (int e = tid; e < C * C / 4; e += kBwdThreads) {
      const int r = e / (C / 4), i0 = (e % (C / 4)) * 4;
      const float4 x = gt[e];
      const bool rin = r < nrows;
      *reinterpret_cast<float4*>(sTm + r * LDT + i0) =
          make_float4(rin && r >= i0 ? x.x : 0.f, rin && r >= i0 + 1 ? x.y : 0.f, rin && r >= i0 + 2 ? x.z : 0.f,
                      rin && r >= i0 + 3 ? x.w : 0.f);
    }
  }
  {
    const int rb0 = warp % RB, n00 = (warp / RB) * NT0 * 8, r0 = 16 * rb0 + g;
    const Elem* gu = static_cast<const Elem*>(a.ws_u) + tile * C * a.VP;
    FragC acc[NT0];
    wy::Pair<Elem> u[NT0][2];  // u at the accumulators' positions, loaded at a pass's start
    for (int j = 0; j < J; ++j) {
      const int st = j % 3, q = j % QS, c0 = (j / QS) * PC;
      cp_async_wait<1>();
      __syncthreads();  // step j visible; every warp is done with step j - 1 (its stage: step j + 2's)
      issue0(j + 2);
      if (q == 0) {  // u's tile rows are VP >= PC * ceil(V / PC) wide: no column bound
#pragma unroll
        for (int nt = 0; nt < NT0; ++nt) {
          acc[nt].zero();
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            u[nt][h] = *reinterpret_cast<const wy::Pair<Elem>*>(gu + (r0 + 8 * h) * a.VP + c0 + n00 + 8 * nt + 2 * t);
          }
        }
      }
      if (16 * rb0 < nrows) {
        const float* sS = stage0_S(st);
        const Elem* sw = stage0_w(st);
#pragma unroll
        for (int ks = 0; ks < KR / 16; ++ks) {
          if (q * KR + 16 * ks < K) {  // w's and h_c's zero padding past K adds nothing
            FragA aw[SE];
            Operand<Elem>::load_a(aw, sw, LDW, 16 * rb0, 16 * ks);
#pragma unroll
            for (int np = 0; np < NT0 / 2; ++np) {
              FragB bs[2][FP];
              FOp::load_b_kn(bs, sS, LDS, 16 * ks, n00 + 16 * np);
              mma_split_b<SE>(acc[2 * np], aw, bs[0]);
              mma_split_b<SE>(acc[2 * np + 1], aw, bs[1]);
            }
          }
        }
      }
      if (q == QS - 1) {
#pragma unroll
        for (int nt = 0; nt < NT0; ++nt) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = r0 + 8 * h, gc = c0 + n00 + 8 * nt + 2 * t;
            float2 uf = wy::pair_float(u[nt][h]);
            if constexpr (sizeof(Elem) == 2) {  // u's lo part (ForwardArgs::ws_ulo): u = hi + lo, exact in fp32
              if (a.ws_ulo != nullptr) {
                const float2 lo = __bfloat1622float2(
                    *reinterpret_cast<const __nv_bfloat162*>(a.ws_ulo + tile * C * a.VP + r * a.VP + gc));
                uf.x += lo.x;
                uf.y += lo.y;
              }
            }
            const bool rin = r < nrows;
            wy::store_pair(a.ws_vnew + t_v + r * V, gc, V, rin ? uf.x - acc[nt].x[2 * h] : 0.f,
                           rin ? uf.y - acc[nt].x[2 * h + 1] : 0.f);
          }
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // phase 0's stages are free; its v_new is visible to the CTA

  // ---- Phase 1, tile vt: columns [NV vt, +NV). Stage st: v_new [C][LDR], dv_new [C][LDKN], dO [C][LDR] (fp32 or
  // bf16), v [C][LDR] (InT).
  const bool do_bf16 = a.d_out.dtype == DType::kBFloat16 && rows_vec(a.d_out, 8, V);
  const bool do_f32 = a.d_out.dtype == DType::kFloat32 && rows_vec(a.d_out, 4, V);
  const bool v_vec = rows_vec(a.v, 16 / sizeof(InT), V);
  auto stage_vn = [&](int st) { return smem + st * S1; };
  auto stage_dvn = [&](int st) { return smem + st * S1 + C * LDR; };
  auto stage_dO = [&](int st) { return smem + st * S1 + C * (LDR + LDKN); };
  auto stage_v = [&](int st) { return reinterpret_cast<InT*>(smem + st * S1 + C * (2 * LDR + LDKN)); };
  const int VT = (V + NV - 1) / NV;
  auto issue1 = [&](int vt) {  // one commit group, empty past the last tile
    if (vt >= VT) {
      cp_async_commit();
      return;
    }
    const int st = vt % 3, c0 = vt * NV;
    wy::copy_ws<C>(stage_vn(st), LDR, a.ws_vnew + t_v, c0, nrows, V);
    wy::copy_ws<C>(stage_dvn(st), LDKN, a.ws_dvnew + t_v, c0, nrows, V);
    float* sO = stage_dO(st);
    if (do_bf16) {
      wy::copy_rows<__nv_bfloat16, C>(reinterpret_cast<__nv_bfloat16*>(sO),
                                      static_cast<const __nv_bfloat16*>(a.d_out.p), sOff, c0, nrows, V);
    } else if (do_f32) {
      wy::copy_rows<float, C>(sO, static_cast<const float*>(a.d_out.p), sOff, c0, nrows, V);
    } else {
      wy::fill_rows<float, C>(sO, sOff, c0, nrows, V, [&](int64_t i) { return a.d_out.load(i); });
    }
    const InT* gv = static_cast<const InT*>(a.v.p);
    if (v_vec) wy::copy_rows<InT, C>(stage_v(st), gv, sOff + C, c0, nrows, V);
    else wy::fill_rows<InT, C>(stage_v(st), sOff + C, c0, nrows, V, [&](int64_t i) { return gv[i]; });
    cp_async_commit();
  };

  // dbv: warp rows [16 rbA, +16), columns [8 cgA, +8) of a tile (warps with cgA >= 2 idle at C = 32). dP, dL: slot s
  // holds block k = warp + 8 s, dP (k even) or dL (odd) at the (k / 2)-th block (row block bi, column block bj <= bi).
  const int rbA = warp % RB, cgA = warp / RB, rA = 16 * rbA + g;
  auto block_of = [](int k, int& bi, int& bj) {
    const int n = k >> 1;
    bi = 0;
    while ((bi + 1) * (bi + 2) / 2 <= n) ++bi;
    bj = n - bi * (bi + 1) / 2;
  };
  FragC acc_b[SLOTS][2];
#pragma unroll
  for (int s = 0; s < SLOTS; ++s) acc_b[s][0].zero(), acc_b[s][1].zero();
  float rsum[2] = {0.f, 0.f};  // rows rA, rA + 8 of rowsum(dbv v) over this warp's columns
  issue1(0);
  issue1(1);
  for (int vt = 0; vt < VT; ++vt) {
    const int st = vt % 3, c0 = vt * NV;
    cp_async_wait<1>();
    __syncthreads();  // tile vt visible; every warp is done with tile vt - 1 (sDbv, and its stage: tile vt + 2's)
    issue1(vt + 2);
    if (cgA < 2) {
      // dbv = Tm^T dv_new: rows i take r >= i only (k-steps from the diagonal block), and r < nrows.
      FragC acc;
      acc.zero();
      const float* sD = stage_dvn(st);
      for (int ks = rbA; ks < RB; ++ks) {
        if (16 * ks < nrows) {
          FragA at[FP];
          FOp::load_a_t(at, sTm, LDT, 16 * rbA, 16 * ks);
          FragB bd[FP];
          FOp::load_b1_kn(bd, sD, LDKN, 16 * ks, 8 * cgA);
          mma_split_b<FP>(acc, at, bd);
        }
      }
      const InT* sv = stage_v(st);
      with_typed(a.dv, [&](auto* dvp) {
        using DvT = std::remove_pointer_t<decltype(dvp)>;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = rA + 8 * h, c = 8 * cgA + 2 * t, gc = c0 + c;
          const bool rin = r < nrows;
          const float d0 = rin && gc < V ? acc.x[2 * h] : 0.f, d1 = rin && gc + 1 < V ? acc.x[2 * h + 1] : 0.f;
          *reinterpret_cast<float2*>(sDbv + r * LDR + c) = make_float2(d0, d1);
          wy::store_pair(a.ws_dbv + t_v + r * V, gc, V, d0, d1);
          if (rin) {
            DvT* dvr = dvp + sOff[2 * C + r];
            if (gc < V) dvr[gc] = from_float<DvT>(sBeta[r] * d0);
            if (gc + 1 < V) dvr[gc + 1] = from_float<DvT>(sBeta[r] * d1);
            const float2 v = wy::pair_float(*reinterpret_cast<const wy::Pair<InT>*>(sv + r * LDR + c));
            rsum[h] += d0 * v.x;
            rsum[h] += d1 * v.y;
          }
        }
      });
    }
    __syncthreads();  // dbv of the tile visible

    // dP += dO v_new^T, dL += dbv v_new^T over the tile's columns, one 16 x 16 block per slot.
    const float* sO = stage_dO(st);
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
      const int k = warp + 8 * s;
      int bi, bj;
      block_of(k, bi, bj);
      if (k < NB && 16 * bi < nrows) {
        FragA fa[FP];
        if ((k & 1) == 0 && do_bf16) {  // bf16 dO enters once: its lower parts are zero
          FragA one[1];
          Operand<__nv_bfloat16>::load_a(one, reinterpret_cast<const __nv_bfloat16*>(sO), LDR, 16 * bi, 0);
          fa[0] = one[0];
#pragma unroll
          for (int i = 1; i < FP; ++i) fa[i] = FragA{};
        } else {
          FOp::load_a(fa, (k & 1) == 0 ? sO : sDbv, LDR, 16 * bi, 0);
        }
        FragB bv[2][FP];
        FOp::load_b_nk(bv, stage_vn(st), LDR, 0, 16 * bj);
        mma_split_b<FP>(acc_b[s][0], fa, bv[0]);
        mma_split_b<FP>(acc_b[s][1], fa, bv[1]);
      }
    }
  }

  // dP and dL: the slots' blocks (zero past nrows and above the diagonal), zeros in the blocks above.
  float* gP = a.ws_dP + tile * C * C;
  float* gL = a.ws_dL + tile * C * C;
#pragma unroll
  for (int s = 0; s < SLOTS; ++s) {
    const int k = warp + 8 * s;
    int bi, bj;
    block_of(k, bi, bj);
    if (k < NB) {
      const bool dp = (k & 1) == 0;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = 16 * bi + g + 8 * h, j = 16 * bj + 8 * nt + 2 * t;
          const float* x = acc_b[s][nt].x + 2 * h;
          const bool in0 = i < nrows && (dp ? j <= i : j < i), in1 = i < nrows && (dp ? j + 1 <= i : j + 1 < i);
          const float f = dp ? a.scale : -1.f;
          *reinterpret_cast<float2*>((dp ? gP : gL) + i * C + j) =
              make_float2(in0 ? f * x[0] : 0.f, in1 ? f * x[1] : 0.f);
        }
      }
    }
  }
  for (int e = tid; e < C * C / 4; e += kBwdThreads) {
    const int i = e / (C / 4), j = (e % (C / 4)) * 4;
    if (j / 16 > i / 16) {
      *reinterpret_cast<float4*>(gP + i * C + j) = make_float4(0.f, 0.f, 0.f, 0.f);
      *reinterpret_cast<float4*>(gL + i * C + j) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }

  // beta's value side: the quad's columns, then the second column group's, in that order.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    rsum[h] += __shfl_xor_sync(0xffffffffu, rsum[h], 1);
    rsum[h] += __shfl_xor_sync(0xffffffffu, rsum[h], 2);
  }
  if (cgA == 1 && t == 0) {
    sRow[rA] = rsum[0];
    sRow[rA + 8] = rsum[1];
  }
  __syncthreads();
  if (cgA == 0 && t == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = rA + 8 * h;
      if (r < nrows) a.ws_dbeta[(a.row(ch.b, ch.row0 + r) * a.HV + hv) * (1 + a.nks)] = rsum[h] + sRow[r];
    }
  }
}

}  // namespace kdakit::cuda
