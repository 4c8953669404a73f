// Entry points: validate, size the workspace, dispatch to the backend of the tensors' device.
#include <string>

#include "core/plan.h"
#include "cpu/backend.h"
#include "kdakit/kdakit.h"

#if defined(KDAKIT_WITH_CUDA)
#include "cuda/backend.h"
#endif

namespace kdakit {
namespace {

[[noreturn]] [[maybe_unused]] void cuda_not_built(const char* op) {
  throw NotBuilt(std::string("kdakit.") + op +
                 ": CUDA kernels not built: this kdakit was compiled without CUDA (no nvcc at build time, or "
                 "KDAKIT_CUDA=OFF); pass CPU tensors or reinstall kdakit where nvcc is available");
}

void require_workspace(void* ws, std::size_t have, std::size_t need) {
  if (need > 0 && (ws == nullptr || have < need)) {
    throw InvalidArgument("workspace", "needs " + std::to_string(need) + " bytes, got " + std::to_string(have) +
                                           (ws ? "" : " (null pointer)"));
  }
}

}  // namespace

int64_t count_chunks(const std::vector<int64_t>& cu_seqlens, int chunk_size) {
  if (chunk_size <= 0) throw InvalidArgument("chunk_size", "must be positive, got " + std::to_string(chunk_size));
  int64_t total = 0;
  for (std::size_t i = 0; i + 1 < cu_seqlens.size(); ++i) {
    const int64_t len = cu_seqlens[i + 1] - cu_seqlens[i];
    if (len < 0) throw InvalidArgument("cu_seqlens", "must be non-decreasing");
    total += (len + chunk_size - 1) / chunk_size;
  }
  return total;
}

std::size_t forward_workspace_size(const ForwardParams& p) {
  const detail::Plan plan = detail::plan_forward(p);
  if (plan.pr.device == Device::kCPU) return cpu::forward_workspace_size(p, plan);
#if defined(KDAKIT_WITH_CUDA)
  return cuda::forward_workspace_size(p, plan);
#else
  cuda_not_built("forward_workspace_size");
#endif
}

std::size_t backward_workspace_size(const BackwardParams& p) {
  const detail::Plan plan = detail::plan_backward(p);
  if (plan.pr.device == Device::kCPU) return cpu::backward_workspace_size(p, plan);
#if defined(KDAKIT_WITH_CUDA)
  return cuda::backward_workspace_size(p, plan);
#else
  cuda_not_built("backward_workspace_size");
#endif
}

void forward(const ForwardParams& p, void* stream) {
  const detail::Plan plan = detail::plan_forward(p);
  if (plan.pr.device == Device::kCPU) {
    require_workspace(p.workspace, p.workspace_bytes, cpu::forward_workspace_size(p, plan));
    cpu::forward_chunked(p, plan);
    return;
  }
#if defined(KDAKIT_WITH_CUDA)
  cuda::forward(p, plan, stream);
#else
  (void)stream;
  cuda_not_built("forward");
#endif
}

void backward(const BackwardParams& p, void* stream) {
  const detail::Plan plan = detail::plan_backward(p);
  if (plan.pr.device == Device::kCPU) {
    require_workspace(p.workspace, p.workspace_bytes, cpu::backward_workspace_size(p, plan));
    cpu::backward(p, plan);
    return;
  }
#if defined(KDAKIT_WITH_CUDA)
  cuda::backward(p, plan, stream);
#else
  (void)stream;
  cuda_not_built("backward");
#endif
}

void decode(const DecodeParams& p, void* stream) {
  const detail::Plan plan = detail::plan_decode(p);
  if (plan.pr.device == Device::kCPU) {
    cpu::decode(p, plan);
    return;
  }
#if defined(KDAKIT_WITH_CUDA)
  cuda::decode(p, plan, stream);
#else
  (void)stream;
  cuda_not_built("decode");
#endif
}

void reference_forward(const ForwardParams& p) {
  const detail::Plan plan = detail::plan_forward(p);
  if (plan.pr.device != Device::kCPU) {
    throw InvalidArgument("q", "the float64 reference runs on CPU tensors only");
  }
  cpu::reference_forward(p, plan);
}

bool cuda_available() {
#if defined(KDAKIT_WITH_CUDA)
  return cuda::device_count() > 0;
#else
  return false;
#endif
}

const char* version() { return KDAKIT_VERSION; }

}  // namespace kdakit
