// Host side of the CUDA backend: CUDA-specific argument checks, workspace planning, kernel configuration.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "cuda/backend.h"
#include "cuda/decode/args.h"
#include "cuda/forward/args.h"
#include "kdakit/error.h"

namespace kdakit::cuda {

template <typename InT>
void launch_forward(const ForwardArgs& a, const ForwardConfig& cfg, cudaStream_t stream);
extern template void launch_forward<__nv_bfloat16>(const ForwardArgs&, const ForwardConfig&, cudaStream_t);
extern template void launch_forward<__half>(const ForwardArgs&, const ForwardConfig&, cudaStream_t);
extern template void launch_forward<float>(const ForwardArgs&, const ForwardConfig&, cudaStream_t);
template <typename InT>
ForwardSmem forward_smem(const ForwardConfig& cfg);
extern template ForwardSmem forward_smem<__nv_bfloat16>(const ForwardConfig&);
extern template ForwardSmem forward_smem<__half>(const ForwardConfig&);
extern template ForwardSmem forward_smem<float>(const ForwardConfig&);

template <typename PoolT>
void launch_decode(const DecodeArgs& a, const DecodeConfig& cfg, cudaStream_t stream);
extern template void launch_decode<float>(const DecodeArgs&, const DecodeConfig&, cudaStream_t);
extern template void launch_decode<__nv_bfloat16>(const DecodeArgs&, const DecodeConfig&, cudaStream_t);

namespace {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev_) == cudaSuccess && prev_ != device) {
      if (cudaSetDevice(device) != cudaSuccess) throw CudaError("kdakit: cannot select CUDA device " + std::to_string(device));
    } else {
      prev_ = -1;
    }
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }

 private:
  int prev_ = -1;
};

int sm_count(int device) {
  static int cache[64] = {};
  if (device < 0 || device >= 64) return 132;
  if (cache[device] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) n = 132;
    cache[device] = n;
  }
  return cache[device];
}

// Compute capability as 10 * major + minor (90: Hopper, the one with warpgroup MMAs); 0 if unknown.
int compute_capability(int device) {
  static int cache[64] = {};
  if (device < 0 || device >= 64) return 0;
  if (cache[device] == 0) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    cache[device] = 10 * major + minor;
  }
  return cache[device];
}

// Opt-in shared memory per block (H100/H200: 227 KB, A100: 163 KB, sm_86/89: 99 KB). KDAKIT_SMEM_LIMIT lowers it
// (tests on a large GPU emulate smaller ones); it never raises it.
size_t smem_limit(int device) {
  static int cache[64] = {};
  int n = 0;
  if (device >= 0 && device < 64 && cache[device] > 0) {
    n = cache[device];
  } else {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess || n <= 0) {
      cudaGetLastError();
      n = 48 * 1024;
    }
    if (device >= 0 && device < 64) cache[device] = n;
  }
  const char* env = std::getenv("KDAKIT_SMEM_LIMIT");
  const long cap = env != nullptr ? std::atol(env) : 0;
  return cap > 0 && cap < n ? static_cast<size_t>(cap) : static_cast<size_t>(n);
}

ForwardSmem forward_smem_of(DType in, const ForwardConfig& cfg) {
  switch (in) {
    case DType::kBFloat16: return forward_smem<__nv_bfloat16>(cfg);
    case DType::kFloat16: return forward_smem<__half>(cfg);
    default: return forward_smem<float>(cfg);
  }
}

DynPtr dyn(const TensorView& t) {
  DynPtr d;
  if (t.present()) {
    d.p = t.data;
    d.dtype = t.dtype;
  }
  return d;
}

TokenTensor token_tensor(const TensorView& t) {
  TokenTensor r;
  r.p = t.data;
  r.sb = t.strides[0];
  r.st = t.strides[1];
  r.sh = t.strides[2];
  return r;
}

StateRef state_ref(const TensorView& t) {
  StateRef s;
  s.ptr = dyn(t);
  if (t.present()) {
    s.slot_stride = t.strides[0];
    s.head_stride = t.strides[1];
  }
  return s;
}

void require_cuda_dtypes(const KdaInputs& in) {
  const DType dt = in.q.dtype;
  if (dt != DType::kBFloat16 && dt != DType::kFloat16 && dt != DType::kFloat32) {
    throw InvalidArgument("q", std::string("the CUDA kernels take bfloat16, float16 or float32 inputs, got ") + dtype_name(dt));
  }
  const std::pair<const TensorView*, const char*> same[] = {{&in.v, "v"}, {&in.g, "g"}};
  for (const auto& [t, name] : same) {
    if (t->dtype != dt) {
      throw InvalidArgument(name, std::string("the CUDA kernels need q, k, v and g of one dtype (") + dtype_name(dt) +
                                      "), got " + dtype_name(t->dtype));
    }
  }
  for (const auto& [t, name] : {std::make_pair(&in.beta, "beta"), std::make_pair(&in.gate.A_log, "A_log"),
                                std::make_pair(&in.gate.dt_bias, "dt_bias")}) {
    if (t->present() && t->dtype == DType::kFloat64) {
      throw InvalidArgument(name, "float64 runs on the CPU only; pass float32, float16 or bfloat16");
    }
  }
}

