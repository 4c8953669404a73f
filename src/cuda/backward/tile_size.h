// Thread counts, tiles and shared-memory sizes of the CUDA backward's own kernels (its prepare and state pass are the
// forward's kernels, with the forward's layouts): the kernels carve their shared memory by them and the planner
// (backward/plan.cpp) sizes the launches by them. Plain C++ (host and device).
//
// These kernels run on CUDA cores in fp32, a tile of 32 value columns at a time (one per lane; eight warps of row
// groups): the first, correctness-first form of the backward, whose products the tensor-core tiles of the forward
// (src/cuda/common/sm80/mma.cuh) are to take over.
#pragma once

#include <cstddef>

namespace kdakit::cuda {

constexpr int kBwdThreads = 256;                     // every backward kernel's CTA
constexpr int kBwdCols = 32;                         // value columns of a tile: one per lane
constexpr int kBwdRowGroups = kBwdThreads / kBwdCols;  // warps; a warp takes the rows r = warp + 8 m of a tile
constexpr int kBwdLd = kBwdCols + 1;                 // row stride of a [rows][32] fp32 tile (conflict-free columns)
constexpr int kBwdKSlice = 16;                       // key dimensions per CTA of the gradient kernel
constexpr int kBwdLdk = kBwdKSlice + 1;              // row stride of a [C][16] fp32 slice tile
constexpr int kBwdMaxChunk = 64;

// The reverse state scan, per (sequence, v-head, 32 value columns): dS [KP][32], dv_new and dO [C][32], gamma [KP].
constexpr std::size_t bwd_scan_smem(int C, int KP) {
  return sizeof(float) * (std::size_t(KP + 2 * C) * kBwdLd + KP);
}

// The WY pass, per (chunk, v-head): Tm [C][C + 1], the state's 32 columns [KP][32], v_new, dv_new, dbv, dO, v
// [C][32], beta [C].
constexpr std::size_t bwd_wy_smem(int C, int KP) {
  return sizeof(float) * (std::size_t(C) * (C + 1) + std::size_t(KP + 5 * C) * kBwdLd + C);
}

// The gradient pass, per (chunk, v-head, 16 keys): the slice's q, k, gates, exp(lam), exp(rho), exp(sigma),
// exp(-sigma), the three state products and the gate gradient's two sums [C][16] each (12 tiles); the union of the
// value tiles (dO, dbv, v_new [C][32]; S, dH [16][32], rows of kBwdLdv floats: the tensor cores' operands) and the
// intra-chunk products (dq_row, dk_row, dk_col, a_row, b_col, dgp and the diagonal blocks' column parts [C][16], and
// the per-(row, earlier block) pair sums [C][3][16]); per row: beta and the two norms; per slice: the sub-chunk totals
// and their exponentials [4][16] each, gamma and rowsum(S dH); four block flags; the block sum's scratch.
constexpr int kBwdLdv = kBwdCols + 8;  // row stride of the gradient kernel's [rows][32] operand tiles (float2 reads)
constexpr int kBwdGradTiles = 12;
constexpr std::size_t bwd_grad_union(int C) {
  const std::size_t values = std::size_t(3 * C + 2 * kBwdKSlice) * kBwdLdv;
  const std::size_t intra = std::size_t(7 * C) * kBwdLdk + std::size_t(C) * 3 * kBwdKSlice;
  return values > intra ? values : intra;
}
constexpr std::size_t bwd_grad_smem(int C) {
  return sizeof(float) * (std::size_t(kBwdGradTiles * C) * kBwdLdk + bwd_grad_union(C) + 3 * std::size_t(C) +
                          10 * kBwdKSlice + 4 + kBwdRowGroups);
}

struct BackwardSmem {
  std::size_t scan = 0, wy = 0, grad = 0;
};

inline BackwardSmem backward_smem(int C, int KP) { return {bwd_scan_smem(C, KP), bwd_wy_smem(C, KP), bwd_grad_smem(C)}; }

}  // namespace kdakit::cuda
