// The chunked forward's launch planner (src/cuda/forward/plan.cpp) as a pure function: tile choice, warpgroup MMAs,
// the context-parallel cut, the shared-memory fit on smaller GPUs, the workspace layout, the dtype checks and the
// padded token tail, for device facts given here (no GPU, no environment overrides).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "common/plan.h"
#include "cuda/cp/segments.h"
#include "cuda/device.h"
#include "cuda/forward/plan.h"
#include "cuda/tuning.h"
#include "device_views.h"

namespace kdakit::test {
namespace {

using cuda::DeviceInfo;
using cuda::ForwardLaunch;
using cuda::Tuning;

struct ForwardCase {
  DeviceInputs x;
  ForwardParams p;
  std::vector<int64_t> cu_host;
  ForwardCase(int64_t B, int64_t T, int64_t H, int64_t HV = 0, int64_t K = 128, int64_t V = 128,
              DType dtype = DType::kBFloat16)
      : x(B, T, H, HV ? HV : H, K, V, dtype) {
    p.in = x.in;
    const int64_t hv = HV ? HV : H;
    p.state.initial_state = device_view(DType::kFloat32, {B, hv, K, V});
    p.state.final_state = device_view(DType::kFloat32, {B, hv, K, V});
    p.out = device_view(dtype, {B, T, hv, V});
  }
  // Varlen with the lengths known on the host (cu_seqlens_cpu), then `tail` padding tokens past the last sequence.
  explicit ForwardCase(const std::vector<int64_t>& lens, int64_t H, bool host_lengths = true, int64_t tail = 0)
      : x(1, total(lens) + tail, H, H, 128, 128, DType::kBFloat16, static_cast<int64_t>(lens.size())) {
    p.in = x.in;
    const int64_t N = static_cast<int64_t>(lens.size()), T = total(lens) + tail;
    cu_host.assign(1, 0);
    for (const int64_t l : lens) cu_host.push_back(cu_host.back() + l);
    if (host_lengths) p.in.cu_seqlens_host = make_view(cu_host.data(), DType::kInt64, {N + 1});
    p.state.initial_state = device_view(DType::kFloat32, {N, H, 128, 128});
    p.out = device_view(DType::kBFloat16, {1, T, H, 128});
  }
  static int64_t total(const std::vector<int64_t>& lens) {
    int64_t t = 0;
    for (const int64_t l : lens) t += l;
    return t;
  }
  ForwardLaunch plan(const DeviceInfo& dev = kH200, const Tuning& tune = Tuning()) const {
    return cuda::plan_forward_launch(p, detail::plan_forward(p), dev, tune);
  }
};

// Every part of the workspace is 256-byte aligned, holds its bytes, and overlaps no other.
void expect_workspace_layout(const ForwardLaunch& f, const ForwardParams& p, const Problem& pr) {
  const std::size_t C = p.chunk_size, tiles = static_cast<std::size_t>(f.slots) * pr.HV;
  struct Part { std::size_t off, bytes; const char* name; };
  std::vector<Part> parts = {
      {f.off_offsets, 8 * std::size_t(pr.N + 1), "chunk offsets"},
      {f.off_w, tiles * C * f.cfg.KP * f.esz, "w"},
      {f.off_qg, tiles * C * f.cfg.KP * f.esz, "qg"},
      {f.off_kg, tiles * C * f.cfg.KP * f.esz, "kg"},
      {f.off_u, tiles * C * f.VP * f.esz, "u"},
      {f.off_a, tiles * C * C * f.esz, "Aqk"},
      {f.off_gam, tiles * f.cfg.KP * 4, "gamma"}};
  if (f.esz == 2) parts.push_back({f.off_alo, tiles * C * C * f.esz, "Aqk lo"});
  if (f.seg_ld > 0) {
    parts.push_back({f.off_seg_offsets, 8 * std::size_t(pr.N + 1), "segment offsets"});
    parts.push_back({f.off_seg, std::size_t(f.segments) * pr.HV * f.cfg.KP * f.seg_ld * 4, "segment states"});
  }
  if (f.ordered) parts.push_back({f.off_order, 4 * std::size_t(pr.N), "order"});
  std::sort(parts.begin(), parts.end(), [](const Part& a, const Part& b) { return a.off < b.off; });
  for (std::size_t i = 0; i < parts.size(); ++i) {
    EXPECT_EQ(parts[i].off % 256, 0u) << parts[i].name;
    const std::size_t end = parts[i].off + parts[i].bytes;
    EXPECT_LE(end, i + 1 < parts.size() ? parts[i + 1].off : f.total) << parts[i].name << " overlaps the next part";
  }
}

TEST(ForwardPlan, HopperManyHeadsTakesWarpgroupMmaWithoutCuts) {
  const ForwardCase c(1, 8192, 64);
  const ForwardLaunch f = c.plan();
  EXPECT_EQ(f.cfg.KP, 128);
  EXPECT_EQ(f.cfg.BV, 64);  // 128 CTAs of 64 columns: one wave on 132 SMs
  EXPECT_TRUE(f.cfg.wgmma);
  EXPECT_EQ(f.seg_target, 1);
  EXPECT_EQ(f.slots, 128);
  EXPECT_FALSE(f.ordered);
  expect_workspace_layout(f, c.p, detail::plan_forward(c.p).pr);
}

TEST(ForwardPlan, MoreThanOneWaveTakesWideTiles) {
  const ForwardCase c(1, 8192, 96);  // 192 CTAs of 64 columns > 132 SMs
  const ForwardLaunch f = c.plan();
  EXPECT_EQ(f.cfg.BV, 128);
  EXPECT_TRUE(f.cfg.wgmma);
  const ForwardCase b8(8, 4096, 32);
  EXPECT_EQ(b8.plan().cfg.BV, 128);
}

TEST(ForwardPlan, FewHeadsCutLongSequences) {
  const ForwardCase c(1, 65536, 8);
  const ForwardLaunch f = c.plan();
  EXPECT_EQ(f.seg_target, 16);      // 132 SMs / (8 heads x 1 segment tile of 128 columns)
  EXPECT_EQ(f.seg_min_chunks, 64);  // 4096 tokens
  EXPECT_EQ(f.segments, 16);        // 1024 chunks in 16 segments of 64
  EXPECT_EQ(f.cfg.BV, 128);
  EXPECT_EQ(f.seg_ld, 128 + 128);
  expect_workspace_layout(f, c.p, detail::plan_forward(c.p).pr);
  // A sequence too short to cut (fewer than 2 x 64 chunks), one just long enough, and the override that turns cuts
  // off.
  EXPECT_EQ(ForwardCase(1, 8128, 8).plan().seg_target, 1);
  EXPECT_EQ(ForwardCase(1, 8192, 8).plan().segments, 2);
  Tuning off;
  off.forward_segments = 1;
  EXPECT_EQ(c.plan(kH200, off).seg_target, 1);
}

// The pre-scan runs at least one transition tile per (segment, head) however wide the tile: K <= 64 keys with
// 64 < V <= 128 cut into 128-column tiles on Hopper (bf16), whose one transition tile covers the 64 keys.
TEST(ForwardPlan, CutsRunTransitionTilesForEveryKey) {
  const ForwardLaunch f = ForwardCase(1, 65536, 8, 8, 64, 128).plan();
  ASSERT_GT(f.seg_target, 1);
  EXPECT_EQ(f.cfg.BV, 128);
  EXPECT_EQ(f.cfg.KP, 64);
  EXPECT_EQ(cuda::segment_transition_tiles(f.cfg.KP, f.cfg.BV), 1);
  EXPECT_EQ(f.seg_ld, 128 + 64) << "one 128-column value tile, then the 64 keys' columns of M";
  for (const auto& [kp, bv, tiles] : std::vector<std::tuple<int, int, int>>{
           {64, 128, 1}, {64, 64, 1}, {128, 128, 1}, {128, 64, 2}, {128, 16, 8}, {256, 32, 8}}) {
    EXPECT_EQ(cuda::segment_transition_tiles(kp, bv), tiles) << kp << " keys, " << bv << " columns";
  }
}

TEST(ForwardPlan, KnownVarlenLengthsRunLongestFirstWithTheEstimatedWidth) {
  const ForwardCase c({1300, 547, 2048, 963, 271, 3063}, 64);
  const ForwardLaunch f = c.plan();
  EXPECT_TRUE(f.ordered);
  EXPECT_EQ(f.slots, 131);  // the chunks of the six sequences
  EXPECT_EQ(f.cfg.BV, 128);  // 1.2 x max(48, 63.5) chunk steps against max(48, 127)
  expect_workspace_layout(f, c.p, detail::plan_forward(c.p).pr);
  // Without host lengths: a bound on the chunks, 64 columns.
  const ForwardCase d({1300, 547, 2048, 963, 271, 3063}, 64, /*host_lengths=*/false);
  const ForwardLaunch g = d.plan();
  EXPECT_EQ(g.slots, (8192 + 63) / 64 + 6);
  EXPECT_EQ(g.cfg.BV, 64);
  expect_workspace_layout(g, d.p, detail::plan_forward(d.p).pr);
}

TEST(ForwardPlan, WarpgroupMmaOnlyOnHopperWithBf16Chunk64) {
  EXPECT_FALSE(ForwardCase(1, 8192, 64).plan(kA100).cfg.wgmma);
  EXPECT_FALSE(ForwardCase(1, 8192, 64, 0, 128, 128, DType::kFloat16).plan().cfg.wgmma);
  EXPECT_FALSE(ForwardCase(1, 8192, 64, 0, 256, 128).plan().cfg.wgmma);
  ForwardCase c32(1, 8192, 64);
  c32.p.chunk_size = 32;
  EXPECT_FALSE(c32.plan().cfg.wgmma);
  Tuning no_wgmma;
  no_wgmma.forward_wgmma = false;
  EXPECT_FALSE(ForwardCase(1, 8192, 64).plan(kH200, no_wgmma).cfg.wgmma);
}

TEST(ForwardPlan, TilesFitTheDevicesSharedMemory) {
  for (const DeviceInfo& dev : {kH200, kA100, kAda}) {
    for (const int64_t K : {64, 128, 256}) {
      for (const DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
        ForwardCase c(1, 4096, 16, 0, K, 128, dt);
        ForwardLaunch f;
        try {
          f = c.plan(dev);
        } catch (const CudaError& e) {
          // Only where no tile fits; the message names the shared memory.
          EXPECT_NE(std::string(e.what()).find("shared memory"), std::string::npos) << e.what();
          EXPECT_LT(dev.smem_optin, std::size_t(227 * 1024)) << "K = " << K << " " << dtype_name(dt);
          continue;
        }
        const cuda::ForwardSmem need = cuda::forward_smem(dt, dt, f.cfg);
        EXPECT_LE(need.recurrence, dev.smem_optin) << "K = " << K << " " << dtype_name(dt);
        EXPECT_LE(need.prepare, dev.smem_optin) << "K = " << K << " " << dtype_name(dt);
      }
    }
  }
  // bf16 K = 128 on a 99 KB device: the 64-column tiles with their prefetch stage do not fit.
  const ForwardLaunch ada = ForwardCase(1, 8192, 64).plan(kAda);
  EXPECT_TRUE(ada.cfg.one_stage || ada.cfg.BV < 64);
}

TEST(ForwardPlan, SharedMemoryLimitOverrideLowersTheFit) {
  Tuning small;
  small.smem_limit = 99 * 1024;
  const ForwardLaunch f = ForwardCase(1, 8192, 64).plan(kH200, small);
  EXPECT_LE(cuda::forward_smem(DType::kBFloat16, DType::kBFloat16, f.cfg).recurrence, std::size_t(99 * 1024));
  small.smem_limit = 16 * 1024;  // nothing fits: the error names the kernel and the limit
  try {
    ForwardCase(1, 8192, 64).plan(kH200, small);
    ADD_FAILURE() << "expected CudaError";
  } catch (const CudaError& e) {
    EXPECT_NE(std::string(e.what()).find("16384"), std::string::npos) << e.what();
  }
}

TEST(ForwardPlan, TileWidthOverrideAmongTheConfigurationsWidths) {
  const ForwardCase c(1, 8192, 64);
  for (const int bv : {16, 32, 64, 128}) {
    Tuning t;
    t.forward_bv = bv;
    EXPECT_EQ(c.plan(kH200, t).cfg.BV, bv);
  }
  Tuning t;
  t.forward_bv = 128;  // float operands have no 128-column kernel
  EXPECT_EQ(ForwardCase(1, 8192, 64, 0, 128, 128, DType::kFloat32).plan(kH200, t).cfg.BV, 64);
}

// g is read in its own dtype (float32 beside bf16 q, k, v is the serving engines' form), so every combination of the
// kernels' three float dtypes plans; float32 g rows staged beside bf16 operands fit over the slice tiles, so the bf16
// prepare kernel keeps its shared memory (two CTAs per SM) at chunk 64.
TEST(ForwardPlan, GInItsOwnDtype) {
  const DType floats[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
  for (const DType in : floats) {
    for (const DType g : floats) {
      for (const int chunk : {32, 64}) {
        for (const int64_t K : {64, 128, 256}) {
          ForwardCase c(1, 256, 4, 0, K, 128, in);
          c.p.in.g.dtype = g;
          c.p.chunk_size = chunk;
          const ForwardLaunch f = c.plan();
          const cuda::ForwardSmem need = cuda::forward_smem(in, g, f.cfg);
          EXPECT_LE(need.prepare, kH200.smem_optin) << dtype_name(in) << " g " << dtype_name(g) << " K " << K;
          EXPECT_LE(need.recurrence, kH200.smem_optin) << dtype_name(in) << " g " << dtype_name(g) << " K " << K;
          EXPECT_EQ(need.recurrence, cuda::forward_smem(in, in, f.cfg).recurrence) << "the recurrence never reads g";
          if (chunk == 64) {
            EXPECT_EQ(need.prepare, cuda::forward_smem(in, in, f.cfg).prepare)
                << dtype_name(in) << " g " << dtype_name(g) << " K " << K;
          } else {  // float32 g staged beside bf16 operands needs a little more than the chunk-32 slice tiles
            EXPECT_GE(need.prepare, cuda::forward_smem(in, in, f.cfg).prepare);
          }
        }
      }
    }
  }
  ForwardCase c(1, 8192, 64);
  c.p.in.g.dtype = DType::kFloat32;
  const ForwardLaunch f = c.plan();
  EXPECT_LE(cuda::forward_smem(DType::kBFloat16, DType::kFloat32, f.cfg).prepare, std::size_t(113 * 1024))
      << "two prepare CTAs per SM on Hopper";
  EXPECT_TRUE(f.cfg.wgmma);  // the recurrence does not depend on g
}

TEST(ForwardPlan, RejectsInputDtypesTheKernelsDoNotTake) {
  ForwardCase g64(1, 256, 4);
  g64.p.in.g.dtype = DType::kFloat64;
  expect_rejected(g64, "g", "float64 runs on the CPU");
  ForwardCase v32(1, 256, 4);
  v32.p.in.v.dtype = DType::kFloat32;  // q, k, v share the operand type
  expect_rejected(v32, "v", "q, k and v of one dtype (bfloat16), got float32");
}

// The split context-parallel forward (CpPhase): both halves plan one workspace, with a segment slot even for a piece
// too short to cut (the summary's scan writes its E and M there); a long piece is cut as a one-GPU forward cuts it.
TEST(ForwardPlan, SplitContextParallelHalvesShareOneWorkspace) {
  auto halves = [](int64_t T, int64_t H) {
    ForwardCase s(1, T, H);
    s.p.state.initial_state = TensorView();
    s.p.state.final_state = TensorView();
    s.p.cp_phase = CpPhase::kSummary;
    s.p.cp_summary = device_view(DType::kFloat32, {H, 128, 256});
    ForwardCase f = s;
    f.p.cp_phase = CpPhase::kFinish;
    f.p.cp_summary = TensorView();
    f.p.state.initial_state = device_view(DType::kFloat32, {1, H, 128, 128});
    return std::make_pair(s, f);
  };
  const auto [s1, f1] = halves(4096, 8);
  const ForwardLaunch a = s1.plan(), b = f1.plan();
  EXPECT_EQ(a.seg_target, 1);
  EXPECT_EQ(a.segments, 1);
  EXPECT_EQ(a.seg_ld, 128 + 128);
  EXPECT_EQ(a.cp_phase, 1);
  EXPECT_EQ(b.cp_phase, 2);
  EXPECT_EQ(a.total, b.total);
  EXPECT_EQ(a.off_seg, b.off_seg);
  expect_workspace_layout(a, s1.p, detail::plan_forward(s1.p).pr);
  const auto [s8, f8] = halves(65536, 8);
  const ForwardLaunch c = s8.plan();
  EXPECT_EQ(c.segments, ForwardCase(1, 65536, 8).plan().segments);  // 16: the one-GPU cut
  EXPECT_EQ(c.total, f8.plan().total);
  // What the halves refuse, naming the argument.
  ForwardCase with_h0 = s1;
  with_h0.p.state.initial_state = device_view(DType::kFloat32, {1, 8, 128, 128});
  expect_rejected(with_h0, "initial_state", "starts from zero");
  ForwardCase no_summary = s1;
  no_summary.p.cp_summary = TensorView();
  expect_rejected(no_summary, "cp_summary", "is required");
  ForwardCase bf16_summary = s1;
  bf16_summary.p.cp_summary = device_view(DType::kBFloat16, {8, 128, 256});
  expect_rejected(bf16_summary, "cp_summary", "float32");
  ForwardCase wrong_shape = s1;
  wrong_shape.p.cp_summary = device_view(DType::kFloat32, {8, 128, 128});
  expect_rejected(wrong_shape, "cp_summary", "[HV,K,V+K]");
  ForwardCase final_out = f1;
  final_out.p.state.final_state = device_view(DType::kFloat32, {1, 8, 128, 128});
  expect_rejected(final_out, "final_state", "not taken with cp_phase");
  ForwardCase two(2, 1024, 8);
  two.p.state = StateIO();
  two.p.cp_phase = CpPhase::kFinish;
  expect_rejected(two, "cp_phase", "one sequence per call, got 2");
  ForwardCase stray(1, 1024, 8);
  stray.p.cp_summary = device_view(DType::kFloat32, {8, 128, 256});
  expect_rejected(stray, "cp_summary", "cp_phase is kNone");
}

// The padded token tail of a varlen batch (CUDA-graph batches: tokens past cu_seqlens[N]) gets prepare CTAs that zero
// its output rows; the workspace holds only the real chunks.
TEST(ForwardPlan, PaddedTokenTailGetsZeroingCtas) {
  const std::vector<int64_t> lens = {100, 30, 0, 270};
  const ForwardLaunch f0 = ForwardCase(lens, 8).plan();
  EXPECT_EQ(f0.slots, 2 + 1 + 0 + 5);
  EXPECT_EQ(f0.tail_slots, 0);
  // The same sequences in a batch padded by 150 tokens.
  const ForwardCase c(lens, 8, /*host_lengths=*/true, 150);
  const ForwardLaunch f = c.plan();
  EXPECT_EQ(f.slots, f0.slots);
  EXPECT_EQ(f.tail_slots, 3);  // ceil(150 / 64)
  EXPECT_EQ(f.total, f0.total) << "the tail needs no workspace";
  expect_workspace_layout(f, c.p, detail::plan_forward(c.p).pr);
  EXPECT_EQ(ForwardCase(lens, 8, true, 192).plan().tail_slots, 3);  // three CTAs of 64 rows
  EXPECT_EQ(ForwardCase(lens, 8, true, 193).plan().tail_slots, 4);
}

// Without host lengths the prepare grid is the bound ceil(T / C) + N of the chunks; the CTAs it has past the real
// chunks zero the padded tail, so the bound must leave at least ceil((T - cu[N]) / C) of them, for any lengths.
TEST(ForwardPlan, ChunkBoundCoversThePaddedTail) {
  for (const int64_t C : {32, 64}) {
    for (const std::vector<int64_t>& lens : std::vector<std::vector<int64_t>>{
             {1}, {0, 0, 0}, {63, 65, 1, 127}, {64, 64}, {3000, 1, 2, 5}, {31, 33, 95, 0, 7}}) {
      for (const int64_t tail : {0, 1, 31, 32, 63, 64, 65, 1000}) {
        ForwardCase c(lens, 8, /*host_lengths=*/false, tail);
        c.p.chunk_size = static_cast<int>(C);
        const ForwardLaunch f = c.plan();
        int64_t chunks = 0;
        for (const int64_t l : lens) chunks += (l + C - 1) / C;
        EXPECT_EQ(f.tail_slots, 0);
        EXPECT_GE(f.slots - chunks, (tail + C - 1) / C) << "C " << C << " tail " << tail;
      }
    }
  }
}

}  // namespace
}  // namespace kdakit::test
