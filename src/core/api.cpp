// The dispatch: validate and plan once, size the workspace, run on the backend of the tensors' device. The only file
// of src/core that includes a backend's header.
#include <string>
#include <utility>

#include "common/plan.h"
#include "cpu/backend.h"
#include "kdakit/config.h"
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

// What a planned call keeps of its backend's plan: the CUDA launch plan.
template <class P>
struct BackendPlan {};
#if defined(KDAKIT_WITH_CUDA)
template <>
struct BackendPlan<ForwardParams> {
  cuda::ForwardLaunch launch;
};
template <>
struct BackendPlan<BackwardParams> {
  cuda::BackwardLaunch launch;
};
#endif

const char* call_name(const ForwardParams&) { return "ForwardCall"; }
const char* call_name(const BackwardParams&) { return "BackwardCall"; }
detail::Plan validate_call(const ForwardParams& p) { return detail::plan_forward(p); }
detail::Plan validate_call(const BackwardParams& p) { return detail::plan_backward(p); }

// The backend's plan of a call and the workspace it needs.
std::size_t plan_backend(const ForwardParams& p, const detail::Plan& plan,
                         [[maybe_unused]] BackendPlan<ForwardParams>& b) {
  if (plan.pr.device == Device::kCPU) return cpu::forward_workspace_size(p, plan);
#if defined(KDAKIT_WITH_CUDA)
  b.launch = cuda::plan_forward(p, plan);
  return b.launch.total;
#else
  cuda_not_built("forward");
#endif
}

std::size_t plan_backend(const BackwardParams& p, const detail::Plan& plan,
                         [[maybe_unused]] BackendPlan<BackwardParams>& b) {
  if (plan.pr.device == Device::kCPU) return cpu::backward_workspace_size(p, plan);
#if defined(KDAKIT_WITH_CUDA)
  b.launch = cuda::plan_backward(p, plan);
  return b.launch.total;
#else
  cuda_not_built("backward");
#endif
}

// Runs a call whose params now carry the workspace.
void run_backend(const ForwardParams& p, const detail::Plan& plan, [[maybe_unused]] const BackendPlan<ForwardParams>& b,
                 [[maybe_unused]] void* stream) {
  if (plan.pr.device == Device::kCPU) return cpu::forward_chunked(p, plan);
#if defined(KDAKIT_WITH_CUDA)
  cuda::forward(p, plan, b.launch, p.workspace, p.workspace_bytes, stream);
#else
  cuda_not_built("forward");
#endif
}

void run_backend(const BackwardParams& p, const detail::Plan& plan,
                 [[maybe_unused]] const BackendPlan<BackwardParams>& b, [[maybe_unused]] void* stream) {
  if (plan.pr.device == Device::kCPU) return cpu::backward(p, plan);
#if defined(KDAKIT_WITH_CUDA)
  cuda::backward(p, plan, b.launch, p.workspace, p.workspace_bytes, stream);
#else
  cuda_not_built("backward");
#endif
}

}  // namespace

template <class Params>
struct PlannedCall<Params>::State {
  Params p;
  detail::Plan plan;
  std::size_t workspace = 0;
  BackendPlan<Params> backend;
};

template <class Params>
PlannedCall<Params>::PlannedCall(const Params& p) {
  // The call sizes the workspace and run() takes it: params that carry one would have it ignored.
  if (p.workspace != nullptr || p.workspace_bytes != 0) {
    throw InvalidArgument("workspace", std::string("is passed to ") + call_name(p) +
                                           "::run(), not in the params; got " + std::to_string(p.workspace_bytes) +
                                           " bytes in the params");
  }
  auto s = std::make_shared<State>();
  s->p = p;
  s->plan = validate_call(p);
  s->workspace = plan_backend(p, s->plan, s->backend);
  state_ = std::move(s);
}

template <class Params>
const Problem& PlannedCall<Params>::problem() const {
  return state_->plan.pr;
}

template <class Params>
std::size_t PlannedCall<Params>::workspace_size() const {
  return state_->workspace;
}

template <class Params>
void PlannedCall<Params>::run(void* workspace, std::size_t workspace_bytes, void* stream) const {
  const State& s = *state_;
  require_workspace(workspace, workspace_bytes, s.workspace);
  Params p = s.p;
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes;
  run_backend(p, s.plan, s.backend, stream);
}

template class PlannedCall<ForwardParams>;
template class PlannedCall<BackwardParams>;

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

const char* version() { return KDAKIT_VERSION_STRING; }

}  // namespace kdakit
