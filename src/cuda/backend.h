// The CUDA backend's entry points, called by src/core/api.cpp (the dispatch) when tensors live on a CUDA device.
#pragma once

#include <cstddef>

#include "common/plan.h"
#include "cuda/backward/plan.h"
#include "cuda/decode/plan.h"
#include "cuda/forward/plan.h"

namespace kdakit::cuda {

int device_count();
// Reads the developer overrides (KDAKIT_* environment variables, cuda/tuning.h) again.
void reload_tuning();

// The forward: planned once per call (workspace size and launch shapes), then run with the caller's workspace, whose
// size PlannedCall::run (src/core/api.cpp) has checked against the launch's total.
ForwardLaunch plan_forward(const ForwardParams& p, const detail::Plan& plan);
void forward(const ForwardParams& p, const detail::Plan& plan, const ForwardLaunch& launch, void* workspace,
             std::size_t workspace_bytes, void* stream);

// The backward, planned and run the same way (src/cuda/backward/run.cu).
BackwardLaunch plan_backward(const BackwardParams& p, const detail::Plan& plan);
void backward(const BackwardParams& p, const detail::Plan& plan, const BackwardLaunch& launch, void* workspace,
              std::size_t workspace_bytes, void* stream);

void decode(const DecodeParams& p, const detail::Plan& plan, void* stream);

}  // namespace kdakit::cuda
