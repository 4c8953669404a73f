// Reads one token's inputs for one head and applies the in-kernel preprocessing: q/k L2 norm, the gate
// activation and the beta activation (spec §1.5, §2.2, §2.5). Acc is float (chunked, decode) or double
// (the reference and the backward).
#pragma once

#include <cmath>
#include <cstdint>

#include "common/kda_math.h"
#include "common/plan.h"
#include "cpu/dtype.h"

namespace kdakit::cpu {

inline int64_t offset4(const TensorView& t, int64_t i0, int64_t i1, int64_t i2) {
  return i0 * t.strides[0] + i1 * t.strides[1] + i2 * t.strides[2];
}

template <class Acc>
class InputReader {
 public:
  InputReader(const KdaInputs& in, const Problem& pr) : in_(in), pr_(pr) {
    gate_mode_ = static_cast<int>(in.gate.mode);
    has_A_log_ = in.gate.A_log.present();
    has_dt_bias_ = in.gate.dt_bias.present();
    lower_bound_ = static_cast<Acc>(in.gate.lower_bound);
    headwise_beta_ = in.beta.ndim == 4;
  }

  int64_t K() const { return pr_.K; }
  int64_t V() const { return pr_.V; }
  bool headwise_beta() const { return headwise_beta_; }
  int gate_mode() const { return gate_mode_; }
  bool has_A_log() const { return has_A_log_; }
  bool has_dt_bias() const { return has_dt_bias_; }
  Acc lower_bound() const { return lower_bound_; }
  Acc A_log(int64_t hv) const { return has_A_log_ ? load_elem<Acc>(in_.gate.A_log.data, in_.gate.A_log.dtype, hv) : Acc(0); }

  // Raw q or k row of head h.
  void raw(const TensorView& t, int64_t b, int64_t s, int64_t h, Acc* dst) const {
    load_row<Acc>(t, offset4(t, b, s, h), pr_.K, t.strides[3], dst);
  }
  // q or k of head h after the optional L2 norm; returns the reciprocal norm used (1 without the norm).
  Acc qk(const TensorView& t, int64_t b, int64_t s, int64_t h, Acc* dst) const {
    raw(t, b, s, h, dst);
    if (!in_.qk_l2norm) return Acc(1);
    Acc ss = 0;
    for (int64_t d = 0; d < pr_.K; ++d) ss += dst[d] * dst[d];
    const Acc rstd = Acc(1) / std::sqrt(ss + static_cast<Acc>(math::kL2NormEps));
    for (int64_t d = 0; d < pr_.K; ++d) dst[d] *= rstd;
    return rstd;
  }
  Acc q(int64_t b, int64_t s, int64_t h, Acc* dst) const { return qk(in_.q, b, s, h, dst); }
  Acc k(int64_t b, int64_t s, int64_t h, Acc* dst) const { return qk(in_.k, b, s, h, dst); }

  void v(int64_t b, int64_t s, int64_t hv, Acc* dst) const {
    load_row<Acc>(in_.v, offset4(in_.v, b, s, hv), pr_.V, in_.v.strides[3], dst);
  }

  // Natural-log decay of every key dimension. With the gate in kernel, x (= g + dt_bias) is returned too.
  void gate(int64_t b, int64_t s, int64_t hv, Acc* g, Acc* x = nullptr) const {
    load_row<Acc>(in_.g, offset4(in_.g, b, s, hv), pr_.K, in_.g.strides[3], g);
    if (gate_mode_ == 0) return;
    const Acc a = A_log(hv);
    for (int64_t d = 0; d < pr_.K; ++d) {
      Acc xd = g[d];
      if (has_dt_bias_) xd += load_elem<Acc>(in_.gate.dt_bias.data, in_.gate.dt_bias.dtype, hv * pr_.K + d);
      if (x) x[d] = xd;
      g[d] = math::gate_value<Acc>(gate_mode_, xd, a, has_A_log_, lower_bound_);
    }
  }

  Acc beta_raw(int64_t b, int64_t s, int64_t hv) const {
    const TensorView& t = in_.beta;
    return load_elem<Acc>(t.data, t.dtype, b * t.strides[0] + s * t.strides[1] + hv * t.strides[2]);
  }
  Acc beta(int64_t b, int64_t s, int64_t hv) const {
    return math::beta_value<Acc>(beta_raw(b, s, hv), in_.beta_sigmoid, in_.allow_neg_eigval);
  }
  // Per-value-column beta [B,T,HV,V] (decode).
  void beta_columns(int64_t b, int64_t s, int64_t hv, Acc* dst) const {
    const TensorView& t = in_.beta;
    load_row<Acc>(t, offset4(t, b, s, hv), pr_.V, t.strides[3], dst);
    for (int64_t j = 0; j < pr_.V; ++j) dst[j] = math::beta_value<Acc>(dst[j], in_.beta_sigmoid, in_.allow_neg_eigval);
  }

 private:
  const KdaInputs& in_;
  const Problem& pr_;
  int gate_mode_ = 0;
  bool has_A_log_ = false, has_dt_bias_ = false, headwise_beta_ = false;
  Acc lower_bound_ = 0;
};

// Token range of sequence n: batch row b, first token t0, length len.
struct SeqRange {
  int64_t b, t0, len;
};
inline SeqRange seq_range(const detail::Plan& plan, int64_t n) {
  const int64_t bos = plan.cu[n], eos = plan.cu[n + 1];
  if (plan.pr.varlen) return {0, bos, eos - bos};
  return {n, 0, eos - bos};
}

// The padded token tail of a varlen batch, [cu_seqlens[N], T) (spec §1.8); empty for fixed-length inputs.
inline SeqRange tail_range(const detail::Plan& plan) {
  if (!plan.pr.varlen) return {0, plan.pr.T, 0};
  return {0, plan.cu[plan.pr.N], plan.pr.T - plan.cu[plan.pr.N]};
}

// Zeros in the rows [t0, t0 + len) of one head of a [B,T,heads,X] or [B,T,heads] tensor (outputs and gradients of
// padding).
template <class Acc>
inline void zero_token_rows(const TensorView& t, const SeqRange& rows, int64_t head) {
  const int64_t X = t.ndim == 4 ? t.shape[3] : 1, xs = t.ndim == 4 ? t.strides[3] : 0;
  for (int64_t s = rows.t0; s < rows.t0 + rows.len; ++s) {
    const int64_t off = offset4(t, rows.b, s, head);
    for (int64_t i = 0; i < X; ++i) store_elem<Acc>(t.data, t.dtype, off + i * xs, Acc(0));
  }
}

}  // namespace kdakit::cpu
