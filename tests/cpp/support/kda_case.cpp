#include "support/kda_case.h"

#include <cmath>
#include <cstring>
#include <sstream>

#include "cpu/dtype.h"

namespace kdakit::test {

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape) : shape_(std::move(shape)) {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  bytes_.assign(static_cast<std::size_t>(std::max<int64_t>(n, 1)) * dtype_size(dtype), 0);
  view_ = make_view(bytes_.data(), dtype, static_cast<int>(shape_.size()), shape_.data(), nullptr);
}

double HostTensor::get(int64_t i) const {
  switch (view_.dtype) {
    case DType::kInt32: return reinterpret_cast<const int32_t*>(bytes_.data())[i];
    case DType::kInt64: return static_cast<double>(reinterpret_cast<const int64_t*>(bytes_.data())[i]);
    case DType::kBool:
    case DType::kUInt8: return bytes_[i];
    default: return cpu::load_elem<double>(bytes_.data(), view_.dtype, i);
  }
}

void HostTensor::set(int64_t i, double value) {
  switch (view_.dtype) {
    case DType::kInt32: reinterpret_cast<int32_t*>(bytes_.data())[i] = static_cast<int32_t>(value); break;
    case DType::kInt64: reinterpret_cast<int64_t*>(bytes_.data())[i] = static_cast<int64_t>(value); break;
    case DType::kBool:
    case DType::kUInt8: bytes_[i] = static_cast<unsigned char>(value); break;
    default: cpu::store_elem<double>(bytes_.data(), view_.dtype, i, value);
  }
}

void HostTensor::fill(double value) {
  for (int64_t i = 0; i < numel(); ++i) set(i, value);
}

std::vector<double> HostTensor::values() const {
  std::vector<double> r(numel());
  for (int64_t i = 0; i < numel(); ++i) r[i] = get(i);
  return r;
}

HostTensor HostTensor::clone() const {
  HostTensor t(view_.dtype, shape_);
  std::memcpy(t.bytes_.data(), bytes_.data(), bytes_.size());
  return t;
}

std::string describe(const CaseConfig& c) {
  std::ostringstream os;
  os << "B" << c.B << " T" << c.T << " H" << c.H << " HV" << c.HV << " K" << c.K << " V" << c.V;
  if (!c.seqlens.empty()) {
    os << " seqlens[";
    for (std::size_t i = 0; i < c.seqlens.size(); ++i) os << (i ? "," : "") << c.seqlens[i];
    os << "]";
    if (c.tail) os << " tail" << c.tail;
  }
  os << " dtype=" << dtype_name(c.dtype) << " gate=" << static_cast<int>(c.gate) << " A_log=" << c.has_A_log
     << " dt_bias=" << c.has_dt_bias << " l2=" << c.l2norm << " beta_sigmoid=" << c.beta_sigmoid
     << " neg=" << c.neg_eigval << " h0=" << c.initial_state << " state=" << dtype_name(c.state_dtype)
     << " layout=" << static_cast<int>(c.layout) << " C=" << c.chunk << " reset=" << c.reset_prob;
  return os.str();
}

