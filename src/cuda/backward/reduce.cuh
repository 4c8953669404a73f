// The backward's reductions (stage 5 of src/cpu/backward_chunked.cpp), each in a fixed order: per token row, dq and
// dk summed over each GVA group's v-heads in order and then through the L2 norm's backward, and beta's gradient from
// its parts through the beta activation (the padded token tail of a varlen batch gets zeros everywhere); per v-head,
// dA_log and ddt_bias summed over the chunks in order.
#pragma once

#include "cuda/backward/common.cuh"

namespace kdakit::cuda {

template <typename InT>
__global__ void __launch_bounds__(kBwdThreads) backward_tokens_kernel(const BackwardArgs a) {
  extern __shared__ __align__(16) float smem[];
  float* red = smem;  // [kBwdRowGroups] block_sum scratch
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
  const int d = tid;  // K <= 256 = kBwdThreads
  const bool in = d < K;
  for (int h = 0; h < a.H; ++h) {
    float gq = 0.f, gk = 0.f;
    if (in) {
      for (int hv = h * a.group; hv < (h + 1) * a.group; ++hv) {
        gq += a.ws_dq[(row * a.HV + hv) * K + d];
        gk += a.ws_dk[(row * a.HV + hv) * K + d];
      }
    }
    if (a.l2norm) {
      const float q = in ? token_at<InT>(a.q, a.q.offset(b, t, h), d) : 0.f;
      const float k = in ? token_at<InT>(a.k, a.k.offset(b, t, h), d) : 0.f;
      const float eps = static_cast<float>(math::kL2NormEps);
      const float rq = 1.f / sqrtf(block_sum(q * q, red) + eps), rk = 1.f / sqrtf(block_sum(k * k, red) + eps);
      const float yq = q * rq, yk = k * rk;
      const float dot_q = block_sum(gq * yq, red), dot_k = block_sum(gk * yk, red);
      gq = (gq - dot_q * yq) * rq;
      gk = (gk - dot_k * yk) * rk;
    }
    if (in) {
      a.dq.store(a.dq.offset(b, t, h) + d, gq);
      a.dk.store(a.dk.offset(b, t, h) + d, gk);
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
  if (a.dA_log.present() && tid == 0) {
    float acc = 0.f;
    for (int64_t s = 0; s < slots; ++s) {
      for (int ks = 0; ks < a.nks; ++ks) acc += a.ws_dA[a.tile(s, hv) * a.nks + ks];
    }
    a.dA_log.store(hv, acc);
  }
}

}  // namespace kdakit::cuda
