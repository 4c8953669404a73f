// The decode kernel's tiling constants and shared-memory layout, as functions of the tile: the kernels lay out their
// shared memory by them and the planner (decode/plan.cpp) sizes launches by them. Plain C++ (host and device).
#pragma once

#include <cstddef>

#include "common/kda_math.h"

namespace kdakit::cuda {

// Warps per CTA are chosen at run time (1, 2 or 4); every warp owns kDecodeWarpCols value columns per pass, and a
// CTA makes 1, 2 or 4 passes over column groups of its tile (run time too), so a CTA tile has up to
// kDecodeMaxTileCols value columns.
constexpr int kDecodeWarpCols = 8;
constexpr int kDecodeMaxWarps = 4;
constexpr int kDecodeMaxPasses = 4;
constexpr int kDecodeMaxTileCols = kDecodeMaxWarps * kDecodeWarpCols * kDecodeMaxPasses;
// The wide [K,V] form's CTA tile (DecodeConfig::wide_kv): `nj` (4 or 8) columns per lane, 4 lanes per row piece,
// 4 warps: the general form's tile at 4 warps and nj / 2 passes.
KDA_HD constexpr int decode_wide_kv_cols(int nj) { return nj * 4 * kDecodeMaxWarps; }
static_assert(decode_wide_kv_cols(8) == kDecodeMaxTileCols, "a wide tile is a general form's tile");
// Dynamic shared memory a decode launch takes without opting in to more.
constexpr std::size_t kDecodeSmemLimit = 48 * 1024;

// Shared memory of the staged state tile of one CTA: every thread stages its own KP / 4 state elements per pass
// (16-byte pieces of the pool's dtype, `pool_bytes` per element).
KDA_HD constexpr std::size_t decode_state_tile_bytes(int KP, int pool_bytes, int nthreads, int passes) {
  return std::size_t(passes) * std::size_t(nthreads) * std::size_t(KP / 4) * std::size_t(pool_bytes);
}

// Shared memory a staged tile takes: the state, plus per pass the padding of the [K,V] row layout (state_io.cuh,
// KvRows: one 16-byte unit after each of the 8 K-lanes' row groups, so that ldmatrix reads it without bank conflicts).
constexpr std::size_t kDecodeKvRowPad = 128;
KDA_HD constexpr std::size_t decode_staged_bytes(int KP, int pool_bytes, int nthreads, int passes) {
  return decode_state_tile_bytes(KP, pool_bytes, nthreads, passes) + std::size_t(passes) * kDecodeKvRowPad;
}

// Dynamic shared memory of one CTA of the general form, byte offsets. Float rows: q * scale / |q|, k / |k| and
// exp(gate) [tb][KP]; v and beta [tb][bv] (bv: the CTA tile's columns, all passes); q.k [tb]; per-token slots (int)
// [tb]; the head's dt_bias [KP] and A_log; then the staged state tile (`state_bytes`, 0 when the state is not
// staged). Inputs are copied raw into the tail of their float row (bf16/fp16: the second half; fp32: the row itself)
// and widened in place.
struct DecodeSmem {
  std::size_t q, k, a, v, beta, qk, slot, bias, a_log, state, total;
  KDA_HD DecodeSmem(int KP, int tb, int bv, std::size_t state_bytes) : q(0) {
    const std::size_t row = 4 * std::size_t(tb) * KP, cols = 4 * std::size_t(tb) * bv,
                      one = (4 * std::size_t(tb) + 15) & ~std::size_t(15);
    k = q + row;
    a = k + row;
    v = a + row;
    beta = v + cols;
    qk = beta + cols;
    slot = qk + one;
    bias = slot + one;
    a_log = bias + 4 * std::size_t(KP);
    state = a_log + 16;
    total = state + state_bytes;
  }
};

}  // namespace kdakit::cuda
