// Argument checks of the CUDA backend beyond the op's validation (src/core/validate.cpp): what its kernels take.
// Plain C++: the planners call them, and their tests run without a GPU.
#pragma once

#include "kdakit/params.h"

namespace kdakit::cuda {

// q, k and v of one dtype, bfloat16, float16 or float32; g, beta, A_log and dt_bias each of those three.
void require_kernel_dtypes(const KdaInputs& in);

}  // namespace kdakit::cuda
