// Chunked-forward kernels for __half inputs.
#include <cuda_fp16.h>

#include "cuda/forward/launch.cuh"

namespace kdakit::cuda {
template void launch_forward<__half>(const ForwardArgs&, const ForwardConfig&, cudaStream_t);
template ForwardSmem forward_smem<__half>(const ForwardConfig&);
}  // namespace kdakit::cuda
