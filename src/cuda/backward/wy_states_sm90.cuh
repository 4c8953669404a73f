// The backward's WY pass and its products with the chunk states in one kernel on Hopper warpgroup MMAs (the value and
// state sides of src/cpu/chunk_gradients.cpp; on other GPUs and shapes, wy_sm80.cuh then state_products_sm80.cuh).
// One CTA of three warpgroups per (chunk, v-head), bf16 inputs, chunk 64, K <= 128, V <= 128, the chunk-start states
// an fp32 [K][V] block. Over value halves of 64 columns:
//   load: S = h_c, dH (the reverse scan's end-state gradient) and dv_new, split into hi and lo bf16 tiles of
//         [64 keys or rows][64 values] in the 128-byte-swizzled layout (common/sm90/gmma.cuh); u (hi and lo), dO and v
//         as bf16 rows; and the state decay's rowsum(S dH) per key, summed as state_products_sm80.cuh sums it.
//   warpgroup 0: v_new = u - w S (w in registers, S as the MN-major B: lo then hi per 16-key step, the forward's
//         order), stored split for the others, then dkg += v_new dH^T (dH as the K-major B);
//   warpgroup 1: dbv = Tm^T dv_new, dv = beta dbv (final) and beta's value part rowsum(dbv v), then
//         dkbg += dbv S^T and dL += dbv v_new^T with dbv's A fragments straight from its accumulators;
//   warpgroup 2: dqg += dO S^T and dP += dO v_new^T (dO exact in one bf16 part).
// One [64 keys][64 values] tile serves as the MN-major B of v_new and as the K-major B of the products with the states.
// Every product takes the k-steps, splits and MMA order of the mma.sync kernels, so the gradients are the same bits.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/backward/common.cuh"
#include "cuda/common/sm80/cp_async.cuh"
#include "cuda/common/sm90/gmma.cuh"
#include "cuda/forward/recurrence_common.cuh"

namespace kdakit::cuda {
namespace wy_states_sm90 {

using bf16 = __nv_bfloat16;
constexpr int TILE = 64 * 64;  // elements of a swizzled [64][64] bf16 tile (8 KB)

// (r, c), (r, c + 1) of an fp32 quantity into its hi and lo swizzled tiles.
__device__ __forceinline__ void store_split(bf16* hi, bf16* lo, int r, int c, float x0, float x1) {
  uint32_t h, l;
  split_pack(x0, x1, h, l);
  const int o = sm90::tile_offset<64>(r, c);
  *reinterpret_cast<uint32_t*>(hi + o) = h;
  *reinterpret_cast<uint32_t*>(lo + o) = l;
}

// d += A B over the k-steps of a [64][64] tile pair (hi, lo) with A in registers: per k-step the MMAs of
// Operand<float>::mma (a lo x b hi, a hi x b lo, a hi x b hi), or, A in one part (A1), b lo then b hi.
// The k-steps k0 .. k0 + NKS - 1 of the tiles (a[i] for k-step k0 + i).
template <sm90::Major B_MAJOR, bool A1, int NKS>
__device__ __forceinline__ void mma_tile(FragC (&d)[8], const FragA (&a)[NKS][2], const bf16* b_hi, const bf16* b_lo,
                                         int k0) {
  constexpr bool KM = B_MAJOR == sm90::Major::K;
  const sm90::TileDescriptors<64, KM> dh(b_hi), dl(b_lo);
#pragma unroll
  for (int i = 0; i < NKS; ++i) {
    const int kd = k0 + i;
    if constexpr (A1) {
      sm90::mma_rs<B_MAJOR>(d, a[i][0], dl(kd));
      sm90::mma_rs<B_MAJOR>(d, a[i][0], dh(kd));
    } else {
      sm90::mma_rs<B_MAJOR>(d, a[i][1], dh(kd));
      sm90::mma_rs<B_MAJOR>(d, a[i][0], dl(kd));
      sm90::mma_rs<B_MAJOR>(d, a[i][0], dh(kd));
    }
  }
}

template <int NKS>
__device__ __forceinline__ void fence_frags(FragA (&a)[NKS][2]) {
#pragma unroll
  for (int i = 0; i < NKS; ++i) sm90::fence_operands(a[i][0]), sm90::fence_operands(a[i][1]);
}

// mma_tile over the tile pair at b (hi, then lo TILE elements on), issued and awaited by the warpgroup.
template <sm90::Major B_MAJOR, bool A1, int NKS>
__device__ __forceinline__ void mma_group(FragC (&d)[8], FragA (&a)[NKS][2], const bf16* b, int k0 = 0) {
  fence_frags(a);
  sm90::fence_operands(d);
  sm90::arrive();
  mma_tile<B_MAJOR, A1>(d, a, b, b + TILE, k0);
  sm90::commit();
  sm90::wait<0>();
  sm90::fence_operands(d);
  fence_frags(a);
}

// A fragments of the warp's 16 rows (row block wl of a 64-row product), k-steps k0 + 16 i, from plain bf16 rows of
// stride ld: A = the rows (T false) or their transpose (T true); SPLIT: hi at `hi`, lo at `lo`, else one part (a[i][1]
// repeats it).
template <bool T, bool SPLIT, int N>
__device__ __forceinline__ void load_frags(FragA (&a)[N][2], const bf16* hi, const bf16* lo, int ld, int wl, int k0) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    FragA x[1];
    if constexpr (T) Operand<bf16>::load_a_t(x, hi, ld, 16 * wl, k0 + 16 * i);
    else Operand<bf16>::load_a(x, hi, ld, 16 * wl, k0 + 16 * i);
    a[i][0] = x[0];
    if constexpr (SPLIT) {
      if constexpr (T) Operand<bf16>::load_a_t(x, lo, ld, 16 * wl, k0 + 16 * i);
      else Operand<bf16>::load_a(x, lo, ld, 16 * wl, k0 + 16 * i);
    }
    a[i][1] = x[0];
  }
}

