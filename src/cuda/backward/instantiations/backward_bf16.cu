// The CUDA backward's kernels for bfloat16 inputs.
#include "cuda/backward/launch.cuh"

namespace kdakit::cuda {
template void launch_backward<__nv_bfloat16>(const BackwardArgs&, const BackwardLaunch&, cudaStream_t);
}  // namespace kdakit::cuda
