// Decode and speculative verify against a state pool, checked against an independent float64 recurrence
// written here: outputs, states written to the named slots, every other slot left bit-exact.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "support/kda_case.h"

namespace kdakit::test {
namespace {

constexpr double kTol = 1e-5;  // float32 decode vs float64 recurrence (relative RMS)
constexpr double kPoison = 1e30;

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Float64 recurrence of one (sequence, v-head) from state S (dense [K][V]); appends outputs and
// per-token states.
struct Naive {
  std::vector<double> out;     // [len][V]
  std::vector<double> states;  // [len][K*V]
};
Naive naive(const KdaCase& c, int64_t n, int64_t hv, std::vector<double> S, const HostTensor* beta_cols) {
  const CaseConfig& cfg = c.cfg;
  const int64_t K = cfg.K, V = cfg.V, H = cfg.H, HV = cfg.HV, h = hv / (HV / H);
  Naive r;
  for (int64_t t = c.cu[n]; t < c.cu[n + 1]; ++t) {
    std::vector<double> q(K), k(K), g(K);
    double nq = 0, nk = 0;
    for (int64_t d = 0; d < K; ++d) {
      q[d] = c.q.get((t * H + h) * K + d);
      k[d] = c.k.get((t * H + h) * K + d);
      nq += q[d] * q[d];
      nk += k[d] * k[d];
    }
    if (cfg.l2norm) {
      for (int64_t d = 0; d < K; ++d) { q[d] /= std::sqrt(nq + 1e-6); k[d] /= std::sqrt(nk + 1e-6); }
    }
    for (int64_t d = 0; d < K; ++d) {
      double x = c.g.get((t * HV + hv) * K + d);
      if (cfg.gate != GateMode::kPreGated) {
        if (c.dt_bias.present()) x += c.dt_bias.get(hv * K + d);
        const double A = c.A_log.present() ? c.A_log.get(hv) : 0.0;
        if (cfg.gate == GateMode::kSoftplus) {
          x = -std::exp(A) * (x > 20 ? x : std::log1p(std::exp(x)));
        } else {
          x = cfg.lower_bound * sigmoid((c.A_log.present() ? std::exp(A) : 1.0) * x);
        }
      }
      g[d] = x;
    }
    std::vector<double> bcol(V);
    for (int64_t j = 0; j < V; ++j) {
      double b = beta_cols ? beta_cols->get((t * HV + hv) * V + j) : c.beta.get(t * HV + hv);
      if (cfg.beta_sigmoid) b = (cfg.neg_eigval ? 2.0 : 1.0) * sigmoid(b);
      bcol[j] = b;
    }
    for (int64_t d = 0; d < K; ++d) for (int64_t j = 0; j < V; ++j) S[d * V + j] *= std::exp(g[d]);
    for (int64_t j = 0; j < V; ++j) {
      double e = c.v.get((t * HV + hv) * V + j);
      for (int64_t d = 0; d < K; ++d) e -= k[d] * S[d * V + j];
      e *= bcol[j];
      for (int64_t d = 0; d < K; ++d) S[d * V + j] += k[d] * e;
    }
    const double scale = cfg.scale < 0 ? 1.0 / std::sqrt(double(K)) : cfg.scale;
    for (int64_t j = 0; j < V; ++j) {
      double o = 0;
      for (int64_t d = 0; d < K; ++d) o += q[d] * S[d * V + j];
      r.out.push_back(scale * o);
    }
    r.states.insert(r.states.end(), S.begin(), S.end());
  }
  return r;
}

// Dense [K][V] state of (slot, hv) in a pool of layout `layout`.
std::vector<double> read_slot(const HostTensor& pool, int64_t slot, int64_t hv, const CaseConfig& cfg) {
  const int64_t K = cfg.K, V = cfg.V, HV = cfg.HV;
  std::vector<double> S(K * V);
  for (int64_t d = 0; d < K; ++d) {
    for (int64_t j = 0; j < V; ++j) {
      const int64_t e = cfg.layout == StateLayout::kKV ? d * V + j : j * K + d;
      S[d * V + j] = pool.get((slot * HV + hv) * K * V + e);
    }
  }
  return S;
}

struct DecodeSetup {
  CaseConfig cfg;
  bool two_d = false;         // indices [N, T_max] with per-token writes
  bool accepted = false;      // num_accepted_tokens (needs two_d)
  bool pad_slot = false;      // sequence 0 is padding (every slot of its row is the pad id)
  int64_t pad_slot_id = -1;   // the pad id: -1, or a pool slot that no sequence names (vLLM's slot 0)
  bool pad_write = false;     // two_d: one per-token write slot of sequence 1 (not its read slot) is the pad id
  int64_t extra_rows = 0;     // rows past N in the indices, num_accepted_tokens and has_initial_state (ignored)
  bool has_initial = false;   // has_initial_state mask with a false entry
  bool token_states = false;  // also return every token's state
  bool verify = false;        // no pool write at all (token states only)
  bool headwise_beta = false;
};

void check_decode(const DecodeSetup& s) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(describe(s.cfg) + " two_d=" + std::to_string(s.two_d) + " accepted=" + std::to_string(s.accepted) +
               " pad=" + std::to_string(s.pad_slot) + " pad_id=" + std::to_string(s.pad_slot_id) +
               " pad_write=" + std::to_string(s.pad_write) + " extra_rows=" + std::to_string(s.extra_rows) +
               " verify=" + std::to_string(s.verify) + " seed=" + std::to_string(seed));
  CaseConfig cfg = s.cfg;
  cfg.initial_state = false;
  KdaCase c = make_case(cfg, seed);
  const CaseConfig& cc = c.cfg;
  const int64_t N = c.N, HV = cc.HV, K = cc.K, V = cc.V, rows = N + s.extra_rows;
  int64_t T_max = 0;
  for (int64_t n = 0; n < N; ++n) T_max = std::max(T_max, c.cu[n + 1] - c.cu[n]);
  const int64_t cols = s.two_d ? std::max<int64_t>(T_max, 1) : 1;
  const int64_t P = 3 * N * cols + 1;  // three times the slots named (FLA's engine recipe), and the pad slot
  std::mt19937_64 rng(seed + 7);
  std::normal_distribution<double> normal;
  const bool vk = cc.layout == StateLayout::kVK;
  HostTensor pool(cc.state_dtype, {P, HV, vk ? V : K, vk ? K : V});
  pool.fill(kPoison);
  // Distinct random slots for every (sequence, column), never the pad id.
  std::vector<int64_t> perm;
  for (int64_t slot = 0; slot < P; ++slot) {
    if (slot != s.pad_slot_id) perm.push_back(slot);
  }
  std::shuffle(perm.begin(), perm.end(), rng);
  HostTensor idx(DType::kInt32, s.two_d ? std::vector<int64_t>{rows, cols} : std::vector<int64_t>{rows});
  for (int64_t i = 0; i < N * cols; ++i) idx.set(i, static_cast<double>(perm[i]));
  for (int64_t i = N * cols; i < rows * cols; ++i) idx.set(i, -7);  // ignored rows: an invalid id
  if (s.pad_slot) for (int64_t j = 0; j < cols; ++j) idx.set(0 * cols + j, static_cast<double>(s.pad_slot_id));
  HostTensor acc(DType::kInt64, {rows});
  for (int64_t n = 0; n < rows; ++n) acc.set(n, n < N ? 1 + static_cast<int64_t>(rng() % cols) : 0);
  HostTensor mask(DType::kBool, {rows});
  for (int64_t n = 0; n < rows; ++n) mask.set(n, n % 3 == 1 ? 0 : 1);
  auto read_col = [&](int64_t n) { return s.two_d && s.accepted ? static_cast<int64_t>(acc.get(n)) - 1 : 0; };
  auto read_of = [&](int64_t n) { return static_cast<int64_t>(idx.get(n * cols + read_col(n))); };
  if (s.pad_write) {
    const int64_t len1 = c.cu[2] - c.cu[1];
    ASSERT_GE(len1, 2) << "pad_write needs a sequence 1 of at least two tokens";
    idx.set(1 * cols + (read_col(1) + 1) % len1, static_cast<double>(s.pad_slot_id));
  }
  auto is_pad = [&](int64_t slot) { return slot < 0 || slot == s.pad_slot_id; };
  // Fill the slots that are read with random states.
  for (int64_t n = 0; n < N; ++n) {
    const int64_t slot = read_of(n);
    if (is_pad(slot)) continue;
    for (int64_t i = 0; i < HV * K * V; ++i) pool.set(slot * HV * K * V + i, normal(rng));
  }
  HostTensor before = pool.clone();
  HostTensor beta_cols;
  if (s.headwise_beta) {
    beta_cols = HostTensor(cc.dtype, {cc.B, cc.T, HV, V});
    for (int64_t i = 0; i < beta_cols.numel(); ++i) beta_cols.set(i, cfg.beta_sigmoid ? normal(rng) : sigmoid(normal(rng)));
  }

