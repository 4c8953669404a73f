// The backward of the whole op in float64, by reverse-mode differentiation of the token recurrence
// (spec §1.4) and of the preprocessing (L2 norm, gate, beta sigmoid). One (sequence, q/k head) per task, so
// the q/k gradients of a GVA group are summed without races; per-(sequence, v-head) partial sums of dA_log
// and ddt_bias are reduced afterwards in a fixed order, so the result is deterministic.
//
// Memory: states are checkpointed every kSegment tokens in a forward sweep; the backward sweep rebuilds one
// segment's per-token states from its checkpoint.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/backend.h"
#include "cpu/inputs.h"
#include "cpu/parallel.h"
#include "cpu/state.h"

namespace kdakit::cpu {
namespace {

constexpr int64_t kSegment = 64;

struct TaskMemory {
  double *ckpt, *seg_states, *dq, *dk;
  static std::size_t doubles(int64_t max_len, int64_t K, int64_t V) {
    const int64_t nseg = (max_len + kSegment - 1) / kSegment + 1;
    return nseg * K * V + kSegment * K * V + 2 * std::max<int64_t>(max_len, 1) * K;
  }
  TaskMemory(double* p, int64_t max_len, int64_t K, int64_t V) {
    const int64_t nseg = (max_len + kSegment - 1) / kSegment + 1;
    ckpt = p; p += nseg * K * V;
    seg_states = p; p += kSegment * K * V;
    dq = p; p += std::max<int64_t>(max_len, 1) * K;
    dk = p;
  }
};

// One token of the forward recurrence: S <- diag(exp g) S; e = beta (v - S^T k); S += k e^T.
void token_step(double* S, const double* k, const double* g, const double* v, double beta, int64_t K, int64_t V,
                double* e) {
  for (int64_t d = 0; d < K; ++d) {
    const double a = std::exp(g[d]);
    for (int64_t j = 0; j < V; ++j) S[d * V + j] *= a;
  }
  for (int64_t j = 0; j < V; ++j) e[j] = v[j];
  for (int64_t d = 0; d < K; ++d) {
    for (int64_t j = 0; j < V; ++j) e[j] -= k[d] * S[d * V + j];
  }
  for (int64_t j = 0; j < V; ++j) e[j] *= beta;
  for (int64_t d = 0; d < K; ++d) {
    for (int64_t j = 0; j < V; ++j) S[d * V + j] += k[d] * e[j];
  }
}

// dx of y = x * rstd with rstd = (sum x^2 + eps)^-1/2, given y and rstd.
void l2norm_backward(const double* y, double rstd, const double* dy, int64_t K, double* dx) {
  double dot = 0;
  for (int64_t d = 0; d < K; ++d) dot += dy[d] * y[d];
  for (int64_t d = 0; d < K; ++d) dx[d] = (dy[d] - dot * y[d]) * rstd;
}

}  // namespace

std::size_t backward_workspace_size(const BackwardParams&, const detail::Plan& plan) {
  const Problem& pr = plan.pr;
  const std::size_t per_task = TaskMemory::doubles(plan.max_len, pr.K, pr.V);
  const std::size_t partials = static_cast<std::size_t>(pr.N * pr.HV * (pr.K + 1));
  return (static_cast<std::size_t>(workers_for(pr.N * pr.H)) * per_task + partials) * sizeof(double);
}

void backward(const BackwardParams& p, const detail::Plan& plan) {
  if (p.d_initial_state_only) {  // the reference backward whole, its token gradients into scratch
    const Problem& pr = plan.pr;
    const int64_t B = pr.B, T = pr.T;
    std::vector<float> dq(B * T * pr.H * pr.K), dk(dq.size()), dv(B * T * pr.HV * pr.V), dg(B * T * pr.HV * pr.K),
        dbeta(B * T * pr.HV);
    BackwardParams full = p;
    full.d_initial_state_only = false;
    full.dq = make_view(dq.data(), DType::kFloat32, {B, T, pr.H, pr.K});
    full.dk = make_view(dk.data(), DType::kFloat32, {B, T, pr.H, pr.K});
    full.dv = make_view(dv.data(), DType::kFloat32, {B, T, pr.HV, pr.V});
    full.dg = make_view(dg.data(), DType::kFloat32, {B, T, pr.HV, pr.K});
    full.dbeta = make_view(dbeta.data(), DType::kFloat32, {B, T, pr.HV});
    backward(full, plan);  // dA_log and ddt_bias stay absent: not written
    return;
  }
  const Problem& pr = plan.pr;
  const int64_t K = pr.K, V = pr.V;
  const KdaInputs& in = p.in;
  InputReader<double> rd(in, pr);
  const bool gate_in_kernel = in.gate.mode != GateMode::kPreGated;
  const std::size_t per_task = TaskMemory::doubles(plan.max_len, K, V);
  double* ws = static_cast<double*>(p.workspace);
  double* dA_partial = ws + static_cast<std::size_t>(workers_for(pr.N * pr.H)) * per_task;  // [N,HV]
  double* dbias_partial = dA_partial + pr.N * pr.HV;                                         // [N,HV,K]
  const double scale = in.scale;

  parallel_for(pr.N * pr.H, [&](int64_t task, int worker) {
    const int64_t n = task / pr.H, h = task % pr.H;
    const SeqRange seq = seq_range(plan, n);
    TaskMemory mem(ws + worker * per_task, plan.max_len, K, V);
    std::fill(mem.dq, mem.dq + std::max<int64_t>(seq.len, 1) * K, 0.0);
    std::fill(mem.dk, mem.dk + std::max<int64_t>(seq.len, 1) * K, 0.0);
    std::vector<double> q(K), k(K), g(K), x(K), v(V), e(V), S(K * V), dS(K * V), S1(K * V), dS1(K * V), dout(V),
        du(V), dkv(K), dqv(K), dgv(K), dvv(V);
    const int64_t nseg = (seq.len + kSegment - 1) / kSegment;

    for (int64_t hv = h * pr.group; hv < (h + 1) * pr.group; ++hv) {
      // Forward sweep with checkpoints.
      std::fill(S.begin(), S.end(), 0.0);
      if (p.initial_state.present()) {
        load_state_block<double>(p.initial_state, state_offset(p.initial_state, n, hv), p.layout, K, V, S.data());
      }
      for (int64_t i = 0; i < seq.len; ++i) {
        if (i % kSegment == 0) std::copy(S.begin(), S.end(), mem.ckpt + (i / kSegment) * K * V);
        const int64_t s = seq.t0 + i;
        rd.k(seq.b, s, h, k.data());
        rd.gate(seq.b, s, hv, g.data());
        rd.v(seq.b, s, hv, v.data());
        token_step(S.data(), k.data(), g.data(), v.data(), rd.beta(seq.b, s, hv), K, V, e.data());
      }
      // Backward sweep.
      std::fill(dS.begin(), dS.end(), 0.0);
      if (p.d_final_state.present()) {
        load_state_block<double>(p.d_final_state, state_offset(p.d_final_state, n, hv), p.layout, K, V, dS.data());
      }
      double dA_sum = 0.0;
      std::vector<double> dbias(K, 0.0);
      for (int64_t sg = nseg - 1; sg >= 0; --sg) {
        const int64_t i0 = sg * kSegment, i1 = std::min(seq.len, i0 + kSegment);
        // States before every token of the segment.
        std::copy(mem.ckpt + sg * K * V, mem.ckpt + (sg + 1) * K * V, S.begin());
        for (int64_t i = i0; i < i1; ++i) {
          std::copy(S.begin(), S.end(), mem.seg_states + (i - i0) * K * V);
          const int64_t s = seq.t0 + i;
          rd.k(seq.b, s, h, k.data());
          rd.gate(seq.b, s, hv, g.data());
          rd.v(seq.b, s, hv, v.data());
          token_step(S.data(), k.data(), g.data(), v.data(), rd.beta(seq.b, s, hv), K, V, e.data());
        }
        for (int64_t i = i1 - 1; i >= i0; --i) {
          const int64_t s = seq.t0 + i;
          const double* S0 = mem.seg_states + (i - i0) * K * V;
          rd.q(seq.b, s, h, q.data());
          rd.k(seq.b, s, h, k.data());
          rd.gate(seq.b, s, hv, g.data(), x.data());
          rd.v(seq.b, s, hv, v.data());
          const double beta_raw = rd.beta_raw(seq.b, s, hv);
          const double beta = rd.beta(seq.b, s, hv);
          load_row<double>(p.d_out, offset4(p.d_out, seq.b, s, hv), V, p.d_out.strides[3], dout.data());
          // Recompute S1 = diag(a) S0, u = v - S1^T k, S2 = S1 + beta k u^T (S2 into S).
          for (int64_t d = 0; d < K; ++d) {
            const double a = std::exp(g[d]);
            for (int64_t j = 0; j < V; ++j) S1[d * V + j] = a * S0[d * V + j];
          }
          for (int64_t j = 0; j < V; ++j) e[j] = v[j];
          for (int64_t d = 0; d < K; ++d) {
            for (int64_t j = 0; j < V; ++j) e[j] -= k[d] * S1[d * V + j];
          }
          // o = scale S2^T q:  dS2 += scale q do^T;  dq = scale S2 do.
          for (int64_t d = 0; d < K; ++d) {
            double acc = 0.0;
            for (int64_t j = 0; j < V; ++j) {
              const double s2 = S1[d * V + j] + beta * k[d] * e[j];
              acc += s2 * dout[j];
              dS[d * V + j] += scale * q[d] * dout[j];
            }
            dqv[d] = scale * acc;
          }
          // S2 = S1 + beta k u^T.
          double dbeta = 0.0;
          for (int64_t j = 0; j < V; ++j) {
            double acc = 0.0;
            for (int64_t d = 0; d < K; ++d) acc += dS[d * V + j] * k[d];
            dbeta += acc * e[j];
            du[j] = beta * acc;
          }
          for (int64_t d = 0; d < K; ++d) {
            double acc_write = 0.0, acc_read = 0.0;
            for (int64_t j = 0; j < V; ++j) {
              acc_write += dS[d * V + j] * e[j];
              acc_read += S1[d * V + j] * du[j];
            }
            dkv[d] = beta * acc_write - acc_read;
          }
          // u = v - S1^T k:  dv = du;  dS1 = dS - k du^T.
          for (int64_t d = 0; d < K; ++d) {
            for (int64_t j = 0; j < V; ++j) dS1[d * V + j] = dS[d * V + j] - k[d] * du[j];
          }
          for (int64_t j = 0; j < V; ++j) dvv[j] = du[j];
          // S1 = diag(a) S0:  dg = a * rowsum(dS1 * S0);  dS0 = diag(a) dS1.
          for (int64_t d = 0; d < K; ++d) {
            const double a = std::exp(g[d]);
            double acc = 0.0;
            for (int64_t j = 0; j < V; ++j) {
              acc += dS1[d * V + j] * S0[d * V + j];
              dS[d * V + j] = a * dS1[d * V + j];
            }
            dgv[d] = acc * a;
          }
          // Chain to the raw gate input.
          if (gate_in_kernel) {
            const double A = rd.A_log(hv);
            for (int64_t d = 0; d < K; ++d) {
              double d_dx, d_dA;
              math::gate_grad<double>(rd.gate_mode(), x[d], A, rd.has_A_log(), rd.lower_bound(), &d_dx, &d_dA);
              dA_sum += dgv[d] * d_dA;
              dgv[d] *= d_dx;
              dbias[d] += dgv[d];
            }
          }
          store_row<double>(p.dg, offset4(p.dg, seq.b, s, hv), K, p.dg.strides[3], dgv.data());
          store_row<double>(p.dv, offset4(p.dv, seq.b, s, hv), V, p.dv.strides[3], dvv.data());
          store_elem<double>(p.dbeta.data, p.dbeta.dtype,
                             seq.b * p.dbeta.strides[0] + s * p.dbeta.strides[1] + hv * p.dbeta.strides[2],
                             dbeta * math::beta_grad<double>(beta_raw, in.beta_sigmoid, in.allow_neg_eigval));
          for (int64_t d = 0; d < K; ++d) {
            mem.dq[i * K + d] += dqv[d];
            mem.dk[i * K + d] += dkv[d];
          }
        }
      }
      if (p.d_initial_state.present()) {
        store_state_block<double>(p.d_initial_state, state_offset(p.d_initial_state, n, hv), p.layout, K, V, dS.data());
      }
      dA_partial[n * pr.HV + hv] = dA_sum;
      std::copy(dbias.begin(), dbias.end(), dbias_partial + (n * pr.HV + hv) * K);
    }
    // q/k gradients of the group, through the optional L2 norm.
    for (int64_t i = 0; i < seq.len; ++i) {
      const int64_t s = seq.t0 + i;
      const double rq = rd.q(seq.b, s, h, q.data());
      const double rk = rd.k(seq.b, s, h, k.data());
      if (in.qk_l2norm) {
        l2norm_backward(q.data(), rq, mem.dq + i * K, K, dqv.data());
        l2norm_backward(k.data(), rk, mem.dk + i * K, K, dkv.data());
      } else {
        std::copy(mem.dq + i * K, mem.dq + (i + 1) * K, dqv.begin());
        std::copy(mem.dk + i * K, mem.dk + (i + 1) * K, dkv.begin());
      }
      store_row<double>(p.dq, offset4(p.dq, seq.b, s, h), K, p.dq.strides[3], dqv.data());
      store_row<double>(p.dk, offset4(p.dk, seq.b, s, h), K, p.dk.strides[3], dkv.data());
    }
  });

  // The padded token tail has zero gradients.
  const SeqRange tail = tail_range(plan);
  for (int64_t hv = 0; hv < pr.HV && tail.len > 0; ++hv) {
    zero_token_rows<double>(p.dv, tail, hv);
    zero_token_rows<double>(p.dg, tail, hv);
    zero_token_rows<double>(p.dbeta, tail, hv);
  }
  for (int64_t h = 0; h < pr.H && tail.len > 0; ++h) {
    zero_token_rows<double>(p.dq, tail, h);
    zero_token_rows<double>(p.dk, tail, h);
  }

  // Deterministic reductions over sequences.
  if (p.dA_log.present()) {
    for (int64_t hv = 0; hv < pr.HV; ++hv) {
      double acc = 0.0;
      for (int64_t n = 0; n < pr.N; ++n) acc += dA_partial[n * pr.HV + hv];
      store_elem<double>(p.dA_log.data, p.dA_log.dtype, hv, acc);
    }
  }
  if (p.ddt_bias.present()) {
    for (int64_t hv = 0; hv < pr.HV; ++hv) {
      for (int64_t d = 0; d < K; ++d) {
        double acc = 0.0;
        for (int64_t n = 0; n < pr.N; ++n) acc += dbias_partial[(n * pr.HV + hv) * K + d];
        store_elem<double>(p.ddt_bias.data, p.ddt_bias.dtype, hv * K + d, acc);
      }
    }
  }
}

}  // namespace kdakit::cpu
