// The CPU backend: the float64 token recurrence (the spec), the float32 chunked forward and backward (the algorithms
// the GPU kernels run), the float64 backward, and decode.
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

// The chunked backward in float32 (src/cpu/backward_chunked.cpp): the algorithm the CUDA backward kernels run, pinned
// to backward() by tests/cpp/cpu/test_backward_chunked.cpp. Its reverse state scan cuts sequences into segments of
// `chunks` chunks (0, the default: no cut), as the CUDA scan cuts long ones; the tests cut short sequences.
std::size_t backward_chunked_workspace_size(const BackwardParams& p, const detail::Plan& plan);
void backward_chunked(const BackwardParams& p, const detail::Plan& plan);
void set_backward_segment_chunks(int chunks);

// How the chunked forward computes the 16x16 diagonal blocks of the intra-chunk matrices (tests pin each).
enum class DiagonalBlocks { kAuto, kExact, kFactorised };
void set_diagonal_blocks(DiagonalBlocks mode);

}  // namespace kdakit::cpu
