// Test support: host tensors, random KDA problems (FLA's input recipe, spec §6.1) and error metrics.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kdakit/kdakit.h"

namespace kdakit::test {

// Contiguous host tensor owning its bytes. Move-only: the view points into `bytes`.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape);
  HostTensor(HostTensor&&) = default;
  HostTensor& operator=(HostTensor&&) = default;
  HostTensor(const HostTensor&) = delete;
  HostTensor& operator=(const HostTensor&) = delete;

  bool present() const { return view_.present(); }
  const TensorView& view() const { return view_; }
  TensorView& view() { return view_; }
  int64_t numel() const { return view_.numel(); }
  const std::vector<int64_t>& shape() const { return shape_; }
  double get(int64_t i) const;
  void set(int64_t i, double value);
  void fill(double value);
  std::vector<double> values() const;
  HostTensor clone() const;

 private:
  std::vector<unsigned char> bytes_;
  std::vector<int64_t> shape_;
  TensorView view_;
};

struct CaseConfig {
  int64_t B = 1, T = 64, H = 2, HV = 2, K = 16, V = 16;
  std::vector<int64_t> seqlens;  // non-empty: varlen (B must be 1)
  int64_t tail = 0;              // varlen: padded tokens past the last sequence (cu_seqlens[N] < T)
  DType dtype = DType::kFloat32;  // q, k, v, g, beta
  GateMode gate = GateMode::kPreGated;
  bool has_A_log = true, has_dt_bias = true;
  float lower_bound = -5.0f;
  bool l2norm = true;            // in kernel; otherwise q, k are normalised when generated
  bool beta_sigmoid = false, neg_eigval = false;
  bool initial_state = true;
  DType state_dtype = DType::kFloat32;
  StateLayout layout = StateLayout::kKV;
  int chunk = 64;
  bool safe_gate = false;
  double reset_prob = 0.0;       // probability of g = -1000 (pre-gated) per token and dim
  double gate_normalizer = 1.0;  // pre-gated g = logsigmoid(N(0,1)) / normalizer
  float scale = -1.0f;           // < 0: K^-0.5
};

std::string describe(const CaseConfig& c);

struct KdaCase {
  CaseConfig cfg;
  int64_t N = 0;
  std::vector<int64_t> cu;
  HostTensor q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens;

  KdaInputs inputs() const;
  StateIO state_io() const;  // initial_state only
};

KdaCase make_case(const CaseConfig& cfg, uint64_t seed);

// Outputs of one forward run.
struct ForwardRun {
  HostTensor out, final_state, intermediate;
};
enum class Impl { kChunked, kReference };
ForwardRun run_forward(const KdaCase& c, Impl impl, bool want_intermediate = false,
                       DType final_dtype = DType::kFloat32, DType out_dtype = DType::kFloat32);

uint64_t fresh_seed();
double rel_rms(const HostTensor& got, const HostTensor& ref);
double rel_rms(const std::vector<double>& got, const std::vector<double>& ref);
bool all_finite(const HostTensor& t);

}  // namespace kdakit::test
