// Hopper (sm_90a) warpgroup MMAs on CuTe's atoms and layouts: the 128-byte-swizzled layout of bf16 operand tiles in
// shared memory, their matrix descriptors, the register-A MMAs (m64nNk16, fp32 accumulators) and the fences around
// them, and stmatrix. Four consecutive warps (a warpgroup) issue each MMA together; warp i of the group supplies and
// receives rows [16 i, 16 i + 16) of the 64-row tile in the per-warp layouts of mma.m16n8k16 (FragA for A, one FragC
// per 8-column n-tile for the accumulator), so code written around mma.sync fragments feeds these MMAs unchanged.
//
// Only sm_90a has these instructions: elsewhere (the compute_80 PTX) the callers trap (KDAKIT_SM90A), and the host
// never selects a kernel that uses them (ForwardConfig::wgmma).
#pragma once

#include <cute/arch/copy_sm90.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "cuda/common/sm80/cp_async.cuh"
#include "cuda/common/sm80/mma.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KDAKIT_SM90A 1
#else
#define KDAKIT_SM90A 0
#endif

namespace kdakit::cuda::sm90 {

namespace gmma = cute::SM90::GMMA;
using Major = gmma::Major;

// A [64][COLS] bf16 operand tile (COLS a multiple of 64): CuTe's K-major 128-byte-swizzle atom (8 rows of 128 bytes,
// the 16-byte piece j of row r stored at j ^ (r % 8)) tiled down the 64 rows first, then across 64-column blocks 8 KB
// apart. Tiles start at 1024-byte boundaries (the swizzle's period). The same tile is a K-major B operand (rows = N,
// columns = K) or an MN-major one (rows = K, columns = N). A layout without swizzle ran the chunk step much slower (docs/perf-notes.md): the
// 8 x 8 core matrices of one K step then sit COLS * 16 bytes apart, in the same banks.
template <int COLS>
using TileLayout = decltype(cute::tile_to_shape(gmma::Layout_K_SW128_Atom<cute::bfloat16_t>{},
                                                cute::Shape<cute::_64, cute::Int<COLS>>{}));

// Element offset of (r, c) in such a tile: TileLayout in closed form (tests/cpp/cuda/test_sm90_layout.cu checks the two
// agree at every coordinate). The copies into the stage tiles compute it on the recurrence's serial path, where CuTe's
// general evaluation of the composed layout takes more instructions (docs/perf-notes.md).
template <int COLS>
__host__ __device__ constexpr int tile_offset(int r, int c) {
  return (c >> 6) * 64 * 64 + r * 64 + ((((c >> 3) & 7) ^ (r & 7)) << 3) + (c & 7);
}

// TileLayout as a layout of element offsets (the swizzle applied to element indices), for checks.
template <int COLS>
auto tile_layout_elements() {
  return cute::as_position_independent_swizzle_layout(TileLayout<COLS>{});
}

// The matrix descriptors of a tile read as the B operand of MMAs of 16 k each, one per k-step:
//   K_MAJOR: B(k, n) = tile(n, k), N = 64 rows; k-step kd covers columns [16 kd, 16 kd + 16).
//   else (MN-major): B(k, n) = tile(k, n), N = COLS; k-step kd covers rows [16 kd, 16 kd + 16).
// CuTe makes the first step's descriptor from the tile's layout; a later step's moves its start address by the step's
// offset in that layout (16-byte units), added to the whole 64-bit descriptor (one uniform instruction per MMA).
template <int COLS, bool K_MAJOR>
struct TileDescriptors {
  uint64_t first = 0;
  __device__ __forceinline__ explicit TileDescriptors(const __nv_bfloat16* tile) {
    using namespace cute;
    Tensor t = make_tensor(make_smem_ptr(reinterpret_cast<const bfloat16_t*>(tile)), TileLayout<COLS>{});
    if constexpr (K_MAJOR) {
      first = gmma::make_gmma_desc<Major::K>(local_tile(t, Shape<_64, _16>{}, make_coord(0, 0))).desc_;
    } else {
      Tensor b = make_tensor(t.data(), select<1, 0>(t.layout()));  // (n, k)
      first = gmma::make_gmma_desc<Major::MN>(local_tile(b, Shape<Int<COLS>, _16>{}, make_coord(0, 0))).desc_;
    }
  }
  __device__ __forceinline__ uint64_t operator()(int kd) const {
    const int elem = K_MAJOR ? tile_offset<COLS>(0, 16 * kd) : tile_offset<COLS>(16 * kd, 0);
    return first + static_cast<uint64_t>(elem * int(sizeof(cute::bfloat16_t)) / 16);
  }
};

// Rows [0, C) of a [C][KC] bf16 workspace tile into a TileLayout<KC> tile by 16-byte cp.async copies (the caller
// commits them), by NT threads of which this is thread `t`: each 8 lanes copy one 128-byte row (a permutation of one
// row's pieces in shared memory: no bank conflicts).
template <typename Elem, int KC, int NT>
__device__ __forceinline__ void copy_ws_swizzled(Elem* dst, const Elem* src, int C, int t) {
  static_assert(sizeof(Elem) == 2, "swizzled stage tiles hold bf16 operands");
  constexpr int KB = KC / 8, RS = NT / KB;  // 16-byte pieces per row; rows per pass (a multiple of 8: same swizzle)
  static_assert(NT % KB == 0 && RS % 8 == 0 && 64 % RS == 0, "whole 8-row groups per pass");
  const int r = t / KB, c = (t % KB) * 8;
  Elem* d = dst + tile_offset<KC>(r, c);
  const int step = tile_offset<KC>(RS, 0);  // RS rows further, the same swizzle
  const Elem* g = src + r * KC + c;
#pragma unroll
  for (int i = 0; i < 64 / RS; ++i) {
    if (r + i * RS < C) cp_async16(d + i * step, g + i * RS * KC);
  }
}
// Named barrier 1 over the CTA's first THREADS threads: the stage hand-over between a warpgroup that copies and one
// that computes (the kernels keep barrier 0, __syncthreads, for whole-CTA steps).
template <int THREADS>
__device__ __forceinline__ void handover_barrier() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(THREADS) : "memory");
}

