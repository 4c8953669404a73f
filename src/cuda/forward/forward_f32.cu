// Chunked-forward kernels for float inputs.
#include <cuda_fp16.h>

#include "cuda/forward/launch.cuh"

namespace kdakit::cuda {
template void launch_forward<float>(const ForwardArgs&, const ForwardConfig&, cudaStream_t);
template ForwardSmem forward_smem<float>(const ForwardConfig&);
}  // namespace kdakit::cuda