// Shared memory, byte offsets (tiles at 1024-byte boundaries, the swizzle's period).
struct Layout {
  static constexpr int LDW = 128 + 8, LDT = 64 + 8, LDR = 64 + 8;  // plain bf16 rows: w, Tm, dO / v / u
  static constexpr std::size_t s_tiles = 0;                              // S hi, lo per 64 keys: [2][2][TILE]
  static constexpr std::size_t h_tiles = s_tiles + 4 * TILE * 2;         // dH likewise
  static constexpr std::size_t dv_tiles = h_tiles + 4 * TILE * 2;        // dv_new hi, lo
  static constexpr std::size_t vn_tiles = dv_tiles + 2 * TILE * 2;       // v_new hi, lo
  static constexpr std::size_t w_rows = vn_tiles + 2 * TILE * 2;         // [64][LDW]
  static constexpr std::size_t tm_rows = w_rows + 64 * LDW * 2;          // Tm hi, lo [64][LDT]
  static constexpr std::size_t do_rows = tm_rows + 2 * 64 * LDT * 2;     // dO [64][LDR]
  static constexpr std::size_t v_rows = do_rows + 64 * LDR * 2;          // v [64][LDR]
  static constexpr std::size_t u_rows = v_rows + 64 * LDR * 2;           // u, then its lo part: [2][64][LDR]
  static constexpr std::size_t dv_stage = u_rows + 2 * 64 * LDR * 2;     // dv_new f32 [64][64]
  static constexpr std::size_t beta = dv_stage + 64 * 64 * 4;            // [64] f32
  static constexpr std::size_t dlp = beta + 64 * 4;                      // dL, dP accumulators [2][32][128] f32
  static constexpr std::size_t bytes = dlp + 2 * 32 * 128 * 4;
  static_assert(bytes + 1024 == bwd_wy_states_sm90_smem(), "the planner's size, with the alignment's slack");
  static_assert(h_tiles % 1024 == 0 && dv_tiles % 1024 == 0 && vn_tiles % 1024 == 0, "swizzle-aligned tiles");
};

}  // namespace wy_states_sm90