// d += A B for a 64 x N tile (N = 64 or 128), A from registers, B through a descriptor of the given major mode.
template <int N, Major B_MAJOR>
using MmaRS = std::conditional_t<N == 64, gmma::MMA_64x64x16_F32BF16BF16_RS<Major::K, B_MAJOR>,
                                 gmma::MMA_64x128x16_F32BF16BF16_RS<Major::K, B_MAJOR>>;

template <typename Op, int NT, std::size_t... I>
__device__ __forceinline__ void mma_rs_expand(FragC (&d)[NT], const FragA& a, uint64_t desc,
                                              std::index_sequence<I...>) {
  Op::fma(a.x[0], a.x[1], a.x[2], a.x[3], desc, d[I / 4].x[I % 4]...);
}

template <Major B_MAJOR, int NT>
__device__ __forceinline__ void mma_rs(FragC (&d)[NT], const FragA& a, uint64_t desc) {
  static_assert(NT == 8 || NT == 16, "64 x 64 or 64 x 128 tiles");
  mma_rs_expand<MmaRS<8 * NT, B_MAJOR>>(d, a, desc, std::make_index_sequence<4 * NT>());
}

// The fences of asynchronous MMAs: register writes before `arrive` are seen by the MMAs issued after it; `commit`
// closes a group; `wait<N>` returns when at most N groups are in flight.
__device__ __forceinline__ void arrive() { cute::warpgroup_arrive(); }
__device__ __forceinline__ void commit() { cute::warpgroup_commit_batch(); }
template <int N>
__device__ __forceinline__ void wait() {
  cute::warpgroup_wait<N>();
}
// Pins registers at this point of the instruction stream: the compiler may not move their reads or writes across
// (accumulators and A fragments of the asynchronous MMAs).
template <int N>
__device__ __forceinline__ void fence_operands(FragC (&c)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) cute::warpgroup_fence_operand(c[i].x[e]);
}
__device__ __forceinline__ void fence_operands(FragA& a) {
#pragma unroll
  for (int e = 0; e < 4; ++e) cute::warpgroup_fence_operand(a.x[e]);
}
// Shared-memory writes of this thread (cp.async, st.shared) made visible to the asynchronous proxy that the MMAs read
// through; before the barrier that hands the tile over.
__device__ __forceinline__ void fence_shared_to_async() { cutlass::arch::fence_view_async_shared(); }

// stmatrix: four 8 x 8 bf16 matrices from mma fragments (register j = matrix j, thread (g, t) holding its elements
// (g, 2t..2t+1)) stored transposed: lane l gives the address of row l % 8 of matrix l / 8, which receives the matrix's
// column l % 8.
__device__ __forceinline__ void store_matrices_t(void* p, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  cute::SM90_U16x8_STSM_T::copy(r0, r1, r2, r3, *reinterpret_cast<cute::uint128_t*>(p));
}

}  // namespace kdakit::cuda::sm90
