// The backward's products with the chunk states (the state side of src/cpu/chunk_gradients.cpp), on tensor cores:
// per (chunk, v-head, 32 keys), over the value columns in 32-column tiles,
//   dqg = scale dO S^T,  dkbg = -dbv S^T,  dkg = v_new dH^T   ([C][32] each, fp32 accumulation)
// and the state decay's part rowsum(S dH) per key. S is the chunk-start state, dH the gradient of its end state (the
// reverse scan's), dbv and v_new the WY pass's. Every operand is fp32 (dO converted), split hi + lo in the products
// (three MMAs). dqg and dkbg go to the per-token dq and dk parts (the gradient kernel adds its terms in place), dkg
// to its own per-token part, rowsum(S dH) per chunk.
#pragma once

#include "cuda/backward/common.cuh"
#include "cuda/common/sm80/mma.cuh"

namespace kdakit::cuda {

// (A template only so that every instantiation file may define it.)
template <typename InT>
__global__ void __launch_bounds__(kBwdStateThreads) backward_state_products_kernel(const BackwardArgs a) {
  constexpr int LD = kBwdLdv, KB = kBwdStateKeys, COLS = kBwdCols, WARPS = kBwdStateThreads / 32;
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

  extern __shared__ __align__(16) float smem[];
  float* sdO = smem;           // [C][LD]
  float* sdbv = sdO + C * LD;  // [C][LD]
  float* svn = sdbv + C * LD;  // [C][LD]
  float* sS = svn + C * LD;    // [KB][LD]: S's rows of this CTA's keys, the tile's columns
  float* sdH = sS + KB * LD;   // [KB][LD]

  // Warp w: chunk rows 16 w.. (chunk 32: warps 2 and 3 only load), all KB keys.
  const bool rows_here = 16 * warp < C;
  FragC aq[1][KB / 8], ab[1][KB / 8], ak[1][KB / 8];
#pragma unroll
  for (int nt = 0; nt < KB / 8; ++nt) {
    aq[0][nt].zero();
    ab[0][nt].zero();
    ak[0][nt].zero();
  }
  float dgam = 0.f;  // key tid (tid < KB)
  const int VT = (V + COLS - 1) / COLS;
  for (int vt = 0; vt < VT; ++vt) {
    if (vt > 0) __syncthreads();  // the previous tile's readers are done
    const int col0 = vt * COLS;
    if (rows_async) {
      // 16-byte copies of the fp32 rows, the tails past V and the chunk's rows zero-filled.
      for (int e = tid; e < (2 * C + 2 * KB) * (COLS / 4); e += kBwdStateThreads) {
        const int r = e / (COLS / 4), c = 4 * (e % (COLS / 4)), col = col0 + c;
        const int bytes = col < V ? 4 * min(4, V - col) : 0;
        float* dst;
        const float* src;
        bool in;
        if (r < C) {
          dst = sdbv + r * LD + c, src = a.ws_dbv + t_v + int64_t(r) * V + col, in = r < nrows;
        } else if (r < 2 * C) {
          dst = svn + (r - C) * LD + c, src = a.ws_vnew + t_v + int64_t(r - C) * V + col, in = r - C < nrows;
        } else if (r < 2 * C + KB) {
          const int d = d0 + r - 2 * C;
          dst = sS + (r - 2 * C) * LD + c, src = hS + int64_t(d) * V + col, in = d < K;
        } else {
          const int d = d0 + r - 2 * C - KB;
          dst = sdH + (r - 2 * C - KB) * LD + c, src = a.ws_dh + (tile * K + d) * V + col, in = d < K;
        }
        cp_async16(dst, in && bytes > 0 ? src : a.ws_dbv, in ? bytes : 0);
      }
      cp_async_commit();
    } else {
      for (int e = tid; e < C * COLS; e += kBwdStateThreads) {
        const int i = e / COLS, c = e % COLS, col = col0 + c;
        const bool in = i < nrows && col < V;
        sdbv[i * LD + c] = in ? a.ws_dbv[t_v + int64_t(i) * V + col] : 0.f;
        svn[i * LD + c] = in ? a.ws_vnew[t_v + int64_t(i) * V + col] : 0.f;
      }
      for (int e = tid; e < KB * COLS; e += kBwdStateThreads) {
        const int dl = e / COLS, c = e % COLS, d = d0 + dl, col = col0 + c;
        const bool in = d < K && col < V;
        sS[dl * LD + c] = in ? a.h.load(hblk + (a.vk ? int64_t(col) * K + d : int64_t(d) * V + col)) : 0.f;
        sdH[dl * LD + c] = in ? a.ws_dh[(tile * K + d) * V + col] : 0.f;
      }
    }
    with_typed(a.d_out, [&](const auto* dO) {
      for (int e = tid; e < C * COLS; e += kBwdStateThreads) {
        const int i = e / COLS, c = e % COLS, col = col0 + c;
        sdO[i * LD + c] = i < nrows && col < V ? to_float(dO[a.d_out.offset(ch.b, ch.row0 + i, hv) + col]) : 0.f;
      }
    });
    if (rows_async) cp_async_wait<0>();
    __syncthreads();
    if (rows_here) {
      warp_gemm<float, 1, KB / 8, false, false>(aq, sdO, LD, 16 * warp, sS, LD, 0, 0, COLS / 16);
      warp_gemm<float, 1, KB / 8, false, false>(ab, sdbv, LD, 16 * warp, sS, LD, 0, 0, COLS / 16);
      warp_gemm<float, 1, KB / 8, false, false>(ak, svn, LD, 16 * warp, sdH, LD, 0, 0, COLS / 16);
    }
    if (tid < KB) {
      for (int c = 0; c < COLS; ++c) dgam += sS[tid * LD + c] * sdH[tid * LD + c];
    }
  }
  static_assert(WARPS * 16 >= kBwdMaxChunk, "a warp per 16 chunk rows");
  if (rows_here) {
    for_each_acc<1, KB / 8>([&](int, int nt, int e, int row, int col) {
      const int i = 16 * warp + row, d = d0 + col;
      if (i < nrows && d < K) {
        const int64_t o = (a.row(ch.b, ch.row0 + i) * a.HV + hv) * K + d;
        a.ws_dq[o] = a.scale * aq[0][nt].x[e];
        a.ws_dk[o] = -ab[0][nt].x[e];
        a.ws_dkg[o] = ak[0][nt].x[e];
      }
    });
  }
  if (tid < KB && d0 + tid < K) a.ws_dgam[tile * K + d0 + tid] = dgam;
}

}  // namespace kdakit::cuda
