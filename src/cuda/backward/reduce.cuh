// The backward's reductions (stage 5 of src/cpu/backward_chunked.cpp), each in a fixed order: per token row, dq and
// dk summed over each GVA group's v-heads in order and then through the L2 norm's backward, and beta's gradient from
// its parts through the beta activation (the padded token tail of a varlen batch gets zeros everywhere), a warp per q/k
// head; per v-head, ddt_bias summed over the chunks in order and dA_log over the (chunk, slice) parts in a fixed
// order (strided shares, then the block sum).
#pragma once

#include "cuda/backward/common.cuh"

namespace kdakit::cuda {

template <typename InT>
__global__ void __launch_bounds__(kBwdThreads) backward_tokens_kernel(const BackwardArgs a) {
  const int64_t row = blockIdx.x, b = row / a.T, t = row % a.T;
  const int K = a.K, V = a.V, tid = threadIdx.x;
  const bool tail = a.cu_seqlens.present() && t >= a.cu_seqlens.load_int(int64_t(a.N) * a.cu_stride);
  if (tail) {  // tokens past cu_seqlens[N] (spec §1.8)
    for (int h = 0; h < a.H; ++h) {
      for (int d = tid; d < K; d += kBwdThreads) {
        a.dq.store(a.dq.offset(b, t, h) + d, 0.f);
        a.dk.store(a.dk.offset(b, t, h) + d, 0.f);
      }
    }
    for (int hv = 0; hv < a.HV; ++hv) {
      for (int d = tid; d < K; d += kBwdThreads) a.dg.store(a.dg.offset(b, t, hv) + d, 0.f);
      for (int c = tid; c < V; c += kBwdThreads) a.dv.store(a.dv.offset(b, t, hv) + c, 0.f);
      if (tid == 0) a.dbeta.store(a.dbeta.offset(b, t, hv), 0.f);
    }
    return;
  }
  // A warp per q/k head: its K <= 256 keys as 8 per lane, the norms' sums by warp butterflies (a fixed order).
  constexpr int PER = 256 / 32;
  const int lane = tid & 31;
  for (int h = tid >> 5; h < a.H; h += kBwdRowGroups) {
    float gq[PER], gk[PER], yq[PER], yk[PER];
    const int64_t qo = a.q.offset(b, t, h), ko = a.k.offset(b, t, h);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int d = lane + 32 * j;
      gq[j] = gk[j] = yq[j] = yk[j] = 0.f;
      if (d < K) {
        for (int hv = h * a.group; hv < (h + 1) * a.group; ++hv) {
          gq[j] += a.ws_dq[(row * a.HV + hv) * K + d];
          gk[j] += a.ws_dk[(row * a.HV + hv) * K + d];
        }
        if (a.l2norm) {
          yq[j] = token_at<InT>(a.q, qo, d);
          yk[j] = token_at<InT>(a.k, ko, d);
        }
      }
    }
    if (a.l2norm) {
      float sq = 0.f, sk = 0.f;
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        sq += yq[j] * yq[j];
        sk += yk[j] * yk[j];
      }
      const float eps = static_cast<float>(math::kL2NormEps);
      const float rq = 1.f / sqrtf(warp_sum(sq) + eps), rk = 1.f / sqrtf(warp_sum(sk) + eps);
      float dot_q = 0.f, dot_k = 0.f;
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        yq[j] *= rq;
        yk[j] *= rk;
        dot_q += gq[j] * yq[j];
        dot_k += gk[j] * yk[j];
      }
      dot_q = warp_sum(dot_q);
      dot_k = warp_sum(dot_k);
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        gq[j] = (gq[j] - dot_q * yq[j]) * rq;
        gk[j] = (gk[j] - dot_k * yk[j]) * rk;
      }
    }
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int d = lane + 32 * j;
      if (d < K) {
        a.dq.store(a.dq.offset(b, t, h) + d, gq[j]);
        a.dk.store(a.dk.offset(b, t, h) + d, gk[j]);
      }
    }
  }
  for (int hv = tid; hv < a.HV; hv += kBwdThreads) {
    const float* part = a.ws_dbeta + (row * a.HV + hv) * (1 + a.nks);
    float db = part[0];
    for (int ks = 0; ks < a.nks; ++ks) db += part[1 + ks];
    const float raw = a.beta.load(a.beta.offset(b, t, hv));
    a.dbeta.store(a.dbeta.offset(b, t, hv), db * math::beta_grad(raw, a.beta_sigmoid, a.neg_eigval));
  }
}

// One CTA per v-head. (A template only so that every instantiation file may define it.)
template <typename InT>
__global__ void __launch_bounds__(kBwdThreads) backward_params_kernel(const BackwardArgs a) {
  const int hv = blockIdx.x, tid = threadIdx.x, K = a.K;
  const int64_t slots = a.N > 0 ? a.chunk_offsets[a.N] : 0;
  if (a.ddt_bias.present()) {
    for (int d = tid; d < K; d += kBwdThreads) {
      float acc = 0.f;
      for (int64_t s = 0; s < slots; ++s) acc += a.ws_ddt[a.tile(s, hv) * K + d];
      a.ddt_bias.store(int64_t(hv) * K + d, acc);
    }
  }
  if (a.dA_log.present()) {  // every thread its strided share of the (chunk, slice) parts, then the block sum
    __shared__ float red[kBwdRowGroups];
    float acc = 0.f;
    const int64_t parts = slots * a.nks;
    for (int64_t e = tid; e < parts; e += kBwdThreads) acc += a.ws_dA[a.tile(e / a.nks, hv) * a.nks + e % a.nks];
    acc = block_sum(acc, red);
    if (tid == 0) a.dA_log.store(hv, acc);
  }
}

}  // namespace kdakit::cuda
