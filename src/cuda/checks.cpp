#include "cuda/checks.h"

#include <string>
#include <utility>

#include "kdakit/error.h"

namespace kdakit::cuda {

void require_kernel_dtypes(const KdaInputs& in) {
  const DType dt = in.q.dtype;
  if (dt != DType::kBFloat16 && dt != DType::kFloat16 && dt != DType::kFloat32) {
    throw InvalidArgument("q", std::string("the CUDA kernels take bfloat16, float16 or float32 inputs, got ") + dtype_name(dt));
  }
  const std::pair<const TensorView*, const char*> same[] = {{&in.v, "v"}, {&in.g, "g"}};
  for (const auto& [t, name] : same) {
    if (t->dtype != dt) {
      throw InvalidArgument(name, std::string("the CUDA kernels need q, k, v and g of one dtype (") + dtype_name(dt) +
                                      "), got " + dtype_name(t->dtype));
    }
  }
  for (const auto& [t, name] : {std::make_pair(&in.beta, "beta"), std::make_pair(&in.gate.A_log, "A_log"),
                                std::make_pair(&in.gate.dt_bias, "dt_bias")}) {
    if (t->present() && t->dtype == DType::kFloat64) {
      throw InvalidArgument(name, "float64 runs on the CPU only; pass float32, float16 or bfloat16");
    }
  }
}

}  // namespace kdakit::cuda
