// The CUDA backward's kernels for float16 inputs.
#include "cuda/backward/launch.cuh"

namespace kdakit::cuda {
template void launch_backward<__half>(const BackwardArgs&, const BackwardLaunch&, cudaStream_t);
}  // namespace kdakit::cuda
