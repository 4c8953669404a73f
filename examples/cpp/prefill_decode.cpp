// kdakit from C++: a varlen prefill that reads and writes a state pool through slot indices, then one decode step of
// the same sequences (and a padding row) against that pool, each checked against kdakit's float64 reference.
// Runs on the GPU when kdakit has the CUDA kernels and a device is present, on the host otherwise.
// Exit status 0 when every check passes, 1 otherwise.
#include <kdakit/kdakit.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(KDAKIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace {

using kdakit::DType;
using kdakit::TensorView;

// Heads as in Kimi Linear's KDA layers (head size 128, more value heads than query/key heads: GVA).
constexpr int64_t H = 2, HV = 4, K = 128, V = 128;
constexpr int64_t kPoolSlots = 8;
const std::vector<int64_t> kPrefillLengths = {37, 64, 5};  // three sequences packed in one batch row
const std::vector<int32_t> kPrefillSlots = {5, 2, 7};      // pool slot of each sequence
// The decode batch continues the three sequences; row 1 is padding (slot -1: no state read or written, zero output).
const std::vector<int32_t> kDecodeSlots = {5, -1, 2, 7};
// Relative error ||got - ref|| / ||ref|| (spec §6.1) allowed against the float64 reference: the host's fp32 kernels,
// and the GPU's with bfloat16 q, k, v.
constexpr double kHostTolerance = 1e-5;
constexpr double kGpuTolerance = 4e-3;

#if defined(KDAKIT_WITH_CUDA)
void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}
#endif

// Where the ops' tensors live: GPU memory when the library has the CUDA kernels and a device is present, host memory
// otherwise. Every tensor has a host copy (what the reference reads) and its own block here (what the op reads and
// writes), so both paths run the same steps: upload, run, download.
class Memory {
 public:
  Memory() {
#if defined(KDAKIT_WITH_CUDA)
    int count = 0;
    const cudaError_t status = cudaGetDeviceCount(&count);
    if (status == cudaSuccess && count > 0) {
      gpu_ = true;
      cuda_check(cudaSetDevice(0), "cudaSetDevice");
      cuda_check(cudaStreamCreate(&stream_), "cudaStreamCreate");
      cudaDeviceProp prop;
      cuda_check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
      where_ = std::string("GPU 0 (") + prop.name + ")";
    } else {
      (void)cudaGetLastError();  // no device or no driver: clear the error and use the host
      where_ = std::string("host (kdakit has the CUDA kernels; no GPU: ") +
               (status == cudaSuccess ? "no device" : cudaGetErrorString(status)) + ")";
    }
#endif
  }
  ~Memory() {
    for (void* block : blocks_) {
#if defined(KDAKIT_WITH_CUDA)
      if (gpu_) {
        cudaFree(block);
        continue;
      }
#endif
      std::free(block);
    }
#if defined(KDAKIT_WITH_CUDA)
    if (stream_) cudaStreamDestroy(stream_);
#endif
  }
  Memory(const Memory&) = delete;
  Memory& operator=(const Memory&) = delete;

  const std::string& where() const { return where_; }
  kdakit::Device device() const { return gpu_ ? kdakit::Device::kCUDA : kdakit::Device::kCPU; }
  double tolerance() const { return gpu_ ? kGpuTolerance : kHostTolerance; }
  // The stream the ops run on (a cudaStream_t; null on the host).
  void* stream() const {
#if defined(KDAKIT_WITH_CUDA)
    return stream_;
#else
    return nullptr;
#endif
  }

  void* allocate(std::size_t bytes) {
    void* block = nullptr;
    bytes = bytes ? bytes : 1;
#if defined(KDAKIT_WITH_CUDA)
    if (gpu_) cuda_check(cudaMalloc(&block, bytes), "cudaMalloc");
#endif
    if (!gpu_) block = std::malloc(bytes);
    if (!block) throw std::runtime_error("out of memory");
    blocks_.push_back(block);
    return block;
  }
  void upload(void* dst, const void* src, std::size_t bytes) {
#if defined(KDAKIT_WITH_CUDA)
    if (gpu_) {
      cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync to the GPU");
      return;
    }
#endif
    std::memcpy(dst, src, bytes);
  }
  // Waits for the ops queued on the stream, then copies.
  void download(void* dst, const void* src, std::size_t bytes) {
#if defined(KDAKIT_WITH_CUDA)
    if (gpu_) {
      cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync to the host");
      cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
      return;
    }
#endif
    std::memcpy(dst, src, bytes);
  }

 private:
  bool gpu_ = false;
  std::string where_ = "host (kdakit built without the CUDA kernels)";
  std::vector<void*> blocks_;
#if defined(KDAKIT_WITH_CUDA)
  cudaStream_t stream_ = nullptr;
#endif
};

// A contiguous tensor: host values and the op's copy in Memory.
template <class T>
struct Tensor {
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<T> host;
  void* op_data = nullptr;

