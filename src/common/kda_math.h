// Scalar math shared by the CPU and CUDA backends: gate activations, beta activation, and their derivatives.
// Everything here is in natural-log units; kernels may switch to base 2 internally.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define KDA_HD __host__ __device__ __forceinline__
#else
#define KDA_HD inline
#endif

namespace kdakit::math {

// softplus with FLA's threshold: x itself above 20.
template <class T>
KDA_HD T softplus(T x) {
  using std::exp;
  using std::log1p;
  return x > T(20) ? x : log1p(exp(x));
}
template <class T>
KDA_HD T softplus_grad(T x) {  // d softplus / dx, consistent with the threshold
  using std::exp;
  return x > T(20) ? T(1) : T(1) / (T(1) + exp(-x));
}

template <class T>
KDA_HD T sigmoid(T x) {
  using std::exp;
  return T(1) / (T(1) + exp(-x));
}

// Gate value (natural-log decay, <= 0) from x = g_raw + dt_bias.
//  mode 1 (softplus):     -exp(A_log) * softplus(x)
//  mode 2 (lower bound):  lower_bound * sigmoid(a * x), a = exp(A_log) or 1 without A_log
template <class T>
KDA_HD T gate_value(int mode, T x, T A_log, bool has_A_log, T lower_bound) {
  using std::exp;
  if (mode == 1) return -exp(A_log) * softplus(x);
  const T a = has_A_log ? exp(A_log) : T(1);
  return lower_bound * sigmoid(a * x);
}

// Derivatives of gate_value: d gate / dx and d gate / dA_log.
template <class T>
KDA_HD void gate_grad(int mode, T x, T A_log, bool has_A_log, T lower_bound, T* d_dx, T* d_dA) {
  using std::exp;
  if (mode == 1) {
    const T e = exp(A_log);
    *d_dx = -e * softplus_grad(x);
    *d_dA = -e * softplus(x);
    return;
  }
  const T a = has_A_log ? exp(A_log) : T(1);
  const T s = sigmoid(a * x);
  const T ds = lower_bound * s * (T(1) - s);
  *d_dx = ds * a;
  *d_dA = has_A_log ? ds * a * x : T(0);
}

// Beta activation: identity, sigmoid, or 2*sigmoid (allow_neg_eigval).
template <class T>
KDA_HD T beta_value(T raw, bool use_sigmoid, bool neg_eigval) {
  if (!use_sigmoid) return raw;
  return (neg_eigval ? T(2) : T(1)) * sigmoid(raw);
}
template <class T>
KDA_HD T beta_grad(T raw, bool use_sigmoid, bool neg_eigval) {
  if (!use_sigmoid) return T(1);
  const T s = sigmoid(raw);
  return (neg_eigval ? T(2) : T(1)) * s * (T(1) - s);
}

constexpr double kL2NormEps = 1e-6;  // y = x * rsqrt(sum(x^2) + eps)

}  // namespace kdakit::math
