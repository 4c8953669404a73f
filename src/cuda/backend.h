// The CUDA backend's host entry points (called by src/core/api.cpp when tensors live on a CUDA device).
#pragma once

#include <cstddef>

#include "core/plan.h"

namespace kdakit::cuda {

int device_count();

std::size_t forward_workspace_size(const ForwardParams& p, const detail::Plan& plan);
void forward(const ForwardParams& p, const detail::Plan& plan, void* stream);

std::size_t backward_workspace_size(const BackwardParams& p, const detail::Plan& plan);
void backward(const BackwardParams& p, const detail::Plan& plan, void* stream);

void decode(const DecodeParams& p, const detail::Plan& plan, void* stream);

}  // namespace kdakit::cuda
