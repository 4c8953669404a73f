#include "kdakit/tensor.h"


#include "kdakit/error.h"

namespace kdakit {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kBool: return "bool";
    case DType::kUInt8: return "uint8";
  }
  return "unknown";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kFloat64: return 8;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kBool: return 1;
    case DType::kUInt8: return 1;
  }
  return 0;
}

int64_t TensorView::numel() const {
  if (ndim < 0) return 0;
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

// Plain string building: iostreams are avoided in the library because a statically linked libstdc++ (as some
// toolchains link Python extensions) may leave their locale uninitialised.
static std::string join(const int64_t* v, int n) {
  std::string s = "[";
  for (int i = 0; i < n; ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

std::string TensorView::shape_str() const { return ndim < 0 ? "(absent)" : join(shape, ndim); }
std::string TensorView::strides_str() const { return ndim < 0 ? "(absent)" : join(strides, ndim); }

TensorView make_view(void* data, DType dtype, int ndim, const int64_t* shape, const int64_t* strides,
                     Device device, int device_index) {
  if (ndim < 0 || ndim > kMaxDims) {
    throw InvalidArgument("tensor", "kdakit views hold 0 to " + std::to_string(kMaxDims) +
                                        " dimensions, got " + std::to_string(ndim));
  }
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.device_index = device_index;
  t.ndim = ndim;
  int64_t running = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.strides[i] = strides ? strides[i] : running;
    running *= shape[i];
  }
  return t;
}

TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device,
                     int device_index) {
  return make_view(data, dtype, static_cast<int>(shape.size()), shape.begin(), nullptr, device,
                   device_index);
}

}  // namespace kdakit
