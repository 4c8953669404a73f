#include "cuda/checks.h"

#include <string>
#include <utility>

#include "kdakit/error.h"

namespace kdakit::cuda {
namespace {

bool kernel_float(DType d) { return d == DType::kBFloat16 || d == DType::kFloat16 || d == DType::kFloat32; }

}  // namespace

// q, k and v share one dtype (the kernels' operand type); g and beta are read in their own dtype (engines compute the
// gate and beta in float32 next to bfloat16 activations), and A_log and dt_bias in theirs.
void require_kernel_dtypes(const KdaInputs& in) {
  const DType dt = in.q.dtype;
  if (!kernel_float(dt)) {
    throw InvalidArgument("q", std::string("the CUDA kernels take bfloat16, float16 or float32 inputs, got ") +
                                   dtype_name(dt) + (dt == DType::kFloat64 ? " (float64 runs on the CPU)" : ""));
  }
  if (in.v.dtype != dt) {
    throw InvalidArgument("v", std::string("the CUDA kernels need q, k and v of one dtype (") + dtype_name(dt) +
                                   "), got " + dtype_name(in.v.dtype));
  }
  for (const auto& [t, name] : {std::make_pair(&in.g, "g"), std::make_pair(&in.beta, "beta"),
                                std::make_pair(&in.gate.A_log, "A_log"), std::make_pair(&in.gate.dt_bias, "dt_bias")}) {
    if (t->present() && !kernel_float(t->dtype)) {
      throw InvalidArgument(name, std::string("the CUDA kernels take float32, float16 or bfloat16, got ") +
                                      dtype_name(t->dtype) +
                                      (t->dtype == DType::kFloat64 ? " (float64 runs on the CPU)" : ""));
    }
  }
}

}  // namespace kdakit::cuda
