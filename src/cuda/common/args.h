// The kernel arguments every op shares, and the tensor descriptors the ops' argument structs are built from. Each
// op's struct (forward/args.h, decode/args.h) derives from KdaArgs; the host fills the shared part with
// fill_kda_args, once, from the same KdaInputs every op takes.
#pragma once

#include <cstdint>

#include "common/plan.h"
#include "cuda/common/math.cuh"
#include "kdakit/params.h"

namespace kdakit::cuda {

// A pointer whose element type is known only at run time (small or rarely touched tensors).
struct DynPtr {
  void* p = nullptr;
  DType dtype = DType::kFloat32;

  __host__ __device__ __forceinline__ bool present() const { return p != nullptr; }
  __device__ __forceinline__ float load(int64_t i) const {
    switch (dtype) {
      case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
      case DType::kFloat16: return __half2float(static_cast<const __half*>(p)[i]);
      case DType::kFloat64: return static_cast<float>(static_cast<const double*>(p)[i]);
      default: return static_cast<const float*>(p)[i];
    }
  }
  __device__ __forceinline__ void store(int64_t i, float v) const {
    switch (dtype) {
      case DType::kBFloat16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
      case DType::kFloat16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
      case DType::kFloat64: static_cast<double*>(p)[i] = v; break;
      default: static_cast<float*>(p)[i] = v;
    }
  }
  __device__ __forceinline__ int64_t load_int(int64_t i) const {
    switch (dtype) {
      case DType::kInt64: return static_cast<const int64_t*>(p)[i];
      case DType::kInt32: return static_cast<const int32_t*>(p)[i];
      default: return static_cast<const uint8_t*>(p)[i];
    }
  }
};

// Calls f(T* p) with T the storage type of d's dtype: one branch per call site instead of one per element.
template <typename F>
__device__ __forceinline__ void with_typed(const DynPtr& d, F&& f) {
  switch (d.dtype) {
    case DType::kBFloat16: f(static_cast<__nv_bfloat16*>(d.p)); break;
    case DType::kFloat16: f(static_cast<__half*>(d.p)); break;
    case DType::kFloat64: f(static_cast<double*>(d.p)); break;
    default: f(static_cast<float*>(d.p));
  }
}

// A token tensor [B,T,heads,dim] (or beta [B,T,HV]) with a contiguous last dimension.
struct TokenRows : DynPtr {
  int64_t sb = 0, st = 0, sh = 0;
  bool vec = false;  // decode: 16-byte vectors at 16-byte multiples of a row may be read (aligned base and strides)
  __host__ __device__ __forceinline__ int64_t offset(int64_t b, int64_t t, int64_t h) const {
    return b * sb + t * st + h * sh;
  }
};

// A state tensor [P,HV,K,V] (or v-first [P,HV,V,K]) with dense per-head blocks.
struct StateRef : DynPtr {
  int64_t slot_stride = 0, head_stride = 0;
  int64_t slots = 0;  // P; decode treats slot ids outside [0, P) like -1
  bool vec = false;   // decode: its 16-byte vector accesses are aligned for this tensor
  __host__ __device__ __forceinline__ int64_t block(int64_t slot, int64_t hv) const {
    return slot * slot_stride + hv * head_stride;
  }
  __device__ __forceinline__ int64_t offset(int64_t slot, int64_t hv, int d, int v, int K, int V, bool vk) const {
    return block(slot, hv) + (vk ? int64_t(v) * K + d : int64_t(d) * V + v);
  }
};

// What every op's kernel reads beside its own tensors: shapes, the gate and the activations, the sequences.
struct KdaArgs {
  int B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0, group = 1, N = 0;
  DynPtr A_log, dt_bias;
  GateMode gate_mode = GateMode::kPreGated;
  float lower_bound = -5.f;
  float scale = 1.f;
  bool l2norm = false, beta_sigmoid = false, neg_eigval = false;
  DynPtr cu_seqlens;  // absent: fixed length
  int64_t cu_stride = 1;
};

inline DynPtr dyn_ptr(const TensorView& t) {
  DynPtr d;
  if (t.present()) {
    d.p = t.data;
    d.dtype = t.dtype;
  }
  return d;
}

inline TokenRows token_rows(const TensorView& t) {
  TokenRows r;
  static_cast<DynPtr&>(r) = dyn_ptr(t);
  r.sb = t.strides[0];
  r.st = t.strides[1];
  if (t.ndim > 2) r.sh = t.strides[2];
  return r;
}

inline StateRef state_ref(const TensorView& t) {
  StateRef s;
  if (!t.present()) return s;
  static_cast<DynPtr&>(s) = dyn_ptr(t);
  s.slot_stride = t.strides[0];
  s.head_stride = t.strides[1];
  s.slots = t.shape[0];
  return s;
}

inline void fill_kda_args(KdaArgs& a, const KdaInputs& in, const Problem& pr) {
  a.B = static_cast<int>(pr.B);
  a.T = static_cast<int>(pr.T);
  a.H = static_cast<int>(pr.H);
  a.HV = static_cast<int>(pr.HV);
  a.K = static_cast<int>(pr.K);
  a.V = static_cast<int>(pr.V);
  a.group = static_cast<int>(pr.group);
  a.N = static_cast<int>(pr.N);
  a.A_log = dyn_ptr(in.gate.A_log);
  a.dt_bias = dyn_ptr(in.gate.dt_bias);
  a.gate_mode = in.gate.mode;
  a.lower_bound = in.gate.lower_bound;
  a.scale = in.scale;
  a.l2norm = in.qk_l2norm;
  a.beta_sigmoid = in.beta_sigmoid;
  a.neg_eigval = in.allow_neg_eigval;
  a.cu_seqlens = dyn_ptr(in.cu_seqlens);
  if (in.cu_seqlens.present()) a.cu_stride = in.cu_seqlens.strides[0];
}

}  // namespace kdakit::cuda