  DecodeParams p;
  p.in = c.inputs();
  if (s.headwise_beta) p.in.beta = beta_cols.view();
  p.state.layout = cc.layout;
  p.state.initial_state = pool.view();
  if (!s.verify) p.state.final_state = pool.view();
  p.state.state_indices = idx.view();
  p.state.pad_slot_id = s.pad_slot_id;
  if (s.accepted) p.num_accepted_tokens = acc.view();
  if (s.has_initial) p.state.has_initial_state = mask.view();
  HostTensor out(DType::kFloat32, {cc.B, cc.T, HV, V});
  out.fill(std::nan(""));
  p.out = out.view();
  HostTensor tstates;
  if (s.token_states || s.verify) {
    tstates = HostTensor(DType::kFloat32, {cc.B * cc.T, HV, vk ? V : K, vk ? K : V});
    tstates.fill(std::nan(""));
    p.token_states = tstates.view();
  }
  decode(p);

  // Padding (a padded sequence, the token tail) gives exact zeros in the outputs and the per-token states.
  auto expect_zero_token = [&](int64_t b, int64_t t, const char* what) {
    for (int64_t hv = 0; hv < HV; ++hv) {
      for (int64_t j = 0; j < V; ++j) {
        ASSERT_EQ(out.get(((b * cc.T + t) * HV + hv) * V + j), 0.0) << what << ": output of token " << t;
      }
      if (tstates.present()) {
        for (double x : read_slot(tstates, b * cc.T + t, hv, cc)) ASSERT_EQ(x, 0.0) << what << ": state of token " << t;
      }
    }
  };
  std::vector<double> got_out, ref_out, got_states, ref_states;
  std::vector<bool> written(P, false);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t len = c.cu[n + 1] - c.cu[n];
    const int64_t b = cc.seqlens.empty() ? n : 0, t0 = cc.seqlens.empty() ? 0 : c.cu[n];
    if (is_pad(read_of(n))) {
      for (int64_t i = 0; i < len; ++i) expect_zero_token(b, t0 + i, "padded sequence");
      continue;
    }
    for (int64_t hv = 0; hv < HV; ++hv) {
      const int64_t rs = read_of(n);
      std::vector<double> S0(K * V, 0.0);
      const bool masked = s.has_initial && mask.get(n) == 0;
      if (!masked) S0 = read_slot(before, rs, hv, cc);
      Naive r = naive(c, n, hv, S0, s.headwise_beta ? &beta_cols : nullptr);
      for (int64_t i = 0; i < len; ++i) {
        for (int64_t j = 0; j < V; ++j) {
          got_out.push_back(out.get(((c.cu[n] + i) * HV + hv) * V + j));
          ref_out.push_back(r.out[i * V + j]);
        }
        if (tstates.present()) {
          const std::vector<double> ts = read_slot(tstates, c.cu[n] + i, hv, cc);
          got_states.insert(got_states.end(), ts.begin(), ts.end());
          ref_states.insert(ref_states.end(), r.states.begin() + i * K * V, r.states.begin() + (i + 1) * K * V);
        }
      }
      if (s.verify) continue;
      // Pool writes: after every token (2-D) or once at the end (1-D; after zero tokens it is S0).
      for (int64_t i = 0; i < (s.two_d ? len : 1); ++i) {
        const int64_t ws = static_cast<int64_t>(s.two_d ? idx.get(n * cols + i) : idx.get(n));
        if (is_pad(ws)) continue;
        written[ws] = true;
        const std::vector<double> gs = read_slot(pool, ws, hv, cc);
        std::vector<double> rs_state;
        if (s.two_d) {
          rs_state.assign(r.states.begin() + i * K * V, r.states.begin() + (i + 1) * K * V);
        } else {
          rs_state = len ? std::vector<double>(r.states.end() - K * V, r.states.end()) : S0;
        }
        got_states.insert(got_states.end(), gs.begin(), gs.end());
        ref_states.insert(ref_states.end(), rs_state.begin(), rs_state.end());
      }
    }
  }
  for (int64_t t = c.cu[N]; !cc.seqlens.empty() && t < cc.T; ++t) expect_zero_token(0, t, "token tail");
  ASSERT_TRUE(all_finite(out)) << "output not finite or not fully written";
  if (!ref_out.empty()) EXPECT_LE(rel_rms(got_out, ref_out), kTol) << "output";
  const double state_tol = cc.state_dtype == DType::kBFloat16 ? 1.0 / 256 : kTol;  // bf16 pool rounding
  if (!ref_states.empty()) EXPECT_LE(rel_rms(got_states, ref_states), state_tol) << "states";
  for (int64_t slot = 0; slot < P; ++slot) {
    if (written[slot]) continue;
    for (int64_t i = 0; i < HV * K * V; ++i) {
      ASSERT_EQ(pool.get(slot * HV * K * V + i), before.get(slot * HV * K * V + i)) << "slot " << slot << " was touched";
    }
  }
}

