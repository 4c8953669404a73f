// The backward's products with the chunk states (the state side of src/cpu/chunk_gradients.cpp), on tensor cores:
// per (chunk, v-head, kBwdStateKeys keys), over the value columns in tiles of kBwdStateCols,
//   dqg = scale dO S^T,  dkbg = -dbv S^T,  dkg = v_new dH^T   ([C][keys] each, fp32 accumulation)
// and the state decay's part rowsum(S dH) per key. S is the chunk-start state, dH the gradient of its end state (the
// reverse scan's), dbv and v_new the WY pass's. The fp32 operands are split hi + lo in the products (three MMAs; for
// float32 inputs hi + mid + lo, six); a bf16 dO is exact in one bf16 part, an fp16 one is split from its 16-bit
// values. dqg and dkbg go to the per-token dq and dk parts (the gradient kernel adds its terms in place), dkg to its
// own per-token part, rowsum(S dH) per chunk.
#pragma once

#include "cuda/backward/common.cuh"
#include "cuda/common/sm80/mma.cuh"

namespace kdakit::cuda {

// How dO sits in shared memory: fp32 rows, or the tensor's own bf16 / fp16 rows (copied as they are).
enum class BwdStateDo { kF32, kBF16, kF16 };

// (A template only so that every instantiation file may define it.)
template <typename InT>
__global__ void __launch_bounds__(kBwdStateThreads) backward_state_products_kernel(const BackwardArgs a) {
  constexpr int LD = kBwdLdv, LDH = kBwdLdvHalf, KB = kBwdStateKeys, COLS = kBwdStateCols;
  const int64_t slot = blockIdx.x;
  const int hv = blockIdx.y, d0 = blockIdx.z * KB;
  ChunkOf ch;
  if (!chunk_of(a, slot, ch)) return;
  const int C = a.chunk, K = a.K, V = a.V, nrows = ch.nrows, tid = threadIdx.x, warp = tid >> 5;
  const int64_t tile = a.tile(slot, hv), t_v = tile * C * V;
  const int64_t hblk = a.h.block(a.cu_seqlens.present(), ch.b, ch.ci, slot, hv);
  // The fp32 rows come by cp.async where every row starts 16-byte aligned and S is an fp32 [K][V] block (the
  // recomputed states, or saved ones of that form); otherwise element by element.
  const bool rows_async = V % 4 == 0 && a.h.dtype == DType::kFloat32 && !a.vk && hblk % 4 == 0 &&
                          reinterpret_cast<uintptr_t>(a.h.p) % 16 == 0;
  const float* hS = static_cast<const float*>(a.h.p) + hblk;
  // dO by cp.async where its rows start 16-byte aligned (base and strides); otherwise converted element by element.
  const int do_bytes = a.d_out.dtype == DType::kFloat32 ? 4
                       : a.d_out.dtype == DType::kBFloat16 || a.d_out.dtype == DType::kFloat16 ? 2 : 0;
  const bool do_async = do_bytes > 0 && reinterpret_cast<uintptr_t>(a.d_out.p) % 16 == 0 &&
                        (a.d_out.st * do_bytes) % 16 == 0 && (a.d_out.sh * do_bytes) % 16 == 0 &&
                        (a.d_out.sb * do_bytes) % 16 == 0;
  const BwdStateDo do_mode = !do_async || do_bytes == 4                ? BwdStateDo::kF32
                             : a.d_out.dtype == DType::kBFloat16 ? BwdStateDo::kBF16
                                                                 : BwdStateDo::kF16;
  // Rows of S and dH some warp reads: whole 32-key groups that start below K.
  const int krows = min(KB, (K - d0 + 31) / 32 * 32);

  // Two stages, each dO, dbv, v_new [C][LD] and S, dH [KB][LD] (dO's region holds [C][LDH] 16-bit rows when copied
  // as they are).
  extern __shared__ __align__(16) float smem[];
  const int stage_floats = (3 * C + 2 * KB) * LD;
  auto load = [&](int stage, int col0) {
    float* sdO = smem + stage * stage_floats;
    float* sdbv = sdO + C * LD;
    float* svn = sdbv + C * LD;
    float* sS = svn + C * LD;
    float* sdH = sS + KB * LD;
    if (rows_async) {
      // 16-byte copies, the tails past V and the rows past the chunk or K zero-filled.
      constexpr int Q = COLS / 4;
      for (int e = tid; e < (2 * C + 2 * krows) * Q; e += kBwdStateThreads) {
        const int r = e / Q, c = 4 * (e % Q), col = col0 + c;
        const int bytes = col < V ? 4 * min(4, V - col) : 0;
        float* dst;
        const float* src;
        bool in;
        if (r < C) {
          dst = sdbv + r * LD + c, src = a.ws_dbv + t_v + int64_t(r) * V + col, in = r < nrows;
        } else if (r < 2 * C) {
          dst = svn + (r - C) * LD + c, src = a.ws_vnew + t_v + int64_t(r - C) * V + col, in = r - C < nrows;
        } else if (r < 2 * C + krows) {
          const int d = d0 + r - 2 * C;
          dst = sS + (r - 2 * C) * LD + c, src = hS + int64_t(d) * V + col, in = d < K;
        } else {
          const int d = d0 + r - 2 * C - krows;
          dst = sdH + (r - 2 * C - krows) * LD + c, src = a.ws_dh + (tile * K + d) * V + col, in = d < K;
        }
        cp_async16(dst, in && bytes > 0 ? src : a.ws_dbv, in ? bytes : 0);
      }
    } else {
      for (int e = tid; e < C * COLS; e += kBwdStateThreads) {
        const int i = e / COLS, c = e % COLS, col = col0 + c;
        const bool in = i < nrows && col < V;
        sdbv[i * LD + c] = in ? a.ws_dbv[t_v + int64_t(i) * V + col] : 0.f;
        svn[i * LD + c] = in ? a.ws_vnew[t_v + int64_t(i) * V + col] : 0.f;
      }
      for (int e = tid; e < krows * COLS; e += kBwdStateThreads) {
        const int dl = e / COLS, c = e % COLS, d = d0 + dl, col = col0 + c;
        const bool in = d < K && col < V;
        sS[dl * LD + c] = in ? a.h.load(hblk + (a.vk ? int64_t(col) * K + d : int64_t(d) * V + col)) : 0.f;
        sdH[dl * LD + c] = in ? a.ws_dh[(tile * K + d) * V + col] : 0.f;
      }
    }
    if (do_async) {
      const int per = do_bytes == 4 ? COLS / 4 : COLS / 8;  // elements of a 16-byte copy: 16 / do_bytes
      for (int e = tid; e < C * per; e += kBwdStateThreads) {
        const int i = e / per, c = (e % per) * (16 / do_bytes), col = col0 + c;
        const int bytes = i < nrows && col < V ? do_bytes * min(16 / do_bytes, V - col) : 0;
        const char* src = static_cast<const char*>(a.d_out.p) +
                          (a.d_out.offset(ch.b, ch.row0 + i, hv) + col) * do_bytes;
        char* dst = do_bytes == 4 ? reinterpret_cast<char*>(sdO + i * LD + c)
                                  : reinterpret_cast<char*>(sdO) + 2 * (i * LDH + c);
        cp_async16(dst, bytes > 0 ? static_cast<const void*>(src) : a.ws_dbv, bytes);
      }
    } else {
      with_typed(a.d_out, [&](const auto* dO) {
        for (int e = tid; e < C * COLS; e += kBwdStateThreads) {
          const int i = e / COLS, c = e % COLS, col = col0 + c;
          sdO[i * LD + c] = i < nrows && col < V ? to_float(dO[a.d_out.offset(ch.b, ch.row0 + i, hv) + col]) : 0.f;
        }
      });
    }
    cp_async_commit();
  };

  // Warp w: chunk rows 16 (w % 4).. (chunk 32: the upper bands only load), keys 32 (w / 4).. of the CTA's.
  static_assert(kBwdStateThreads / 32 == 4 * (KB / 32) && 4 * 16 >= kBwdMaxChunk, "a warp per 16 rows x 32 keys");
  const int m0 = 16 * (warp & 3), n0 = 32 * (warp >> 2);
  const bool mma_here = m0 < C && d0 + n0 < K;
  FragC aq[4], ab[4], ak[4];
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    aq[nt].zero();
    ab[nt].zero();
    ak[nt].zero();
  }
  // rowsum(S dH): four threads per key, COLS / 4 columns of a tile each (summed across the four at the end).
  static_assert(kBwdStateThreads == 4 * KB && COLS == 16, "four threads of a key, four columns each");
  const int gkey = tid >> 2, gcol = 4 * (tid & 3);
  float dgam = 0.f;