  Tensor(Memory& mem, DType dt, std::vector<int64_t> dims) : dtype(dt), shape(std::move(dims)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    host.assign(static_cast<std::size_t>(n), T{});
    op_data = mem.allocate(bytes());
  }
  std::size_t bytes() const { return host.size() * sizeof(T); }
  void upload(Memory& mem) { mem.upload(op_data, host.data(), bytes()); }
  std::vector<T> download(Memory& mem) const {
    std::vector<T> out(host.size());
    mem.download(out.data(), op_data, bytes());
    return out;
  }
  TensorView op_view(const Memory& mem) const {
    return kdakit::make_view(op_data, dtype, static_cast<int>(shape.size()), shape.data(), nullptr, mem.device());
  }
  TensorView host_view() {
    return kdakit::make_view(host.data(), dtype, static_cast<int>(shape.size()), shape.data(), nullptr);
  }
};

// bfloat16 bits of a finite float, rounded to nearest even.
uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// The inputs of one call, for B sequences of T tokens (B = 1 with cu_seqlens for varlen batches). Kimi Linear's
// recipe: bfloat16 q, k, v; the gate computed in the kernel from the raw gate input g, -exp(A_log) *
// softplus(g + dt_bias); beta as logits; q and k L2-normalised in the kernel.
struct Inputs {
  Tensor<uint16_t> q, k, v;
  Tensor<float> g, beta, A_log, dt_bias;

  Inputs(Memory& mem, int64_t B, int64_t T)
      : q(mem, DType::kBFloat16, {B, T, H, K}),
        k(mem, DType::kBFloat16, {B, T, H, K}),
        v(mem, DType::kBFloat16, {B, T, HV, V}),
        g(mem, DType::kFloat32, {B, T, HV, K}),
        beta(mem, DType::kFloat32, {B, T, HV}),
        A_log(mem, DType::kFloat32, {HV}),
        dt_bias(mem, DType::kFloat32, {HV * K}) {}

  void fill(std::mt19937_64& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    for (auto* t : {&q, &k, &v}) {
      for (auto& x : t->host) x = to_bf16(normal(rng));
    }
    for (auto& x : g.host) x = normal(rng);
    for (auto& x : beta.host) x = normal(rng);
    // A = exp(A_log) ~ U(1, 16); softplus(dt_bias) = dt ~ log-uniform in [1e-3, 1e-1]: decays of realistic size.
    for (auto& x : A_log.host) x = std::log(1.0f + 15.0f * unit(rng));
    for (auto& x : dt_bias.host) {
      const float dt = std::exp(std::log(1e-3f) + unit(rng) * (std::log(1e-1f) - std::log(1e-3f)));
      x = std::log(std::expm1(dt));
    }
  }
  void upload(Memory& mem) {
    for (auto* t : {&q, &k, &v}) t->upload(mem);
    for (auto* t : {&g, &beta, &A_log, &dt_bias}) t->upload(mem);
  }

  // The op's inputs (on_host: the host copies, for the reference).
  kdakit::KdaInputs params(const Memory& mem, bool on_host) {
    auto view = [&](auto& t) { return on_host ? t.host_view() : t.op_view(mem); };
    kdakit::KdaInputs in;
    in.q = view(q);
    in.k = view(k);
    in.v = view(v);
    in.g = view(g);
    in.beta = view(beta);
    in.scale = kdakit::default_scale(K);
    in.gate.mode = kdakit::GateMode::kSoftplus;
    in.gate.A_log = view(A_log);
    in.gate.dt_bias = view(dt_bias);
    in.qk_l2norm = true;
    in.beta_sigmoid = true;
    return in;
  }
};

double relative_error(const std::vector<float>& got, const std::vector<float>& ref) {
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    diff += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]);
    norm += double(ref[i]) * ref[i];
  }
  return std::sqrt(diff / (norm > 0.0 ? norm : 1.0));
}

// Prints one check; true when every error is within the tolerance.
bool report(const char* what, double out_error, double pool_error, double tolerance, const std::string& note = "") {
  const double worst = std::max(out_error, pool_error);
  const bool ok = worst <= tolerance;
  std::printf("%s: max rel err %.2e (output %.2e, state pool %.2e), tolerance %.0e%s %s\n", what, worst, out_error,
              pool_error, tolerance, note.c_str(), ok ? "OK" : "FAILED");
  return ok;
}

// A state pool [slots, HV, V, K] in the v-first layout serving engines use.
kdakit::StateIO pool_io(const TensorView& pool, const TensorView& slots) {
  kdakit::StateIO state;
  state.layout = kdakit::StateLayout::kVK;
  state.initial_state = pool;
  state.final_state = pool;  // the same tensor: the pool is updated in place
  state.state_indices = slots;
  return state;
}