CaseConfig decode_config(int64_t N, int64_t T) {
  CaseConfig cfg;
  cfg.B = N; cfg.T = T; cfg.H = 2; cfg.HV = 4; cfg.K = 32; cfg.V = 16;
  return cfg;
}

TEST(Decode, SingleTokenPoolInPlace) {
  for (StateLayout layout : {StateLayout::kKV, StateLayout::kVK}) {
    for (DType sdt : {DType::kFloat32, DType::kBFloat16}) {
      DecodeSetup s;
      s.cfg = decode_config(7, 1);
      s.cfg.layout = layout;
      s.cfg.state_dtype = sdt;
      s.cfg.gate = GateMode::kLowerBound;
      s.cfg.beta_sigmoid = true;
      s.pad_slot = true;
      check_decode(s);
    }
  }
}

TEST(Decode, VarlenTokensGatesAndMasks) {
  for (GateMode gate : {GateMode::kPreGated, GateMode::kSoftplus, GateMode::kLowerBound}) {
    DecodeSetup s;
    s.cfg = decode_config(1, 0);
    s.cfg.seqlens = {1, 4, 0, 16, 3};
    s.cfg.gate = gate;
    s.has_initial = true;
    s.token_states = true;
    check_decode(s);
  }
}

TEST(Decode, SpeculativeVerifyWithAcceptedTokens) {
  for (StateLayout layout : {StateLayout::kKV, StateLayout::kVK}) {
    DecodeSetup s;
    s.cfg = decode_config(6, 4);
    s.cfg.layout = layout;
    s.two_d = true;
    s.accepted = true;
    s.pad_slot = true;
    check_decode(s);
  }
}

