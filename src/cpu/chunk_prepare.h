// The state-independent part of one chunk of the chunked form (spec §3.1, §3.2) in float32, shared by the chunked
// forward (src/cpu/chunked.cpp) and the chunked backward (src/cpu/backward_chunked.cpp): what the CUDA prepare kernel
// computes per (chunk, v-head).
//
// Exponent anchoring. All decay factors are exponentials of sums of gates over a contiguous token range,
// and every such sum is accumulated directly from the gates (never as a difference of two cumulative sums),
// so a hard reset (g = -1000) costs no precision in the tokens after it. Within a chunk, rows are grouped in
// sub-chunks of 16 with, per sub-chunk, the inclusive prefix sum `lam` (from the sub-chunk's first row),
// the exclusive suffix sum `rho` (to its last row) and the total `tot`. Then, for i in sub-chunk a and j in
// an earlier sub-chunk b,
//     G_i - G_j = lam_i + (sum of tot over the sub-chunks strictly between b and a) + rho_j,
// and each factor exp(lam_i), exp(mid + rho_j) is <= 1: the off-diagonal blocks are exact products of
// bounded factors (matrix products on the GPU). Diagonal 16x16 blocks are factorised around their middle
// row m, exp(G_i - G_m) * exp(G_m - G_j), when every such exponent stays within +-kMaxAnchorExponent
// (always true for bounded gates); otherwise each pair's decay is a running product of per-token decays.
#pragma once

#include <cstdint>

#include "cpu/backend.h"

namespace kdakit::cpu {

constexpr int kSub = 16;                     // sub-chunk rows
constexpr float kMaxAnchorExponent = 64.0f;  // e^64 ~ 6e27: products of factors stay well inside fp32

// One chunk's inputs (after the L2 norm and the gate and beta activations) and its state-independent quantities,
// rows x dims, row-major. Carved from caller memory (floats(C, K, V) floats).
struct ChunkTiles {
  float *q, *k, *v, *g, *beta;   // inputs: [C][K] q, k, g; [C][V] v; [C] beta
  float *lam, *rho, *tot, *sigma;  // sub-chunk sums (header comment); sigma: G_i - G_m of the diagonal blocks
  float *qg, *kbg, *kg, *gamma;  // q e^G, beta k e^G, k e^(G_last - G) [C][K]; e^(G_last) [K]
  float *fa, *fb, *fc;           // anchored operands of one block pair (temporaries)
  float *P, *L, *Tm;             // [C][C]: q.k with decay (j <= i), beta_i k_i.k_j with decay (j < i), (I + L)^-1
  float *w, *u;                  // Tm (beta k e^G) [C][K], Tm (beta v) [C][V]
  bool factorised[8];            // per diagonal block: factorised around its middle row (else running products)

  static std::size_t floats(int64_t C, int64_t K, int64_t V);
  ChunkTiles(float* p, int64_t C, int64_t K, int64_t V);
};

// The sub-chunk sums lam, rho, tot and the diagonal blocks' sigma and algorithm, from t.g.
void chunk_sums(ChunkTiles& t, int64_t rows, int64_t K, DiagonalBlocks diag_mode);
// e^(sum of tot over the sub-chunks before a) and after a, per dimension: the chunk-level factors' whole-sub-chunk
// parts.
void totals_around(const ChunkTiles& t, int64_t rows, int64_t K, int64_t a, float* before, float* after);
// qg, kbg, kg and gamma, from the sums.
void chunk_factors(ChunkTiles& t, int64_t rows, int64_t K);
// P (when want_P) and L, from the sums and the factorised flags.
void intra_matrices(ChunkTiles& t, int64_t rows, int64_t K, bool want_P);
// Tm = (I + L)^-1.
void invert(ChunkTiles& t, int64_t rows);
// w = Tm (beta k e^G) and u = Tm (beta v).
void wy(ChunkTiles& t, int64_t rows, int64_t K, int64_t V);
// Everything state-independent of a chunk whose inputs are loaded: the four steps above after chunk_sums.
void prepare_chunk(ChunkTiles& t, int64_t rows, int64_t K, int64_t V, DiagonalBlocks diag_mode);
// The diagonal-block algorithm set by set_diagonal_blocks (kAuto unless a test pins one).
DiagonalBlocks diagonal_blocks();

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace kdakit::cpu
