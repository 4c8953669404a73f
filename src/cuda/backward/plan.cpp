#include "cuda/backward/plan.h"

#include <algorithm>
#include <string>

#include "kdakit/error.h"

namespace kdakit::cuda {

ForwardParams backward_forward_params(const BackwardParams& p) {
  ForwardParams f;
  f.in = p.in;
  f.state.layout = p.layout;
  f.state.initial_state = p.initial_state;
  f.chunk_size = p.chunk_size;
  f.safe_gate = p.safe_gate;
  return f;
}

BackwardLaunch plan_backward_launch(const BackwardParams& p, const detail::Plan& plan, const DeviceInfo& device,
                                    const Tuning& tuning) {
  const Problem& pr = plan.pr;
  BackwardLaunch bp;
  bp.fwd = plan_forward_launch(backward_forward_params(p), plan, device, tuning);  // checks the input dtypes
  bp.recompute_states = !p.chunk_states.present();
  bp.fwd.cfg.prepare_only = !bp.recompute_states;
  bp.slots = bp.fwd.slots;
  bp.rows = pr.B * pr.T;
  bp.nks = static_cast<int>((pr.K + kBwdKSlice - 1) / kBwdKSlice);
  const int C = p.chunk_size, KP = bp.fwd.cfg.KP;
  const std::size_t limit = tuning.smem_limit > 0 && static_cast<std::size_t>(tuning.smem_limit) < device.smem_optin
                                ? static_cast<std::size_t>(tuning.smem_limit)
                                : device.smem_optin;

  // The scan's tile: the widest value tile whose stage ring prefetches (the deeper ring first), else the widest with
  // one stage slot; the narrowest one-slot tile where nothing fits (the check below reports it). Wide tiles read each
  // workspace tile for more columns.
  const int esz = static_cast<int>(bp.fwd.esz);
  auto pick_scan = [&](int ring_lo, int ring_hi) {
    for (const int bv : {64, 32, 16}) {
      for (int ring = ring_hi; ring >= ring_lo; --ring) {
        if (bv <= bwd_scan_max_bv(KP) && bwd_scan_smem(esz, KP, bv, ring) <= limit) {
          bp.scan_bv = bv;
          bp.scan_ring = ring;
          return true;
        }
      }
    }
    return false;
  };
  if (!pick_scan(2, kBwdScanMaxRing) && !pick_scan(1, 1)) {
    bp.scan_bv = 16;
    bp.scan_ring = 1;
  }
  bp.vt = static_cast<int>((pr.V + bp.scan_bv - 1) / bp.scan_bv);
  bp.smem = backward_smem(C, KP, bwd_scan_smem(esz, KP, bp.scan_bv, bp.scan_ring));
  const std::size_t need = std::max({bp.smem.scan, bp.smem.wy, bp.smem.state, bp.smem.grad, bp.smem.merge});
  if (need > limit) {
    throw CudaError("kdakit: the CUDA backward's kernels need " + std::to_string(need) +
                    " bytes of shared memory per block with K = " + std::to_string(pr.K) + " (chunk_size " +
                    std::to_string(C) + "); device " + std::to_string(pr.device_index) + " allows " +
                    std::to_string(limit) + (C == 64 ? "; chunk_size=32 needs less" : ""));
  }

  // The workspace: the forward's, then the backward's parts.
  auto align = [](std::size_t x) { return (x + 255) & ~std::size_t(255); };
  const std::size_t tiles = static_cast<std::size_t>(bp.slots) * pr.HV;
  const std::size_t rows = static_cast<std::size_t>(bp.rows) * pr.HV;
  const std::size_t K = pr.K, V = pr.V, f = sizeof(float);
  std::size_t off = align(bp.fwd.total);
  bp.off_tm = off;    off = align(off + tiles * C * C * f);
  bp.off_out = off;   off = align(off + rows * V * dtype_size(p.in.q.dtype));  // the prepare zeroes its padded tail
  if (bp.recompute_states) {
    bp.off_h = off;   off = align(off + tiles * K * V * f);
  }
  bp.off_dh = off;    off = align(off + tiles * K * V * f);
  bp.off_dvnew = off; off = align(off + tiles * C * V * f);
  bp.off_vnew = off;  off = align(off + tiles * C * V * f);
  bp.off_dbv = off;   off = align(off + tiles * C * V * f);
  bp.off_dP = off;    off = align(off + tiles * C * C * f);
  bp.off_dL = off;    off = align(off + tiles * C * C * f);
  bp.off_dq = off;    off = align(off + rows * K * f);
  bp.off_dk = off;    off = align(off + rows * K * f);
  bp.off_dkg = off;   off = align(off + rows * K * f);
  bp.off_dgam = off;  off = align(off + tiles * K * f);
  bp.off_dbeta = off; off = align(off + rows * (1 + bp.nks) * f);
  bp.off_dA = off;    off = align(off + tiles * bp.nks * f);
  bp.off_ddt = off;   off = align(off + tiles * K * f);
  if (bp.fwd.seg_target > 1) {
    bp.segments = bp.fwd.segments;
    bp.seg_ld = bp.vt * bp.scan_bv + KP;
    bp.off_seg = off; off = align(off + static_cast<std::size_t>(bp.segments) * pr.HV * KP * bp.seg_ld * f);
  }
  bp.total = off;
  return bp;
}

}  // namespace kdakit::cuda