// CUDA-graph batches (spec §1.7): padded sequences with -1 or with vLLM's pad slot 0, rows past N, a token tail.
TEST(Decode, PaddedBatchOfACapturedSize) {
  for (int64_t pad : {-1, 0}) {
    for (bool two_d : {false, true}) {
      DecodeSetup s;
      s.cfg = decode_config(1, 0);
      s.cfg.seqlens = two_d ? std::vector<int64_t>{3, 3, 2, 0} : std::vector<int64_t>{1, 1, 1, 0, 1};
      s.cfg.tail = 3;
      s.cfg.layout = pad ? StateLayout::kKV : StateLayout::kVK;
      s.two_d = two_d;
      s.accepted = two_d;
      s.pad_slot = true;
      s.pad_slot_id = pad;
      s.pad_write = two_d;
      s.extra_rows = 3;
      s.has_initial = true;
      s.token_states = true;
      check_decode(s);
    }
  }
}

TEST(Decode, PaddedSequencesInVerify) {
  DecodeSetup s;
  s.cfg = decode_config(1, 0);
  s.cfg.seqlens = {3, 3, 3};
  s.cfg.tail = 2;
  s.two_d = true;
  s.accepted = true;
  s.pad_slot = true;
  s.pad_slot_id = 0;
  s.verify = true;
  check_decode(s);
}

TEST(Decode, VerifyLeavesThePoolUntouched) {
  DecodeSetup s;
  s.cfg = decode_config(5, 3);
  s.cfg.gate = GateMode::kSoftplus;
  s.two_d = true;
  s.accepted = true;
  s.verify = true;
  check_decode(s);
}

TEST(Decode, HeadwiseBetaAndGva) {
  DecodeSetup s;
  s.cfg = decode_config(4, 2);
  s.cfg.H = 1; s.cfg.HV = 8;
  s.cfg.beta_sigmoid = true;
  s.cfg.neg_eigval = true;
  s.headwise_beta = true;
  check_decode(s);
}

TEST(Decode, LargeHeadDims) {
  DecodeSetup s;
  s.cfg = decode_config(3, 2);
  s.cfg.K = 128; s.cfg.V = 128; s.cfg.H = 1; s.cfg.HV = 2;
  s.cfg.layout = StateLayout::kVK;
  check_decode(s);
}

}  // namespace
}  // namespace kdakit::test
