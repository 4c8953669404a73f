#include "cuda/device.h"

#include <cuda_runtime.h>

#include <mutex>
#include <string>

#include "kdakit/error.h"

namespace kdakit::cuda {

const DeviceInfo& device_info(int device) {
  constexpr int kMaxDevices = 64;
  static DeviceInfo cache[kMaxDevices];
  static std::once_flag once[kMaxDevices];
  static const DeviceInfo fallback{132, 0, 48 * 1024};
  if (device < 0 || device >= kMaxDevices) return fallback;
  std::call_once(once[device], [device] {
    DeviceInfo d;
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) n = 132;
    d.sm_count = n;
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
      major = minor = 0;
    }
    d.compute_capability = 10 * major + minor;
    int smem = 0;
    if (cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess || smem <= 0) {
      smem = 48 * 1024;
    }
    d.smem_optin = static_cast<std::size_t>(smem);
    cudaGetLastError();  // a failed query leaves no error for the next launch check
    cache[device] = d;
  });
  return cache[device];
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

DeviceGuard::DeviceGuard(int device) {
  if (cudaGetDevice(&prev_) == cudaSuccess && prev_ != device) {
    if (cudaSetDevice(device) != cudaSuccess) throw CudaError("kdakit: cannot select CUDA device " + std::to_string(device));
  } else {
    prev_ = -1;
  }
}

DeviceGuard::~DeviceGuard() {
  if (prev_ >= 0) cudaSetDevice(prev_);
}

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw CudaError(std::string("kdakit: ") + what + " launch failed: " + cudaGetErrorString(err));
}

void set_dynamic_smem(const void* kernel, std::size_t bytes) {
  if (bytes <= 48 * 1024) return;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err != cudaSuccess) {
    cudaGetLastError();  // do not leave the error for the next launch check
    throw CudaError(std::string("kdakit: shared memory request of ") + std::to_string(bytes) +
                    " bytes failed: " + cudaGetErrorString(err));
  }
}

}  // namespace kdakit::cuda
