// Chunked-forward kernels for __nv_bfloat16 inputs.
#include <cuda_fp16.h>

#include "cuda/forward/launch.cuh"

namespace kdakit::cuda {
template void launch_forward<__nv_bfloat16>(const ForwardArgs&, const ForwardConfig&, cudaStream_t);
template ForwardSmem forward_smem<__nv_bfloat16>(const ForwardConfig&);
}  // namespace kdakit::cuda
