// The CUDA backward's launch planner (src/cuda/backward/plan.cpp) as a pure function: the forward pass it runs (the
// forward's plan, prepare-only with saved states), its kernels' tiles and shared memory, the fit on smaller GPUs, the
// workspace layout and the dtype checks, for device facts given here (no GPU, no environment overrides).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "common/plan.h"
#include "cuda/backward/plan.h"
#include "cuda/cp/segments.h"
#include "cuda/device.h"
#include "cuda/forward/plan.h"
#include "cuda/tuning.h"
#include "device_views.h"

namespace kdakit::test {
namespace {

using cuda::BackwardLaunch;
using cuda::DeviceInfo;
using cuda::Tuning;

struct BackwardCase {
  DeviceInputs x;
  BackwardParams p;
  std::vector<int64_t> cu_host;
  BackwardCase(int64_t B, int64_t T, int64_t H, int64_t HV = 0, int64_t K = 128, int64_t V = 128,
               DType dtype = DType::kBFloat16, int chunk = 64)
      : x(B, T, H, HV ? HV : H, K, V, dtype) {
    const int64_t hv = HV ? HV : H;
    init(B, T, H, hv, K, V, dtype, B);
    p.chunk_size = chunk;
  }
  // Varlen (B = 1), the lengths known on the host unless host_lengths is false.
  BackwardCase(const std::vector<int64_t>& lens, int64_t H, bool host_lengths)
      : x(1, total(lens), H, H, 128, 128, DType::kBFloat16, static_cast<int64_t>(lens.size())) {
    const int64_t N = static_cast<int64_t>(lens.size());
    cu_host.assign(1, 0);
    for (const int64_t l : lens) cu_host.push_back(cu_host.back() + l);
    init(1, total(lens), H, H, 128, 128, DType::kBFloat16, N);
    if (host_lengths) p.in.cu_seqlens_host = make_view(cu_host.data(), DType::kInt64, {N + 1});
  }
  void init(int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V, DType dtype, int64_t N) {
    p.in = x.in;
    p.initial_state = device_view(DType::kFloat32, {N, HV, K, V});
    p.d_initial_state = device_view(DType::kFloat32, {N, HV, K, V});
    p.d_final_state = device_view(DType::kFloat32, {N, HV, K, V});
    p.d_out = device_view(dtype, {B, T, HV, V});
    p.dq = device_view(dtype, {B, T, H, K});
    p.dk = device_view(dtype, {B, T, H, K});
    p.dv = device_view(dtype, {B, T, HV, V});
    p.dg = device_view(dtype, {B, T, HV, K});
    p.dbeta = device_view(dtype, {B, T, HV});
    p.dA_log = device_view(DType::kFloat32, {HV});
    p.ddt_bias = device_view(DType::kFloat32, {HV * K});
  }
  static int64_t total(const std::vector<int64_t>& lens) {
    int64_t t = 0;
    for (const int64_t l : lens) t += l;
    return t;
  }
  detail::Plan plan() const { return detail::plan_backward(p); }
  BackwardLaunch launch(const DeviceInfo& dev = kH200, const Tuning& tune = Tuning()) const {
    return cuda::plan_backward_launch(p, plan(), dev, tune);
  }
};

// The launches of a backward call in stream order (backward/run.cu, launch.cuh), written here apart from the planner:
// the forward (chunk offsets, prepare, state pass), the scan, the WY pass, the state products, the gradient kernel,
// the token and the parameter reductions.
enum Step { kFwd, kScan, kWy, kStates, kGrad, kTokens, kParams };

struct Part {
  std::size_t off, bytes;
  Step first, last;  // first write, last read
  const char* name;
};

// The workspace's parts with their sizes and lives, from the kernels' reads and writes.
std::vector<Part> workspace_parts(const BackwardLaunch& b, const BackwardParams& p, const Problem& pr) {
  const cuda::ForwardLaunch& f = b.fwd;
  const std::size_t C = p.chunk_size, tiles = static_cast<std::size_t>(b.slots) * pr.HV;
  const std::size_t rows = static_cast<std::size_t>(b.rows) * pr.HV, K = pr.K, V = pr.V, KP = f.cfg.KP;
  // The Hopper kernel runs the WY pass and the state products in one launch, without v_new and dbv in the workspace.
  const Step states = b.ws_sm90 ? kWy : kStates;
  std::vector<Part> parts = {{f.off_offsets, 8 * std::size_t(pr.N + 1), kFwd, kParams, "chunk offsets"},
                             {f.off_w, tiles * C * KP * f.esz, kFwd, kWy, "w"},
                             {f.off_qg, tiles * C * KP * f.esz, kFwd, kScan, "qg"},
                             {f.off_kg, tiles * C * KP * f.esz, kFwd, kScan, "kg"},
                             {f.off_u, tiles * C * f.VP * f.esz, kFwd, kWy, "u"},
                             {f.off_a, tiles * C * C * f.esz, kFwd, kScan, "Aqk"},
                             {f.off_gam, tiles * KP * 4, kFwd, kScan, "gamma"},
                             {b.off_tm, tiles * C * C * 4, kFwd, kWy, "Tm"},
                             {b.off_out, rows * V * dtype_size(p.in.q.dtype), kFwd, kFwd, "forward outputs"},
                             {b.off_dh, tiles * K * V * 4, kScan, states, "dh"},
                             {b.off_dvnew, tiles * C * V * 4, kScan, kWy, "dv_new"},
                             {b.off_dP, tiles * C * C * 4, kWy, kGrad, "dP"},
                             {b.off_dL, tiles * C * C * 4, kWy, kGrad, "dL"},
                             {b.off_dq, rows * K * 4, states, kTokens, "dq"},
                             {b.off_dk, rows * K * 4, states, kTokens, "dk"},
                             {b.off_dkg, rows * K * 4, states, kGrad, "dkg"},
                             {b.off_dgam, tiles * K * 4, states, kGrad, "rowsum(S dH)"},
                             {b.off_dbeta, rows * (1 + b.nks) * 4, kWy, kTokens, "dbeta"},
                             {b.off_dA, tiles * b.nks * 4, kGrad, kParams, "dA_log"},
                             {b.off_ddt, tiles * K * 4, kGrad, kParams, "ddt_bias"}};
  if (f.esz == 2) parts.push_back({f.off_alo, tiles * C * C * f.esz, kFwd, kScan, "Aqk lo"});
  if (f.esz == 2) parts.push_back({b.off_ulo, tiles * C * f.VP * 2, kFwd, kWy, "u lo"});
  if (f.esz == 2) parts.push_back({b.off_qglo, tiles * C * KP * 2, kFwd, kScan, "qg lo"});
  if (f.esz == 2) parts.push_back({b.off_kglo, tiles * C * KP * 2, kFwd, kScan, "kg lo"});
  if (f.seg_ld > 0) {
    // The segment table: the scan reads it where it runs in segments.
    parts.push_back({f.off_seg_offsets, 8 * std::size_t(pr.N + 1), kFwd, b.segments > 0 ? kScan : kFwd,
                     "segment offsets"});
    parts.push_back({f.off_seg, std::size_t(f.segments) * pr.HV * KP * f.seg_ld * 4, kFwd, kFwd, "segment states"});
  }
  if (f.ordered) parts.push_back({f.off_order, 4 * std::size_t(pr.N), kFwd, kFwd, "order"});
  if (b.recompute_states) parts.push_back({b.off_h, tiles * K * V * 4, kFwd, states, "chunk states"});
  if (!b.ws_sm90) {
    parts.push_back({b.off_vnew, tiles * C * V * 4, kWy, kStates, "v_new"});
    parts.push_back({b.off_dbv, tiles * C * V * 4, kWy, kStates, "dbv"});
  }
  if (b.segments > 0) {  // the scan's pre-scan, merge and scan
    parts.push_back({b.off_seg, std::size_t(b.segments) * pr.HV * KP * b.seg_ld * 4, kScan, kScan, "scan segments"});
  }
  return parts;
}

// The parts laid end to end, 256-byte aligned: the workspace without sharing.
std::size_t unshared_total(const std::vector<Part>& parts) {
  std::size_t t = 0;
  for (const Part& x : parts) t += (x.bytes + 255) / 256 * 256;
  return t;
}

// Every part is 256-byte aligned and inside the total, and shares no byte with a part live during any of the same
// launches.
void expect_parts_apart(const std::vector<Part>& parts, std::size_t total) {
  for (const Part& x : parts) {
    EXPECT_EQ(x.off % 256, 0u) << x.name;
    EXPECT_LE(x.off + x.bytes, total) << x.name << " ends past the workspace";
  }
  for (std::size_t i = 0; i < parts.size(); ++i) {
    for (std::size_t j = i + 1; j < parts.size(); ++j) {
      const Part &x = parts[i], &y = parts[j];
      const bool together = x.first <= y.last && y.first <= x.last;
      const bool shared = x.bytes > 0 && y.bytes > 0 && x.off < y.off + y.bytes && y.off < x.off + x.bytes;
      EXPECT_FALSE(together && shared) << x.name << " and " << y.name << " live at once in the same bytes";
    }
  }
}

// The workspace's parts apart (expect_parts_apart), the total at most the unshared one.
void expect_workspace_layout(const BackwardLaunch& b, const BackwardParams& p, const Problem& pr) {
  const std::vector<Part> parts = workspace_parts(b, p, pr);
  expect_parts_apart(parts, b.total);
  EXPECT_LE(b.total, unshared_total(parts));
}

TEST(BackwardPlan, RunsTheForwardsPlanAndRecomputesTheStates) {
  const BackwardCase c(2, 4096, 8);
  const BackwardLaunch b = c.launch();
  const cuda::ForwardLaunch f =
      cuda::plan_forward_launch(cuda::backward_forward_params(c.p), c.plan(), kH200, Tuning());
  EXPECT_TRUE(b.recompute_states);
  EXPECT_FALSE(b.fwd.cfg.prepare_only);
  EXPECT_EQ(b.fwd.cfg.KP, f.cfg.KP);
  EXPECT_EQ(b.fwd.cfg.BV, f.cfg.BV);
  EXPECT_EQ(b.fwd.total, f.total);
  EXPECT_EQ(b.slots, 2 * 64);
  EXPECT_EQ(b.rows, 2 * 4096);
  expect_workspace_layout(b, c.p, c.plan().pr);
}

// Few heads and a long sequence: the forward cuts it, and the reverse scan takes the same cut (the forward's segment
// table) with its own segment buffer: E_s over the scan's value tiles, then M_s^T.
TEST(BackwardPlan, LongSequencesOfFewHeadsScanInSegments) {
  for (const bool saved : {false, true}) {
    BackwardCase c(1, 65536, 8);
    if (saved) c.p.chunk_states = device_view(DType::kFloat32, {1, 1024, 8, 128, 128});
    const BackwardLaunch b = c.launch();
    ASSERT_GT(b.fwd.seg_target, 1) << "the forward cuts the sequence";
    ASSERT_GT(b.fwd.seg_ld, 0) << "its segment table is in the workspace";
    EXPECT_EQ(b.segments, b.fwd.segments);
    int64_t per = 0;
    EXPECT_EQ(b.segments, cuda::segments_of(1024, b.fwd.seg_target, b.fwd.seg_min_chunks, per));
    EXPECT_GT(b.segments, 1);
    EXPECT_EQ(b.seg_ld, b.vt * b.scan_bv + b.fwd.cfg.KP);
    EXPECT_GE(b.seg_ld - b.fwd.cfg.KP, 128) << "every value column";
    EXPECT_EQ(b.smem.merge, cuda::bwd_merge_smem(b.fwd.cfg.KP));
    expect_workspace_layout(b, c.p, c.plan().pr);
  }
  // Many heads: no cut, no segment buffer.
  const BackwardLaunch u = BackwardCase(1, 65536, 64).launch();
  EXPECT_EQ(u.fwd.seg_target, 1);
  EXPECT_EQ(u.segments, 0);
  EXPECT_EQ(u.seg_ld, 0);
  // Varlen with lengths unknown on the host: segment slots are the forward's bound.
  const BackwardCase vc({40000, 20000, 100}, 4, false);
  const BackwardLaunch v = vc.launch();
  ASSERT_GT(v.fwd.seg_target, 1);
  EXPECT_EQ(v.segments, v.fwd.segments);
  expect_workspace_layout(v, vc.p, vc.plan().pr);
}

TEST(BackwardPlan, SavedStatesRunThePrepareOnly) {
  BackwardCase c(2, 1000, 4, 8, 64, 64);
  c.p.chunk_states = device_view(DType::kFloat32, {2, 16, 8, 64, 64});
  const BackwardLaunch b = c.launch();
  EXPECT_FALSE(b.recompute_states);
  EXPECT_TRUE(b.fwd.cfg.prepare_only);
  expect_workspace_layout(b, c.p, c.plan().pr);
  BackwardCase r(2, 1000, 4, 8, 64, 64);
  EXPECT_LT(b.total, r.launch().total) << "no chunk states in the workspace";
}

// d_initial_state_only: the forward's prepare (no state pass, no Tm or u lo part) and the scan; the workspace holds
// the prepare's tiles (with the scan's qg and kg lo parts), the forward's scratch and the scan's segments only,
// placed apart where they live together.
TEST(BackwardPlan, InitialStateGradientOnlyRunsThePrepareAndTheScan) {
  for (const int64_t T : {1000, 65536}) {  // the long one scans in segments
    BackwardCase c(1, T, T > 1000 ? 8 : 4, T > 1000 ? 8 : 8, 128, 128);
    const BackwardLaunch full = c.launch();
    c.p.d_initial_state_only = true;
    c.p.initial_state = TensorView();
    for (TensorView* g : {&c.p.dq, &c.p.dk, &c.p.dv, &c.p.dg, &c.p.dbeta, &c.p.dA_log, &c.p.ddt_bias}) *g = TensorView();
    const BackwardLaunch b = c.launch();
    EXPECT_TRUE(b.d_initial_only);
    EXPECT_FALSE(b.recompute_states);
    EXPECT_TRUE(b.fwd.cfg.prepare_only);
    EXPECT_EQ(b.segments, full.segments);
    EXPECT_LT(b.total, full.total / 2) << "no chunk states, gradient parts or Tm";
    const std::vector<std::string> kept = {"chunk offsets", "w", "qg", "kg", "u", "Aqk", "gamma", "forward outputs",
                                           "Aqk lo", "qg lo", "kg lo", "segment offsets", "segment states", "order",
                                           "scan segments"};
    std::vector<Part> parts;
    for (const Part& x : workspace_parts(b, c.p, c.plan().pr)) {
      if (std::find(kept.begin(), kept.end(), x.name) != kept.end()) parts.push_back(x);
    }
    expect_parts_apart(parts, b.total);
  }
}

// The split context-parallel backward (BackwardParams::cp_phase): the summary (no gradient outputs, no d_final_state)
// and the finish plan the same workspace, part for part, so that the finish reads what the summary left; what the
// halves refuse names the argument.
TEST(BackwardPlan, SplitContextParallelHalvesShareOneWorkspace) {
  for (const int64_t T : {1000, 65536}) {  // the long one scans in segments
    BackwardCase finish(1, T, 8);
    finish.p.cp_phase = CpPhase::kFinish;
    BackwardCase summary = finish;
    summary.p.cp_phase = CpPhase::kSummary;
    summary.p.d_final_state = TensorView();
    for (TensorView* g : {&summary.p.dq, &summary.p.dk, &summary.p.dv, &summary.p.dg, &summary.p.dbeta,
                          &summary.p.dA_log, &summary.p.ddt_bias}) {
      *g = TensorView();
    }
    const BackwardLaunch a = summary.launch(), b = finish.launch();
    EXPECT_EQ(a.segments, b.segments);
    EXPECT_EQ(T > 1000, a.segments > 1);
    const std::vector<Part> pa = workspace_parts(a, summary.p, summary.plan().pr);
    const std::vector<Part> pb = workspace_parts(b, finish.p, finish.plan().pr);
    ASSERT_EQ(pa.size(), pb.size());
    for (std::size_t i = 0; i < pa.size(); ++i) {
      EXPECT_EQ(pa[i].off, pb[i].off) << pa[i].name;
      EXPECT_EQ(pa[i].bytes, pb[i].bytes) << pa[i].name;
    }
    EXPECT_EQ(a.total, b.total);
    BackwardCase no_initial = summary;  // a rank whose first sequence starts there
    no_initial.p.initial_state = TensorView();
    no_initial.p.d_initial_state = TensorView();
    EXPECT_EQ(no_initial.launch().total, a.total);
  }
  BackwardCase s(1, 1000, 8);
  s.p.cp_phase = CpPhase::kSummary;
  for (TensorView* g : {&s.p.dq, &s.p.dk, &s.p.dv, &s.p.dg, &s.p.dbeta, &s.p.dA_log, &s.p.ddt_bias}) *g = TensorView();
  expect_rejected(s, "d_final_state", "zero d_final_state");
  s.p.d_final_state = TensorView();
  BackwardCase with_dq = s;
  with_dq.p.dq = device_view(DType::kBFloat16, {1, 1000, 8, 128});
  expect_rejected(with_dq, "dq", "kFinish call writes it");
  BackwardCase only = s;
  only.p.d_initial_state_only = true;
  expect_rejected(only, "d_initial_state_only", "not taken with cp_phase");
  BackwardCase two(2, 1000, 8);
  two.p.cp_phase = CpPhase::kFinish;
  expect_rejected(two, "cp_phase", "one sequence per call, got 2");
  BackwardCase varlen({500, 500}, 8, true);
  varlen.p.cp_phase = CpPhase::kFinish;
  expect_rejected(varlen, "cu_seqlens", "not taken with cp_phase");
}

TEST(BackwardPlan, TilesAndSlicesCoverOddHeadSizes) {
  for (const auto& kv : std::vector<std::pair<int64_t, int64_t>>{{16, 16}, {60, 100}, {100, 60}, {256, 256}}) {
    const BackwardCase c(1, 300, 2, 4, kv.first, kv.second);
    const BackwardLaunch b = c.launch();
    EXPECT_TRUE(b.scan_bv == 16 || b.scan_bv == 32 || b.scan_bv == 64) << b.scan_bv;
    EXPECT_LE(b.scan_bv, cuda::bwd_scan_max_bv(b.fwd.cfg.KP));
    EXPECT_EQ(b.vt, (kv.second + b.scan_bv - 1) / b.scan_bv);
    EXPECT_EQ(b.nks, (kv.first + 15) / 16);
    EXPECT_EQ(b.fwd.cfg.KP, kv.first <= 64 ? 64 : (kv.first <= 128 ? 128 : 256));
    expect_workspace_layout(b, c.p, c.plan().pr);
  }
}

TEST(BackwardPlan, SharedMemoryFitsAmpereAdaAndHopper) {
  for (const DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (const int chunk : {32, 64}) {
      const BackwardCase c(1, 256, 1, 1, 256, 256, dt, chunk);
      const BackwardLaunch b = c.launch(kH200);
      const int esz = dt == DType::kBFloat16 ? 2 : 4, parts = cuda::bwd_split_parts(dt == DType::kFloat32);
      EXPECT_EQ(b.smem.scan, cuda::bwd_scan_smem(esz, 256, b.scan_bv, b.scan_ring));
      EXPECT_GE(b.scan_ring, 2) << "Hopper prefetches the scan's tiles";
      EXPECT_EQ(b.smem.wy, cuda::bwd_wy_smem(chunk, 256));
      EXPECT_EQ(b.smem.state, cuda::bwd_state_smem(chunk));
      // Two cached gradient CTAs fit a Hopper multiprocessor, except with float32 inputs' three-part cache at chunk 64.
      EXPECT_EQ(b.grad_cache, dt != DType::kFloat32 || chunk == 32);
      EXPECT_EQ(b.grad_cache, cuda::bwd_grad_cache_fits(chunk, kH200.smem_optin, parts));
      EXPECT_EQ(b.smem.grad, cuda::bwd_grad_smem(chunk, b.grad_cache, parts));
      EXPECT_LE(2 * (b.smem.grad + 1024), kH200.smem_optin + 1024);
      EXPECT_LE(b.smem.scan, kH200.smem_optin);
      for (const std::size_t s : {b.smem.wy, b.smem.state, cuda::bwd_grad_smem(chunk, false, parts)}) {
        EXPECT_LE(s, kAda.smem_optin);
      }
      // The A100 and Ada (bf16, where the forward fits both): the cached form where two of it fit a multiprocessor
      // (chunk 32 on the A100), else the uncached one (chunk 64 on both).
      for (const DeviceInfo& dev : {kA100, kAda}) {
        const BackwardLaunch s = BackwardCase(1, 256, 1, 1, 128, 128, DType::kBFloat16, chunk).launch(dev);
        EXPECT_EQ(s.grad_cache, cuda::bwd_grad_cache_fits(chunk, dev.smem_optin, 2));
        EXPECT_EQ(s.smem.grad, cuda::bwd_grad_smem(chunk, s.grad_cache, 2));
        if (chunk == 64) EXPECT_FALSE(s.grad_cache);
      }
      EXPECT_LE(2 * (cuda::bwd_grad_smem(chunk, false, parts) + 1024), kA100.smem_optin + 1024);
      Tuning no_cache;
      no_cache.backward_grad_cache = false;
      EXPECT_FALSE(c.launch(kH200, no_cache).grad_cache);
      for (const int bv : {16, 32}) {  // the scan's width override, where it fits
        Tuning narrow;
        narrow.backward_scan_bv = bv;
        const BackwardLaunch n = c.launch(kH200, narrow);
        EXPECT_EQ(n.scan_bv, bv);
        EXPECT_EQ(n.vt, (256 + bv - 1) / bv);
      }
    }
  }
  // The scan's tile narrows (or stops prefetching) to fit smaller GPUs: wherever the forward fits, the backward does.
  for (const DeviceInfo& dev : {kH200, kA100, kAda}) {
    for (const int64_t K : {64, 128, 256}) {
      for (const DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
        const BackwardCase c(1, 256, 1, 1, K, K, dt);
        try {
          cuda::plan_forward_launch(cuda::backward_forward_params(c.p), c.plan(), dev, Tuning());
        } catch (const CudaError&) {
          continue;
        }
        BackwardLaunch b;
        EXPECT_NO_THROW(b = c.launch(dev)) << "K = " << K << " " << dtype_name(dt);
        EXPECT_LE(b.smem.scan, dev.smem_optin) << "K = " << K << " " << dtype_name(dt);
      }
    }
  }
  // bf16 K = 128 on Ada (99 KB), float32 K = 128 on an A100 (163 KB): the forward's kernels fit there too, and the
  // scan keeps its prefetch.
  EXPECT_GE(BackwardCase(1, 256, 1, 1, 128, 128).launch(kAda).scan_ring, 2);
  EXPECT_GE(BackwardCase(1, 256, 1, 1, 128, 128, DType::kFloat32).launch(kA100).scan_ring, 2);
  // bf16 K = 128 on Hopper: 64-column tiles with the deepest ring.
  const BackwardLaunch h = BackwardCase(1, 256, 1, 1, 128, 128).launch(kH200);
  EXPECT_EQ(h.scan_bv, 64);
  EXPECT_EQ(h.scan_ring, cuda::kBwdScanMaxRing);
}

TEST(BackwardPlan, HopperFusesTheWyPassAndTheStateProducts) {
  // Hopper, bf16 inputs and cotangent, chunk 64, K <= 128, V <= 128 (a multiple of 4), fp32 [K][V] states.
  for (const int64_t K : {64, 100, 128}) {
    const BackwardLaunch b = BackwardCase(1, 256, 2, 2, K, 128).launch(kH200);
    EXPECT_TRUE(b.ws_sm90) << "K = " << K;
    EXPECT_EQ(b.smem.wy, cuda::bwd_wy_states_sm90_smem());
    EXPECT_LE(b.smem.wy, kH200.smem_optin);
  }
  EXPECT_FALSE(BackwardCase(1, 256, 2, 2, 256, 128).launch(kH200).ws_sm90) << "K = 256";
  EXPECT_FALSE(BackwardCase(1, 256, 2, 2, 128, 256).launch(kH200).ws_sm90) << "V = 256";
  EXPECT_FALSE(BackwardCase(1, 256, 2, 2, 128, 126).launch(kH200).ws_sm90) << "V % 4 != 0";
  EXPECT_FALSE(BackwardCase(1, 256, 2, 2, 128, 128, DType::kBFloat16, 32).launch(kH200).ws_sm90) << "chunk 32";
  EXPECT_FALSE(BackwardCase(1, 256, 2, 2, 128, 128, DType::kFloat32).launch(kH200).ws_sm90) << "float32";
  EXPECT_FALSE(BackwardCase(1, 256, 2, 2, 128, 128, DType::kFloat16).launch(kH200).ws_sm90) << "float16";
  EXPECT_FALSE(BackwardCase(1, 256, 2, 2).launch(kA100).ws_sm90) << "A100";
  BackwardCase vk(1, 256, 2, 2);
  vk.p.layout = StateLayout::kVK;
  EXPECT_FALSE(vk.launch(kH200).ws_sm90) << "[V][K] states";
  BackwardCase do32(1, 256, 2, 2);
  do32.p.d_out = device_view(DType::kFloat32, {1, 256, 2, 128});
  EXPECT_FALSE(do32.launch(kH200).ws_sm90) << "fp32 cotangent";
  Tuning off;
  off.backward_wgmma = false;
  EXPECT_FALSE(BackwardCase(1, 256, 2, 2).launch(kH200, off).ws_sm90);
}

TEST(BackwardPlan, HopperScansOnWarpgroupMmas) {
  // Hopper, bf16 tiles, chunk 64, K <= 128: the warpgroup-MMA scan at 64 value columns, whatever the cotangent's dtype
  // and the state layout.
  for (const int64_t K : {64, 100, 128}) {
    for (const int64_t V : {36, 128, 256}) {
      const BackwardLaunch b = BackwardCase(1, 256, 2, 2, K, V).launch(kH200);
      EXPECT_TRUE(b.scan_sm90) << "K = " << K << ", V = " << V;
      EXPECT_EQ(b.scan_bv, 64);
      EXPECT_EQ(b.vt, (V + 63) / 64);
      EXPECT_EQ(b.smem.scan, cuda::bwd_scan_sm90_smem(b.fwd.cfg.KP));
      EXPECT_LE(b.smem.scan, kH200.smem_optin);
    }
  }
  BackwardCase do32(1, 256, 2, 2);
  do32.p.d_out = device_view(DType::kFloat32, {1, 256, 2, 128});
  EXPECT_TRUE(do32.launch(kH200).scan_sm90) << "fp32 cotangent";
  BackwardCase cut(1, 65536, 8);
  const BackwardLaunch c = cut.launch(kH200);
  EXPECT_TRUE(c.scan_sm90);
  EXPECT_EQ(c.seg_ld, c.vt * 64 + c.fwd.cfg.KP) << "the segments' rows at the Hopper scan's tile";
  EXPECT_FALSE(BackwardCase(1, 256, 2, 2, 256, 128).launch(kH200).scan_sm90) << "K = 256";
  EXPECT_FALSE(BackwardCase(1, 256, 2, 2, 128, 128, DType::kBFloat16, 32).launch(kH200).scan_sm90) << "chunk 32";
  EXPECT_FALSE(BackwardCase(1, 256, 2, 2, 128, 128, DType::kFloat32).launch(kH200).scan_sm90) << "float32";
  EXPECT_FALSE(BackwardCase(1, 256, 2, 2, 128, 128, DType::kFloat16).launch(kH200).scan_sm90) << "float16";
  EXPECT_FALSE(BackwardCase(1, 256, 2, 2).launch(kA100).scan_sm90) << "A100";
  Tuning off;
  off.backward_wgmma = false;
  const BackwardLaunch o = BackwardCase(1, 256, 2, 2).launch(kH200, off);
  EXPECT_FALSE(o.scan_sm90);
  EXPECT_EQ(o.smem.scan, cuda::bwd_scan_smem(2, 128, o.scan_bv, o.scan_ring));
  for (const int bv : {16, 32}) {  // another width asked for: the mma.sync scan
    Tuning narrow;
    narrow.backward_scan_bv = bv;
    const BackwardLaunch n = BackwardCase(1, 256, 2, 2).launch(kH200, narrow);
    EXPECT_FALSE(n.scan_sm90) << bv;
    EXPECT_EQ(n.scan_bv, bv);
  }
  Tuning wide;
  wide.backward_scan_bv = 64;
  EXPECT_TRUE(BackwardCase(1, 256, 2, 2).launch(kH200, wide).scan_sm90);
}

TEST(BackwardPlan, TooLittleSharedMemoryIsACudaError) {
  // bf16, K = 64, chunk 64: the forward's kernels fit 80 KB, the backward's state products (84 KB) do not.
  Tuning small;
  small.smem_limit = 80 * 1024;
  const BackwardCase c(1, 256, 1, 1, 64, 64);
  ASSERT_GT(cuda::bwd_state_smem(64), static_cast<std::size_t>(small.smem_limit));
  try {
    c.launch(kH200, small);
    FAIL() << "expected CudaError";
  } catch (const CudaError& e) {
    EXPECT_NE(std::string(e.what()).find("backward"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("chunk_size=32"), std::string::npos) << e.what();
  }
  BackwardCase c32(1, 256, 1, 1, 64, 64, DType::kBFloat16, 32);
  EXPECT_NO_THROW(c32.launch(kH200, small));
}

TEST(BackwardPlan, VarlenSlotsExactWithHostLengthsAndBoundedWithout) {
  const std::vector<int64_t> lens = {1, 15, 0, 64, 65, 300};
  const BackwardCase known(lens, 2, true), device_only(lens, 2, false);
  const BackwardLaunch a = known.launch(), b = device_only.launch();
  EXPECT_EQ(a.slots, 1 + 1 + 0 + 1 + 2 + 5);
  EXPECT_EQ(b.slots, (BackwardCase::total(lens) + 63) / 64 + 6);
  EXPECT_GE(b.slots, a.slots);
  expect_workspace_layout(a, known.p, known.plan().pr);
  expect_workspace_layout(b, device_only.p, device_only.plan().pr);
}

TEST(BackwardPlan, KernelDtypesAreChecked) {
  BackwardCase c(1, 64, 1);
  c.p.in.v = device_view(DType::kFloat32, {1, 64, 1, 128});
  try {
    c.launch();
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()).rfind("v:", 0), 0u) << e.what();
  }
}

TEST(BackwardPlan, WorkspacePartsLiveAtOnceNeverShareBytes) {
  for (const DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (const int chunk : {32, 64}) {
      for (const int64_t K : {16, 60, 100, 128, 256}) {
        for (const int64_t V : {16, 60, 100, 128, 256}) {
          for (const bool saved : {false, true}) {
            BackwardCase c(2, 300, 2, 4, K, V, dt, chunk);  // GVA: 2 q/k heads, 4 v-heads
            if (saved) c.p.chunk_states = device_view(DType::kFloat32, {2, (300 + chunk - 1) / chunk, 4, K, V});
            SCOPED_TRACE(std::string(dtype_name(dt)) + " chunk " + std::to_string(chunk) + " K " +
                         std::to_string(K) + " V " + std::to_string(V) + (saved ? " saved" : ""));
            const BackwardLaunch b = c.launch();
            EXPECT_EQ(b.recompute_states, !saved);
            expect_workspace_layout(b, c.p, c.plan().pr);
          }
        }
      }
    }
  }
  // Varlen (ordered sequences; lengths known on the host or not), and context-parallel segments (few heads, long
  // sequences), with and without saved states.
  for (const bool host : {true, false}) {
    const BackwardCase v({1, 15, 0, 64, 65, 300, 4097}, 2, host);
    expect_workspace_layout(v.launch(), v.p, v.plan().pr);
  }
  for (const int chunk : {32, 64}) {
    BackwardCase c(1, 65536, 2, 2, 128, 128, DType::kBFloat16, chunk);
    BackwardLaunch b = c.launch();
    EXPECT_GT(b.fwd.seg_ld, 0) << "segment buffers in the workspace";
    expect_workspace_layout(b, c.p, c.plan().pr);
    c.p.chunk_states = device_view(DType::kFloat32, {1, 65536 / chunk, 2, 128, 128});
    b = c.launch();
    expect_workspace_layout(b, c.p, c.plan().pr);
  }
}

TEST(BackwardPlan, SharingShrinksTheWorkspace) {
  struct Shape { int64_t B, T, H; };
  for (const Shape& s : {Shape{1, 8192, 64}, Shape{8, 4096, 32}, Shape{1, 65536, 8}}) {
    const BackwardCase c(s.B, s.T, s.H);
    const BackwardLaunch b = c.launch();
    const std::vector<Part> parts = workspace_parts(b, c.p, c.plan().pr);
    const std::size_t before = unshared_total(parts);
    EXPECT_LT(b.total, before);
    // The parts live during the state products bound it below: h, dh, v_new, dbv, dP, dL, dq, dk, dkg, rowsum(S dH),
    // dbeta and the chunk offsets (with the Hopper kernel, during its one launch: w, u, Tm, dv_new for v_new and dbv).
    const Step states = b.ws_sm90 ? kWy : kStates;
    std::size_t peak = 0;
    for (const Part& x : parts) {
      if (x.first <= states && states <= x.last) peak += x.bytes;
    }
    std::printf("B%lld T%lld H%lld bf16 K=V=128: workspace %zu bytes, %zu unshared (%zu saved), %zu live at once\n",
                static_cast<long long>(s.B), static_cast<long long>(s.T), static_cast<long long>(s.H), b.total, before,
                before - b.total, peak);
    EXPECT_GE(b.total, peak);
    // On these rows the placement reaches that bound, up to the parts' 256-byte alignment.
    EXPECT_LE(b.total, peak + 256 * parts.size());
  }
}

}  // namespace
}  // namespace kdakit::test
