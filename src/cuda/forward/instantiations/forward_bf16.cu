// The chunked forward's kernels for __nv_bfloat16 inputs.
#include "cuda/forward/launch.cuh"

namespace kdakit::cuda {
template void launch_forward<__nv_bfloat16>(const ForwardArgs&, const ForwardConfig&, cudaStream_t);
}  // namespace kdakit::cuda
