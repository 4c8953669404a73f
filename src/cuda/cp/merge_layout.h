// The segment merges' launch shape and shared-memory layouts (cp/merge.cuh, backward/merge.cuh). Plain C++ (host
// planner and kernels).
#pragma once

#include <cstddef>

namespace kdakit::cuda {

constexpr int kMergeThreads = 256;
constexpr int kMergeCols = 8;   // state columns per CTA
constexpr int kMergeKeys = 32;  // keys of M staged at a time

// The fold (a context-parallel summary): S [KP][9] and one block of M [KP][33].
template <int KP>
struct MergeLayout {
  static constexpr int LDS = kMergeCols + 1, LDM = kMergeKeys + 1;
  static constexpr std::size_t bytes() { return sizeof(float) * (KP * LDS + KP * LDM); }
};

// The merge chain: X twice ([2][kMergeCols][KP + 4]: a column's keys contiguous, read four at a time; step s reads
// one buffer and writes Y into the other), then a ring of RING key blocks of M ([KP][kMergeKeys + 4] each: rows
// 16-byte aligned, a warp's four rows on distinct banks). At most 99 KB: sm_86 / sm_89 run it too.
template <int KP>
struct MergeChainLayout {
  static constexpr int LDX = KP + 4, LDB = kMergeKeys + 4, RING = KP <= 128 ? 4 : 2, BLOCK = KP * LDB;
  static constexpr std::size_t bytes() { return sizeof(float) * (2 * kMergeCols * LDX + RING * BLOCK); }
  static_assert(RING >= 2 && bytes() <= 99 * 1024, "the merge fits every sm_80+ device");
};

// The backward's merge kernel runs either (the summary's fold or the chain): the larger of the two, KP = 64, 128 or
// 256.
constexpr std::size_t backward_merge_bytes(int KP) {
  constexpr std::size_t f64 = MergeLayout<64>::bytes(), c64 = MergeChainLayout<64>::bytes();
  constexpr std::size_t f128 = MergeLayout<128>::bytes(), c128 = MergeChainLayout<128>::bytes();
  constexpr std::size_t f256 = MergeLayout<256>::bytes(), c256 = MergeChainLayout<256>::bytes();
  return KP <= 64 ? (f64 > c64 ? f64 : c64) : KP <= 128 ? (f128 > c128 ? f128 : c128) : (f256 > c256 ? f256 : c256);
}

}  // namespace kdakit::cuda
