// The backward's WY pass (the value side of src/cpu/chunk_gradients.cpp), one CTA per (chunk, v-head), 32 value
// columns at a time: v_new = u - w h_c (the forward's), dbv = Tm^T dv_new, dv = beta dbv (final), beta's value-side
// gradient rowsum(dbv v), and the intra-chunk matrices' gradients dP = scale tril_incl(dO v_new^T) and
// dL = -tril_strict(dbv v_new^T). v_new, dbv, dP and dL go to the workspace for the gradient kernel.
#pragma once

#include "cuda/backward/common.cuh"

namespace kdakit::cuda {

template <typename InT, typename Elem>
__global__ void __launch_bounds__(kBwdThreads) backward_wy_kernel(const BackwardArgs a) {
  constexpr int LD = kBwdLd, RG = kBwdRowGroups, MAX_E = kBwdMaxChunk * kBwdMaxChunk / kBwdThreads;
  const int64_t slot = blockIdx.x;
  const int hv = blockIdx.y;
  ChunkOf ch;
  if (!chunk_of(a, slot, ch)) return;
  const int C = a.chunk, K = a.K, V = a.V, KP = a.KP, nrows = ch.nrows, LDT = C + 1;
  const int64_t tile = a.tile(slot, hv);
  const int tid = threadIdx.x, lane = tid & 31, rg = tid >> 5;

  extern __shared__ __align__(16) float smem[];
  float* sTm = smem;               // [C][C + 1]
  float* sS = sTm + C * LDT;       // [KP][LD]: the state's columns of this tile
  float* svn = sS + KP * LD;       // [C][LD] v_new
  float* sdvn = svn + C * LD;      // [C][LD] dv_new
  float* sdbv = sdvn + C * LD;     // [C][LD] dbv
  float* sdO = sdbv + C * LD;      // [C][LD]
  float* sv = sdO + C * LD;        // [C][LD]
  float* sbeta = sv + C * LD;      // [C]

  for (int e = tid; e < C * C; e += kBwdThreads) sTm[(e / C) * LDT + e % C] = a.ws_tm[tile * C * C + e];
  for (int i = tid; i < C; i += kBwdThreads) {
    sbeta[i] = i < nrows ? math::beta_value(a.beta.load(a.beta.offset(ch.b, ch.row0 + i, hv)), a.beta_sigmoid,
                                            a.neg_eigval)
                         : 0.f;
  }
  const int64_t hblk = a.h.block(a.cu_seqlens.present(), ch.b, ch.ci, slot, hv);
  const int64_t t_k = tile * C * KP, t_u = tile * C * a.VP, t_v = tile * C * V;
  // Entries (i, j) = (e / C, e % C), e = tid + kBwdThreads m, of dP and dL.
  float accP[MAX_E], accL[MAX_E], accB[kBwdMaxChunk / RG];
#pragma unroll
  for (int m = 0; m < MAX_E; ++m) accP[m] = accL[m] = 0.f;
#pragma unroll
  for (int m = 0; m < kBwdMaxChunk / RG; ++m) accB[m] = 0.f;

  const int VT = (V + kBwdCols - 1) / kBwdCols;
  for (int vt = 0; vt < VT; ++vt) {
    const int col = vt * kBwdCols + lane;
    const bool col_in = col < V;
    for (int d = rg; d < KP; d += RG) {
      sS[d * LD + lane] =
          col_in && d < K ? a.h.load(hblk + (a.vk ? int64_t(col) * K + d : int64_t(d) * V + col)) : 0.f;
    }
    for (int i = rg; i < C; i += RG) {
      const bool in = i < nrows && col_in;
      const int64_t off = in ? a.v.offset(ch.b, ch.row0 + i, hv) : 0;
      sdvn[i * LD + lane] = in ? a.ws_dvnew[t_v + int64_t(i) * V + col] : 0.f;
      sdO[i * LD + lane] = in ? a.d_out.load(a.d_out.offset(ch.b, ch.row0 + i, hv) + col) : 0.f;
      sv[i * LD + lane] = in ? token_at<InT>(a.v, off, col) : 0.f;
    }
    __syncthreads();
    // v_new = u - w S (the forward's order: u, then each key), then dbv = Tm^T dv_new.
    for (int i = rg; i < C; i += RG) {
      float vn = 0.f;
      if (i < nrows && col_in) {
        vn = tile_at<Elem>(a.ws_u, t_u + int64_t(i) * a.VP + col);
        for (int d = 0; d < K; ++d) vn -= tile_at<Elem>(a.ws_w, t_k + int64_t(i) * KP + d) * sS[d * LD + lane];
      }
      svn[i * LD + lane] = vn;
      float db = 0.f;
      for (int r = i; r < nrows; ++r) db += sTm[r * LDT + i] * sdvn[r * LD + lane];
      sdbv[i * LD + lane] = db;
      if (col_in) {
        a.ws_vnew[t_v + int64_t(i) * V + col] = vn;
        a.ws_dbv[t_v + int64_t(i) * V + col] = db;
      }
    }
    __syncthreads();
    // dv = beta dbv; beta's value side, rowsum(dbv v), a warp's row at a time.
#pragma unroll
    for (int m = 0; m < kBwdMaxChunk / RG; ++m) {
      const int j = rg + RG * m;
      if (j < C) {
        if (j < nrows && col_in) a.dv.store(a.dv.offset(ch.b, ch.row0 + j, hv) + col, sbeta[j] * sdbv[j * LD + lane]);
        accB[m] += warp_sum(sdbv[j * LD + lane] * sv[j * LD + lane]);
      }
    }
    // dP and dL over this tile's columns.
#pragma unroll
    for (int m = 0; m < MAX_E; ++m) {
      const int e = tid + kBwdThreads * m, i = e / C, j = e % C;
      if (e < C * C) {
        float p = 0.f, l = 0.f;
#pragma unroll 8
        for (int c = 0; c < kBwdCols; ++c) {
          const float vj = svn[j * LD + c];
          p += sdO[i * LD + c] * vj;
          l += sdbv[i * LD + c] * vj;
        }
        accP[m] += p;
        accL[m] += l;
      }
    }
    __syncthreads();  // the tile's readers are done before the next tile's loads
  }
#pragma unroll
  for (int m = 0; m < MAX_E; ++m) {
    const int e = tid + kBwdThreads * m, i = e / C, j = e % C;
    if (e < C * C) {
      a.ws_dP[tile * C * C + e] = i < nrows && j <= i ? a.scale * accP[m] : 0.f;
      a.ws_dL[tile * C * C + e] = i < nrows && j < i ? -accL[m] : 0.f;
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < kBwdMaxChunk / RG; ++m) {
      const int j = rg + RG * m;
      if (j < nrows) a.ws_dbeta[(a.row(ch.b, ch.row0 + j) * a.HV + hv) * (1 + a.nks)] = accB[m];
    }
  }
}

}  // namespace kdakit::cuda