KdaCase make_case(const CaseConfig& cfg, uint64_t seed) {
  KdaCase c;
  c.cfg = cfg;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unif(0.0, 1.0);
  std::normal_distribution<double> normal(0.0, 1.0);
  const bool varlen = !cfg.seqlens.empty();
  int64_t T = cfg.T;
  if (varlen) {
    c.cu.push_back(0);
    for (int64_t len : cfg.seqlens) c.cu.push_back(c.cu.back() + len);
    T = c.cu.back() + cfg.tail;
    c.N = static_cast<int64_t>(cfg.seqlens.size());
    c.cu_seqlens = HostTensor(DType::kInt64, {c.N + 1});
    for (int64_t i = 0; i <= c.N; ++i) c.cu_seqlens.set(i, static_cast<double>(c.cu[i]));
  } else {
    c.N = cfg.B;
    for (int64_t n = 0; n <= c.N; ++n) c.cu.push_back(n * T);
  }
  const int64_t B = varlen ? 1 : cfg.B;
  c.cfg.T = T;
  c.cfg.B = B;
  c.q = HostTensor(cfg.dtype, {B, T, cfg.H, cfg.K});
  c.k = HostTensor(cfg.dtype, {B, T, cfg.H, cfg.K});
  c.v = HostTensor(cfg.dtype, {B, T, cfg.HV, cfg.V});
  c.g = HostTensor(cfg.dtype, {B, T, cfg.HV, cfg.K});
  c.beta = HostTensor(cfg.dtype, {B, T, cfg.HV});
  // q, k ~ U(0,1), normalised here when the kernel does not.
  for (HostTensor* t : {&c.q, &c.k}) {
    for (int64_t row = 0; row < B * T * cfg.H; ++row) {
      std::vector<double> x(cfg.K);
      double ss = 0;
      for (auto& e : x) { e = unif(rng); ss += e * e; }
      for (int64_t d = 0; d < cfg.K; ++d) t->set(row * cfg.K + d, cfg.l2norm ? x[d] : x[d] / std::sqrt(ss + 1e-6));
    }
  }
  for (int64_t i = 0; i < c.v.numel(); ++i) c.v.set(i, normal(rng));
  for (int64_t i = 0; i < c.g.numel(); ++i) {
    if (cfg.gate == GateMode::kPreGated) {
      const double z = normal(rng);
      double gv = -std::log1p(std::exp(-z)) / cfg.gate_normalizer;  // logsigmoid
      if (cfg.safe_gate) gv = std::max(gv, -5.0);
      if (cfg.reset_prob > 0 && unif(rng) < cfg.reset_prob) gv = -1000.0;
      c.g.set(i, gv);
    } else {
      c.g.set(i, normal(rng));
    }
  }
  for (int64_t i = 0; i < c.beta.numel(); ++i) {
    const double z = normal(rng);
    c.beta.set(i, cfg.beta_sigmoid ? z : 1.0 / (1.0 + std::exp(-z)));
  }
  if (cfg.gate != GateMode::kPreGated) {
    // A_log and dt_bias are float32 in models; float64 problems (finite differences) keep them float64.
    const DType param_dtype = cfg.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
    if (cfg.has_A_log) {
      c.A_log = HostTensor(param_dtype, {cfg.HV});
      for (int64_t i = 0; i < cfg.HV; ++i) c.A_log.set(i, std::log(1.0 + 15.0 * unif(rng)));
    }
    if (cfg.has_dt_bias) {
      c.dt_bias = HostTensor(param_dtype, {cfg.HV * cfg.K});
      for (int64_t i = 0; i < cfg.HV * cfg.K; ++i) c.dt_bias.set(i, normal(rng));
    }
  }
  if (cfg.initial_state) {
    const bool vk = cfg.layout == StateLayout::kVK;
    c.h0 = HostTensor(cfg.state_dtype, {c.N, cfg.HV, vk ? cfg.V : cfg.K, vk ? cfg.K : cfg.V});
    for (int64_t i = 0; i < c.h0.numel(); ++i) c.h0.set(i, normal(rng));
  }
  return c;
}

KdaInputs KdaCase::inputs() const {
  KdaInputs in;
  in.q = q.view();
  in.k = k.view();
  in.v = v.view();
  in.g = g.view();
  in.beta = beta.view();
  in.scale = cfg.scale < 0 ? default_scale(cfg.K) : cfg.scale;
  in.gate.mode = cfg.gate;
  if (A_log.present()) in.gate.A_log = A_log.view();
  if (dt_bias.present()) in.gate.dt_bias = dt_bias.view();
  in.gate.lower_bound = cfg.lower_bound;
  in.qk_l2norm = cfg.l2norm;
  in.beta_sigmoid = cfg.beta_sigmoid;
  in.allow_neg_eigval = cfg.neg_eigval;
  if (cu_seqlens.present()) in.cu_seqlens = cu_seqlens.view();
  return in;
}

StateIO KdaCase::state_io() const {
  StateIO st;
  st.layout = cfg.layout;
  if (h0.present()) st.initial_state = h0.view();
  return st;
}

ForwardRun run_forward(const KdaCase& c, Impl impl, bool want_intermediate, DType final_dtype, DType out_dtype) {
  ForwardRun r;
  const CaseConfig& cfg = c.cfg;
  ForwardParams p;
  p.in = c.inputs();
  p.state = c.state_io();
  p.chunk_size = cfg.chunk;
  p.safe_gate = cfg.safe_gate;
  r.out = HostTensor(out_dtype, {cfg.B, cfg.T, cfg.HV, cfg.V});
  r.out.fill(std::nan(""));  // poison: every element must be written
  p.out = r.out.view();
  const bool vk = cfg.layout == StateLayout::kVK;
  r.final_state = HostTensor(final_dtype, {c.N, cfg.HV, vk ? cfg.V : cfg.K, vk ? cfg.K : cfg.V});
  r.final_state.fill(std::nan(""));
  p.state.final_state = r.final_state.view();
  if (want_intermediate) {
    const int64_t nt = cfg.seqlens.empty() ? (cfg.T + cfg.chunk - 1) / cfg.chunk : count_chunks(c.cu, cfg.chunk);
    r.intermediate = HostTensor(DType::kFloat32, {cfg.B, nt, cfg.HV, vk ? cfg.V : cfg.K, vk ? cfg.K : cfg.V});
    r.intermediate.fill(std::nan(""));
    p.intermediate_states = r.intermediate.view();
  }
  if (impl == Impl::kReference) {
    reference_forward(p);
  } else {
    std::vector<unsigned char> ws(forward_workspace_size(p));
    p.workspace = ws.data();
    p.workspace_bytes = ws.size();
    forward(p);
  }
  return r;
}

uint64_t fresh_seed() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

double rel_rms(const std::vector<double>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double d = got[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  if (std::isnan(num)) return std::nan("");
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}

double rel_rms(const HostTensor& got, const HostTensor& ref) { return rel_rms(got.values(), ref.values()); }

bool all_finite(const HostTensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (!std::isfinite(t.get(i))) return false;
  }
  return true;
}

}  // namespace kdakit::test
