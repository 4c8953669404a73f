#include "cuda/forward/plan.h"

#include <algorithm>
#include <string>

#include "cuda/checks.h"
#include "cuda/cp/segments.h"
#include "kdakit/error.h"

namespace kdakit::cuda {

ForwardSmem forward_smem(DType in, DType g, const ForwardConfig& cfg) {
  // g is read by its width (the prepare kernel's G_BYTES): float32, or 16 bits (bfloat16 or float16).
  const bool g32 = g == DType::kFloat32;
  switch (in) {
    case DType::kBFloat16: return g32 ? forward_smem<2, 2, 4>(cfg) : forward_smem<2, 2, 2>(cfg);
    case DType::kFloat16: return g32 ? forward_smem<2, 4, 4>(cfg) : forward_smem<2, 4, 2>(cfg);
    default: return g32 ? forward_smem<4, 4, 4>(cfg) : forward_smem<4, 4, 2>(cfg);
  }
}

ForwardLaunch plan_forward_launch(const ForwardParams& p, const detail::Plan& plan, const DeviceInfo& device,
                                  const Tuning& tuning) {
  require_kernel_dtypes(p.in);  // g in its own dtype: the prepare kernel reads it as it is (G_BYTES)
  const Problem& pr = plan.pr;
  ForwardLaunch fp;
  fp.cfg.chunk = p.chunk_size;
  fp.cfg.KP = pr.K <= 64 ? 64 : (pr.K <= 128 ? 128 : 256);
  fp.VP = static_cast<int>((pr.V + 63) / 64 * 64);
  fp.esz = p.in.q.dtype == DType::kBFloat16 ? 2 : 4;
  const int64_t C = p.chunk_size;
  if (pr.varlen && plan.cu_known) {
    fp.slots = pr.num_chunks;
    // Tokens past the last boundary are padding (spec §1.7): tail_slots more CTAs zero their output rows.
    fp.tail_slots = (std::max<int64_t>(0, pr.T - plan.cu[pr.N]) + C - 1) / C;
  } else if (pr.varlen) {
    // A bound of the chunks, sum ceil(len_n / C) <= (cu[N] + N (C - 1)) / C; its surplus over them,
    // ceil(T / C) + N - that >= (T - cu[N]) / C, covers the padded token tail's CTAs as well.
    fp.slots = (pr.T + C - 1) / C + pr.N;
  } else {
    fp.slots = pr.B * ((pr.T + C - 1) / C);
  }
  // Warpgroup MMAs for the recurrence on Hopper (sm_90): bf16 operands, chunk 64, K <= 128, 64- or 128-column tiles.
  // They give the same bits as the mma.sync kernels (tested).
  const bool wgmma = device.compute_capability == 90 && fp.esz == 2 && fp.cfg.KP <= 128 && C == 64 &&
                     tuning.forward_wgmma;
  // The recurrence's V tile: the widest that still gives every SM work.
  const int sms = device.sm_count;
  auto ctas = [&](int bv) { return pr.N * pr.HV * ((pr.V + bv - 1) / bv); };
  const int wide = fp.cfg.KP <= 128 ? 64 : 32;
  int bv = wide;
  while (bv > 16 && ctas(bv) < (3 * sms) / 4) bv /= 2;
  // More than one wave of 64-column CTAs (one CTA per SM: their shared memory) over sequences of one length:
  // 128-column tiles, whose kernel (recurrence_vrows_kernel: eight warps of independent value rows) runs a chunk step
  // of twice the columns in less than twice the time of a 64-column step, so half the waves win. With one wave of
  // 64-column CTAs the narrower tiles' shorter step wins. Sequences of different lengths: where the host knows them,
  // the estimate below decides; where it does not, 64 columns (the longest chain, longer with wide tiles, may set the
  // time). Either kernel gives the same bits. (Needs bf16 operands, K <= 128 and V in (64, 128]: the u workspace
  // rows are VP = 128 columns wide.)
  const bool wide128 = fp.cfg.KP <= 128 && fp.esz == 2 && pr.V > 64 && pr.V <= 128;
  const bool equal_lengths = !pr.varlen || (plan.cu_known && plan.max_len * pr.N == plan.cu[pr.N]);
  bool wide_wins = equal_lengths && ctas(64) > sms;
  if (!equal_lengths && plan.cu_known && pr.N <= kMaxOrdered) {
    // Known lengths that differ, run longest first (below): each width's time is about the longer of the longest
    // sequence's chain and the whole work spread over the SMs, in 64-column chunk steps; a 128-column step costs
    // kWideStep of them (measured: docs/perf-notes.md).
    constexpr double kWideStepMma = 1.75, kWideStepWgmma = 1.2;
    const double longest = static_cast<double>((plan.max_len + C - 1) / C), chunks = static_cast<double>(pr.num_chunks);
    const double t64 = std::max(longest, chunks * pr.HV * ((pr.V + 63) / 64) / sms);
    const double t128 =
        (wgmma ? kWideStepWgmma : kWideStepMma) * std::max(longest, chunks * pr.HV * ((pr.V + 127) / 128) / sms);
    wide_wins = t128 < t64;
  }
  if (bv == 64 && wide128 && wide_wins) bv = 128;
  // Context parallelism for few heads: where one sequence's wide-tile CTAs leave at least half the SMs idle, a
  // sequence of at least 2 * segment_tokens tokens is cut into up to seg_target segments of at least segment_tokens
  // (4096) tokens; seg_target = the SMs over the CTAs that the segments' tile (128 columns with warpgroup MMAs) gives
  // one sequence, at most 32. Both depend on the head count and the device only, never on the batch (batch
  // invariance).
  {
    const int seg_bv = wgmma && wide128 ? 128 : wide;
    const int64_t wide_ctas = pr.HV * ((pr.V + wide - 1) / wide), seg_ctas = pr.HV * ((pr.V + seg_bv - 1) / seg_bv);
    int target = 2 * wide_ctas <= sms ? static_cast<int>(std::min<int64_t>(32, sms / std::max<int64_t>(1, seg_ctas)))
                                      : 1;
    if (tuning.forward_segments >= 0) target = tuning.forward_segments;
    const int min_tokens = std::max(1, tuning.forward_segment_tokens);
    const int min_chunks = std::max<int>(1, (min_tokens + p.chunk_size - 1) / p.chunk_size);
    // Is any sequence long enough? (Fixed length, or known boundaries: exactly; otherwise: possibly.)
    const int64_t longest = !pr.varlen ? pr.T : (plan.cu_known ? plan.max_len : pr.T);
    const int64_t longest_chunks = (longest + p.chunk_size - 1) / p.chunk_size;
    if (target >= 2 && longest_chunks >= 2 * int64_t(min_chunks)) {
      fp.seg_target = target;
      fp.seg_min_chunks = min_chunks;
      // The segments supply the parallelism; wide tiles do the most work per chunk step (with warpgroup MMAs 128
      // columns).
      bv = seg_bv;
    }
  }
  // Developer override (Tuning::forward_bv) among the widths this configuration has; the result does not depend on it.
  if (const int want = tuning.forward_bv) {
    if (want == 16 || want == 32 || (want == 64 && fp.cfg.KP <= 128) || (want == 128 && wide128)) bv = want;
  }
  // Fit the device's shared memory: the chosen width first with its prefetch stage, then without, then narrower
  // tiles (A100: bf16 K = 128 runs 64-column tiles with one stage). The tile never changes a result.
  {
    const std::size_t limit = tuning.smem_limit > 0 && static_cast<std::size_t>(tuning.smem_limit) < device.smem_optin
                                  ? static_cast<std::size_t>(tuning.smem_limit)
                                  : device.smem_optin;
    const DType in = p.in.q.dtype, gt = p.in.g.dtype;
    ForwardConfig c = fp.cfg;
    bool fit = false;
    for (int w = bv; w >= 16 && !fit; w /= 2) {
      for (const bool one : {false, true}) {
        c.BV = w;
        c.one_stage = one;
        c.wgmma = wgmma && (w == 64 || w == 128);
        if (forward_smem(in, gt, c).recurrence <= limit) {
          fit = true;
          break;
        }
      }
    }
    const ForwardSmem need = forward_smem(in, gt, c);
    if (!fit || need.prepare > limit) {
      const bool rec = !fit;
      throw CudaError("kdakit: the chunked forward's " + std::string(rec ? "recurrence" : "prepare") +
                      " kernel needs " + std::to_string(rec ? need.recurrence : need.prepare) +
                      " bytes of shared memory per block for " + dtype_name(in) + " inputs with K = " +
                      std::to_string(pr.K) + " (chunk_size " + std::to_string(p.chunk_size) + "); device " +
                      std::to_string(pr.device_index) + " allows " + std::to_string(limit) +
                      (in == DType::kBFloat16 ? "" : "; bfloat16 inputs need about half") +
                      (!rec && p.chunk_size == 64 ? "; chunk_size=32 halves the prepare kernel's tiles" : ""));
    }
    bv = c.BV;
    fp.cfg.one_stage = c.one_stage;
    fp.cfg.wgmma = c.wgmma;
  }
  fp.cfg.BV = bv;
  fp.ordered = pr.varlen && fp.seg_target == 1 && pr.N > 1 && pr.N <= kMaxOrdered;

  // The workspace: segment slots first (their count sizes a part), then the parts one after another.
  fp.segments = pr.N;
  fp.cp_phase = static_cast<int>(p.cp_phase);
  if (fp.seg_target > 1 || fp.cp_phase != 0) {
    // Segment slots: exact for fixed length; otherwise a bound (a cut sequence of c chunks has at most
    // c / seg_min_chunks + 1 segments).
    if (!pr.varlen) {
      int64_t per = 0;
      fp.segments = pr.N * segments_of((pr.T + C - 1) / C, fp.seg_target, fp.seg_min_chunks, per);
    } else {
      fp.segments = pr.N + (fp.seg_min_chunks > 0 ? fp.slots / fp.seg_min_chunks : 0);
    }
    fp.seg_ld = static_cast<int>((pr.V + bv - 1) / bv * bv + fp.cfg.KP);
  }
  std::size_t off = 0;
  for (const WorkspacePart& part : forward_workspace_parts(fp, pr)) {
    *part.off = off;
    off = (off + part.bytes + 255) & ~std::size_t(255);
  }
  fp.total = off;
  return fp;
}

std::vector<WorkspacePart> forward_workspace_parts(ForwardLaunch& fp, const Problem& pr) {
  const std::size_t tiles = static_cast<std::size_t>(fp.slots) * pr.HV, C = fp.cfg.chunk, KP = fp.cfg.KP;
  const std::size_t offsets = 8 * static_cast<std::size_t>(pr.N + 1);
  std::vector<WorkspacePart> parts = {{&fp.off_offsets, offsets},
                                      {&fp.off_w, tiles * C * KP * fp.esz},
                                      {&fp.off_qg, tiles * C * KP * fp.esz},
                                      {&fp.off_kg, tiles * C * KP * fp.esz},
                                      {&fp.off_u, tiles * C * fp.VP * fp.esz},
                                      {&fp.off_a, tiles * C * C * fp.esz}};
  if (fp.esz == 2) parts.push_back({&fp.off_alo, tiles * C * C * fp.esz});  // Aqk's lo half
  parts.push_back({&fp.off_gam, tiles * KP * 4});
  if (fp.seg_ld > 0) {
    parts.push_back({&fp.off_seg_offsets, offsets});
    parts.push_back({&fp.off_seg, static_cast<std::size_t>(fp.segments) * pr.HV * KP * fp.seg_ld * 4});
  }
  if (fp.ordered) parts.push_back({&fp.off_order, 4 * static_cast<std::size_t>(pr.N)});
  return parts;
}

}  // namespace kdakit::cuda
