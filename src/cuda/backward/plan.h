// The CUDA backward's launch plan for one call: the forward pass it runs first (the prepare, and the state pass unless
// the caller saved the chunk states), its own kernels' shapes and shared memory, and the workspace layout. A pure
// function of the call, the device's facts and the developer overrides: made once per call, read by the workspace
// query and the launch alike, tested on the CPU (tests/cpp/cuda/test_backward_plan.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/plan.h"
#include "cuda/backward/tile_size.h"
#include "cuda/device.h"
#include "cuda/forward/plan.h"
#include "cuda/tuning.h"

namespace kdakit::cuda {

struct BackwardLaunch {
  // The forward's launch plan for the same inputs: its chunk offsets, prepare (whose tiles the scan reads, and Tm)
  // and, when recompute_states, the recurrence that writes the chunk-start states. Its workspace comes first.
  ForwardLaunch fwd;
  bool recompute_states = true;  // false: BackwardParams::chunk_states are read instead
  int64_t slots = 0;     // chunk slots (fwd.slots): an upper bound of the chunks
  int64_t rows = 0;      // token rows B * T
  int vt = 1;            // the scan's value tiles (scan_bv columns each)
  int scan_bv = 64;      // the scan's value columns per CTA: 16, 32, 64 (BwdScanLayout)
  int scan_ring = 2;     // the scan's stage slots: 1 (no prefetch) to kBwdScanMaxRing
  int nks = 1;           // 16-key slices of the gradient kernel
  // The scan's segments where the forward cuts a sequence (fwd.seg_target > 1; its segment table is read): segment
  // slots (fwd.segments) and the row length of a slot, vt * scan_bv value columns then KP transition columns.
  int64_t segments = 0;
  int seg_ld = 0;
  BackwardSmem smem;
  // Workspace parts after the forward's (byte offsets, 256-byte aligned) and the total:
  //   tm [slot][HV][C][C] f32         Tm, from the prepare kernel
  //   out [B,T,HV,V] q's dtype        the forward kernels' outputs (unused)
  //   h [slot][HV][K*V] f32           chunk-start states (recompute_states only; the layout of BackwardParams::layout)
  //   dh [slot][HV][K][V] f32         gradient of every chunk's end state (the reverse scan)
  //   dvnew, vnew, dbv [slot][HV][C][V] f32
  //   dP, dL [slot][HV][C][C] f32
  //   dq, dk [row][HV][K] f32         per-v-head q/k gradients, before the GVA sum and the L2 norm's backward (first
  //                                   their state parts, dqg and dkbg, from the state products)
  //   dkg [row][HV][K] f32            the state products' dkg = v_new dH^T
  //   dgam [slot][HV][K] f32          rowsum(S dH), the state decay's part of the gate gradient
  //   dbeta [row][HV][1 + nks] f32    beta's gradient in parts (the value side, then each key slice)
  //   dA [slot][HV][nks] f32, ddt [slot][HV][K] f32   per-chunk partial sums of dA_log and ddt_bias
  //   seg [segment][HV][KP][seg_ld] f32 the scan's segment results (segments > 0 only): E_s, then the merged end
  //                                   gradients, and M_s^T
  std::size_t off_seg = 0;
  std::size_t off_tm = 0, off_out = 0, off_h = 0, off_dh = 0, off_dvnew = 0, off_vnew = 0, off_dbv = 0, off_dP = 0,
              off_dL = 0, off_dq = 0, off_dk = 0, off_dkg = 0, off_dgam = 0, off_dbeta = 0, off_dA = 0, off_ddt = 0;
  std::size_t total = 0;
};

// The forward call the backward runs on its inputs (no outputs of its own: the backward points them into its
// workspace).
ForwardParams backward_forward_params(const BackwardParams& p);

// Throws InvalidArgument for inputs the kernels do not take and CudaError where a kernel does not fit the shared
// memory.
BackwardLaunch plan_backward_launch(const BackwardParams& p, const detail::Plan& plan, const DeviceInfo& device,
                                    const Tuning& tuning);

}  // namespace kdakit::cuda
