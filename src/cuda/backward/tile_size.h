// Thread counts, tiles and shared-memory sizes of the CUDA backward's own kernels (its prepare and state pass are the
// forward's kernels, with the forward's layouts): the kernels carve their shared memory by them and the planner
// (backward/plan.cpp) sizes the launches by them. Plain C++ (host and device).
//
// The reverse state scan (with its own tiles, BwdScanLayout), the WY pass and the products with the states run on
// tensor cores (src/cuda/common/sm80/mma.cuh); the gradient kernel's intra-chunk products and the reductions run on
// CUDA cores in fp32.
#pragma once

#include <cstddef>

namespace kdakit::cuda {

constexpr int kBwdThreads = 256;                     // every backward kernel's CTA
constexpr int kBwdCols = 32;                         // value columns of a tile: one per lane
constexpr int kBwdRowGroups = kBwdThreads / kBwdCols;  // warps; a warp takes the rows r = warp + 8 m of a tile
constexpr int kBwdKSlice = 16;                       // key dimensions per slice of the gradient kernel
constexpr int kBwdLdk = kBwdKSlice + 1;              // row stride of a [C][16] fp32 slice tile
constexpr int kBwdMaxChunk = 64;

// The reverse state scan (scan_sm80.cuh), per (sequence, v-head, BV value columns), for operands of elem_bytes (2:
// bf16, 4: float, split into hi + lo in the products). Warps: four row groups (16 chunk rows of dv_new, KP / 4 rows of
// dS each) times two column groups, four from BV = 64 on (the forward's recurrence_kernel shape).
// Shared memory: a ring of `ring` stage slots, then dO [2][64][LDB] (this chunk's and the next one's), -dv_new
// [64][LDB] and dS [KP][LDB] (hi and lo tiles of both for bf16 operands). A chunk runs in `phases()` phases, each
// reading one slot: phase 0 kg, Aqk (and its lo tile for bf16 operands) and gamma; then qg and w together in one
// phase, or, where one [64][KP] tile takes 512 bytes a row or more, qg and w in a phase each (smaller slots). A slot
// is copied ring - 1 phases ahead (ring 1: no prefetch). Tiles take 64 rows whatever the chunk, so the size depends
// on neither the chunk nor the device.
struct BwdScanLayout {
  int elem_bytes = 2, KP = 128, BV = 64;
  constexpr int groups() const { return BV >= 64 ? 4 : 2; }
  constexpr int threads() const { return 128 * groups(); }
  constexpr int cols_per_warp() const { return BV / groups(); }
  constexpr int pad() const { return elem_bytes == 4 ? 4 : 8; }  // conflict-free fragment loads (cols + pad)
  constexpr int ldk() const { return KP + pad(); }
  constexpr int ldb() const { return BV + pad(); }
  constexpr int lda() const { return kBwdMaxChunk + pad(); }
  constexpr bool split() const { return elem_bytes == 2; }  // Aqk's lo tile; dS and -dv_new as hi + lo bf16 tiles
  constexpr int phases() const { return elem_bytes * KP >= 512 ? 3 : 2; }
  constexpr std::size_t tile_bytes() const { return std::size_t(elem_bytes) * kBwdMaxChunk * ldk(); }
  constexpr std::size_t first_bytes() const {  // beside kg: Aqk (and lo), gamma
    return std::size_t(elem_bytes) * (split() ? 2 : 1) * kBwdMaxChunk * lda() + sizeof(float) * KP;
  }
  constexpr std::size_t slot_bytes() const {
    const std::size_t second = phases() == 2 ? tile_bytes() : 0;  // w beside qg
    return (tile_bytes() + (first_bytes() > second ? first_bytes() : second) + 15) & ~std::size_t(15);
  }
  constexpr std::size_t fixed_bytes() const {
    return std::size_t(elem_bytes) * ldb() * ((split() ? 4 : 3) * kBwdMaxChunk + (split() ? 2 : 1) * std::size_t(KP));
  }
  constexpr std::size_t bytes(int ring) const { return std::size_t(ring) * slot_bytes() + fixed_bytes(); }
};
constexpr int kBwdScanMaxRing = 3;  // slots copied two phases ahead: a whole chunk of two phases
// At KP = 256 the 64-column tile's sixteen warps would need more registers than the 128 a thread that 512 threads get
// (dS and the update's A fragments grow with KP).
constexpr int bwd_scan_max_bv(int KP) { return KP > 128 ? 32 : 64; }

constexpr std::size_t bwd_scan_smem(int elem_bytes, int KP, int BV, int ring) {
  return BwdScanLayout{elem_bytes, KP, BV}.bytes(ring);
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

// The products with the states (state_products_sm80.cuh), per (chunk, v-head, 32 keys): four warps, a 16-row band of
// the chunk each; the value tiles dO, dbv, v_new [C][32] and S, dH [32 keys][32] in fp32, rows of kBwdLdv floats (an
// even stride: the split operands are read as float pairs).
constexpr int kBwdStateThreads = 128;
constexpr int kBwdStateKeys = 32;
constexpr int kBwdLdv = kBwdCols + 8;
constexpr std::size_t bwd_state_smem(int C) {
  return sizeof(float) * std::size_t(3 * C + 2 * kBwdStateKeys) * kBwdLdv;
}

// The gradient pass, per (chunk, v-head), a 16-key slice at a time: the slice's q, k, gates, exp(lam), exp(rho),
// exp(sigma), exp(-sigma), the products' factors q e^lam, beta k e^lam and k e^rho, and the gate gradient's two sums
// [C][16] each (12 tiles); the
// intra-chunk products (dq_row, dk_row, dk_col, a_row, b_col, dgp and the diagonal blocks' column parts [C][16], and
// the per-(row, earlier block) pair sums [C][3][16]); per row: beta and the two norms; per slice: the sub-chunk totals
// and their exponentials [4][16] each, gamma and rowsum(S dH); four block flags; the block sum's scratch.
constexpr int kBwdGradTiles = 12;
constexpr std::size_t bwd_grad_intra(int C) {
  return std::size_t(7 * C) * kBwdLdk + std::size_t(C) * 3 * kBwdKSlice;
}
constexpr std::size_t bwd_grad_smem(int C) {
  return sizeof(float) * (std::size_t(kBwdGradTiles * C) * kBwdLdk + bwd_grad_intra(C) + 3 * std::size_t(C) +
                          10 * kBwdKSlice + 4 + kBwdRowGroups);
}

struct BackwardSmem {
  std::size_t scan = 0, wy = 0, state = 0, grad = 0;
};

// `scan`: bwd_scan_smem of the planner's scan tile.
inline BackwardSmem backward_smem(int C, int KP, std::size_t scan) {
  return {scan, bwd_wy_smem(C, KP), bwd_state_smem(C), bwd_grad_smem(C)};
}

}  // namespace kdakit::cuda