struct ForwardPlan {
  ForwardConfig cfg;
  int VP = 64;
  size_t esz = 2;
  int64_t slots = 0;
  size_t off_offsets = 0, off_w = 0, off_qg = 0, off_kg = 0, off_u = 0, off_a = 0, off_alo = 0, off_gam = 0, total = 0;
  // Context parallelism (ForwardArgs::seg_target): off when seg_target == 1.
  int seg_target = 1, seg_min_chunks = 0, seg_ld = 0;
  int64_t segments = 0;  // segment slots (the sequences without cuts)
  size_t off_seg_offsets = 0, off_seg = 0;
  bool ordered = false;  // the recurrence runs the sequences longest first (ForwardArgs::seq_order)
  size_t off_order = 0;
};

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

ForwardPlan plan_forward_cuda(const ForwardParams& p, const detail::Plan& plan) {
  const Problem& pr = plan.pr;
  ForwardPlan fp;
  fp.cfg.chunk = p.chunk_size;
  fp.cfg.KP = pr.K <= 64 ? 64 : (pr.K <= 128 ? 128 : 256);
  fp.VP = static_cast<int>((pr.V + 63) / 64 * 64);
  fp.esz = p.in.q.dtype == DType::kBFloat16 ? 2 : 4;
  const int64_t C = p.chunk_size;
  if (pr.varlen) {
    fp.slots = plan.cu_known ? pr.num_chunks : (pr.T + C - 1) / C + pr.N;
  } else {
    fp.slots = pr.B * ((pr.T + C - 1) / C);
  }
  // Warpgroup MMAs for the recurrence on Hopper (sm_90): bf16 operands, chunk 64, K <= 128, 64- or 128-column tiles.
  // They give the same bits as the mma.sync kernels (tested). KDAKIT_FORWARD_WGMMA=0 turns them off (A/B timing).
  const bool wgmma = compute_capability(pr.device_index) == 90 && fp.esz == 2 && fp.cfg.KP <= 128 && C == 64 &&
                     env_int("KDAKIT_FORWARD_WGMMA", 1) != 0;
  // The recurrence's V tile: the widest that still gives every SM work.
  const int sms = sm_count(pr.device_index);
  auto ctas = [&](int bv) { return pr.N * pr.HV * ((pr.V + bv - 1) / bv); };
  const int wide = fp.cfg.KP <= 128 ? 64 : 32;
  int bv = wide;
  while (bv > 16 && ctas(bv) < (3 * sms) / 4) bv /= 2;
  // More than one wave of 64-column CTAs (one CTA per SM: their shared memory) over sequences of one length:
  // 128-column tiles, whose kernel (recurrence_vrows_kernel: eight warps of independent value rows) runs a chunk step
  // of twice the columns in ~1.7x the time of a 64-column step, so half the waves win (B1 T8192 H96: 192 CTAs on
  // 132 SMs -> 96; B8 T4096 H32: 512 -> 256). With one wave of 64-column CTAs the narrower tiles' shorter step wins.
  // Sequences of different lengths: where the host knows them, the estimate below decides; where it does not, 64
  // columns (the longest chain, 1.7x longer with wide tiles, may set the time). Either kernel gives the same bits.
  // (Needs bf16 operands, K <= 128 and V in (64, 128]: the u workspace rows are VP = 128 columns wide.)
  const bool wide128 = fp.cfg.KP <= 128 && fp.esz == 2 && pr.V > 64 && pr.V <= 128;
  const bool equal_lengths = !pr.varlen || (plan.cu_known && plan.max_len * pr.N == pr.T);
  bool wide_wins = equal_lengths && ctas(64) > sms;
  if (!equal_lengths && plan.cu_known && pr.N <= kMaxOrdered) {
    // Known lengths that differ, run longest first (below): each width's time is about the longer of the longest
    // sequence's chain and the whole work spread over the SMs, in 64-column chunk steps (a 128-column step costs
    // ~1.75 of them, ~1.2 with warpgroup MMAs; varlen [1300,547,2048,963,271,3063] H64: 127 against 111).
    const double longest = static_cast<double>((plan.max_len + C - 1) / C), chunks = static_cast<double>(pr.num_chunks);
    const double t64 = std::max(longest, chunks * pr.HV * ((pr.V + 63) / 64) / sms);
    const double t128 = (wgmma ? 1.2 : 1.75) * std::max(longest, chunks * pr.HV * ((pr.V + 127) / 128) / sms);
    wide_wins = t128 < t64;
  }
  if (bv == 64 && wide128 && wide_wins) bv = 128;
  // Context parallelism for few heads: a sequence of at least 2 * 8192 tokens is cut into up to seg_target segments
  // of at least 8192 tokens, seg_target = the wide-tile CTAs that one sequence leaves the SMs short of. Both depend on
  // the head count and the device only, never on the batch (batch invariance). Developer overrides for tests and
  // tuning: KDAKIT_FORWARD_SEGMENTS (target, 1 = off), KDAKIT_FORWARD_SEGMENT_TOKENS (the 8192).
  {
    const int64_t per_seq = pr.HV * ((pr.V + wide - 1) / wide);
    int target = static_cast<int>(std::min<int64_t>(32, sms / std::max<int64_t>(1, per_seq)));
    target = env_int("KDAKIT_FORWARD_SEGMENTS", target);
    const int min_tokens = std::max(1, env_int("KDAKIT_FORWARD_SEGMENT_TOKENS", 8192));
    const int min_chunks = std::max<int>(1, (min_tokens + p.chunk_size - 1) / p.chunk_size);
    // Is any sequence long enough? (Fixed length, or known boundaries: exactly; otherwise: possibly.)
    const int64_t longest = !pr.varlen ? pr.T : (plan.cu_known ? plan.max_len : pr.T);
    const int64_t longest_chunks = (longest + p.chunk_size - 1) / p.chunk_size;
    if (target >= 2 && longest_chunks >= 2 * int64_t(min_chunks)) {
      fp.seg_target = target;
      fp.seg_min_chunks = min_chunks;
      // The segments supply the parallelism; wide tiles do the most work per chunk step (warpgroup MMAs: 128
      // columns, B1 T65536 H8 recurrence 1.009 -> 0.915 ms).
      bv = wgmma && wide128 ? 128 : wide;
    }
  }
  // Developer override for tuning (KDAKIT_FORWARD_BV=16|32|64|128); the result does not depend on it.
  if (const char* env = std::getenv("KDAKIT_FORWARD_BV")) {
    const int want = std::atoi(env);
    if (want == 16 || want == 32 || (want == 64 && fp.cfg.KP <= 128) || (want == 128 && wide128)) {
      bv = want;
    }
  }
  // Fit the device's shared memory: the chosen width first with its prefetch stage, then without, then narrower
  // tiles (A100: bf16 K = 128 runs 64-column tiles with one stage). The tile never changes a result.
  {
    const size_t limit = smem_limit(pr.device_index);
    const DType in = p.in.q.dtype;
    ForwardConfig c = fp.cfg;
    bool fit = false;
    for (int w = bv; w >= 16 && !fit; w /= 2) {
      for (const bool one : {false, true}) {
        c.BV = w;
        c.one_stage = one;
        c.wgmma = wgmma && (w == 64 || w == 128);
        if (forward_smem_of(in, c).recurrence <= limit) {
          fit = true;
          break;
        }
      }
    }
    const ForwardSmem need = forward_smem_of(in, c);
    if (!fit || need.prepare > limit) {
      const bool rec = !fit;
      throw CudaError("kdakit: the chunked forward's " + std::string(rec ? "recurrence" : "prepare") +
                      " kernel needs " + std::to_string(rec ? need.recurrence : need.prepare) +
                      " bytes of shared memory per block for " + dtype_name(in) + " inputs with K = " +
                      std::to_string(pr.K) + " (chunk_size " + std::to_string(p.chunk_size) + "); device " +
                      std::to_string(pr.device_index) + " allows " + std::to_string(limit) +
                      (in == DType::kBFloat16 ? "" : "; bfloat16 inputs need about half") +
                      (!rec && p.chunk_size == 64 ? "; chunk_size=32 halves the prepare kernel's tiles" : ""));
    }
    bv = c.BV;
    fp.cfg.one_stage = c.one_stage;
    fp.cfg.wgmma = c.wgmma;
  }
  fp.cfg.BV = bv;
  fp.ordered = pr.varlen && fp.seg_target == 1 && pr.N > 1 && pr.N <= kMaxOrdered;
  auto align = [](size_t x) { return (x + 255) & ~size_t(255); };
  const size_t tiles = static_cast<size_t>(fp.slots) * pr.HV;
  size_t off = 0;
  fp.off_offsets = off; off = align(off + 8 * (pr.N + 1));
  fp.off_w = off;  off = align(off + tiles * C * fp.cfg.KP * fp.esz);
  fp.off_qg = off; off = align(off + tiles * C * fp.cfg.KP * fp.esz);
  fp.off_kg = off; off = align(off + tiles * C * fp.cfg.KP * fp.esz);
  fp.off_u = off;  off = align(off + tiles * C * fp.VP * fp.esz);
  fp.off_a = off;  off = align(off + tiles * C * C * fp.esz);
  if (fp.esz == 2) { fp.off_alo = off; off = align(off + tiles * C * C * fp.esz); }  // Aqk's lo half
  fp.off_gam = off; off = align(off + tiles * fp.cfg.KP * 4);
  fp.segments = pr.N;
  if (fp.seg_target > 1) {
    // Segment slots: exact for fixed length; otherwise a bound (a cut sequence of c chunks has at most
    // c / seg_min_chunks + 1 segments).
    int64_t per = 0;
    if (!pr.varlen) {
      ForwardArgs probe;
      probe.seg_target = fp.seg_target;
      probe.seg_min_chunks = fp.seg_min_chunks;
      fp.segments = pr.N * probe.segments_of((pr.T + C - 1) / C, per);
    } else {
      fp.segments = pr.N + fp.slots / fp.seg_min_chunks;
    }
    fp.seg_ld = static_cast<int>((pr.V + bv - 1) / bv * bv + fp.cfg.KP);
    fp.off_seg_offsets = off; off = align(off + 8 * (pr.N + 1));
    fp.off_seg = off; off = align(off + static_cast<size_t>(fp.segments) * pr.HV * fp.cfg.KP * fp.seg_ld * 4);
  }
  if (fp.ordered) {
    fp.off_order = off;
    off = align(off + 4 * static_cast<size_t>(pr.N));
  }
  fp.total = off;
  return fp;
}

}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

