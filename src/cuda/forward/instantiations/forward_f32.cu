// The chunked forward's kernels for float inputs.
#include "cuda/forward/launch.cuh"

namespace kdakit::cuda {
template void launch_forward<float>(const ForwardArgs&, const ForwardConfig&, cudaStream_t);
}  // namespace kdakit::cuda
