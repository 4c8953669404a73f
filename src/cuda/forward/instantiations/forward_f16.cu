// The chunked forward's kernels for __half inputs.
#include "cuda/forward/launch.cuh"

namespace kdakit::cuda {
template void launch_forward<__half>(const ForwardArgs&, const ForwardConfig&, cudaStream_t);
}  // namespace kdakit::cuda