namespace {

// The fields ForwardArgs and DecodeArgs share (same names): shapes, gate, scale and activation flags.
template <typename Args>
void fill_shared_args(Args& a, const KdaInputs& in, const Problem& pr) {
  a.A_log = dyn(in.gate.A_log);
  a.dt_bias = dyn(in.gate.dt_bias);
  a.gate_mode = static_cast<int>(in.gate.mode);
  a.lower_bound = in.gate.lower_bound;
  a.scale = in.scale;
  a.l2norm = in.qk_l2norm;
  a.beta_sigmoid = in.beta_sigmoid;
  a.neg_eigval = in.allow_neg_eigval;
  a.B = static_cast<int>(pr.B);
  a.T = static_cast<int>(pr.T);
  a.H = static_cast<int>(pr.H);
  a.HV = static_cast<int>(pr.HV);
  a.K = static_cast<int>(pr.K);
  a.V = static_cast<int>(pr.V);
  a.group = static_cast<int>(pr.group);
  a.N = static_cast<int>(pr.N);
  a.cu_seqlens = dyn(in.cu_seqlens);
}

}  // namespace

std::size_t forward_workspace_size(const ForwardParams& p, const detail::Plan& plan) {
  require_cuda_dtypes(p.in);
  return plan_forward_cuda(p, plan).total;
}