template <typename InT>
__global__ void __launch_bounds__(kWsSm90Threads, 1) backward_wy_states_sm90_kernel(const BackwardArgs a) {
#if KDAKIT_SM90A
  using namespace wy_states_sm90;
  using L = Layout;
  static_assert(std::is_same<InT, __nv_bfloat16>::value, "bf16 inputs");
  constexpr int C = 64;
  ChunkOf ch;
  if (!chunk_of(a, blockIdx.x, ch)) return;
  const int hv = blockIdx.y, K = a.K, V = a.V, nrows = ch.nrows, KT = (K + 63) / 64;
  const int64_t tile = a.tile(blockIdx.x, hv), t_v = tile * C * V;
  const int tid = threadIdx.x, wg = tid >> 7, wl = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int r0 = 16 * wl + g;  // the thread's accumulator rows r0, r0 + 8 in every 64-row product

  extern __shared__ __align__(16) char smem_raw[];
  char* const smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);  // the tiles' 1024-byte base
  bf16* sS = reinterpret_cast<bf16*>(smem + L::s_tiles);  // key tile kt: hi at 2 kt TILE, lo at (2 kt + 1) TILE
  bf16* sH = reinterpret_cast<bf16*>(smem + L::h_tiles);
  bf16* sDv = reinterpret_cast<bf16*>(smem + L::dv_tiles);
  bf16* sVn = reinterpret_cast<bf16*>(smem + L::vn_tiles);
  bf16* sW = reinterpret_cast<bf16*>(smem + L::w_rows);
  bf16* sTm = reinterpret_cast<bf16*>(smem + L::tm_rows);  // hi, then lo at 64 LDT
  bf16* sO = reinterpret_cast<bf16*>(smem + L::do_rows);
  bf16* sV = reinterpret_cast<bf16*>(smem + L::v_rows);
  bf16* sU = reinterpret_cast<bf16*>(smem + L::u_rows);  // u, then u's lo part at 64 LDR
  float* sDvF = reinterpret_cast<float*>(smem + L::dv_stage);
  float* sBeta = reinterpret_cast<float*>(smem + L::beta);
  // Warpgroups 1 and 2 keep their dL / dP accumulators here between value halves (element (i, e) of the thread's
  // fragments at (4 i + e) 128 + its lane in the warpgroup: conflict-free), so that no role holds a third block of
  // accumulators through the loads and the first phase. With them in registers the kernel needed more than its 168
  // registers and ptxas ran every warpgroup MMA alone (C7512). Stored and reloaded exactly: the same bits.
  float* sAcc = reinterpret_cast<float*>(smem + L::dlp) + (wg >= 1 ? (wg - 1) * 32 * 128 : 0) + (tid & 127);

  // The chunk's w (all keys) and Tm (zero outside rows [i, nrows) of column i, split), beta.
  {
    const bf16* gw = static_cast<const bf16*>(a.ws_w) + tile * C * a.KP;
    for (int e = tid; e < C * a.KP / 8; e += kWsSm90Threads) {
      const int r = e / (a.KP / 8), c = 8 * (e % (a.KP / 8));
      *reinterpret_cast<uint4*>(sW + r * L::LDW + c) = *reinterpret_cast<const uint4*>(gw + r * a.KP + c);
    }
    const float* gt = a.ws_tm + tile * C * C;
    for (int e = tid; e < C * C / 2; e += kWsSm90Threads) {
      const int r = e / (C / 2), i = 2 * (e % (C / 2));
      const float2 x = *reinterpret_cast<const float2*>(gt + r * C + i);
      const bool rin = r < nrows;
      uint32_t h, l;
      split_pack(rin && r >= i ? x.x : 0.f, rin && r >= i + 1 ? x.y : 0.f, h, l);
      *reinterpret_cast<uint32_t*>(sTm + r * L::LDT + i) = h;
      *reinterpret_cast<uint32_t*>(sTm + 64 * L::LDT + r * L::LDT + i) = l;
    }
    for (int r = tid; r < C; r += kWsSm90Threads) {
      sBeta[r] = r < nrows ? math::beta_value(a.beta.load(a.beta.offset(ch.b, ch.row0 + r, hv)), a.beta_sigmoid,
                                              a.neg_eigval)
                           : 0.f;
    }
  }

  const float* hS = static_cast<const float*>(a.h.p) + a.h.block(a.cu_seqlens.present(), ch.b, ch.ci, blockIdx.x, hv);
  const bool s_vec = reinterpret_cast<uintptr_t>(hS) % 16 == 0;  // the workspace's rows are (V % 4 == 0)
  // dO and v (bf16) in 16-byte pieces: whole pieces per row, aligned rows.
  const bool vec_rows = a.d_out.dtype == DType::kBFloat16 && rows_vec(a.d_out, 8, V) && rows_vec(a.v, 8, V);
  const float* gdH = a.ws_dh + tile * K * V;
  const float* gdv = a.ws_dvnew + t_v;
  float dgam[2] = {0.f, 0.f};  // rowsum(S dH) of the thread's two (key, q) items (the loads below)

  // The accumulators: warpgroup 0 dkg, 1 dkbg, 2 dqg ([64][KT * 64]); 1 dL, 2 dP ([64][64], in sAcc between value
  // halves).
  FragC acc[2][8];
  float rsum[2][2] = {{0.f, 0.f}, {0.f, 0.f}};  // warpgroup 1: [8-column group][row r0, r0 + 8] of rowsum(dbv v)
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[0][i].zero(), acc[1][i].zero();
  // The dL / dP accumulators of warpgroup wg >= 1: from sAcc (zero before the first value half).
  auto load_acc2 = [&](FragC(&d)[8], bool first) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) d[i].x[e] = first ? 0.f : sAcc[(4 * i + e) * 128];
    }
  };
  auto store_acc2 = [&](const FragC(&d)[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) sAcc[(4 * i + e) * 128] = d[i].x[e];
    }
  };

  const bf16* gu = static_cast<const bf16*>(a.ws_u) + tile * C * a.VP;
  const bf16* gulo = a.ws_ulo + tile * C * a.VP;  // the planner sets it for bf16 operands
  for (int c0 = 0; c0 < V; c0 += 64) {
    __syncthreads();  // every warpgroup is done with the previous half's tiles
    // dv_new (fp32, to be split below), u, and dO and v where their rows allow 16-byte pieces: cp.async, issued first
    // so that they land while the S and dH loads below wait. Zero past nrows and V.
    for (int e = tid; e < 64 * 16; e += kWsSm90Threads) {
      const int r = e >> 4, c = 4 * (e & 15);
      const bool in = r < nrows && c0 + c < V;
      cp_async16(sDvF + r * 64 + c, gdv + (in ? r * V + c0 + c : 0), in ? 16 : 0);
    }
    for (int e = tid; e < 64 * 8 * (vec_rows ? 4 : 2); e += kWsSm90Threads) {
      const int m = e >> 9, r = (e >> 3) & 63, c = 8 * (e & 7), col = c0 + c;
      if (m < 2) {  // u and its lo part: tile rows VP >= c0 + 64 wide
        cp_async16(sU + m * 64 * L::LDR + r * L::LDR + c, (m == 0 ? gu : gulo) + r * a.VP + col);
      } else {
        const TokenRows& tr = m == 2 ? a.d_out : a.v;
        const bool in = r < nrows && col < V;
        cp_async16((m == 2 ? sO : sV) + r * L::LDR + c,
                   static_cast<const bf16*>(tr.p) + (in ? tr.offset(ch.b, ch.row0 + r, hv) + col : 0), in ? 16 : 0);
      }
    }
    cp_async_commit();
    // Every thread issues all its loads of the half before it uses any (one round trip to memory, not one per row
    // piece). S and dH: work items (key, q) = (i / 4, i % 4), i = tid and tid + 384 below 4 KT * 64: columns
    // 4q .. 4q + 3 of each 16-column tile, which is also how state_products_sm80.cuh sums rowsum(S dH) (a key's four
    // threads, the tiles in order; their sum at the end). Zero past K and V.
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int i = tid + j * kWsSm90Threads, key = i >> 2, q = i & 3;
      if (i < 4 * KT * 64) {
        float4 xs[4], xh[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int col = c0 + 16 * u + 4 * q;
          xs[u] = xh[u] = make_float4(0.f, 0.f, 0.f, 0.f);
          if (key < K && col < V) {  // V % 4 == 0: whole pieces
            const float* src = hS + int64_t(key) * V + col;
            xs[u] = s_vec ? *reinterpret_cast<const float4*>(src) : make_float4(src[0], src[1], src[2], src[3]);
            xh[u] = *reinterpret_cast<const float4*>(gdH + int64_t(key) * V + col);
          }
        }
        bf16* ts = sS + 2 * (key >> 6) * TILE;
        bf16* th = sH + 2 * (key >> 6) * TILE;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          if (key < K && c0 + 16 * u < V) {
            dgam[j] += xs[u].x * xh[u].x;
            dgam[j] += xs[u].y * xh[u].y;
            dgam[j] += xs[u].z * xh[u].z;
            dgam[j] += xs[u].w * xh[u].w;
          }
          const int c = 16 * u + 4 * q;
          store_split(ts, ts + TILE, key & 63, c, xs[u].x, xs[u].y);
          store_split(ts, ts + TILE, key & 63, c + 2, xs[u].z, xs[u].w);
          store_split(th, th + TILE, key & 63, c, xh[u].x, xh[u].y);
          store_split(th, th + TILE, key & 63, c + 2, xh[u].z, xh[u].w);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the copies above landed
    for (int e = tid; e < 64 * 32; e += kWsSm90Threads) {  // dv_new split, a pair of columns a thread
      const int r = e >> 5, c = 2 * (e & 31);
      const float2 x = *reinterpret_cast<const float2*>(sDvF + r * 64 + c);
      store_split(sDv, sDv + TILE, r, c, x.x, x.y);
    }
    if (!vec_rows) {  // dO and v element by element (other dtypes, unaligned rows)
      for (int e = tid; e < 64 * 64; e += kWsSm90Threads) {
        const int r = e >> 6, c = e & 63, col = c0 + c;
        const bool in = r < nrows && col < V;
        sO[r * L::LDR + c] = in ? a.d_out.load(a.d_out.offset(ch.b, ch.row0 + r, hv) + col) : 0.f;
        sV[r * L::LDR + c] =
            in ? static_cast<const bf16*>(a.v.p)[a.v.offset(ch.b, ch.row0 + r, hv) + col] : __float2bfloat16_rn(0.f);
      }
    }
    sm90::fence_shared_to_async();
    __syncthreads();  // the half's tiles visible to every warpgroup (and to the MMAs)

    // Phase 1: warpgroup 0 v_new (stored split), 1 dbv -> dv, rowsum(dbv v), dkbg; 2 dqg. fr: the A fragments each
    // keeps for phase 2 (v_new, dbv, dO).
    FragA fr[4][2];
    if (wg == 0) {  // v_new = u - w S
      FragC vn[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) vn[i].zero();
#pragma unroll
      for (int kt = 0; kt < 2; ++kt) {
        if (kt >= KT) break;
        FragA aw[4][2];
        load_frags<false, false>(aw, sW, sW, L::LDW, wl, 64 * kt);
        mma_group<sm90::Major::MN, true>(vn, aw, sS + 2 * kt * TILE);
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = r0 + 8 * h, c = 8 * nt + 2 * t, gc = c0 + c;
          float2 uf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(sU + r * L::LDR + c));
          const float2 ulo =
              __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(sU + 64 * L::LDR + r * L::LDR + c));
          uf.x += ulo.x;  // u = hi + lo, exact in fp32
          uf.y += ulo.y;
          const bool rin = r < nrows;
          vn[nt].x[2 * h] = rin && gc < V ? uf.x - vn[nt].x[2 * h] : 0.f;
          vn[nt].x[2 * h + 1] = rin && gc + 1 < V ? uf.y - vn[nt].x[2 * h + 1] : 0.f;
          store_split(sVn, sVn + TILE, r, c, vn[nt].x[2 * h], vn[nt].x[2 * h + 1]);
        }
      }
