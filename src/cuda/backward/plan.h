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

// The launches of a backward call in stream order, the steps of the workspace parts' lives: the forward's (chunk
// offsets, prepare with Tm, the state pass: one step), the reverse scan, the WY pass, the products with the states,
// the gradient kernel, the token reductions, the parameter reductions.
enum BwdStep : int { kBwdForward, kBwdScan, kBwdWy, kBwdStates, kBwdGrad, kBwdTokens, kBwdParams };

struct BackwardLaunch {
  // The forward's launch plan for the same inputs: its chunk offsets, prepare (whose tiles the scan reads, and Tm)
  // and, when recompute_states, the recurrence that writes the chunk-start states. Its workspace parts' offsets
  // (fwd.off_*) are placed in the backward's workspace with the parts below; fwd.total stays the forward's own.
  ForwardLaunch fwd;
  bool recompute_states = true;  // false: BackwardParams::chunk_states are read instead, or none are needed
  // BackwardParams::d_initial_state_only: the forward's prepare and the reverse scan alone (which writes no dh_c or
  // dv_new), and only their workspace parts.
  bool d_initial_only = false;
  int64_t slots = 0;     // chunk slots (fwd.slots): an upper bound of the chunks
  int64_t rows = 0;      // token rows B * T
  int vt = 1;            // the scan's value tiles (scan_bv columns each)
  int scan_bv = 64;      // the scan's value columns per CTA: 16, 32, 64 (BwdScanLayout)
  int scan_ring = 2;     // the mma.sync scan's stage slots: 1 (no prefetch) to kBwdScanMaxRing
  int nks = 1;           // 16-key slices of the gradient kernel
  bool grad_cache = false;  // the gradient kernel's dP/dL cache (bwd_grad_cache_fits)
  // The WY pass and the state products as one kernel on warpgroup MMAs (wy_states_sm90.cuh): Hopper, bf16 inputs and
  // cotangent, chunk 64, K <= 128, V <= 128 with V % 4 == 0, fp32 [K][V] chunk-start states. Its launch is both
  // steps (kBwdWy), and v_new and dbv never reach the workspace.
  bool ws_sm90 = false;
  // The reverse scan on warpgroup MMAs (scan_sm90.cuh; scan_bv 64, no stage ring): Hopper, bf16 tiles, chunk 64,
  // K <= 128, and no other scan width asked for.
  bool scan_sm90 = false;
  // The scan's segments where the forward cuts a sequence (fwd.seg_target > 1; its segment table is read): segment
  // slots (fwd.segments) and the row length of a slot, vt * scan_bv value columns then KP transition columns.
  int64_t segments = 0;
  int seg_ld = 0;
  BackwardSmem smem;  // smem.wy: the fused kernel's where ws_sm90
  // Workspace parts (byte offsets, 256-byte aligned), each with its life in BwdSteps [first write, last read]:
  //   chunk offsets (fwd)                                  forward .. params
  //   w, u (fwd) [slot][HV][C][KP|VP] operand dtype        forward .. WY
  //   qg, kg, Aqk, Aqk lo, gamma (fwd)                     forward .. scan
  //   segment offsets (fwd)                                forward (.. scan where the scan runs in segments)
  //   segment states, sequence order (fwd)                 forward
  //   tm [slot][HV][C][C] f32         Tm, from the prepare kernel                      forward .. WY
  //   ulo [slot][HV][C][VP] bf16      u's lo part (bf16 operands), from the prepare    forward .. WY
  //   qglo, kglo [slot][HV][C][KP]    qg's and kg's lo parts (bf16 operands), from     forward .. scan
  //     bf16                          the prepare
  //   out [B,T,HV,V] q's dtype        the forward kernels' outputs (unused)            forward
  //   h [slot][HV][K*V] f32           chunk-start states (recompute_states only; the   forward .. state products
  //                                   layout of BackwardParams::layout)
  //   dh [slot][HV][K][V] f32         gradient of every chunk's end state              scan .. state products
  //   dvnew [slot][HV][C][V] f32      the scan's dv_new                                scan .. WY
  //   vnew, dbv [slot][HV][C][V] f32  (not with ws_sm90)                              WY .. state products
  //   dP, dL [slot][HV][C][C] f32                                                      WY .. grad
  //   dq, dk [row][HV][K] f32         per-v-head q/k gradients, before the GVA sum     state products .. tokens
  //                                   and the L2 norm's backward (first their state
  //                                   parts, dqg and dkbg, from the state products)
  //   dkg [row][HV][K] f32            the state products' dkg = v_new dH^T             state products .. grad
  //   dgam [slot][HV][K] f32          rowsum(S dH), the state decay's gate part        state products .. grad
  //   dbeta [row][HV][1 + nks] f32    beta's gradient in parts (the value side from    WY .. tokens
  //                                   the WY pass, then each key slice)
  //   dA [slot][HV][nks] f32, ddt [slot][HV][K] f32   per-chunk partial sums           grad .. params
  //   seg [segment][HV][KP][seg_ld] f32  the scan's segment results (segments > 0):    scan (pre-scan, merge, scan)
  //                                   E_s, then the merged end gradients, and M_s^T
  // Placement: first fit, largest part first (ties: earlier born, then the order above), each part at the lowest
  // offset where it shares no byte with a placed part whose life overlaps its own (inclusive: a kernel's inputs and
  // outputs never alias). Parts that die early (the prepare's tiles, Tm, out, dvnew, the forward's scratch) give their
  // bytes to parts born later. Deterministic; the total never exceeds the parts laid end to end.
  std::size_t off_seg = 0;
  std::size_t off_ulo = 0, off_qglo = 0, off_kglo = 0;
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
