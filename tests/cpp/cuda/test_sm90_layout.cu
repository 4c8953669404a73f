// The Hopper recurrence's stage tiles: the closed form the copies use (sm90::tile_offset) is CuTe's swizzled layout
// (sm90::TileLayout) at every coordinate, a permutation of the tile, and the descriptors' k-steps move by the
// layout's offsets. Host code: runs without a GPU (built where the CUDA compiler is).
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "cuda/common/sm90/gmma.cuh"

namespace kdakit::test {
namespace {

template <int COLS>
void expect_closed_form_is_the_layout() {
  const auto layout = cuda::sm90::tile_layout_elements<COLS>();
  std::vector<int> seen(64 * COLS, 0);
  for (int r = 0; r < 64; ++r) {
    for (int c = 0; c < COLS; ++c) {
      const int want = static_cast<int>(layout(r, c));
      const int got = cuda::sm90::tile_offset<COLS>(r, c);
      ASSERT_EQ(got, want) << "COLS " << COLS << " at (" << r << ", " << c << ")";
      ASSERT_GE(got, 0);
      ASSERT_LT(got, 64 * COLS);
      ++seen[got];
    }
  }
  for (int i = 0; i < 64 * COLS; ++i) ASSERT_EQ(seen[i], 1) << "offset " << i << " of COLS " << COLS;
}

TEST(Sm90Layout, ClosedFormIsCuTesSwizzledLayout) {
  expect_closed_form_is_the_layout<64>();
  expect_closed_form_is_the_layout<128>();
  expect_closed_form_is_the_layout<256>();
}

TEST(Sm90Layout, RowsOfEightSpreadOverTheBanksAndStepsAreUnswizzled) {
  // The 16-byte piece p of rows 8a..8a+7 lands in 8 different 16-byte bank groups of a 128-byte line (no conflicts
  // for the copies and the MMAs' reads), and row 0 (column 0) is not permuted, so a k-step's descriptor moves by the
  // unswizzled offset: 16 columns (K-major) or 16 rows (MN-major).
  for (int p = 0; p < 8; ++p) {
    std::vector<int> groups;
    for (int r = 8; r < 16; ++r) groups.push_back((cuda::sm90::tile_offset<128>(r, 8 * p) % 64) / 8);
    std::sort(groups.begin(), groups.end());
    for (int i = 0; i < 8; ++i) EXPECT_EQ(groups[i], i) << "piece " << p;
  }
  for (int kd = 0; kd < 8; ++kd) {
    EXPECT_EQ(cuda::sm90::tile_offset<128>(0, 16 * kd), (16 * kd / 64) * 4096 + (16 * kd) % 64);
    EXPECT_EQ(cuda::sm90::tile_offset<128>(16 * kd % 64, 0), (16 * kd % 64) * 64);
  }
}

}  // namespace
}  // namespace kdakit::test
