// The CUDA backward's entry points. Not implemented yet: a CUDA tensor that needs a gradient gets a clear error, and
// the CPU backend (src/cpu/backward.cpp) computes the backward for CPU tensors. docs/ARCHITECTURE.md says where the
// backward's stages go.
#include "cuda/backend.h"
#include "kdakit/error.h"

namespace kdakit::cuda {

std::size_t backward_workspace_size(const BackwardParams&, const detail::Plan&) {
  throw NotBuilt("kdakit.backward: the CUDA backward is not implemented yet; run the backward on CPU tensors");
}

void backward(const BackwardParams&, const detail::Plan&, void*) {
  throw NotBuilt("kdakit.backward: the CUDA backward is not implemented yet; run the backward on CPU tensors");
}

}  // namespace kdakit::cuda
