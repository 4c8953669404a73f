// The backward's reductions (stage 5 of src/cpu/backward_chunked.cpp), each in a fixed order: per token row, dq and
// dk summed over each GVA group's v-heads in order and then through the L2 norm's backward, and beta's gradient from
// its parts through the beta activation (the padded token tail of a varlen batch gets zeros everywhere), a warp per q/k
// head; per v-head, ddt_bias summed over the chunks in order and dA_log over the (chunk, slice) parts in a fixed
// order (strided shares, then the block sum).
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/backward/common.cuh"

namespace kdakit::cuda {

// Four consecutive elements of a token row at p, widened: one vector load where p is aligned to their size, else four.
template <typename T>
__device__ __forceinline__ void load_four(const T* p, float (&x)[4]) {
  if ((reinterpret_cast<uintptr_t>(p) & (4 * sizeof(T) - 1)) == 0) {
    if constexpr (std::is_same<T, float>::value) {
      const float4 w = *reinterpret_cast<const float4*>(p);
      x[0] = w.x, x[1] = w.y, x[2] = w.z, x[3] = w.w;
    } else {
      const uint2 w = *reinterpret_cast<const uint2*>(p);
      const T* e = reinterpret_cast<const T*>(&w);
#pragma unroll
      for (int i = 0; i < 4; ++i) x[i] = to_float(e[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = to_float(p[i]);
  }
}

// Four consecutive elements of a token row at p, narrowed to T: one vector store where p is aligned to their size,
// else four.
template <typename T>
__device__ __forceinline__ void store_four(T* p, const float (&x)[4]) {
  if ((reinterpret_cast<uintptr_t>(p) & (4 * sizeof(T) - 1)) == 0) {
    if constexpr (std::is_same<T, float>::value) {
      *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
      return;
    } else if constexpr (sizeof(T) == 2) {
      T e[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) e[i] = from_float<T>(x[i]);
      *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(e);
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = from_float<T>(x[i]);
}

// NJ: 128-key groups of a lane's keys (K <= 128 * NJ); lane l holds keys 128 j + 4 l + i, i < 4.
template <typename InT, int NJ>
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
  // A warp per q/k head, four consecutive keys per lane: the fp32 parts by 16-byte loads, every load of the head in
  // flight before its first sum (the kernel streams the parts). The norms' sums by warp butterflies (a fixed order).
  constexpr int E = 4 * NJ;  // keys per lane
  const int lane = tid & 31;
  const bool ws_vec = (K & 3) == 0;  // the workspace rows (K floats each) are 16-byte aligned
  struct Head {
    float gq[E], gk[E], yq[E], yk[E];
  };
  // The token rows first, then the parts summed over the group's v-heads: no row load waits behind the loop's adds.
  auto load = [&](int h, Head& x) {
    const int64_t qo = a.q.offset(b, t, h), ko = a.k.offset(b, t, h);
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int d0 = 128 * j + 4 * lane;
      float yq[4] = {0.f, 0.f, 0.f, 0.f}, yk[4] = {0.f, 0.f, 0.f, 0.f};
      if (a.l2norm && d0 < K) {
        const InT* q = static_cast<const InT*>(a.q.p) + qo + d0;
        const InT* k = static_cast<const InT*>(a.k.p) + ko + d0;
        if (d0 + 4 <= K) {
          load_four(q, yq);
          load_four(k, yk);
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            yq[i] = d0 + i < K ? to_float(q[i]) : 0.f;
            yk[i] = d0 + i < K ? to_float(k[i]) : 0.f;
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) x.yq[4 * j + i] = yq[i], x.yk[4 * j + i] = yk[i];
    }
#pragma unroll
    for (int e = 0; e < E; ++e) x.gq[e] = x.gk[e] = 0.f;
    for (int hv = h * a.group; hv < (h + 1) * a.group; ++hv) {
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int d0 = 128 * j + 4 * lane;
        if (d0 >= K) continue;
        const float* pq = a.ws_dq + (row * a.HV + hv) * K + d0;
        const float* pk = a.ws_dk + (row * a.HV + hv) * K + d0;
        float wq[4], wk[4];
        if (ws_vec) {
          load_four(pq, wq);
          load_four(pk, wk);
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            wq[i] = d0 + i < K ? pq[i] : 0.f;
            wk[i] = d0 + i < K ? pk[i] : 0.f;
          }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) x.gq[4 * j + i] += wq[i], x.gk[4 * j + i] += wk[i];
      }
    }
  };
  auto finish = [&](int h, Head& x) {
    if (a.l2norm) {
      float sq = 0.f, sk = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        sq += x.yq[e] * x.yq[e];
        sk += x.yk[e] * x.yk[e];
      }
      const float eps = static_cast<float>(math::kL2NormEps);
      const float rq = 1.f / sqrtf(warp_sum(sq) + eps), rk = 1.f / sqrtf(warp_sum(sk) + eps);
      float dot_q = 0.f, dot_k = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        x.yq[e] *= rq;
        x.yk[e] *= rk;
        dot_q += x.gq[e] * x.yq[e];
        dot_k += x.gk[e] * x.yk[e];
      }
      dot_q = warp_sum(dot_q);
      dot_k = warp_sum(dot_k);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        x.gq[e] = (x.gq[e] - dot_q * x.yq[e]) * rq;
        x.gk[e] = (x.gk[e] - dot_k * x.yk[e]) * rk;
      }
    }
    // Four keys a store where they are all inside K (one vector where aligned), one dtype branch a head.
    const int64_t qo = a.dq.offset(b, t, h), ko = a.dk.offset(b, t, h);
    auto put = [&](const DynPtr& out, int64_t o, const float* g) {
      with_typed(out, [&](auto* p) {
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const int d0 = 128 * j + 4 * lane;
          const float w[4] = {g[4 * j], g[4 * j + 1], g[4 * j + 2], g[4 * j + 3]};
          if (d0 + 4 <= K) {
            store_four(p + o + d0, w);
          } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              if (d0 + i < K) p[o + d0 + i] = from_float<std::remove_pointer_t<decltype(p)>>(w[i]);
            }
          }
        }
      });
    };
    put(a.dq, qo, x.gq);
    put(a.dk, ko, x.gk);
  };
  // The next head's loads are issued before this head's sums and stores, so that they are in flight meanwhile.
  int h = tid >> 5;
  if (h < a.H) {
    Head x;
    load(h, x);
    for (; h < a.H; h += kBwdRowGroups) {
      Head y;
      const bool more = h + kBwdRowGroups < a.H;
      if (more) load(h + kBwdRowGroups, y);
      finish(h, x);
      if (more) x = y;
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