int run() {
  Memory mem;
  std::printf("kdakit %s (headers %s), running on the %s\n", kdakit::version(), KDAKIT_VERSION_STRING,
              mem.where().c_str());
  std::mt19937_64 rng(2024);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const double tolerance = mem.tolerance();
  bool ok = true;

  // The pool: every slot holds a state (the prefill's sequences start from theirs: a cached prefix).
  Tensor<float> pool(mem, DType::kFloat32, {kPoolSlots, HV, V, K});
  for (auto& x : pool.host) x = normal(rng);
  pool.upload(mem);

  // --- Prefill: the three sequences packed in one row, each from and into its pool slot.
  const int64_t N = static_cast<int64_t>(kPrefillLengths.size());
  Tensor<int32_t> cu_seqlens(mem, DType::kInt32, {N + 1});
  for (int64_t n = 0; n < N; ++n) {
    cu_seqlens.host[n + 1] = cu_seqlens.host[n] + static_cast<int32_t>(kPrefillLengths[n]);
  }
  const int64_t T = cu_seqlens.host[N];
  Tensor<int32_t> prefill_slots(mem, DType::kInt32, {N});
  prefill_slots.host = kPrefillSlots;
  Inputs prefill(mem, 1, T);
  prefill.fill(rng);
  prefill.upload(mem);
  cu_seqlens.upload(mem);
  prefill_slots.upload(mem);
  Tensor<float> prefill_out(mem, DType::kFloat32, {1, T, HV, V});

  kdakit::ForwardParams fp;
  fp.in = prefill.params(mem, false);
  fp.in.cu_seqlens = cu_seqlens.op_view(mem);
  fp.in.cu_seqlens_host = cu_seqlens.host_view();  // spares the library a copy of the boundaries to the host
  fp.state = pool_io(pool.op_view(mem), prefill_slots.op_view(mem));
  fp.out = prefill_out.op_view(mem);
  // Validated and planned once: the workspace query and the run read the same plan.
  const kdakit::ForwardCall call(fp);
  const std::size_t workspace_bytes = call.workspace_size();
  void* workspace = mem.allocate(workspace_bytes);
  call.run(workspace, workspace_bytes, mem.stream());
  const std::vector<float> prefill_got = prefill_out.download(mem);
  const std::vector<float> pool_after_prefill = pool.download(mem);

  kdakit::ForwardParams fr;  // the float64 reference on the host copies, from the same pool
  fr.in = prefill.params(mem, true);
  fr.in.cu_seqlens = cu_seqlens.host_view();
  fr.state = pool_io(pool.host_view(), prefill_slots.host_view());
  fr.out = prefill_out.host_view();
  kdakit::reference_forward(fr);
  ok &= report("prefill", relative_error(prefill_got, prefill_out.host), relative_error(pool_after_prefill, pool.host),
               tolerance, " (" + std::to_string(T) + " tokens, " + std::to_string(N) + " sequences, workspace " +
                              std::to_string(workspace_bytes) + " bytes)");

  // --- Decode: one token per row from the pool as the prefill left it, in place; row 1 is padding.
  const int64_t B = static_cast<int64_t>(kDecodeSlots.size());
  pool.host = pool_after_prefill;  // the reference starts from the pool the op starts from
  Tensor<int32_t> decode_slots(mem, DType::kInt32, {B});
  decode_slots.host = kDecodeSlots;
  decode_slots.upload(mem);
  Inputs step(mem, B, 1);
  step.fill(rng);
  step.upload(mem);
  Tensor<float> decode_out(mem, DType::kFloat32, {B, 1, HV, V});

  kdakit::DecodeParams dp;  // decode has no workspace
  dp.in = step.params(mem, false);
  dp.state = pool_io(pool.op_view(mem), decode_slots.op_view(mem));
  dp.out = decode_out.op_view(mem);
  kdakit::decode(dp, mem.stream());
  const std::vector<float> decode_got = decode_out.download(mem);
  const std::vector<float> pool_after_decode = pool.download(mem);

  kdakit::ForwardParams dr;  // the reference: a forward of one token per sequence, same slots
  dr.in = step.params(mem, true);
  dr.state = pool_io(pool.host_view(), decode_slots.host_view());
  dr.out = decode_out.host_view();
  kdakit::reference_forward(dr);
  bool padding_zero = true;
  for (int64_t i = 0; i < HV * V; ++i) padding_zero &= decode_got[1 * HV * V + i] == 0.0f;
  ok &= padding_zero;
  ok &= report("decode", relative_error(decode_got, decode_out.host), relative_error(pool_after_decode, pool.host),
               tolerance, std::string(" (") + std::to_string(B) + " rows, padding row " +
                              (padding_zero ? "zero" : "NOT zero") + ")");

  // --- Errors are types: an invalid argument raises kdakit::InvalidArgument naming it.
  kdakit::ForwardParams bad = fr;
  bad.chunk_size = 16;
  try {
    kdakit::validate(bad);
    std::printf("errors: chunk_size 16 was accepted FAILED\n");
    ok = false;
  } catch (const kdakit::InvalidArgument& e) {
    std::printf("errors: kdakit::InvalidArgument for '%s' caught OK\n", e.argument().c_str());
  }

  std::printf("%s\n", ok ? "all checks passed" : "a check FAILED");
  return ok ? 0 : 1;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const kdakit::Error& e) {
    std::fprintf(stderr, "kdakit error: %s\n", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
  }
  return 1;
}
