// The float32 chunked forward against the float64 token recurrence (the spec), over the grid of shapes,
// gates, chunk sizes, varlen batches, state layouts and dtypes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "cpu/backend.h"
#include "support/kda_case.h"

namespace kdakit::test {
namespace {

constexpr double kTol = 1e-5;  // relative RMS error, float32 chunked vs float64 recurrence
// A bfloat16 state is the float32 result rounded to 8 significant bits: every element lies within half a
// bf16 ulp (2^-8 relative) of the float64 value, plus the float32 tolerance (kTol times the RMS value).
constexpr double kBf16HalfUlp = 1.0 / 256.0;

void expect_within_bf16_rounding(const HostTensor& got, const HostTensor& ref64, const std::string& what) {
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

// Runs chunked and reference on one case and checks every output.
void check_case(const CaseConfig& cfg, bool intermediate = true) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(describe(cfg) + " seed=" + std::to_string(seed));
  KdaCase c = make_case(cfg, seed);
  const DType final_dtype = cfg.state_dtype;
  ForwardRun ref = run_forward(c, Impl::kReference, intermediate, DType::kFloat64);
  ForwardRun got = run_forward(c, Impl::kChunked, intermediate, final_dtype);
  ASSERT_TRUE(all_finite(got.out)) << "output not finite or not fully written";
  ASSERT_TRUE(all_finite(got.final_state)) << "final state not finite or not fully written";
  if (std::getenv("KDAKIT_TEST_VERBOSE")) std::printf("  out %.2e final %.2e\n", rel_rms(got.out, ref.out), rel_rms(got.final_state, ref.final_state));
  EXPECT_LE(rel_rms(got.out, ref.out), kTol) << "output";
  if (final_dtype == DType::kFloat32) {
    EXPECT_LE(rel_rms(got.final_state, ref.final_state), kTol) << "final state";
  } else {
    expect_within_bf16_rounding(got.final_state, ref.final_state, "final state");
  }
  if (intermediate) {
    ASSERT_TRUE(all_finite(got.intermediate)) << "intermediate states not finite or not fully written";
    EXPECT_LE(rel_rms(got.intermediate, ref.intermediate), kTol) << "intermediate states";
  }
}

TEST(ChunkedForward, HeadDimensions) {
  for (int64_t K : {16, 60, 64, 100, 128}) {
    for (int64_t V : {16, 60, 64, 100, 128}) {
      CaseConfig cfg;
      cfg.B = 1; cfg.T = 100; cfg.H = 1; cfg.HV = 2; cfg.K = K; cfg.V = V;
      cfg.chunk = (K + V) % 3 == 0 ? 32 : 64;
      cfg.layout = (K * V) % 2 ? StateLayout::kVK : StateLayout::kKV;
      check_case(cfg);
    }
  }
}

TEST(ChunkedForward, GatesGvaAndChunkSizes) {
  struct Gate { GateMode mode; bool A, bias; };
  const Gate gates[] = {{GateMode::kPreGated, false, false}, {GateMode::kSoftplus, true, true},
                        {GateMode::kSoftplus, true, false},  {GateMode::kLowerBound, true, true},
                        {GateMode::kLowerBound, false, true}, {GateMode::kLowerBound, false, false}};
  for (int64_t group : {1, 2, 4}) {
    for (const Gate& gt : gates) {
      for (int chunk : {32, 64}) {
        CaseConfig cfg;
        cfg.B = 2; cfg.T = 150; cfg.H = 2; cfg.HV = 2 * group; cfg.K = 32; cfg.V = 24;
        cfg.gate = gt.mode; cfg.has_A_log = gt.A; cfg.has_dt_bias = gt.bias;
        cfg.chunk = chunk;
        cfg.beta_sigmoid = chunk == 32;
        check_case(cfg);
      }
    }
  }
}

TEST(ChunkedForward, VarlenStatesLayoutsDtypes) {
  const std::vector<int64_t> lens = {1, 15, 63, 0, 64, 65, 1000};
  for (GateMode gate : {GateMode::kPreGated, GateMode::kSoftplus, GateMode::kLowerBound}) {
    for (StateLayout layout : {StateLayout::kKV, StateLayout::kVK}) {
      for (DType sdt : {DType::kFloat32, DType::kBFloat16}) {
        CaseConfig cfg;
        cfg.seqlens = lens;
        cfg.H = 2; cfg.HV = 4; cfg.K = 64; cfg.V = 64;
        cfg.gate = gate; cfg.layout = layout; cfg.state_dtype = sdt;
        check_case(cfg);
      }
    }
  }
}

TEST(ChunkedForward, VarlenWithoutInitialState) {
  CaseConfig cfg;
  cfg.seqlens = {65, 0, 1, 130};
  cfg.H = 1; cfg.HV = 1; cfg.K = 100; cfg.V = 60;
  cfg.initial_state = false;
  cfg.chunk = 32;
  check_case(cfg);
}

TEST(ChunkedForward, HardResetsStayFiniteAndExact) {
  for (double p : {0.05, 0.5}) {
    for (int chunk : {32, 64}) {
      CaseConfig cfg;
      cfg.B = 2; cfg.T = 200; cfg.H = 2; cfg.HV = 2; cfg.K = 64; cfg.V = 32;
      cfg.reset_prob = p; cfg.chunk = chunk;
      check_case(cfg);
    }
  }
  CaseConfig cfg;  // varlen with resets and the default chunk
  cfg.seqlens = {15, 64, 300};
  cfg.K = 128; cfg.V = 128; cfg.H = 1; cfg.HV = 1;
  cfg.reset_prob = 0.1;
  check_case(cfg);
}

TEST(ChunkedForward, StrongAndWeakDecays) {
  for (double norm : {0.05, 1.0, 16.0}) {
    CaseConfig cfg;
    cfg.B = 1; cfg.T = 256; cfg.H = 1; cfg.HV = 2; cfg.K = 64; cfg.V = 64;
    cfg.gate_normalizer = norm;
    check_case(cfg);
  }
}

TEST(ChunkedForward, BetaOptionsScaleAndNoNorm) {
  for (int variant = 0; variant < 4; ++variant) {
    CaseConfig cfg;
    cfg.B = 2; cfg.T = 97; cfg.H = 3; cfg.HV = 3; cfg.K = 60; cfg.V = 60;
    cfg.beta_sigmoid = variant >= 1;
    cfg.neg_eigval = variant == 2;
    cfg.l2norm = variant != 3;
    cfg.scale = variant == 3 ? 0.1f : -1.0f;
    check_case(cfg);
  }
}

TEST(ChunkedForward, SingleTokenAndTinyShapes) {
  for (int64_t T : {1, 2, 16, 17, 31, 33}) {
    CaseConfig cfg;
    cfg.B = 3; cfg.T = T; cfg.H = 1; cfg.HV = 4; cfg.K = 8; cfg.V = 5;
    cfg.chunk = T % 2 ? 32 : 64;
    check_case(cfg);
  }
}

TEST(ChunkedForward, Float16AndBFloat16Inputs) {
  for (DType dt : {DType::kFloat16, DType::kBFloat16}) {
    CaseConfig cfg;
    cfg.B = 1; cfg.T = 130; cfg.H = 2; cfg.HV = 4; cfg.K = 64; cfg.V = 64;
    cfg.dtype = dt;
    cfg.gate = GateMode::kLowerBound;
    check_case(cfg);  // the reference reads the same rounded inputs, so float32 accuracy still holds
  }
}

// Both diagonal-block algorithms agree with the reference where each is valid: the factorised one on
// bounded gates, the exact one everywhere (including hard resets).
TEST(ChunkedForward, DiagonalBlockAlgorithms) {
  CaseConfig bounded;
  bounded.B = 1; bounded.T = 200; bounded.H = 1; bounded.HV = 2; bounded.K = 64; bounded.V = 64;
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

// CUDA-graph batches (spec §1.7): a state pool read and written through slot ids with padded sequences (-1, or
// vLLM's pad slot 0), index rows past N, and a token tail past cu_seqlens[N]. Padding gives exact zeros in the output
// and the chunk states and leaves the pool alone; the real sequences match the reference.
TEST(ChunkedForward, PaddedSequencesAndTokenTail) {
  for (int64_t pad : {-1, 0}) {
    CaseConfig cfg;
    cfg.seqlens = {40, 70, 0, 33, 5};
    cfg.tail = 9;
    cfg.H = 2; cfg.HV = 4; cfg.K = 32; cfg.V = 16;
    cfg.gate = GateMode::kLowerBound;
    cfg.initial_state = false;
    cfg.chunk = 32;
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(describe(cfg) + " pad_slot_id=" + std::to_string(pad) + " seed=" + std::to_string(seed));
    KdaCase c = make_case(cfg, seed);
    const CaseConfig& cc = c.cfg;
    const int64_t HV = cc.HV, K = cc.K, V = cc.V, P = 8, block = HV * K * V;
    std::mt19937_64 rng(seed + 3);
    std::normal_distribution<double> normal;
    HostTensor pool(DType::kFloat32, {P, HV, K, V}), ref_pool(DType::kFloat64, {P, HV, K, V});
    for (int64_t i = 0; i < pool.numel(); ++i) {
      pool.set(i, normal(rng));
      ref_pool.set(i, pool.get(i));
    }
    const HostTensor before = pool.clone();
    const std::vector<int64_t> slots = {5, pad, 3, pad, 7, -9, 100};  // the last two rows are past N = 5: ignored
    const std::vector<bool> padded = {false, true, false, true, false};
    HostTensor idx(DType::kInt64, {7});
    for (int64_t i = 0; i < 7; ++i) idx.set(i, static_cast<double>(slots[i]));
    const int64_t nt = count_chunks(c.cu, cc.chunk);

    auto run = [&](HostTensor& state, DType dt, Impl impl, HostTensor& out, HostTensor& inter) {
      ForwardParams p;
      p.in = c.inputs();
      p.state.initial_state = state.view();
      p.state.final_state = state.view();
      p.state.state_indices = idx.view();
      p.state.pad_slot_id = pad;
      p.chunk_size = cc.chunk;
      out = HostTensor(dt, {1, cc.T, HV, V});
      out.fill(std::nan(""));
      p.out = out.view();
      inter = HostTensor(dt, {1, nt, HV, K, V});
      inter.fill(std::nan(""));
      p.intermediate_states = inter.view();
      if (impl == Impl::kReference) {
        reference_forward(p);
      } else {
        std::vector<unsigned char> ws(forward_workspace_size(p));
        p.workspace = ws.data();
        p.workspace_bytes = ws.size();
        forward(p);
      }
    };
    HostTensor out, inter, ref_out, ref_inter;
    run(pool, DType::kFloat32, Impl::kChunked, out, inter);
    run(ref_pool, DType::kFloat64, Impl::kReference, ref_out, ref_inter);

    std::vector<double> got_o, ref_o, got_h, ref_h, got_s, ref_s;
    for (int64_t n = 0; n < 5; ++n) {
      for (int64_t t = c.cu[n]; t < c.cu[n + 1]; ++t) {
        for (int64_t i = t * HV * V; i < (t + 1) * HV * V; ++i) {
          if (padded[n]) {
            ASSERT_EQ(out.get(i), 0.0) << "output of padded sequence " << n << ", token " << t;
          } else {
            got_o.push_back(out.get(i));
            ref_o.push_back(ref_out.get(i));
          }
        }
      }
      // Chunks of the sequences before n, and up to n.
      const int64_t c0 = count_chunks(std::vector<int64_t>(c.cu.begin(), c.cu.begin() + n + 1), cc.chunk);
      const int64_t c1 = count_chunks(std::vector<int64_t>(c.cu.begin(), c.cu.begin() + n + 2), cc.chunk);
      for (int64_t ch = c0; ch < c1; ++ch) {
        for (int64_t i = ch * block; i < (ch + 1) * block; ++i) {
          if (padded[n]) {
            ASSERT_EQ(inter.get(i), 0.0) << "chunk state of padded sequence " << n;
          } else {
            got_h.push_back(inter.get(i));
            ref_h.push_back(ref_inter.get(i));
          }
        }
      }
    }
    for (int64_t i = c.cu[5] * HV * V; i < cc.T * HV * V; ++i) ASSERT_EQ(out.get(i), 0.0) << "output of the token tail";
    for (int64_t slot = 0; slot < P; ++slot) {
      const bool named = slot == 5 || slot == 3 || slot == 7;
      for (int64_t i = slot * block; i < (slot + 1) * block; ++i) {
        if (named) {
          got_s.push_back(pool.get(i));
          ref_s.push_back(ref_pool.get(i));
        } else {
          ASSERT_EQ(pool.get(i), before.get(i)) << "slot " << slot << " was touched";
        }
      }
    }
    EXPECT_LE(rel_rms(got_o, ref_o), kTol) << "output";
    EXPECT_LE(rel_rms(got_h, ref_h), kTol) << "chunk states";
    EXPECT_LE(rel_rms(got_s, ref_s), kTol) << "pool";
  }
}

TEST(ChunkedForward, DeterministicAndBatchInvariant) {
  CaseConfig cfg;
  cfg.seqlens = {70, 5, 129};
  cfg.H = 2; cfg.HV = 4; cfg.K = 32; cfg.V = 32;
  KdaCase batch = make_case(cfg, fresh_seed());
  ForwardRun a = run_forward(batch, Impl::kChunked);
  ForwardRun b = run_forward(batch, Impl::kChunked);
  EXPECT_EQ(a.out.values(), b.out.values());
  EXPECT_EQ(a.final_state.values(), b.final_state.values());

  // The third sequence alone must give bit-identical output and final state.
  CaseConfig one = cfg;
  one.seqlens = {129};
  KdaCase alone = make_case(one, 1);
  const int64_t t0 = 75, HV = cfg.HV, H = cfg.H, K = cfg.K, V = cfg.V;
  for (int64_t t = 0; t < 129; ++t) {
    for (int64_t i = 0; i < H * K; ++i) {
      alone.q.set(t * H * K + i, batch.q.get((t0 + t) * H * K + i));
      alone.k.set(t * H * K + i, batch.k.get((t0 + t) * H * K + i));
    }
    for (int64_t i = 0; i < HV * K; ++i) alone.g.set(t * HV * K + i, batch.g.get((t0 + t) * HV * K + i));
    for (int64_t i = 0; i < HV * V; ++i) alone.v.set(t * HV * V + i, batch.v.get((t0 + t) * HV * V + i));
    for (int64_t i = 0; i < HV; ++i) alone.beta.set(t * HV + i, batch.beta.get((t0 + t) * HV + i));
  }
  for (int64_t i = 0; i < HV * K * V; ++i) alone.h0.set(i, batch.h0.get(2 * HV * K * V + i));
  ForwardRun c = run_forward(alone, Impl::kChunked);
  for (int64_t i = 0; i < 129 * HV * V; ++i) ASSERT_EQ(c.out.get(i), a.out.get(t0 * HV * V + i)) << i;
  for (int64_t i = 0; i < HV * K * V; ++i) ASSERT_EQ(c.final_state.get(i), a.final_state.get(2 * HV * K * V + i));
}

}  // namespace
}  // namespace kdakit::test
