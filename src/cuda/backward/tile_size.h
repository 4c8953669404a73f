// Thread counts, tiles and shared-memory sizes of the CUDA backward's own kernels (its prepare and state pass are the
// forward's kernels, with the forward's layouts): the kernels carve their shared memory by them and the planner
// (backward/plan.cpp) sizes the launches by them. Plain C++ (host and device).
//
// The reverse state scan (with its own tiles, BwdScanLayout), the WY pass, the gradient kernel's products with the
// states and its intra-chunk block products run on tensor cores (src/cuda/common/sm80/mma.cuh); the running products
// of diagonal blocks that are not factorised, the pair sums and the reductions run on CUDA cores in fp32.
#pragma once

#include <cstddef>

#include "cuda/cp/merge_layout.h"
#include "kdakit/params.h"

namespace kdakit::cuda {

constexpr int kBwdThreads = 256;                     // every backward kernel's CTA
constexpr int kBwdCols = 32;                         // value columns of a tile: one per lane
constexpr int kBwdRowGroups = kBwdThreads / kBwdCols;  // warps; a warp takes the rows r = warp + 8 m of a tile
constexpr int kBwdLd = kBwdCols + 1;                 // row stride of a [rows][32] fp32 tile (conflict-free columns)
constexpr int kBwdKSlice = 16;                       // key dimensions per CTA of the gradient kernel
constexpr int kBwdLdk = kBwdKSlice + 1;              // row stride of a [C][16] fp32 slice tile
constexpr int kBwdMaxChunk = 64;

// The reverse state scan (scan_sm80.cuh), per (sequence, v-head, BV value columns), for operands of elem_bytes (2:
// bf16, 4: float, split into hi + lo in the products). Warps: four row groups (16 chunk rows of dv_new, KP / 4 rows of
// dS each) times two column groups, four from BV = 64 on (the forward's recurrence_kernel shape).
// Shared memory: a ring of `ring` stage slots, then dO [2][64][LDB] (this chunk's and the next one's), -dv_new
// [64][LDB] and dS [KP][LDB] (hi and lo tiles of both for bf16 operands). A chunk runs in `phases()` phases, each
// reading one slot (the list at phases()); two [64][KP] tiles share a phase where a row of one takes under 512
// bytes, else each has its own (smaller slots). A slot is copied ring - 1 phases ahead (ring 1: no prefetch). Tiles
// take 64 rows whatever the chunk, so the size depends on neither the chunk nor the device.
struct BwdScanLayout {
  int elem_bytes = 2, KP = 128, BV = 64;
  constexpr int groups() const { return BV >= 64 ? 4 : 2; }
  constexpr int threads() const { return 128 * groups(); }
  constexpr int cols_per_warp() const { return BV / groups(); }
  constexpr int pad() const { return elem_bytes == 4 ? 4 : 8; }  // conflict-free fragment loads (cols + pad)
  constexpr int ldk() const { return KP + pad(); }
  constexpr int ldb() const { return BV + pad(); }
  constexpr int lda() const { return kBwdMaxChunk + pad(); }
  // bf16 operands: the lo tiles of Aqk, kg and qg; dS and -dv_new as hi + lo tiles.
  constexpr bool split() const { return elem_bytes == 2; }
  // Two [64][KP] tiles share a phase's slot where a row is under 512 bytes.
  constexpr bool paired() const { return elem_bytes * KP < 512; }
  // Per chunk, the phases' tiles (t0, t1 beside it). Float operands: kg + (Aqk, gamma); qg + w (paired), or qg; w.
  // bf16: kg + kg lo (paired), or kg; kg lo; then (Aqk, its lo tile, gamma); qg + qg lo (paired), or qg; qg lo; w.
  constexpr int phases() const { return split() ? (paired() ? 4 : 6) : (paired() ? 2 : 3); }
  constexpr std::size_t tile_bytes() const { return std::size_t(elem_bytes) * kBwdMaxChunk * ldk(); }
  constexpr std::size_t aqk_bytes() const {  // Aqk (and lo), gamma
    return std::size_t(elem_bytes) * (split() ? 2 : 1) * kBwdMaxChunk * lda() + sizeof(float) * KP;
  }
  constexpr std::size_t slot_bytes() const {
    // bf16: a phase holds its tiles or (Aqk, gamma). Float: a tile, and beside it (Aqk, gamma) or (paired) w.
    const std::size_t beside = split() ? 0 : tile_bytes(), tiles = (paired() ? 2 : 1) * tile_bytes() - beside;
    return (beside + (tiles > aqk_bytes() ? tiles : aqk_bytes()) + 15) & ~std::size_t(15);
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

// The reverse scan on Hopper warpgroup MMAs (scan_sm90.cuh): per 64 value columns, one warpgroup for the products
// and one that copies the stages; two stages of kg, qg, w and the lo tiles of kg and qg ([64][KP] bf16 each), Aqk and
// its lo tile ([64][64]) and gamma ([KP] f32), each stage rounded up to the swizzle's 1024-byte period; dO [2][64][72]
// bf16; and 1 KB of slack to align the base.
constexpr int kBwdScanSm90Threads = 256;
constexpr std::size_t bwd_scan_sm90_smem(int KP) {
  return 2 * ((std::size_t(5) * 64 * KP * 2 + 2 * 64 * 64 * 2 + std::size_t(KP) * 4 + 1023) / 1024 * 1024) +
         2 * 64 * 72 * 2 + 1024;
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

// The products with the states (state_products_sm80.cuh), per (chunk, v-head, 128 keys): all keys of K <= 128 in one
// CTA, so that the value tiles (dO, dbv, v_new) are read once per chunk there. Sixteen warps, a 16-row band of the
// chunk times 32 keys each; value tiles of 16 columns in two stages (the next tile's copies land during this one's
// products), each dO, dbv, v_new [C][kBwdLdv] and S, dH [128 keys][kBwdLdv] in fp32 (an even stride: the split
// operands are read as float pairs, a half-warp's four rows of pairs on distinct banks). A dO copied as bf16 / fp16
// rows takes kBwdLdvHalf 16-bit elements a row in its region (16-byte rows; 12 words mod 32 keep a warp's words apart).
constexpr int kBwdStateThreads = 512;
constexpr int kBwdStateKeys = 128;
constexpr int kBwdStateCols = 16;
constexpr int kBwdStateStages = 2;
constexpr int kBwdLdv = kBwdStateCols + 8;
constexpr int kBwdLdvHalf = kBwdStateCols + 8;
constexpr std::size_t bwd_state_smem(int C) {
  return sizeof(float) * kBwdStateStages * std::size_t(3 * C + 2 * kBwdStateKeys) * kBwdLdv;
}

// The WY pass with the state products on warpgroup MMAs (wy_states_sm90.cuh): three warpgroups, and a fixed
// shared-memory layout (wy_states_sm90::Layout, about 216 KB, and 1 KB of slack to align its base to 1024 bytes).
constexpr int kWsSm90Threads = 384;
constexpr std::size_t bwd_wy_states_sm90_smem() {
  // S and dH hi + lo tiles for 128 keys, dv_new and v_new hi + lo ([64][64] bf16 each); w [64][136], Tm hi + lo
  // [64][72], dO, v, u and u's lo part [64][72] (bf16); dv_new staging [64][64] and beta [64] (f32); the dL and dP
  // accumulators between value halves (f32, 32 a thread of two warpgroups).
  return 2 * (4 * 4096 + 4 * 4096 + 2 * 4096 + 2 * 4096 + 64 * 136 + 2 * 64 * 72 + 4 * 64 * 72) + 4 * 64 * 64 +
         4 * 64 + 4 * 2 * 32 * 128 + 1024;
}

// The gradient pass, per (chunk, v-head), a 16-key slice at a time: the slice's q, k, gates, exp(lam), exp(rho),
// exp(sigma) and the gates' raw inputs [C][16] each (7 tiles); the intra-chunk products (dq_row, dk_row, dk_col, a_row,
// b_col, dgp and the diagonal blocks' column parts [C][16], and the per-(row, earlier block) pair sums [C][3][16]; the
// gate gradient's two sums take a_row's and b_col's bytes after the products); per row: beta and the two norms; per
// slice: the sub-chunk totals, their exponentials and the products of those before and after a block [4][16] each,
// gamma and rowsum(S dH); four block flags; the block sum's scratch; per chunk: dt_bias's keys and P's diagonal.
// With the dP/dL cache (kernel flag CACHE), first the strictly lower parts of dP and dL split into `parts` bf16 parts
// (hi + lo; hi + mid + lo for float32 inputs), [C][C + 8] each, read by ldmatrix for every slice instead of rebuilt
// from the workspace.
constexpr int kBwdGradTiles = 7;
constexpr int kBwdDplLd = kBwdMaxChunk + 8;  // row stride (elements) of a cached dP/dL matrix: 16-byte rows, no conflicts
constexpr std::size_t bwd_grad_intra(int C) {
  return std::size_t(7 * C) * kBwdLdk + std::size_t(C) * 3 * kBwdKSlice;
}
// The bf16 parts of every float operand of the backward's products: three for float32 inputs, else two.
constexpr int bwd_split_parts(bool f32_inputs) { return f32_inputs ? 3 : 2; }
constexpr std::size_t bwd_grad_dpl_cache(int C, int parts) { return std::size_t(2 * parts) * C * kBwdDplLd * 2; }
constexpr std::size_t bwd_grad_smem(int C, bool cache, int parts) {
  return (cache ? bwd_grad_dpl_cache(C, parts) : 0) +
         sizeof(float) * (std::size_t(kBwdGradTiles * C) * kBwdLdk + bwd_grad_intra(C) + 3 * std::size_t(C) +
                          18 * kBwdKSlice + kMaxHeadDim + std::size_t(C) + 4 + kBwdRowGroups);
}
// The cached form where two of its CTAs fit a multiprocessor (`smem_optin`, a block's most, is the multiprocessor's
// capacity less the 1 KB every block reserves): fewer instructions at the same occupancy. Elsewhere the uncached form
// keeps two CTAs (or fits at all).
constexpr bool bwd_grad_cache_fits(int C, std::size_t smem_optin, int parts) {
  return 2 * (bwd_grad_smem(C, true, parts) + 1024) <= smem_optin + 1024;
}

// The merge of the scan's segments (backward/merge.cuh; cp/merge_layout.h).
constexpr std::size_t bwd_merge_smem(int KP) { return backward_merge_bytes(KP); }

struct BackwardSmem {
  std::size_t scan = 0, wy = 0, state = 0, grad = 0, merge = 0;
};

// `scan`: bwd_scan_smem of the planner's scan tile; `grad_cache`: the gradient kernel's form; `parts`:
// bwd_split_parts of the inputs.
inline BackwardSmem backward_smem(int C, int KP, std::size_t scan, bool grad_cache, int parts) {
  return {scan, bwd_wy_smem(C, KP), bwd_state_smem(C), bwd_grad_smem(C, grad_cache, parts), bwd_merge_smem(KP)};
}

}  // namespace kdakit::cuda
