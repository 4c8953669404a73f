// The float32 chunked backward (the algorithm of the CUDA backward) against the float64 backward of the token
// recurrence (itself checked against finite differences in test_backward.cpp), every gradient, over the grid of head
// sizes, GVA, gates, activations, lengths, varlen batches, hard resets, state layouts and dtypes, saved chunk states and
// the reverse scan's segments.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/kda_math.h"
#include "cpu/backend.h"
#include "support/kda_case.h"

namespace kdakit::test {
namespace {

constexpr double kTol = 1e-5;  // relative RMS error of each gradient, float32 chunked vs float64
constexpr double kBf16HalfUlp = 1.0 / 256.0;

struct Options {
  bool d_final = true;              // a final-state gradient flows in
  bool saved_states = false;        // the forward's chunk states are passed (disable_recompute)
  int segment_chunks = 0;           // the reverse scan's cut (0: none)
};

struct Grads {
  HostTensor dq, dk, dv, dg, dbeta, dA, dbias, dh0;
};

struct Cotangents {
  HostTensor d_out, d_final;
};

Cotangents make_cotangents(const KdaCase& c, uint64_t seed) {
  const CaseConfig& cc = c.cfg;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  Cotangents t;
  t.d_out = HostTensor(DType::kFloat32, {cc.B, cc.T, cc.HV, cc.V});
  for (int64_t i = 0; i < t.d_out.numel(); ++i) t.d_out.set(i, normal(rng));
  const bool vk = cc.layout == StateLayout::kVK;
  t.d_final = HostTensor(DType::kFloat32, {c.N, cc.HV, vk ? cc.V : cc.K, vk ? cc.K : cc.V});
  for (int64_t i = 0; i < t.d_final.numel(); ++i) t.d_final.set(i, normal(rng));
  return t;
}

// The reference (float64 gradients) or the chunked backward (float32 gradients; d_initial_state in h0's dtype).
Grads run_backward(const KdaCase& c, const Cotangents& ct, bool chunked, const Options& o) {
  const CaseConfig& cc = c.cfg;
  const DType dt = chunked ? DType::kFloat32 : DType::kFloat64;
  BackwardParams bp;
  bp.in = c.inputs();
  bp.layout = cc.layout;
  bp.chunk_size = cc.chunk;
  bp.safe_gate = cc.safe_gate;
  if (c.h0.present()) bp.initial_state = c.h0.view();
  bp.d_out = ct.d_out.view();
  if (o.d_final) bp.d_final_state = ct.d_final.view();
  Grads g;
  g.dq = HostTensor(dt, c.q.shape());
  g.dk = HostTensor(dt, c.k.shape());
  g.dv = HostTensor(dt, c.v.shape());
  g.dg = HostTensor(dt, c.g.shape());
  g.dbeta = HostTensor(dt, c.beta.shape());
  for (HostTensor* t : {&g.dq, &g.dk, &g.dv, &g.dg, &g.dbeta}) t->fill(std::nan(""));
  bp.dq = g.dq.view(); bp.dk = g.dk.view(); bp.dv = g.dv.view(); bp.dg = g.dg.view(); bp.dbeta = g.dbeta.view();
  const bool gate_in_kernel = cc.gate != GateMode::kPreGated;
  if (gate_in_kernel && c.A_log.present()) {
    g.dA = HostTensor(dt, {cc.HV});
    g.dA.fill(std::nan(""));
    bp.dA_log = g.dA.view();
  }
  if (gate_in_kernel && c.dt_bias.present()) {
    g.dbias = HostTensor(dt, {cc.HV * cc.K});
    g.dbias.fill(std::nan(""));
    bp.ddt_bias = g.dbias.view();
  }
  if (c.h0.present()) {
    g.dh0 = HostTensor(chunked ? cc.state_dtype : DType::kFloat64, c.h0.shape());
    g.dh0.fill(std::nan(""));
    bp.d_initial_state = g.dh0.view();
  }
  ForwardRun fwd;
  if (chunked && o.saved_states) {
    fwd = run_forward(c, Impl::kChunked, /*want_intermediate=*/true);
    bp.chunk_states = fwd.intermediate.view();
  }
  if (!chunked) {
    std::vector<unsigned char> ws(backward_workspace_size(bp));
    bp.workspace = ws.data();
    bp.workspace_bytes = ws.size();
    backward(bp);
    return g;
  }
  const detail::Plan plan = detail::plan_backward(bp);
  std::vector<unsigned char> ws(cpu::backward_chunked_workspace_size(bp, plan));
  bp.workspace = ws.data();
  bp.workspace_bytes = ws.size();
  cpu::set_backward_segment_chunks(o.segment_chunks);
  cpu::backward_chunked(bp, plan);
  cpu::set_backward_segment_chunks(0);
  return g;
}

void expect_within_bf16_rounding(const HostTensor& got, const HostTensor& ref64, const char* what) {
  const std::vector<double> r = ref64.values();
  double ss = 0;
  for (double x : r) ss += x * x;
  const double abs_tol = kTol * std::sqrt(ss / std::max<std::size_t>(r.size(), 1));
  int64_t bad = 0;
  for (std::size_t i = 0; i < r.size(); ++i) {
    if (!(std::fabs(got.get(i) - r[i]) <= kBf16HalfUlp * std::fabs(r[i]) + abs_tol)) ++bad;
  }
  EXPECT_EQ(bad, 0) << what << ": elements outside bf16 rounding of the float64 reference";
}

double g_max_err = 0;  // the largest error seen (KDAKIT_TEST_VERBOSE prints it)

// dA_log = sum over tokens and keys of dg * d(gate)/dA_log, per v-head: a sum whose terms cancel (their magnitudes add
// up to 10^4 times the sum on FLA's recipe with strong softplus gates), so its error is measured against the sum of the
// terms' magnitudes, sum |dg_raw * (d gate / dA_log) / (d gate / dx)|: float32 rounding of the chunked algorithm's
// intermediate tiles (v_new, dv_new, at the forward's ~1e-7) reaches the sum in proportion to the terms, not to it.
// (Measured: the per-chunk pass in float64 on the same float32 tiles leaves the error of dA_log where it is.)
std::vector<double> dA_log_term_magnitudes(const KdaCase& c, const HostTensor& dg_raw_ref) {
  const CaseConfig& cc = c.cfg;
  std::vector<double> mag(cc.HV, 0.0);
  for (int64_t row = 0; row < cc.B * cc.T; ++row) {
    for (int64_t hv = 0; hv < cc.HV; ++hv) {
      for (int64_t d = 0; d < cc.K; ++d) {
        const int64_t i = (row * cc.HV + hv) * cc.K + d;
        const double x = c.g.get(i) + (c.dt_bias.present() ? c.dt_bias.get(hv * cc.K + d) : 0.0);
        double d_dx = 0, d_dA = 0;
        math::gate_grad<double>(static_cast<int>(cc.gate), x, c.A_log.present() ? c.A_log.get(hv) : 0.0,
                                c.A_log.present(), cc.lower_bound, &d_dx, &d_dA);
        if (d_dx != 0) mag[hv] += std::fabs(dg_raw_ref.get(i) * d_dA / d_dx);
      }
    }
  }
  return mag;
}

// Runs both backwards on one case and checks every gradient.
void check_case(const CaseConfig& cfg, const Options& o = {}) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(describe(cfg) + " d_final=" + std::to_string(o.d_final) + " saved=" + std::to_string(o.saved_states) +
               " segments=" + std::to_string(o.segment_chunks) + " seed=" + std::to_string(seed));
  const KdaCase c = make_case(cfg, seed);
  const Cotangents ct = make_cotangents(c, seed + 1);
  const Grads ref = run_backward(c, ct, false, o);
  const Grads got = run_backward(c, ct, true, o);
  const bool verbose = std::getenv("KDAKIT_TEST_VERBOSE") != nullptr;
  auto expect = [&](const HostTensor& g, const HostTensor& r, const char* name) {
    if (!r.present()) return;
    ASSERT_TRUE(all_finite(g)) << name << " not finite or not fully written";
    if (name == std::string("d_initial_state") && g.view().dtype == DType::kBFloat16) {
      expect_within_bf16_rounding(g, r, name);
      return;
    }
    const double err = rel_rms(g, r);
    g_max_err = std::max(g_max_err, err);
    if (verbose) std::printf("  %-16s %.2e\n", name, err);
    EXPECT_LE(err, kTol) << name;
  };
  expect(got.dq, ref.dq, "dq");
  expect(got.dk, ref.dk, "dk");
  expect(got.dv, ref.dv, "dv");
  expect(got.dg, ref.dg, "dg");
  expect(got.dbeta, ref.dbeta, "dbeta");
  if (ref.dA.present()) {
    ASSERT_TRUE(all_finite(got.dA)) << "dA_log not finite or not fully written";
    const std::vector<double> mag = dA_log_term_magnitudes(c, ref.dg);
    double worst = 0;
    for (int64_t hv = 0; hv < cfg.HV; ++hv) worst = std::max(worst, std::fabs(got.dA.get(hv) - ref.dA.get(hv)) / mag[hv]);
    g_max_err = std::max(g_max_err, worst);
    if (verbose) std::printf("  %-16s %.2e (of the terms' magnitude; %.2e of the sum)\n", "dA_log", worst, rel_rms(got.dA, ref.dA));
    EXPECT_LE(worst, kTol) << "dA_log";
  }
  expect(got.dbias, ref.dbias, "ddt_bias");
  expect(got.dh0, ref.dh0, "d_initial_state");
}

struct Gate {
  GateMode mode;
  bool A, bias;
};
constexpr Gate kGates[] = {{GateMode::kPreGated, false, false}, {GateMode::kSoftplus, true, true},
                           {GateMode::kSoftplus, true, false},  {GateMode::kLowerBound, true, true},
                           {GateMode::kLowerBound, false, true}, {GateMode::kLowerBound, false, false}};

TEST(ChunkedBackward, HeadDimensions) {
  const int64_t dims[][2] = {{16, 16}, {60, 100}, {64, 64}, {100, 60}, {128, 128}, {256, 64}, {16, 256}, {256, 256}};
  int i = 0;
  for (const auto& kv : dims) {
    CaseConfig cfg;
    cfg.B = 1; cfg.T = kv[0] * kv[1] > 128 * 128 ? 70 : 130; cfg.H = 1; cfg.HV = 2; cfg.K = kv[0]; cfg.V = kv[1];
    cfg.chunk = i % 3 == 2 ? 32 : 64;
    cfg.layout = i % 2 ? StateLayout::kVK : StateLayout::kKV;
    cfg.gate = kGates[i % 6].mode; cfg.has_A_log = kGates[i % 6].A; cfg.has_dt_bias = kGates[i % 6].bias;
    check_case(cfg);
    ++i;
  }
}

TEST(ChunkedBackward, GatesGvaActivations) {
  int i = 0;
  for (int64_t group : {1, 2, 4}) {
    for (const Gate& gt : kGates) {
      CaseConfig cfg;
      cfg.B = 2; cfg.T = 90; cfg.H = 2; cfg.HV = 2 * group; cfg.K = 32; cfg.V = 24;
      cfg.gate = gt.mode; cfg.has_A_log = gt.A; cfg.has_dt_bias = gt.bias;
      cfg.chunk = i % 2 ? 32 : 64;
      cfg.l2norm = i % 3 != 1;
      cfg.beta_sigmoid = i % 4 != 0;
      cfg.neg_eigval = i % 4 == 3;
      Options o;
      o.d_final = i % 5 != 2;
      check_case(cfg, o);
      ++i;
    }
  }
}

TEST(ChunkedBackward, LengthsInitialStatesAndLayouts) {
  for (int64_t T : {1, 15, 63, 64, 65, 200}) {
    for (StateLayout layout : {StateLayout::kKV, StateLayout::kVK}) {
      CaseConfig cfg;
      cfg.B = 2; cfg.T = T; cfg.H = 1; cfg.HV = 2; cfg.K = 48; cfg.V = 40;
      cfg.layout = layout;
      cfg.initial_state = T % 2 == 1 || layout == StateLayout::kVK;
      cfg.gate = GateMode::kLowerBound;
      Options o;
      o.d_final = T != 64;
      check_case(cfg, o);
    }
  }
}

TEST(ChunkedBackward, VarlenWithEmptySequencesAndBf16States) {
  const std::vector<int64_t> lens = {1, 15, 63, 0, 64, 65, 200};
  int i = 0;
  for (GateMode gate : {GateMode::kPreGated, GateMode::kSoftplus, GateMode::kLowerBound}) {
    for (DType sdt : {DType::kFloat32, DType::kBFloat16}) {
      CaseConfig cfg;
      cfg.seqlens = lens;
      cfg.H = 2; cfg.HV = 4; cfg.K = 64; cfg.V = 32;
      cfg.gate = gate; cfg.state_dtype = sdt;
      cfg.layout = i % 2 ? StateLayout::kVK : StateLayout::kKV;
      cfg.chunk = i == 4 ? 32 : 64;
      Options o;
      o.d_final = i != 2;
      check_case(cfg, o);
      ++i;
    }
  }
  CaseConfig cfg;  // no initial state, no final-state gradient
  cfg.seqlens = {65, 0, 1, 130};
  cfg.H = 1; cfg.HV = 1; cfg.K = 100; cfg.V = 60;
  cfg.initial_state = false;
  cfg.chunk = 32;
  check_case(cfg, Options{false, false, 0});
}

TEST(ChunkedBackward, HardResets) {
  for (double p : {0.05, 0.5}) {
    for (int chunk : {32, 64}) {
      CaseConfig cfg;
      cfg.B = 2; cfg.T = 150; cfg.H = 1; cfg.HV = 2; cfg.K = 64; cfg.V = 32;
      cfg.reset_prob = p; cfg.chunk = chunk;
      check_case(cfg);
    }
  }
  CaseConfig cfg;  // varlen with resets
  cfg.seqlens = {15, 64, 200};
  cfg.K = 128; cfg.V = 64; cfg.H = 1; cfg.HV = 2;
  cfg.reset_prob = 0.1;
  check_case(cfg);
}

TEST(ChunkedBackward, StrongAndWeakDecays) {
  for (double norm : {0.05, 16.0}) {
    CaseConfig cfg;
    cfg.B = 1; cfg.T = 192; cfg.H = 1; cfg.HV = 2; cfg.K = 64; cfg.V = 64;
    cfg.gate_normalizer = norm;
    check_case(cfg);
  }
}

// Both diagonal-block algorithms, where each is valid: the factorised one on bounded gates, the exact one everywhere.
TEST(ChunkedBackward, DiagonalBlockAlgorithms) {
  CaseConfig bounded;
  bounded.B = 1; bounded.T = 150; bounded.H = 1; bounded.HV = 2; bounded.K = 64; bounded.V = 48;
  bounded.gate = GateMode::kLowerBound; bounded.safe_gate = true;
  CaseConfig resets = bounded;
  resets.gate = GateMode::kPreGated; resets.safe_gate = false; resets.reset_prob = 0.2;
  cpu::set_diagonal_blocks(cpu::DiagonalBlocks::kFactorised);
  check_case(bounded);
  cpu::set_diagonal_blocks(cpu::DiagonalBlocks::kExact);
  check_case(bounded);
  check_case(resets);
  cpu::set_diagonal_blocks(cpu::DiagonalBlocks::kAuto);
}

TEST(ChunkedBackward, Float16AndBFloat16Inputs) {
  for (DType dt : {DType::kFloat16, DType::kBFloat16}) {
    CaseConfig cfg;
    cfg.B = 1; cfg.T = 130; cfg.H = 2; cfg.HV = 4; cfg.K = 64; cfg.V = 64;
    cfg.dtype = dt;
    cfg.gate = GateMode::kSoftplus;
    check_case(cfg);  // the reference reads the same rounded inputs
  }
}

// The reverse scan cut into segments (spec §7.2 transposed): the same gradients within the tolerance.
TEST(ChunkedBackward, ScanSegments) {
  for (int per : {1, 2, 3}) {
    CaseConfig cfg;
    cfg.seqlens = {300, 64, 0, 130, 1};
    cfg.H = 1; cfg.HV = 2; cfg.K = 32; cfg.V = 48;
    cfg.chunk = per == 3 ? 32 : 64;
    cfg.gate = GateMode::kSoftplus;
    cfg.layout = per == 2 ? StateLayout::kVK : StateLayout::kKV;
    check_case(cfg, Options{true, false, per});
  }
}

// Saved chunk states (FLA's disable_recompute) give the gradients of the recomputed ones, bit for bit (the state pass
// runs the forward's recurrence in its order).
TEST(ChunkedBackward, SavedChunkStates) {
  for (int variant = 0; variant < 2; ++variant) {
    CaseConfig cfg;
    if (variant == 0) {
      cfg.B = 2; cfg.T = 150;
    } else {
      cfg.seqlens = {70, 0, 129, 1};
      cfg.layout = StateLayout::kVK;
      cfg.chunk = 32;
    }
    cfg.H = 2; cfg.HV = 4; cfg.K = 32; cfg.V = 32;
    check_case(cfg, Options{true, true, 0});
    const KdaCase c = make_case(cfg, fresh_seed());
    const Cotangents ct = make_cotangents(c, 7);
    const Grads a = run_backward(c, ct, true, Options{true, false, 0});
    const Grads b = run_backward(c, ct, true, Options{true, true, 0});
    EXPECT_EQ(a.dq.values(), b.dq.values());
    EXPECT_EQ(a.dk.values(), b.dk.values());
    EXPECT_EQ(a.dv.values(), b.dv.values());
    EXPECT_EQ(a.dg.values(), b.dg.values());
    EXPECT_EQ(a.dbeta.values(), b.dbeta.values());
    EXPECT_EQ(a.dh0.values(), b.dh0.values());
  }
}

// A padded token tail past cu_seqlens[N] (spec §1.8) gets zero gradients.
TEST(ChunkedBackward, PaddedTokenTail) {
  CaseConfig cfg;
  cfg.seqlens = {40, 0, 70};
  cfg.tail = 9;
  cfg.H = 1; cfg.HV = 2; cfg.K = 32; cfg.V = 16;
  cfg.gate = GateMode::kLowerBound;
  check_case(cfg);
}

// Bit-identical gradients run to run, and a sequence's gradients do not depend on its batch neighbours.
TEST(ChunkedBackward, DeterministicAndBatchInvariant) {
  CaseConfig cfg;
  cfg.seqlens = {70, 5, 129};
  cfg.H = 2; cfg.HV = 4; cfg.K = 32; cfg.V = 32;
  cfg.gate = GateMode::kSoftplus;
  const KdaCase batch = make_case(cfg, fresh_seed());
  const Cotangents ct = make_cotangents(batch, 11);
  const Grads a = run_backward(batch, ct, true, {});
  const Grads b = run_backward(batch, ct, true, {});
  EXPECT_EQ(a.dq.values(), b.dq.values());
  EXPECT_EQ(a.dk.values(), b.dk.values());
  EXPECT_EQ(a.dg.values(), b.dg.values());
  EXPECT_EQ(a.dA.values(), b.dA.values());
  EXPECT_EQ(a.dbias.values(), b.dbias.values());

  // The third sequence alone.
  CaseConfig one = cfg;
  one.seqlens = {129};
  KdaCase alone = make_case(one, 1);
  Cotangents ct1 = make_cotangents(alone, 1);
  const int64_t t0 = 75, HV = cfg.HV, H = cfg.H, K = cfg.K, V = cfg.V;
  for (int64_t t = 0; t < 129; ++t) {
    for (int64_t i = 0; i < H * K; ++i) {
      alone.q.set(t * H * K + i, batch.q.get((t0 + t) * H * K + i));
      alone.k.set(t * H * K + i, batch.k.get((t0 + t) * H * K + i));
    }
    for (int64_t i = 0; i < HV * K; ++i) alone.g.set(t * HV * K + i, batch.g.get((t0 + t) * HV * K + i));
    for (int64_t i = 0; i < HV * V; ++i) {
      alone.v.set(t * HV * V + i, batch.v.get((t0 + t) * HV * V + i));
      ct1.d_out.set(t * HV * V + i, ct.d_out.get((t0 + t) * HV * V + i));
    }
    for (int64_t i = 0; i < HV; ++i) alone.beta.set(t * HV + i, batch.beta.get((t0 + t) * HV + i));
  }
  for (int64_t i = 0; i < HV * K * V; ++i) {
    alone.h0.set(i, batch.h0.get(2 * HV * K * V + i));
    ct1.d_final.set(i, ct.d_final.get(2 * HV * K * V + i));
  }
  for (int64_t i = 0; i < HV; ++i) alone.A_log.set(i, batch.A_log.get(i));
  for (int64_t i = 0; i < HV * K; ++i) alone.dt_bias.set(i, batch.dt_bias.get(i));
  const Grads c = run_backward(alone, ct1, true, {});
  for (int64_t i = 0; i < 129 * H * K; ++i) {
    ASSERT_EQ(c.dq.get(i), a.dq.get(t0 * H * K + i)) << i;
    ASSERT_EQ(c.dk.get(i), a.dk.get(t0 * H * K + i)) << i;
  }
  for (int64_t i = 0; i < 129 * HV * K; ++i) ASSERT_EQ(c.dg.get(i), a.dg.get(t0 * HV * K + i)) << i;
  for (int64_t i = 0; i < 129 * HV * V; ++i) ASSERT_EQ(c.dv.get(i), a.dv.get(t0 * HV * V + i)) << i;
  for (int64_t i = 0; i < 129 * HV; ++i) ASSERT_EQ(c.dbeta.get(i), a.dbeta.get(t0 * HV + i)) << i;
  for (int64_t i = 0; i < HV * K * V; ++i) ASSERT_EQ(c.dh0.get(i), a.dh0.get(2 * HV * K * V + i)) << i;
}

TEST(ChunkedBackward, ZZReportLargestError) {
  if (std::getenv("KDAKIT_TEST_VERBOSE")) std::printf("largest relative RMS error: %.3e\n", g_max_err);
}

}  // namespace
}  // namespace kdakit::test