  // One MMA step (16 columns) of the three products for the warp's 16 rows x 32 keys.
  auto step = [&](auto mode_tag, const float* st) {
    constexpr BwdStateDo MODE = decltype(mode_tag)::value;
    // float32 inputs: three-part operands (Float3Split), as the backward's other products.
    using Op = FloatOperand<TileElem<InT>>;
    constexpr int FP = Op::kSplit;
    const float* sdO = st;
    const float* sdbv = sdO + C * LD;
    const float* svn = sdbv + C * LD;
    const float* sS = svn + C * LD;
    const float* sdH = sS + KB * LD;
    // dO and dbv against S, then v_new against dH: two A operands live at a time.
    FragA fo[FP], fa[FP];
    if constexpr (MODE == BwdStateDo::kF32) {
      Op::load_a(fo, sdO, LD, m0, 0);
    } else {
      const int lane = tid & 31, g = lane >> 2, t = lane & 3;
      const uint32_t* w = reinterpret_cast<const uint32_t*>(sdO);  // 16-bit pairs
      const int idx[4] = {(m0 + g) * LDH / 2 + t, (m0 + g + 8) * LDH / 2 + t, (m0 + g) * LDH / 2 + t + 4,
                          (m0 + g + 8) * LDH / 2 + t + 4};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if constexpr (MODE == BwdStateDo::kBF16) {
          fo[0].x[j] = w[idx[j]];  // exact in bf16: no lo part
        } else {
          const __half* h = reinterpret_cast<const __half*>(w + idx[j]);
          Op::put(fo, j, __half2float(h[0]), __half2float(h[1]));
        }
      }
    }
    Op::load_a(fa, sdbv, LD, m0, 0);
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      FragB b[2][FP];
      Op::load_b_nk(b, sS, LD, 0, n0 + 16 * np);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        FragC& q = aq[2 * np + j];
        if constexpr (MODE == BwdStateDo::kBF16) {
          mma_split_b<1, FP>(q, {fo[0]}, b[j]);  // dO exact in one part
        } else {
          Op::mma(q, fo, b[j]);
        }
        Op::mma(ab[2 * np + j], fa, b[j]);
      }
    }
    Op::load_a(fa, svn, LD, m0, 0);
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      FragB b[2][FP];
      Op::load_b_nk(b, sdH, LD, 0, n0 + 16 * np);
