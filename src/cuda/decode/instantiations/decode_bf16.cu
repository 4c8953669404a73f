// The decode kernels for __nv_bfloat16 state pools.
#include "cuda/decode/launch.cuh"

namespace kdakit::cuda {
template void launch_decode<__nv_bfloat16>(const DecodeArgs&, const DecodeConfig&, cudaStream_t);
}  // namespace kdakit::cuda
