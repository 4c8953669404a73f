// Argument checks of the CUDA backend beyond the op's validation (src/core/validate.cpp): what its kernels take.
// Plain C++: the planners call them, and their tests run without a GPU.
#pragma once

#include "kdakit/params.h"

namespace kdakit::cuda {

// q, k, v, g of one dtype, bfloat16, float16 or float32; beta, A_log and dt_bias not float64.
void require_kernel_dtypes(const KdaInputs& in);

}  // namespace kdakit::cuda
