// The CUDA backward's kernels for float32 inputs.
#include "cuda/backward/launch.cuh"

namespace kdakit::cuda {
template void launch_backward<float>(const BackwardArgs&, const BackwardLaunch&, cudaStream_t);
}  // namespace kdakit::cuda
