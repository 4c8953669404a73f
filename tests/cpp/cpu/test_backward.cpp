// The float64 backward against central finite differences of the float64 forward, for every gradient:
// dq, dk, dv, dg (raw gate input), dbeta (logit), dA_log, ddt_bias, d_initial_state.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "support/kda_case.h"

namespace kdakit::test {
namespace {

constexpr double kTol = 1e-6;   // relative L2 error of each gradient tensor
// Finite-difference step of the fourth-order central stencil: truncation ~h^4 and round-off ~eps |loss| / h both stay
// far below kTol (a second-order stencil at h = 1e-6 had round-off near 1e-6 relative on some draws, so the
// reference, not the backward, decided those runs).
constexpr double kStep = 1e-4;

struct Problem64 {
  KdaCase c;
  HostTensor d_out, d_final;
  bool with_d_final = true;
};

// loss = sum(o * d_out) + sum(final_state * d_final), by the float64 reference.
double loss(const Problem64& p) {
  const KdaCase& c = p.c;
  ForwardRun r = run_forward(c, Impl::kReference, false, DType::kFloat64, DType::kFloat64);
  double l = 0;
  for (int64_t i = 0; i < r.out.numel(); ++i) l += r.out.get(i) * p.d_out.get(i);
  if (p.with_d_final) {
    for (int64_t i = 0; i < r.final_state.numel(); ++i) l += r.final_state.get(i) * p.d_final.get(i);
  }
  return l;
}

std::vector<double> finite_difference(Problem64& p, HostTensor& x) {
  std::vector<double> grad(x.numel());
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double x0 = x.get(i);
    auto at = [&](double dx) {
      x.set(i, x0 + dx);
      return loss(p);
    };
    const double d1 = at(kStep) - at(-kStep), d2 = at(2 * kStep) - at(-2 * kStep);
    x.set(i, x0);
    grad[i] = (8 * d1 - d2) / (12 * kStep);
  }
  return grad;
}

void check_backward(CaseConfig cfg, bool with_d_final) {
  cfg.dtype = DType::kFloat64;
  cfg.state_dtype = DType::kFloat64;
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(describe(cfg) + " d_final=" + std::to_string(with_d_final) + " seed=" + std::to_string(seed));
  Problem64 p{make_case(cfg, seed), {}, {}, with_d_final};
  const CaseConfig& cc = p.c.cfg;
  std::mt19937_64 rng(seed + 1);
  std::normal_distribution<double> normal;
  p.d_out = HostTensor(DType::kFloat64, {cc.B, cc.T, cc.HV, cc.V});
  for (int64_t i = 0; i < p.d_out.numel(); ++i) p.d_out.set(i, normal(rng));
  const bool vk = cc.layout == StateLayout::kVK;
  p.d_final = HostTensor(DType::kFloat64, {p.c.N, cc.HV, vk ? cc.V : cc.K, vk ? cc.K : cc.V});
  for (int64_t i = 0; i < p.d_final.numel(); ++i) p.d_final.set(i, normal(rng));

  BackwardParams bp;
  bp.in = p.c.inputs();
  bp.layout = cc.layout;
  bp.chunk_size = cc.chunk;
  if (p.c.h0.present()) bp.initial_state = p.c.h0.view();
  bp.d_out = p.d_out.view();
  if (with_d_final) bp.d_final_state = p.d_final.view();
  HostTensor dq(DType::kFloat64, p.c.q.shape()), dk(DType::kFloat64, p.c.k.shape()),
      dv(DType::kFloat64, p.c.v.shape()), dg(DType::kFloat64, p.c.g.shape()), db(DType::kFloat64, p.c.beta.shape()),
      dA, dbias, dh0;
  for (HostTensor* t : {&dq, &dk, &dv, &dg, &db}) t->fill(std::nan(""));
  bp.dq = dq.view(); bp.dk = dk.view(); bp.dv = dv.view(); bp.dg = dg.view(); bp.dbeta = db.view();
  const bool gate_in_kernel = cc.gate != GateMode::kPreGated;
  if (gate_in_kernel && p.c.A_log.present()) { dA = HostTensor(DType::kFloat64, {cc.HV}); bp.dA_log = dA.view(); }
  if (gate_in_kernel && p.c.dt_bias.present()) { dbias = HostTensor(DType::kFloat64, {cc.HV * cc.K}); bp.ddt_bias = dbias.view(); }
  if (p.c.h0.present()) { dh0 = HostTensor(DType::kFloat64, p.c.h0.shape()); dh0.fill(std::nan("")); bp.d_initial_state = dh0.view(); }
  std::vector<unsigned char> ws(backward_workspace_size(bp));
  bp.workspace = ws.data();
  bp.workspace_bytes = ws.size();
  backward(bp);

  auto expect_grad = [&](HostTensor& x, const HostTensor& analytic, const char* name) {
    if (!x.present()) return;
    const std::vector<double> fd = finite_difference(p, x);
    const double err = rel_rms(analytic.values(), fd);
    if (std::getenv("KDAKIT_TEST_VERBOSE")) std::printf("  %s %.2e\n", name, err);
    EXPECT_LE(err, kTol) << name;
    EXPECT_TRUE(all_finite(analytic)) << name;
  };
  expect_grad(p.c.q, dq, "dq");
  expect_grad(p.c.k, dk, "dk");
  expect_grad(p.c.v, dv, "dv");
  expect_grad(p.c.g, dg, "dg");
  expect_grad(p.c.beta, db, "dbeta");
  if (bp.dA_log.present()) expect_grad(p.c.A_log, dA, "dA_log");
  if (bp.ddt_bias.present()) expect_grad(p.c.dt_bias, dbias, "ddt_bias");
  if (p.c.h0.present()) expect_grad(p.c.h0, dh0, "d_initial_state");
}

CaseConfig small() {
  CaseConfig cfg;
  cfg.B = 2; cfg.T = 7; cfg.H = 1; cfg.HV = 2; cfg.K = 4; cfg.V = 3;
  return cfg;
}

TEST(Backward, PreGated) {
  check_backward(small(), true);
  CaseConfig cfg = small();
  cfg.l2norm = false;
  cfg.initial_state = false;
  check_backward(cfg, false);
}

TEST(Backward, SoftplusGateWithAndWithoutBias) {
  CaseConfig cfg = small();
  cfg.gate = GateMode::kSoftplus;
  check_backward(cfg, true);
  cfg.has_dt_bias = false;
  check_backward(cfg, false);
}

TEST(Backward, LowerBoundGate) {
  CaseConfig cfg = small();
  cfg.gate = GateMode::kLowerBound;
  cfg.lower_bound = -3.0f;
  check_backward(cfg, true);
  cfg.has_A_log = false;
  check_backward(cfg, true);
  cfg.has_dt_bias = false;
  check_backward(cfg, true);
}

TEST(Backward, BetaSigmoidAndNegativeEigenvalues) {
  CaseConfig cfg = small();
  cfg.beta_sigmoid = true;
  check_backward(cfg, true);
  cfg.neg_eigval = true;
  check_backward(cfg, true);
}

TEST(Backward, GvaVarlenAndVFirstLayout) {
  CaseConfig cfg;
  cfg.seqlens = {3, 0, 5, 1};
  cfg.H = 2; cfg.HV = 4; cfg.K = 3; cfg.V = 2;
  cfg.gate = GateMode::kSoftplus;
  cfg.layout = StateLayout::kVK;
  check_backward(cfg, true);
}

// A padded token tail past cu_seqlens[N] (spec §1.8): its gradients are zeros (the finite differences are zero too).
TEST(Backward, PaddedTokenTail) {
  CaseConfig cfg;
  cfg.seqlens = {4, 3};
  cfg.tail = 3;
  cfg.H = 1; cfg.HV = 2; cfg.K = 3; cfg.V = 2;
  cfg.gate = GateMode::kLowerBound;
  check_backward(cfg, true);
}

// A sequence longer than the backward's checkpoint segment (64 tokens).
TEST(Backward, AcrossCheckpointSegments) {
  CaseConfig cfg;
  cfg.B = 1; cfg.T = 70; cfg.H = 1; cfg.HV = 1; cfg.K = 2; cfg.V = 2;
  cfg.gate = GateMode::kLowerBound;
  check_backward(cfg, true);
}

}  // namespace
}  // namespace kdakit::test
