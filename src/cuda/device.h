// The CUDA device facts the planners use (one cached query per device), the current-device guard, and the launch
// checks. The header is plain C++ (no CUDA headers): the planners that read DeviceInfo are tested on machines
// without CUDA.
#pragma once

#include <cstddef>

namespace kdakit::cuda {

struct DeviceInfo {
  int sm_count = 132;
  int compute_capability = 90;        // 10 * major + minor (90: Hopper, the one with warpgroup MMAs)
  std::size_t smem_optin = 227 * 1024;  // opt-in shared memory per block (H100/H200 227 KB, A100 163 KB, sm_86/89 99 KB)
};

// Queried once per device and cached; fallbacks where a query fails (132 SMs, capability 0, 48 KB).
const DeviceInfo& device_info(int device);
int device_count();

// Makes `device` current for its lifetime.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

// Throws CudaError naming `what` if the last launch failed.
void check_launch(const char* what);
// Raises a kernel's dynamic shared-memory limit where `bytes` exceeds the default 48 KB (CudaError on failure).
void set_dynamic_smem(const void* kernel, std::size_t bytes);

}  // namespace kdakit::cuda
