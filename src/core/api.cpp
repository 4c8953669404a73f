// The dispatch: validate and plan once, size the workspace, run on the backend of the tensors' device. The only file
// of src/core that includes a backend's header.
#include <string>
#include <utility>

#include "common/plan.h"
#include "cpu/backend.h"
#include "kdakit/kdakit.h"

#if defined(KDAKIT_WITH_CUDA)
#include "cuda/backend.h"
#include "cuda/tuning.h"
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

// A call's params carry no workspace: the call sizes it, and run() takes it.
template <class P>
void require_no_workspace(const P& p, const char* call) {
  if (p.workspace != nullptr || p.workspace_bytes != 0) {
    throw InvalidArgument("workspace", std::string("is passed to ") + call + "::run(), not in the params; got " +
                                           std::to_string(p.workspace_bytes) + " bytes in the params");
  }
}

// The params of a one-step op with their workspace fields moved out (checked as the validation checks them).
template <class P>
P without_workspace(const P& p) {
  if (p.workspace_bytes > 0 && p.workspace == nullptr) {
    throw InvalidArgument("workspace", "workspace_bytes > 0 but workspace is null");
  }
  P q = p;
  q.workspace = nullptr;
  q.workspace_bytes = 0;
  return q;
}

}  // namespace

struct ForwardCall::State {
  ForwardParams p;
  detail::Plan plan;
  std::size_t workspace = 0;
#if defined(KDAKIT_WITH_CUDA)
  cuda::ForwardLaunch cuda;
#endif
};

ForwardCall::ForwardCall(const ForwardParams& p) {
  require_no_workspace(p, "ForwardCall");
  auto s = std::make_shared<State>();
  s->p = p;
  s->plan = detail::plan_forward(p);
  if (s->plan.pr.device == Device::kCPU) {
    s->workspace = cpu::forward_workspace_size(p, s->plan);
  } else {
#if defined(KDAKIT_WITH_CUDA)
    s->cuda = cuda::plan_forward(p, s->plan);
    s->workspace = s->cuda.total;
#else
    cuda_not_built("forward");
#endif
  }
  state_ = std::move(s);
}

const Problem& ForwardCall::problem() const { return state_->plan.pr; }
std::size_t ForwardCall::workspace_size() const { return state_->workspace; }

void ForwardCall::run(void* workspace, std::size_t workspace_bytes, void* stream) const {
  const State& s = *state_;
  require_workspace(workspace, workspace_bytes, s.workspace);
  if (s.plan.pr.device == Device::kCPU) {
    ForwardParams p = s.p;
    p.workspace = workspace;
    p.workspace_bytes = workspace_bytes;
    cpu::forward_chunked(p, s.plan);
    return;
  }
#if defined(KDAKIT_WITH_CUDA)
  cuda::forward(s.p, s.plan, s.cuda, workspace, workspace_bytes, stream);
#else
  (void)stream;
  cuda_not_built("forward");
#endif
}

struct BackwardCall::State {
  BackwardParams p;
  detail::Plan plan;
  std::size_t workspace = 0;
};

BackwardCall::BackwardCall(const BackwardParams& p) {
  require_no_workspace(p, "BackwardCall");
  auto s = std::make_shared<State>();
  s->p = p;
  s->plan = detail::plan_backward(p);
  if (s->plan.pr.device == Device::kCPU) {
    s->workspace = cpu::backward_workspace_size(p, s->plan);
  } else {
#if defined(KDAKIT_WITH_CUDA)
    s->workspace = cuda::backward_workspace_size(p, s->plan);
#else
    cuda_not_built("backward");
#endif
  }
  state_ = std::move(s);
}

const Problem& BackwardCall::problem() const { return state_->plan.pr; }
std::size_t BackwardCall::workspace_size() const { return state_->workspace; }

void BackwardCall::run(void* workspace, std::size_t workspace_bytes, void* stream) const {
  const State& s = *state_;
  require_workspace(workspace, workspace_bytes, s.workspace);
  BackwardParams p = s.p;
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes;
  if (s.plan.pr.device == Device::kCPU) {
    cpu::backward(p, s.plan);
    return;
  }
#if defined(KDAKIT_WITH_CUDA)
  cuda::backward(p, s.plan, stream);
#else
  (void)stream;
  cuda_not_built("backward");
#endif
}

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
  return ForwardCall(without_workspace(p)).workspace_size();
}

std::size_t backward_workspace_size(const BackwardParams& p) {
  return BackwardCall(without_workspace(p)).workspace_size();
}

void forward(const ForwardParams& p, void* stream) {
  ForwardCall(without_workspace(p)).run(p.workspace, p.workspace_bytes, stream);
}

void backward(const BackwardParams& p, void* stream) {
  BackwardCall(without_workspace(p)).run(p.workspace, p.workspace_bytes, stream);
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

void reload_overrides() {
#if defined(KDAKIT_WITH_CUDA)
  cuda::reload_tuning();
#endif
}

const char* version() { return KDAKIT_VERSION; }

}  // namespace kdakit
