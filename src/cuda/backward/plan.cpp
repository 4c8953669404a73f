#include "cuda/backward/plan.h"

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "kdakit/error.h"

namespace kdakit::cuda {

namespace {

// A workspace part and its life: the launches (BwdStep) that first write and last read it.
struct LivePart {
  std::size_t* off;
  std::size_t bytes;
  int first, last;
};

// First fit, largest part first (ties: the earlier born, then table order): each part at the lowest 256-byte
// aligned offset where it overlaps no placed part whose life overlaps its own. Returns the total. The end never
// passes the sum of the aligned sizes: a part starts at 0 or at a placed part's end.
std::size_t place_parts(std::vector<LivePart>& parts) {
  auto align = [](std::size_t x) { return (x + 255) & ~std::size_t(255); };
  std::vector<std::size_t> order(parts.size());
  std::iota(order.begin(), order.end(), std::size_t(0));
  std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) {
    if (parts[x].bytes != parts[y].bytes) return parts[x].bytes > parts[y].bytes;
    return parts[x].first < parts[y].first;
  });
  std::vector<const LivePart*> placed, live;
  std::size_t total = 0;
  for (const std::size_t i : order) {
    LivePart& p = parts[i];
    live.clear();
    for (const LivePart* q : placed) {
      if (q->first <= p.last && p.first <= q->last) live.push_back(q);
    }
    std::sort(live.begin(), live.end(), [](const LivePart* x, const LivePart* y) { return *x->off < *y->off; });
    std::size_t at = 0;
    for (const LivePart* q : live) {
      if (at + p.bytes <= *q->off) break;
      at = std::max(at, align(*q->off + q->bytes));
    }
    *p.off = at;
    placed.push_back(&p);
    total = std::max(total, align(at + p.bytes));
  }
  return total;
}

}  // namespace

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
  bp.d_initial_only = p.d_initial_state_only;
  bp.recompute_states = !p.chunk_states.present() && !bp.d_initial_only;
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
  // workspace tile for more columns. A developer override of the width is tried first.
  const int esz = static_cast<int>(bp.fwd.esz);
  auto pick_scan = [&](int ring_lo, int ring_hi, int only) {
    for (const int bv : {64, 32, 16}) {
      if (only > 0 && bv != only) continue;
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
  const int only = tuning.backward_scan_bv;
  if (!(only > 0 && (pick_scan(2, kBwdScanMaxRing, only) || pick_scan(1, 1, only))) &&
      !pick_scan(2, kBwdScanMaxRing, 0) && !pick_scan(1, 1, 0)) {
    bp.scan_bv = 16;
    bp.scan_ring = 1;
  }
  bp.scan_sm90 = device.compute_capability == 90 && tuning.backward_wgmma && esz == 2 && C == 64 && KP <= 128 &&
                 (only == 0 || only == 64) && bwd_scan_sm90_smem(KP) <= limit;
  if (bp.scan_sm90) {
    bp.scan_bv = 64;
  }
  bp.vt = static_cast<int>((pr.V + bp.scan_bv - 1) / bp.scan_bv);
  const int split_parts = bwd_split_parts(p.in.q.dtype == DType::kFloat32);
  bp.grad_cache = tuning.backward_grad_cache && bwd_grad_cache_fits(C, limit, split_parts);
  bp.smem = backward_smem(C, KP,
                          bp.scan_sm90 ? bwd_scan_sm90_smem(KP) : bwd_scan_smem(esz, KP, bp.scan_bv, bp.scan_ring),
                          bp.grad_cache, split_parts);
  const bool states_f32 = !p.chunk_states.present() || p.chunk_states.dtype == DType::kFloat32;
  bp.ws_sm90 = device.compute_capability == 90 && tuning.backward_wgmma && esz == 2 && C == 64 && KP <= 128 &&
               pr.V <= 128 && pr.V % 4 == 0 && p.d_out.dtype == DType::kBFloat16 &&
               p.layout == StateLayout::kKV && states_f32 && bwd_wy_states_sm90_smem() <= limit;
  if (bp.ws_sm90) {
    bp.smem.wy = bwd_wy_states_sm90_smem();
    bp.smem.state = 0;
  }
  const std::size_t need = bp.d_initial_only
                               ? std::max(bp.smem.scan, bp.smem.merge)
                               : std::max({bp.smem.scan, bp.smem.wy, bp.smem.state, bp.smem.grad, bp.smem.merge});
  if (need > limit) {
    throw CudaError("kdakit: the CUDA backward's kernels need " + std::to_string(need) +
                    " bytes of shared memory per block with K = " + std::to_string(pr.K) + " (chunk_size " +
                    std::to_string(C) + "); device " + std::to_string(pr.device_index) + " allows " +
                    std::to_string(limit) + (C == 64 ? "; chunk_size=32 needs less" : ""));
  }

  // The workspace: the forward's parts and the backward's, each live from the launch that first writes it to the
  // last that reads it (plan.h), placed so that parts live at once never share bytes.
  const std::size_t tiles = static_cast<std::size_t>(bp.slots) * pr.HV;
  const std::size_t rows = static_cast<std::size_t>(bp.rows) * pr.HV;
  const std::size_t K = pr.K, V = pr.V, f = sizeof(float);
  std::vector<LivePart> parts;
  for (const WorkspacePart& w : forward_workspace_parts(bp.fwd, pr)) {
    // Chunk offsets: read by every backward kernel. w and u: read by the WY pass; qg, kg, Aqk (hi, lo) and gamma: by
    // the scan, and so is the segment table where the scan runs in segments. The rest (the forward's segment states,
    // the sequence order) serve the forward's launches alone.
    const ForwardLaunch& fl = bp.fwd;
    int last = kBwdForward;
    if (w.off == &fl.off_offsets) last = kBwdParams;
    else if (w.off == &fl.off_seg_offsets && fl.seg_target > 1) last = kBwdScan;
    else if (w.off == &fl.off_w || w.off == &fl.off_u) last = kBwdWy;
    else if (w.off == &fl.off_qg || w.off == &fl.off_kg || w.off == &fl.off_a || w.off == &fl.off_alo ||
             w.off == &fl.off_gam) last = kBwdScan;
    parts.push_back({w.off, w.bytes, kBwdForward, last});
  }
  // With the fused kernel, the state products' step is the WY pass's.
  const int states = bp.ws_sm90 ? kBwdWy : kBwdStates;
  auto place = [&] {
    if (bp.fwd.seg_target > 1) {  // the scan's segments: its pre-scan, merge and scan, all in the scan step
      bp.segments = bp.fwd.segments;
      bp.seg_ld = bp.vt * bp.scan_bv + KP;
      parts.push_back({&bp.off_seg, static_cast<std::size_t>(bp.segments) * pr.HV * KP * bp.seg_ld * f, kBwdScan,
                       kBwdScan});
    }
    bp.total = place_parts(parts);
    return bp;
  };
  if (esz == 2) {  // the scan's qg and kg lo parts (d_initial too depends on them)
    parts.push_back({&bp.off_qglo, tiles * C * KP * 2, kBwdForward, kBwdScan});
    parts.push_back({&bp.off_kglo, tiles * C * KP * 2, kBwdForward, kBwdScan});
  }
  if (!bp.d_initial_only) {  // Tm and u's lo part serve the WY pass
    parts.push_back({&bp.off_tm, tiles * C * C * f, kBwdForward, kBwdWy});
    if (esz == 2) parts.push_back({&bp.off_ulo, tiles * C * bp.fwd.VP * 2, kBwdForward, kBwdWy});
  }
  parts.push_back({&bp.off_out, rows * V * dtype_size(p.in.q.dtype), kBwdForward, kBwdForward});
  if (bp.d_initial_only) return place();  // the prepare's tiles and the scan's segments
  if (bp.recompute_states) parts.push_back({&bp.off_h, tiles * K * V * f, kBwdForward, states});
  parts.push_back({&bp.off_dh, tiles * K * V * f, kBwdScan, states});
  parts.push_back({&bp.off_dvnew, tiles * C * V * f, kBwdScan, kBwdWy});
  if (!bp.ws_sm90) {
    parts.push_back({&bp.off_vnew, tiles * C * V * f, kBwdWy, kBwdStates});
    parts.push_back({&bp.off_dbv, tiles * C * V * f, kBwdWy, kBwdStates});
  }
  parts.push_back({&bp.off_dP, tiles * C * C * f, kBwdWy, kBwdGrad});
  parts.push_back({&bp.off_dL, tiles * C * C * f, kBwdWy, kBwdGrad});
  parts.push_back({&bp.off_dq, rows * K * f, states, kBwdTokens});
  parts.push_back({&bp.off_dk, rows * K * f, states, kBwdTokens});
  parts.push_back({&bp.off_dkg, rows * K * f, states, kBwdGrad});
  parts.push_back({&bp.off_dgam, tiles * K * f, states, kBwdGrad});
  parts.push_back({&bp.off_dbeta, rows * (1 + bp.nks) * f, kBwdWy, kBwdTokens});
  parts.push_back({&bp.off_dA, tiles * bp.nks * f, kBwdGrad, kBwdParams});
  parts.push_back({&bp.off_ddt, tiles * K * f, kBwdGrad, kBwdParams});
  return place();
}

}  // namespace kdakit::cuda