#pragma unroll
      for (int kd = 0; kd < 4; ++kd) acc_to_parts<2>(vn[2 * kd], vn[2 * kd + 1], fr[kd]);
      sm90::fence_shared_to_async();  // v_new's tiles, for the MMAs after the barrier
    } else if (wg == 1) {  // dbv = Tm^T dv_new (Tm zero above the diagonal and past nrows: the extra k-steps add zeros)
      FragC db[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) db[i].zero();
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // Tm^T's fragments for two k-steps at a time (registers)
        FragA at[2][2];
        load_frags<true, true>(at, sTm, sTm + 64 * L::LDT, L::LDT, wl, 32 * half);
        mma_group<sm90::Major::MN, false>(db, at, sDv, 2 * half);
      }
      with_typed(a.dv, [&](auto* dvp) {
        using DvT = std::remove_pointer_t<decltype(dvp)>;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = r0 + 8 * h, c = 8 * nt + 2 * t, gc = c0 + c;
            const bool rin = r < nrows;
            const float d0v = rin && gc < V ? db[nt].x[2 * h] : 0.f;
            const float d1v = rin && gc + 1 < V ? db[nt].x[2 * h + 1] : 0.f;
            db[nt].x[2 * h] = d0v;
            db[nt].x[2 * h + 1] = d1v;
            if (rin) {
              DvT* dvr = dvp + a.dv.offset(ch.b, ch.row0 + r, hv);
              if (gc < V) dvr[gc] = from_float<DvT>(sBeta[r] * d0v);
              if (gc + 1 < V) dvr[gc + 1] = from_float<DvT>(sBeta[r] * d1v);
              // The WY pass's sums: per 8-column group of each 16-column tile (nt & 1), the tiles in order.
              const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(sV + r * L::LDR + c));
              rsum[nt & 1][h] += d0v * v.x;
              rsum[nt & 1][h] += d1v * v.y;
            }
          }
        }
      });
