// Non-owning strided tensor views and the element types kdakit understands.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "kdakit/export.h"

namespace kdakit {

enum class DType : int32_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat64 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kBool = 6,
  kUInt8 = 7,
};

enum class Device : int32_t { kCPU = 0, kCUDA = 1 };

KDAKIT_API const char* dtype_name(DType dtype);
KDAKIT_API std::size_t dtype_size(DType dtype);
inline bool is_floating(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16 || d == DType::kFloat64;
}
inline bool is_index(DType d) { return d == DType::kInt32 || d == DType::kInt64; }

constexpr int kMaxDims = 6;

// A view of memory owned by the caller. Shapes and strides count elements.
// `ndim < 0` marks an optional argument that was not given.
struct KDAKIT_API TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device = Device::kCPU;
  int device_index = 0;
  int ndim = -1;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};

  bool present() const { return ndim >= 0; }
  int64_t numel() const;
  int64_t size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }
  int64_t stride(int dim) const { return strides[dim < 0 ? dim + ndim : dim]; }
  // Row-major contiguous (size-1 dims may carry any stride).
  bool is_contiguous() const;
  std::string shape_str() const;
  std::string strides_str() const;
};

// Builds a view; without strides the view is row-major contiguous.
KDAKIT_API TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                     Device device = Device::kCPU, int device_index = 0);
KDAKIT_API TensorView make_view(void* data, DType dtype, int ndim, const int64_t* shape, const int64_t* strides,
                     Device device = Device::kCPU, int device_index = 0);

}  // namespace kdakit