void forward(const ForwardParams& p, const detail::Plan& plan, void* stream) {
  require_cuda_dtypes(p.in);
  const Problem& pr = plan.pr;
  const ForwardPlan fp = plan_forward_cuda(p, plan);
  if (p.workspace_bytes < fp.total || (fp.total > 0 && p.workspace == nullptr)) {
    throw InvalidArgument("workspace", "needs " + std::to_string(fp.total) + " bytes, got " +
                                           std::to_string(p.workspace_bytes));
  }
  if (pr.N == 0) return;
  DeviceGuard guard(pr.device_index);
  char* ws = static_cast<char*>(p.workspace);
  ForwardArgs a;
  a.q = token_tensor(p.in.q);
  a.k = token_tensor(p.in.k);
  a.v = token_tensor(p.in.v);
  a.g = token_tensor(p.in.g);
  a.beta = dyn(p.in.beta);
  a.beta_sb = p.in.beta.strides[0];
  a.beta_st = p.in.beta.strides[1];
  a.beta_sh = p.in.beta.strides[2];
  fill_shared_args(a, p.in, pr);
  {
    const int64_t epc = 16 / static_cast<int64_t>(dtype_size(p.in.q.dtype));
    auto aligned = [&](const TensorView& t) {
      return reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && t.strides[0] % epc == 0 && t.strides[1] % epc == 0 &&
             t.strides[2] % epc == 0;
    };
    a.vec_qk = pr.K % epc == 0 && aligned(p.in.q) && aligned(p.in.k);
    a.vec_v = pr.V % epc == 0 && aligned(p.in.v);
    a.vec_g = pr.K % epc == 0 && aligned(p.in.g);
    const size_t esz = dtype_size(p.in.q.dtype);
    auto paired = [&](const TensorView& t) {
      return reinterpret_cast<uintptr_t>(t.data) % (2 * esz) == 0 && t.strides[0] % 2 == 0 &&
             t.strides[1] % 2 == 0 && t.strides[2] % 2 == 0;
    };
    a.pair_qk = paired(p.in.q) && paired(p.in.k);
    a.pair_g = paired(p.in.g);
    a.vec_out = p.out.dtype == DType::kBFloat16 && pr.V % 8 == 0 &&
                reinterpret_cast<uintptr_t>(p.out.data) % 16 == 0 && p.out.strides[0] % 8 == 0 &&
                p.out.strides[1] % 8 == 0 && p.out.strides[2] % 8 == 0;
  }
  a.chunk = p.chunk_size;
  a.chunk_offsets = reinterpret_cast<int64_t*>(ws + fp.off_offsets);
  a.num_slots = fp.slots;
  a.ws_w = ws + fp.off_w;
  a.ws_qg = ws + fp.off_qg;
  a.ws_kg = ws + fp.off_kg;
  a.ws_u = ws + fp.off_u;
  a.ws_a = ws + fp.off_a;
  a.ws_alo = fp.esz == 2 ? ws + fp.off_alo : nullptr;
  a.ws_gam = reinterpret_cast<float*>(ws + fp.off_gam);
  a.KP = fp.cfg.KP;
  a.VP = fp.VP;
  a.num_segments = fp.segments;
  if (fp.seg_target > 1) {
    a.seg_target = fp.seg_target;
    a.seg_min_chunks = fp.seg_min_chunks;
    a.seg_offsets = reinterpret_cast<int64_t*>(ws + fp.off_seg_offsets);
    a.ws_seg = reinterpret_cast<float*>(ws + fp.off_seg);
    a.seg_ld = fp.seg_ld;
  }
  if (fp.ordered) a.seq_order = reinterpret_cast<int32_t*>(ws + fp.off_order);
  a.vk = p.state.layout == StateLayout::kVK;
  a.initial = state_ref(p.state.initial_state);
  a.final_state = state_ref(p.state.final_state);
  a.state_indices = dyn(p.state.state_indices);
  a.has_initial_state = dyn(p.state.has_initial_state);
  if (p.intermediate_states.present()) {
    a.inter = dyn(p.intermediate_states);
    a.inter_sb = p.intermediate_states.strides[0];
    a.inter_sc = p.intermediate_states.strides[1];
    a.inter_sh = p.intermediate_states.strides[2];
  }
  a.out = dyn(p.out);
  a.out_sb = p.out.strides[0];
  a.out_st = p.out.strides[1];
  a.out_sh = p.out.strides[2];
  auto s = static_cast<cudaStream_t>(stream);
  switch (p.in.q.dtype) {
    case DType::kBFloat16: launch_forward<__nv_bfloat16>(a, fp.cfg, s); break;
    case DType::kFloat16: launch_forward<__half>(a, fp.cfg, s); break;
    default: launch_forward<float>(a, fp.cfg, s); break;
  }
}

