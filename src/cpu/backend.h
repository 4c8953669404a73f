// The CPU backend: the float64 token recurrence (the spec), the float32 chunked forward (the algorithm the
// GPU kernels run), the float64 backward, and decode.
#pragma once

#include <cstddef>

#include "common/plan.h"

namespace kdakit::cpu {

std::size_t forward_workspace_size(const ForwardParams& p, const detail::Plan& plan);
std::size_t backward_workspace_size(const BackwardParams& p, const detail::Plan& plan);

void forward_chunked(const ForwardParams& p, const detail::Plan& plan);
void reference_forward(const ForwardParams& p, const detail::Plan& plan);
void decode(const DecodeParams& p, const detail::Plan& plan);
void backward(const BackwardParams& p, const detail::Plan& plan);

// How the chunked forward computes the 16x16 diagonal blocks of the intra-chunk matrices (tests pin each).
enum class DiagonalBlocks { kAuto, kExact, kFactorised };
void set_diagonal_blocks(DiagonalBlocks mode);

}  // namespace kdakit::cpu