#pragma unroll
      for (int j = 0; j < 2; ++j) Op::mma(ak[2 * np + j], fa, b[j]);
    }
  };

  static_assert(kBwdStateStages == 2, "a tile in use, the next one landing");
  const int VT = (V + COLS - 1) / COLS;
  load(0, 0);
  for (int vt = 0; vt < VT; ++vt) {
    cp_async_wait<0>();  // this tile's copies: the only ones in flight
    __syncthreads();     // ... visible to all; and every reader of the other stage is done with it
    if (vt + 1 < VT) load((vt + 1) & 1, (vt + 1) * COLS);  // lands while this tile's products run
    const float* st = smem + (vt & 1) * stage_floats;
    if (mma_here) {
      switch (do_mode) {
        case BwdStateDo::kBF16: step(std::integral_constant<BwdStateDo, BwdStateDo::kBF16>(), st); break;
        case BwdStateDo::kF16: step(std::integral_constant<BwdStateDo, BwdStateDo::kF16>(), st); break;
        default: step(std::integral_constant<BwdStateDo, BwdStateDo::kF32>(), st);
      }
    }
    if (gkey < krows) {
      const float* s = st + 3 * C * LD + gkey * LD + gcol;
      const float* h = s + KB * LD;
#pragma unroll
      for (int c = 0; c < 4; ++c) dgam += s[c] * h[c];
    }
  }
  if (mma_here) {
    for_each_acc<1, 4>([&](int, int nt, int e, int row, int col) {
      const int i = m0 + row, d = d0 + n0 + col;
      if (i < nrows && d < K) {
        const int64_t o = (a.row(ch.b, ch.row0 + i) * a.HV + hv) * K + d;
        a.ws_dq[o] = a.scale * aq[nt].x[e];
        a.ws_dk[o] = -ab[nt].x[e];
        a.ws_dkg[o] = ak[nt].x[e];
      }
    });
  }
  dgam += __shfl_xor_sync(0xffffffffu, dgam, 1);
  dgam += __shfl_xor_sync(0xffffffffu, dgam, 2);
  if ((tid & 3) == 0 && d0 + gkey < K) a.ws_dgam[tile * K + d0 + gkey] = dgam;
}

}  // namespace kdakit::cuda