std::size_t backward_workspace_size(const BackwardParams&, const detail::Plan&) {
  throw NotBuilt("kdakit.backward: the CUDA backward is not implemented yet; run the backward on CPU tensors");
}

void backward(const BackwardParams&, const detail::Plan&, void*) {
  throw NotBuilt("kdakit.backward: the CUDA backward is not implemented yet; run the backward on CPU tensors");
}

// ---- decode / speculative verify (kernel: src/cuda/decode/kernels.cuh) ------------------------------------

namespace {

// 16-byte copies of 8-element pieces at multiples of 8 (bf16/fp16) or of 4-element pieces (fp32) need an
// aligned base and strides; size-1 dimensions never move the pointer.
bool rows_vectorizable(const TensorView& t) {
  const int64_t epc = 16 / static_cast<int64_t>(dtype_size(t.dtype));
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  for (int i = 0; i + 1 < t.ndim; ++i) {
    if (t.shape[i] > 1 && t.strides[i] % epc != 0) return false;
  }
  return true;
}

DecodeRows decode_rows(const TensorView& t) {
  DecodeRows r;
  r.p = t.data;
  r.dtype = t.dtype;
  r.sb = t.strides[0];
  r.st = t.strides[1];
  r.sh = t.strides[2];
  r.vec = t.ndim == 4 && rows_vectorizable(t);
  return r;
}

// `vec_elems`: elements per vector access of the kernel's mapping; `row`: the contiguous dimension (K for the
// v-first layout, V otherwise), whose multiples every vector offset is built from.
DecodeState decode_state(const TensorView& t, const char* name, int64_t vec_elems, int64_t row) {
  DecodeState s;
  if (!t.present()) return s;
  if (t.dtype != DType::kFloat32 && t.dtype != DType::kBFloat16) {
    throw InvalidArgument(name, std::string("the CUDA decode reads and writes float32 or bfloat16 states, got ") +
                                    dtype_name(t.dtype) + (t.dtype == DType::kFloat64 ? " (float64 runs on the CPU)" : ""));
  }
  s.p = t.data;
  s.dtype = t.dtype;
  s.slot_stride = t.strides[0];
  s.head_stride = t.strides[1];
  s.slots = t.shape[0];
  const int64_t align = std::min<int64_t>(16, vec_elems * static_cast<int64_t>(dtype_size(t.dtype)));
  s.vec = reinterpret_cast<uintptr_t>(t.data) % align == 0 && (t.shape[0] <= 1 || s.slot_stride % vec_elems == 0) &&
          (t.shape[1] <= 1 || s.head_stride % vec_elems == 0) && row % vec_elems == 0;
  return s;
}

int decode_warps_override() {
  if (const char* env = std::getenv("KDAKIT_DECODE_WARPS")) {
    const int w = std::atoi(env);
    if (w == 1 || w == 2 || w == 4) return w;
  }
  return 0;
}

int decode_passes_override() {
  if (const char* env = std::getenv("KDAKIT_DECODE_PASSES")) {
    const int w = std::atoi(env);
    if (w == 1 || w == 2 || w == 4) return w;
  }
  return 0;
}

// 32-bit strides (the host checked that every element's offset fits); a size-1 dimension never moves the pointer.
// A row is a token with cu_seqlens (one batch row) and a batch row otherwise (at most one token).
OneRows one_rows(const TensorView& t, bool varlen) {
  auto stride = [&](int i) { return t.shape[i] > 1 ? static_cast<int>(t.strides[i]) : 0; };
  return OneRows{t.data, stride(varlen ? 1 : 0), stride(2)};
}

// The one-token form's packed arguments (DecodeOneArgs), from the general ones and the call.
void fill_one_args(DecodeArgs& a, const DecodeParams& p, const Problem& pr) {
  DecodeOneArgs& o = a.one;
  const bool varlen = a.cu_seqlens.p != nullptr;
  o.q = one_rows(p.in.q, varlen);
  o.k = one_rows(p.in.k, varlen);
  o.g = one_rows(p.in.g, varlen);
  o.v = one_rows(p.in.v, varlen);
  o.beta = one_rows(p.in.beta, varlen);
  o.out = one_rows(p.out, varlen);
  o.A_log = static_cast<const float*>(p.in.gate.A_log.data);
  o.dt_bias = static_cast<const float*>(p.in.gate.dt_bias.data);
  o.state_indices = static_cast<const int*>(a.state_indices.p);
  o.idx_stride = static_cast<uint16_t>(a.idx_s0);
  o.cu_seqlens = static_cast<const int*>(a.cu_seqlens.p);
  o.cu_stride = static_cast<uint16_t>(a.cu_stride);
  o.initial = a.initial.p;
  o.initial_slot_stride = static_cast<int>(a.initial.slot_stride);
  o.initial_slots = static_cast<int>(a.initial.slots);
  o.final_state = a.final_state.p;
  o.final_slot_stride = static_cast<int>(a.final_state.slot_stride);
  o.final_slots = static_cast<int>(a.final_state.slots);
  o.has_initial_state = a.has_initial_state.p;
  o.has_stride = static_cast<uint16_t>(a.has_stride);
  o.V = static_cast<uint16_t>(a.V);
  o.group = static_cast<uint16_t>(a.group);
  for (int sh = 0; sh < 16; ++sh) {
    if ((int64_t(1) << sh) == pr.group) o.group_shift = static_cast<int8_t>(sh);
  }
  const int has_dtype = a.has_initial_state.p != nullptr ? static_cast<int>(a.has_initial_state.dtype) : 0;
  o.dtypes = static_cast<uint8_t>(static_cast<int>(p.in.q.dtype) | has_dtype << 4);
  o.scale = a.scale;
  o.lower_bound = a.lower_bound;
  o.flags = static_cast<uint8_t>(a.gate_mode | (a.l2norm ? DecodeOneArgs::kL2Norm : 0) |
                                 (a.beta_sigmoid ? DecodeOneArgs::kBetaSigmoid : 0) |
                                 (a.neg_eigval ? DecodeOneArgs::kNegEigval : 0) |
                                 (a.beta_cols ? DecodeOneArgs::kBetaCols : 0) |
                                 (!varlen && a.T == 1 ? DecodeOneArgs::kOneToken : 0));
}

}  // namespace