#pragma unroll
      for (int kd = 0; kd < 4; ++kd) acc_to_parts<2>(db[2 * kd], db[2 * kd + 1], fr[kd]);
#pragma unroll
      for (int kt = 0; kt < 2; ++kt) {  // dkbg += dbv S^T
        if (kt < KT) mma_group<sm90::Major::K, false>(acc[kt], fr, sS + 2 * kt * TILE);
      }
    } else {  // dqg += dO S^T
      load_frags<false, false>(fr, sO, sO, L::LDR, wl, 0);
#pragma unroll
      for (int kt = 0; kt < 2; ++kt) {
        if (kt < KT) mma_group<sm90::Major::K, true>(acc[kt], fr, sS + 2 * kt * TILE);
      }
    }
    __syncthreads();  // v_new's tiles visible
    // Phase 2: warpgroup 0 dkg += v_new dH^T, 1 dL += dbv v_new^T, 2 dP += dO v_new^T.
    if (wg == 0) {
#pragma unroll
      for (int kt = 0; kt < 2; ++kt) {
        if (kt < KT) mma_group<sm90::Major::K, false>(acc[kt], fr, sH + 2 * kt * TILE);
      }
    } else {
      FragC acc2[8];
      load_acc2(acc2, c0 == 0);
      if (wg == 1) mma_group<sm90::Major::K, false>(acc2, fr, sVn);
      else mma_group<sm90::Major::K, true>(acc2, fr, sVn);
      store_acc2(acc2);
    }
  }

  // The per-token parts: warpgroup 2 dq = scale dqg, 1 dk = -dkbg, 0 dkg (a row's two adjacent keys in one 8-byte
  // store where K is even); rowsum(S dH) per key.
  {
    float* part = wg == 2 ? a.ws_dq : wg == 1 ? a.ws_dk : a.ws_dkg;
    const float f = wg == 2 ? a.scale : wg == 1 ? -1.f : 1.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = r0 + 8 * h;
      if (i < nrows) {
        float* row = part + (a.row(ch.b, ch.row0 + i) * a.HV + hv) * K;
#pragma unroll
        for (int kt = 0; kt < 2; ++kt) {
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
            const int d = 64 * kt + 8 * nt + 2 * t;
            const float x0 = f * acc[kt][nt].x[2 * h], x1 = f * acc[kt][nt].x[2 * h + 1];
            if ((K & 1) == 0 && d + 1 < K) {
              *reinterpret_cast<float2*>(row + d) = make_float2(x0, x1);
            } else {
              if (d < K) row[d] = x0;
              if (d + 1 < K) row[d + 1] = x1;
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    dgam[j] += __shfl_xor_sync(0xffffffffu, dgam[j], 1);
    dgam[j] += __shfl_xor_sync(0xffffffffu, dgam[j], 2);
    const int i = tid + j * kWsSm90Threads, key = i >> 2;
    if (i < 512 && (i & 3) == 0 && key < K) a.ws_dgam[tile * K + key] = dgam[j];
  }
  // dP (warpgroup 2) and dL (1): scale tril_incl and -tril_strict of the chunk's rows, zero elsewhere.
  if (wg >= 1) {
    float* out = (wg == 2 ? a.ws_dP : a.ws_dL) + tile * C * C;
    const float f = wg == 2 ? a.scale : -1.f;
    FragC acc2[8];
    load_acc2(acc2, V <= 0);  // zero where no value half ran
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = r0 + 8 * h, j = 8 * nt + 2 * t;
        const float* x = acc2[nt].x + 2 * h;
        const bool in0 = i < nrows && (wg == 2 ? j <= i : j < i), in1 = i < nrows && (wg == 2 ? j + 1 <= i : j + 1 < i);
        *reinterpret_cast<float2*>(out + i * C + j) = make_float2(in0 ? f * x[0] : 0.f, in1 ? f * x[1] : 0.f);
      }
    }
  }
  // beta's value side (warpgroup 1): each column group's quad, then the first group's sum plus the second's, as the
  // WY pass sums it.
  if (wg == 1) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int cg = 0; cg < 2; ++cg) {
        rsum[cg][h] += __shfl_xor_sync(0xffffffffu, rsum[cg][h], 1);
        rsum[cg][h] += __shfl_xor_sync(0xffffffffu, rsum[cg][h], 2);
      }
      const int r = r0 + 8 * h;
      if (t == 0 && r < nrows) {
        a.ws_dbeta[(a.row(ch.b, ch.row0 + r) * a.HV + hv) * (1 + a.nks)] = rsum[0][h] + rsum[1][h];
      }
    }
  }
#else
  (void)a;
  __trap();
#endif
}

}  // namespace kdakit::cuda
