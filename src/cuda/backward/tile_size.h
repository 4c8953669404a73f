// Thread counts, tiles and shared-memory sizes of the CUDA backward's own kernels (its prepare and state pass are the
// forward's kernels, with the forward's layouts): the kernels carve their shared memory by them and the planner
// (backward/plan.cpp) sizes the launches by them. Plain C++ (host and device).
//
// The WY pass runs its products on tensor cores (src/cuda/common/sm80/mma.cuh). The other kernels run on CUDA cores in
// fp32, a tile of 32 value columns at a time (one per lane; eight warps of row groups): the first, correctness-first
// form of the backward, whose products the tensor-core tiles are to take over.
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

// The WY pass, per (chunk, v-head), in two phases over one shared-memory union; independent of K (the keys stream).
// Phase 0, v_new = u - w h_c, in passes of kWyPassCols value columns over steps of kWyKRows keys, three stages of: the
// state's rows [kWyKRows][kWyLdS] (fp32) and w's columns [C][kWyLdW] (sized for float). Phase 1, over tiles of
// kWyCols value columns, three stages of: v_new [C][kWyLdRow] and dv_new [C][kWyLdKN] (fp32), dO [C][kWyLdRow] (fp32,
// or bf16 in the same rows), v [C][kWyLdRow] (sized for 4-byte elements). Then Tm [C][C + 4], dbv [C][kWyLdRow], beta
// [C], the row sums of a second column group [C] and the token offsets of the rows of dO, v and dv [3][C] (int64).
// The strides keep fragment reads free of bank conflicts: kWyLdS, kWyLdKN and C + 4 are 4 mod 16 (pairs down a
// column); kWyLdRow and kWyLdW are 8 mod 16 (float2 and ldmatrix rows).
constexpr int kWyCols = 16, kWyPassCols = 64, kWyKRows = 32;
constexpr int kWyLdKN = kWyCols + 4, kWyLdRow = kWyCols + 8, kWyLdS = kWyPassCols + 4, kWyLdW = kWyKRows + 8;
constexpr int kWyStages0 = 3, kWyStages1 = 3;
constexpr std::size_t bwd_wy_stage0_floats(int C) {
  return std::size_t(kWyKRows) * kWyLdS + std::size_t(C) * kWyLdW;
}
constexpr std::size_t bwd_wy_stage1_floats(int C) { return std::size_t(C) * (3 * kWyLdRow + kWyLdKN); }
constexpr std::size_t bwd_wy_union_floats(int C) {
  return kWyStages0 * bwd_wy_stage0_floats(C) > kWyStages1 * bwd_wy_stage1_floats(C)
             ? kWyStages0 * bwd_wy_stage0_floats(C)
             : kWyStages1 * bwd_wy_stage1_floats(C);
}
constexpr std::size_t bwd_wy_smem(int C, int /*KP*/) {
  return sizeof(float) * (bwd_wy_union_floats(C) + std::size_t(C) * (C + 4) + std::size_t(C) * kWyLdRow +
                          8 * std::size_t(C));
}

// The gradient pass, per (chunk, v-head, 16 keys): the slice's q, k, gates, lam, rho, sigma, the three state products
// and the gate gradient's two sums [C][16] each (11 tiles); the union of the value tiles (dO, dbv, v_new [C][32]; S,
// dH [16][32]) and the intra-chunk products (dq_row, dk_row, dk_col, a_row, b_col, dgp [C][16] and the per-(row,
// block) pair sums [C][4][16]); per row: beta and the two norms; per slice: the sub-chunk totals [4][16], gamma and
// rowsum(S dH); four block flags; the block sum's scratch.
constexpr std::size_t bwd_grad_union(int C) {
  const std::size_t values = std::size_t(3 * C + 2 * kBwdKSlice) * kBwdLd;
  const std::size_t intra = std::size_t(6 * C) * kBwdLdk + std::size_t(C) * 4 * kBwdKSlice;
  return values > intra ? values : intra;
}
constexpr std::size_t bwd_grad_smem(int C) {
  return sizeof(float) * (std::size_t(11 * C) * kBwdLdk + bwd_grad_union(C) + 3 * std::size_t(C) + 6 * kBwdKSlice +
                          4 + kBwdRowGroups);
}

struct BackwardSmem {
  std::size_t scan = 0, wy = 0, grad = 0;
};

inline BackwardSmem backward_smem(int C, int KP) { return {bwd_scan_smem(C, KP), bwd_wy_smem(C, KP), bwd_grad_smem(C)}; }

}  // namespace kdakit::cuda