void decode(const DecodeParams& p, const detail::Plan& plan, void* stream) {
  require_cuda_dtypes(p.in);
  const Problem& pr = plan.pr;
  const StateIO& st = p.state;
  const bool vk = st.layout == StateLayout::kVK;
  // The pool's dtype fixes the kernel's vector width: 16 bytes of the pool's elements.
  const TensorView& pool = st.initial_state.present() ? st.initial_state : st.final_state;
  const bool bf16_pool = pool.present() && pool.dtype == DType::kBFloat16;
  const int64_t vec = bf16_pool ? 8 : 4;

  DecodeArgs a;
  a.initial = decode_state(st.initial_state, "initial_state", vec, vk ? pr.K : pr.V);
  a.final_state = decode_state(st.final_state, "final_state", vec, vk ? pr.K : pr.V);
  a.token_states = decode_state(p.token_states, "token_states", vec, vk ? pr.K : pr.V);
  if (pr.N == 0) return;

  a.q = decode_rows(p.in.q);
  a.k = decode_rows(p.in.k);
  a.v = decode_rows(p.in.v);
  a.g = decode_rows(p.in.g);
  a.beta = decode_rows(p.in.beta);
  a.beta_cols = p.in.beta.ndim == 4;
  fill_shared_args(a, p.in, pr);
  if (p.in.cu_seqlens.present()) a.cu_stride = p.in.cu_seqlens.strides[0];
  const TensorView& idx = st.state_indices;
  if (idx.present()) {
    a.state_indices = dyn(idx);
    a.idx_s0 = idx.strides[0];
    if (idx.ndim == 2) {
      a.idx_2d = true;
      a.idx_s1 = idx.strides[1];
      a.idx_cols = idx.shape[1];
    }
  }
  if (p.num_accepted_tokens.present()) {
    a.num_accepted = dyn(p.num_accepted_tokens);
    a.acc_stride = p.num_accepted_tokens.strides[0];
  }
  if (st.has_initial_state.present()) {
    a.has_initial_state = dyn(st.has_initial_state);
    a.has_stride = st.has_initial_state.strides[0];
  }
  a.out = dyn(p.out);
  a.out_sb = p.out.strides[0];
  a.out_st = p.out.strides[1];
  a.out_sh = p.out.strides[2];

  // Launch shape. Every warp owns 8 value columns; CTAs of 4 warps (fewer only where V has fewer columns) share the
  // staged token inputs and split the per-CTA chain (staging, preparation) over more warps. Smaller CTAs for small
  // batches spread them over more SMs but lengthen each CTA's chain: 4 warps were faster at every N of the
  // benchmark (tools/gpu/decode_tilings.py; docs/perf-notes.md).
  DecodeConfig cfg;
  cfg.KP = pr.K <= 64 ? 64 : (pr.K <= 128 ? 128 : 256);
  cfg.vk = vk;
  const int64_t col_warps = (pr.V + kDecodeWarpCols - 1) / kDecodeWarpCols;
  const int sms = sm_count(pr.device_index);
  int warps = kDecodeMaxWarps;
  while (warps > 1 && warps / 2 >= col_warps) warps /= 2;
  if (const int w = decode_warps_override()) warps = w;  // developer override for tuning; results do not change
  cfg.warps = warps;
  const int bv = warps * kDecodeWarpCols;
  // Tokens staged at a time: the longest sequence when known (any sequence is at most T long), up to 16.
  const int64_t longest = plan.cu_known ? plan.max_len : pr.T;
  const int tb_max = cfg.KP <= 128 ? 16 : 8;
  a.tb = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(longest, tb_max)));
  // The state tile is staged in shared memory (cp.async, all issued up front) where the pool allows 16-byte copies,
  // so the loads in flight per SM are bounded by shared memory, not registers. Passes: a CTA tile of up to 32 KB of
  // state (2 x 32 fp32 or 4 x 32 bf16 columns of K = 128), which puts >= 128 KB of loads in flight per SM, where the
  // grid still has >= 16 CTAs per SM (large batches); tiles up to 16 KB where it has >= 3 per SM (mid-size batches:
  // fewer, longer CTAs than one pass, without a 32 KB tile's serial chain); one pass otherwise (small batches:
  // latency). Within the 48 KB of dynamic shared memory a launch gets without opting in.
  a.stage_state = a.initial.present() && a.initial.vec;
  const int pool_bytes = bf16_pool ? 2 : 4;
  auto smem_of = [&](int passes) {
    const size_t tile = a.stage_state ? decode_state_tile_bytes(cfg.KP, pool_bytes, 32 * warps, passes) : 0;
    return DecodeSmem(cfg.KP, a.tb, bv * passes, tile).total;
  };
  if (smem_of(1) > 49152) a.stage_state = false;  // K = 256 fp32 with 8 staged tokens: registers only
  const int64_t col_tiles = (pr.V + bv - 1) / bv;  // CTA tiles of one pass
  int passes = 1;
  for (const int P : {4, 2}) {
    if (!a.stage_state) break;
    const size_t tile = decode_state_tile_bytes(cfg.KP, pool_bytes, 32 * warps, P);
    if (P > col_tiles || tile > 32768 || smem_of(P) > 49152) continue;
    if (pr.N * pr.HV * ((col_tiles + P - 1) / P) < (tile > 16384 ? 16 : 3) * int64_t(sms)) continue;
    passes = P;
    break;
  }
  // One token per sequence (serving decode): the register-prepared form, where its conditions hold
  // (DecodeConfig::one). Without known lengths (device cu_seqlens) a call of at most N tokens still takes it; a
  // longer sequence's CTAs then run the general path in the same launch, with the same tile. Its tile: below.
  const bool at_most_one = longest <= 1 || (pr.varlen && pr.T <= pr.N);
  auto same_as_pool = [&](const DecodeState& o) {
    return !o.present() || (o.dtype == pool.dtype && o.vec);
  };
  const auto aligned16 = [](const TensorView& t) { return reinterpret_cast<uintptr_t>(t.data) % 16 == 0; };
  const auto offsets32 = [](const TensorView& t) {  // every element's offset fits an int
    int64_t last = 0;
    for (int i = 0; i < t.ndim; ++i) last += (t.shape[i] - 1) * std::max<int64_t>(t.strides[i], 0);
    return last < (int64_t(1) << 31) - 16;
  };
  const auto int32_or_absent = [](const TensorView& t) { return !t.present() || t.dtype == DType::kInt32; };
  const bool one_dtypes = p.in.beta.dtype == p.in.q.dtype && p.out.dtype == p.in.q.dtype &&
                          int32_or_absent(st.state_indices) && int32_or_absent(p.in.cu_seqlens) &&
                          (!p.in.gate.A_log.present() || p.in.gate.A_log.dtype == DType::kFloat32) &&
                          (!p.in.gate.dt_bias.present() ||
                           (p.in.gate.dt_bias.dtype == DType::kFloat32 && aligned16(p.in.gate.dt_bias)));
  const bool one_offsets = offsets32(p.in.q) && offsets32(p.in.k) && offsets32(p.in.v) && offsets32(p.in.g) &&
                           offsets32(p.in.beta) && offsets32(p.out) &&
                           pr.N * std::max({a.idx_s0, a.cu_stride, a.has_stride}) < (int64_t(1) << 31) - 16;
  // The one-token form's CTA tile: several passes (the state staged in shared memory, up to a 32 KB tile per CTA: more
  // bytes in flight than registers hold) where the grid keeps at least two CTAs per SM; one pass (the state straight
  // to registers, the shortest chain) below that. H200 sweep, docs/perf-notes.md: T1 N32 H16 bf16 11.5 / 9.4 / 8.5 us
  // at 1 / 2 / 4 passes, N8 H16 bf16 3.8 / 4.2 / 5.2, N1024 H16 fp32 626 / 591 (two passes: 32 KB).
  const int passes_override = decode_passes_override();  // developer overrides for tuning and tests
  const bool force_general = std::getenv("KDAKIT_DECODE_GENERAL") != nullptr;  // the masked general form
  auto one_tile_fits = [&](int P) {
    return a.stage_state && pr.V % (int64_t(bv) * P) == 0 &&
           decode_state_tile_bytes(cfg.KP, pool_bytes, 32 * warps, P) <= 32768 && smem_of(P) <= 49152;
  };
  int one_passes = 1;
  for (const int P : {4, 2}) {
    if (one_tile_fits(P) && pr.N * pr.HV * (col_tiles / P) >= 2 * int64_t(sms)) {
      one_passes = P;
      break;
    }
  }
  if (passes_override) {
    one_passes = passes_override;
    while (one_passes > 1 && !one_tile_fits(one_passes)) one_passes /= 2;
  }
  // DecodeOneArgs' packing: 16-bit strides of the per-sequence scalars, 32-bit slot strides and counts, and each
  // state's head blocks dense (a slot's heads one after another, as engines' pools have them; a slot may be padded).
  const auto u16 = [](int64_t v) { return v >= 0 && v <= 0xffff; };
  const auto packs = [&](const DecodeState& o) {
    return !o.present() || (o.slot_stride >= 0 && o.slot_stride < (int64_t(1) << 31) && o.slots < (int64_t(1) << 31) &&
                            (pr.HV <= 1 || o.head_stride == pr.K * pr.V));
  };
  const bool one_packs = u16(a.idx_s0) && u16(a.cu_stride) && u16(a.has_stride) && u16(pr.V) && u16(pr.group) &&
                         packs(a.initial) && packs(a.final_state);
  cfg.one = at_most_one && cfg.KP <= 128 && pr.K == cfg.KP && pr.V % (int64_t(bv) * one_passes) == 0 && a.q.vec &&
            a.k.vec && a.g.vec && one_dtypes && one_offsets && one_packs && same_as_pool(a.initial) &&
            same_as_pool(a.final_state) && !a.token_states.present() && !a.idx_2d &&
            !force_general;
  if (cfg.one) {
    passes = one_passes;
    fill_one_args(a, p, pr);
    a.one.passes = passes;
    // Staged tiles on Hopper: each CTA prefetches into L2 (bulk prefetch) the tile of the CTA one per SM later in
    // launch order. KDAKIT_DECODE_PREFETCH=<CTAs per SM> sets the distance for tuning, 0 turns it off (the results
    // do not change).
    const char* ahead = std::getenv("KDAKIT_DECODE_PREFETCH");
    const float per_sm = ahead ? std::strtof(ahead, nullptr) : 1.f;
    const int ahead_ctas = compute_capability(pr.device_index) >= 90 ? static_cast<int>(per_sm * sms + 0.5f) : 0;
    a.one.prefetch_ahead = static_cast<uint16_t>(std::clamp(ahead_ctas, 0, 0xffff));
  } else if (passes_override) {
    passes = passes_override;
    while (passes > 1 && smem_of(passes) > 49152) passes /= 2;
  }
  cfg.passes = a.passes = passes;
  a.vtiles = static_cast<int>((pr.V + int64_t(bv) * passes - 1) / (int64_t(bv) * passes));
  // The grid is (N, HV, vtiles): y and z are limited to 65535 (vtiles <= V / 8 <= 32).
  if (pr.N > 0x7fffffff) {
    throw InvalidArgument("q", "at most 2147483647 sequences per decode call, got " + std::to_string(pr.N));
  }
  if (pr.HV > 65535) {
    throw InvalidArgument("v", "at most 65535 value heads for the CUDA decode, got " + std::to_string(pr.HV));
  }
  cfg.one_entry = cfg.one && longest <= 1;
  // The one-token entry needs shared memory only for a staged state (several passes); the ONE instance of the general
  // kernel holds the general path's layout, whose state tile is the same size.
  cfg.smem = !cfg.one_entry ? smem_of(passes)
             : passes > 1   ? decode_state_tile_bytes(cfg.KP, pool_bytes, 32 * warps, passes)
                            : 0;
  cfg.full = a.stage_state && pr.K == cfg.KP && pr.V % (int64_t(bv) * passes) == 0 && same_as_pool(a.final_state) &&
             same_as_pool(a.token_states) && !force_general;

  DeviceGuard guard(pr.device_index);
  auto s = static_cast<cudaStream_t>(stream);
  if (bf16_pool) launch_decode<__nv_bfloat16>(a, cfg, s);
  else launch_decode<float>(a, cfg, s);
}

}  // namespace kdakit::cuda
