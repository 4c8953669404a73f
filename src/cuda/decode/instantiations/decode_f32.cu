// The decode kernels for float state pools.
#include "cuda/decode/launch.cuh"

namespace kdakit::cuda {
template void launch_decode<float>(const DecodeArgs&, const DecodeConfig&, cudaStream_t);
}  // namespace kdakit::cuda
