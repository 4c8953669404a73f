// The per-chunk gradient pass of the chunked backward (spec §4.2, B1-B5 and B7) in float32: what the CUDA gradient
// kernels compute per (chunk, v-head). Its inputs: the chunk's inputs with their sums recomputed (chunk_prepare.h),
// Tm (from the prepare stage), its start state h_c and v_new = u - w h_c, the gradient of its end state dH and
// dv_new = scale P^T dO + kg dH (from the reverse state scan), and the output gradient dO.
//
// Everything left is a product with the states or within the chunk: with dbv = Tm^T dv_new,
//   dL = -tril_strict(Tm^T dTm Tm^T) = -tril_strict(dbv v_new^T)   (dTm = dw kbg^T + dv_new (beta v)^T, w S = u - v_new)
//   dkbg = Tm^T dw = -dbv S^T,  dqg = scale dO S^T,  dkg = v_new dH^T,  dP = scale tril_incl(dO v_new^T),
// so no product of the chunk needs w, u or P, and those over K (dkbg, dqg, dkg) are column slices of K.
#pragma once

#include <cstdint>

#include "cpu/chunk_prepare.h"

namespace kdakit::cpu {

// Scratch of one chunk's gradient pass, carved from caller memory (floats(C, K, V) floats).
struct GradTiles {
  float *dqg, *dkg, *dkbg;       // [C][K] scale dO S^T, v_new dH^T, -dbv S^T
  float *dbv;                    // [C][V] Tm^T dv_new
  float *dP, *dL;                // [C][C] scale tril_incl(dO v_new^T), -tril_strict(dbv v_new^T)
  float *dgam;                   // [K] rowsum(S * dH)
  float *dq_row, *dk_row, *dk_col;  // [C][K] intra-chunk products (block accumulators)
  float *opa, *opb, *opc;        // [C][K] anchored operands of one block pair (temporaries)
  float *dG;                     // [C][K] the gate gradient's chunk-level terms (q e^G, beta k e^G), before the reverse sum
  float *dgp;                    // [C][K] the gate gradient's part from the pairs of P and L (chunk_gradients.cpp)

  static std::size_t floats(int64_t C, int64_t K, int64_t V);
  GradTiles(float* p, int64_t C, int64_t K, int64_t V);
};

// One chunk's gradients. In: t (inputs loaded; chunk_sums, chunk_factors and Tm), S = h_c [K][V], dH [K][V],
// vnew, dvnew, dO [rows][V].
// Out (w.r.t. the L2-normalised q, k, the activated gate and beta): dq, dk [rows][K] of this v-head, dv [rows][V],
// dbeta [rows], dg [rows][K] (the reverse chunk-local sum of dG, B7).
void chunk_gradients(const ChunkTiles& t, GradTiles& s, int64_t rows, int64_t K, int64_t V, float scale,
                     const float* S, const float* dH, const float* vnew, const float* dvnew, const float* dO, float* dq, float* dk, float* dv, float* dbeta,
                     float* dg);

}  // namespace kdakit::cpu
