// The reverse state scan of the backward (stage 3 of src/cpu/backward_chunked.cpp): one CTA per (sequence, v-head,
// 32 value columns), serial over the sequence's chunks from the last. From dS = dht (or zero), per chunk: the
// gradient of its end state dh_c = dS, dv_new = kg dS + Aqk^T dO, dS <- gamma dS + qg^T dO - w^T dv_new (qg and Aqk
// carry the scale); after chunk 0, dS is d_initial_state. It reads the forward's prepare tiles (Elem) and keeps dS
// in fp32 shared memory: lane = value column, warps over keys (dS) or chunk rows (dv_new), so a warp's tile reads are
// one broadcast address.
#pragma once

#include "cuda/backward/common.cuh"

namespace kdakit::cuda {

template <typename Elem>
__global__ void __launch_bounds__(kBwdThreads, 1) backward_scan_kernel(const BackwardArgs a) {
  constexpr int LD = kBwdLd, RG = kBwdRowGroups;
  const int C = a.chunk, KP = a.KP, K = a.K, V = a.V;
  const int VT = (V + kBwdCols - 1) / kBwdCols;
  int64_t idx = blockIdx.x;
  const int vt = static_cast<int>(idx % VT);
  idx /= VT;
  const int hv = static_cast<int>(idx % a.HV);
  const int n = static_cast<int>(idx / a.HV);
  int64_t b, t0, len;
  sequence(a, n, b, t0, len);
  const int64_t nch = (len + C - 1) / C, base = a.chunk_offsets[n];
  const int tid = threadIdx.x, lane = tid & 31, rg = tid >> 5;
  const int col = vt * kBwdCols + lane;
  const bool col_in = col < V;

  extern __shared__ __align__(16) float smem[];
  float* sdS = smem;               // [KP][LD]
  float* sdv = sdS + KP * LD;      // [C][LD] dv_new
  float* sdO = sdv + C * LD;       // [C][LD]
  float* sgam = sdO + C * LD;      // [KP]

  for (int d = rg; d < KP; d += RG) {
    sdS[d * LD + lane] = col_in && d < K && a.d_final.present()
                             ? a.d_final.load(a.d_final.offset(n, hv, d, col, K, V, a.vk))
                             : 0.f;
  }
  for (int64_t ci = nch - 1; ci >= 0; --ci) {
    const int64_t slot = base + ci, tile = a.tile(slot, hv), row0 = t0 + ci * C;
    const int nrows = static_cast<int>(min(static_cast<int64_t>(C), len - ci * C));
    __syncthreads();  // the previous chunk's update of dS, and its readers of sdO and sgam, are done
    if (col_in) {
      for (int d = rg; d < K; d += RG) a.ws_dh[(tile * K + d) * V + col] = sdS[d * LD + lane];
    }
    for (int i = rg; i < C; i += RG) {
      sdO[i * LD + lane] = i < nrows && col_in ? a.d_out.load(a.d_out.offset(b, row0 + i, hv) + col) : 0.f;
    }
    for (int d = tid; d < KP; d += kBwdThreads) sgam[d] = a.ws_gam[tile * KP + d];
    __syncthreads();
    // dv_new = kg dS + Aqk^T dO (Aqk of bf16 operands as hi + lo).
    const int64_t t_k = tile * C * KP, t_a = tile * C * C;
    for (int i = rg; i < C; i += RG) {
      float acc = 0.f;
      if (i < nrows) {
        for (int d = 0; d < K; ++d) acc += tile_at<Elem>(a.ws_kg, t_k + i * KP + d) * sdS[d * LD + lane];
        for (int j = i; j < nrows; ++j) {
          float aji = tile_at<Elem>(a.ws_a, t_a + j * C + i);
          if (a.ws_alo != nullptr) aji += tile_at<Elem>(a.ws_alo, t_a + j * C + i);
          acc += aji * sdO[j * LD + lane];
        }
      }
      sdv[i * LD + lane] = acc;
      if (col_in) a.ws_dvnew[(tile * C + i) * V + col] = acc;
    }
    __syncthreads();
    // dS <- gamma dS + qg^T dO - w^T dv_new: each thread its own keys of its column.
    for (int d = rg; d < K; d += RG) {
      float acc = sgam[d] * sdS[d * LD + lane];
      for (int i = 0; i < nrows; ++i) {
        acc += tile_at<Elem>(a.ws_qg, t_k + i * KP + d) * sdO[i * LD + lane] -
               tile_at<Elem>(a.ws_w, t_k + i * KP + d) * sdv[i * LD + lane];
      }
      sdS[d * LD + lane] = acc;
    }
  }
  if (a.d_initial.present() && col_in) {
    for (int d = rg; d < K; d += RG) a.d_initial.store(a.d_initial.offset(n, hv, d, col, K, V, a.vk), sdS[d * LD + lane]);
  }
}

}  // namespace kdakit::cuda
