// kdakit: Kimi Delta Attention kernels. The public C++ API.
//
// Every entry point validates its params (throwing kdakit::InvalidArgument naming the argument), then
// dispatches on the tensors' device: CPU tensors run the CPU backend, CUDA tensors the CUDA backend of the
// device's architecture (kdakit::NotBuilt if this build has none). `stream` is a cudaStream_t (ignored,
// and may be null, for CPU tensors).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kdakit/config.h"
#include "kdakit/error.h"
#include "kdakit/export.h"
#include "kdakit/params.h"
#include "kdakit/tensor.h"
#include "kdakit/version.h"

namespace kdakit {

// Dimensions derived from validated params.
struct KDAKIT_API Problem {
  int64_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0;
  int64_t N = 0;           // sequences
  int64_t group = 1;       // HV / H
  int64_t T_max = 0;       // tokens per sequence (fixed length) or the indices' T_max (decode, 2-D)
  int64_t num_chunks = -1; // total chunks over all sequences, or -1 when unknown without reading
                           // device-side cu_seqlens
  bool varlen = false;
  Device device = Device::kCPU;
  int device_index = 0;
};

// Validation: one function per op. Each returns the problem's dimensions or throws InvalidArgument.
KDAKIT_API Problem validate(const ForwardParams& p);
KDAKIT_API Problem validate(const BackwardParams& p);
KDAKIT_API Problem validate(const DecodeParams& p);

// A validated and planned call of the chunked forward (or its backward): validation and planning run once, and the
// workspace query and the launch read the same plan. Make it from params whose workspace fields are empty, allocate
// workspace_size() bytes, then run(). A call may run several times (its params' tensors must stay alive).
template <class Params>
class KDAKIT_API PlannedCall {
 public:
  explicit PlannedCall(const Params& p);
  const Problem& problem() const;
  std::size_t workspace_size() const;
  void run(void* workspace, std::size_t workspace_bytes, void* stream = nullptr) const;
  struct State;

 private:
  std::shared_ptr<const State> state_;
};
using ForwardCall = PlannedCall<ForwardParams>;
using BackwardCall = PlannedCall<BackwardParams>;
extern template class PlannedCall<ForwardParams>;
extern template class PlannedCall<BackwardParams>;

// Scratch memory an op needs in `workspace` (bytes). Validates and plans the params.
KDAKIT_API std::size_t forward_workspace_size(const ForwardParams& p);
KDAKIT_API std::size_t backward_workspace_size(const BackwardParams& p);

// The ops, in one step (forward and backward: a call made and run with the params' workspace). Outputs are written into
// the caller's tensors.
KDAKIT_API void forward(const ForwardParams& p, void* stream = nullptr);
KDAKIT_API void backward(const BackwardParams& p, void* stream = nullptr);
KDAKIT_API void decode(const DecodeParams& p, void* stream = nullptr);

// The specification, CPU only: the token recurrence of spec §1.4 in float64. Same params and outputs as
// forward() (intermediate_states are the states before every chunk_size-th token).
KDAKIT_API void reference_forward(const ForwardParams& p);

// Number of chunks of every sequence given host-side sequence boundaries.
KDAKIT_API int64_t count_chunks(const std::vector<int64_t>& cu_seqlens, int chunk_size);

// Build information.
KDAKIT_API bool cuda_available();  // built with CUDA kernels and a device is visible
KDAKIT_API const char* version();  // the library's version, "MAJOR.MINOR.PATCH" (version.h: the headers')

// Threads the CPU backend uses (default: the hardware concurrency).
KDAKIT_API void set_cpu_threads(int n);
KDAKIT_API int cpu_threads();

// The developer overrides of the CUDA backend's launch choices (KDAKIT_* environment variables, docs/ARCHITECTURE.md)
// are read once per process; this reads them again. None of them changes a result.
KDAKIT_API void reload_overrides();

}  // namespace kdakit
