// Hopper (sm_90a) warpgroup MMA: wgmma.mma_async m64nNk16 bf16 -> fp32 with the A operand in registers and B from
// shared memory through a matrix descriptor, plus the fences it needs. Four consecutive warps (a warpgroup) issue
// each instruction together; warp i of the group supplies and receives rows [16 i, 16 i + 16) of the 64-row tile, in
// the per-warp layouts of mma.m16n8k16 (FragA for A; FragC per 8-column n-tile for the accumulator), so code written
// around mma.sync fragments feeds these instructions unchanged.
//
// Shared-memory layout (128-byte swizzle): a [64][KC] bf16 tile (KC a multiple of 64) is stored as KC / 64 column
// blocks of [64][64], each row 128 bytes with its 16-byte pieces permuted (piece j of row r at j ^ (r % 8)), blocks
// 1024-byte aligned (`swizzled_offset`). The same tile is a K-major B operand (rows = N, columns = K) or an N-major
// one (rows = K, columns = N). A first layout without swizzle (8 x 8 core matrices of 128 contiguous bytes) ran the
// chunk step ~2x slower: its core matrices of one K step sit KC * 16 bytes apart, in the same banks.
//
// Only sm_90a has these instructions: elsewhere (the compute_80 PTX) the wrappers trap, and the host never selects
// a kernel that uses them (ForwardConfig::wgmma).
#pragma once

#include <cstdint>

#include "cuda/common/mma.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KDAKIT_WGMMA_ARCH 1
#else
#define KDAKIT_WGMMA_ARCH 0
#endif

namespace kdakit::cuda {

// Element offset of (r, c) in a swizzled [64][KC] tile.
__device__ __forceinline__ int swizzled_offset(int r, int c) {
  return (c >> 6) * 64 * 64 + r * 64 + ((((c >> 3) & 7) ^ (r & 7)) << 3) + (c & 7);
}

// Matrix descriptor: start address, leading and stride byte offsets, 128-byte swizzle (layout type 1, base offset 0:
// the tiles' column blocks are 1024-byte aligned).
__device__ __forceinline__ uint64_t wgmma_desc(const void* p, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return static_cast<uint64_t>((smem_addr(p) >> 4) & 0x3FFF) |
         (static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFF) << 32) | (uint64_t(1) << 62);
}
// B = a swizzled [N = 64][KC] tile read K-major (B(k, n) = tile(n, k)), or a swizzled [K = 64][KC] tile read
// N-major (B(k, n) = tile(k, n); its column blocks of 64 n are LBO = 8 KB apart, its 8-row groups SBO = 1 KB).
__device__ __forceinline__ uint64_t wgmma_desc_k_major(const __nv_bfloat16* tile) { return wgmma_desc(tile, 16, 1024); }
__device__ __forceinline__ uint64_t wgmma_desc_n_major(const __nv_bfloat16* tile) {
  return wgmma_desc(tile, 64 * 128, 1024);
}
// The descriptor moved to column k0 (K-major) or row k0 (N-major), k0 a multiple of 16: a constant added to the
// start address (within a column block the hardware applies the swizzle to the address bits).
__device__ __forceinline__ uint64_t wgmma_k_step(uint64_t desc, int k0) {
  return desc + static_cast<uint64_t>(((k0 >> 6) * 64 * 64 + (k0 & 63)) * 2 / 16);
}
__device__ __forceinline__ uint64_t wgmma_n_step(uint64_t desc, int k0) {
  return desc + static_cast<uint64_t>(k0 * 64 * 2 / 16);
}

// stmatrix (sm_90): four 8 x 8 bf16 matrices from mma fragments (register j = matrix j, thread (g, t) holding its
// elements (g, 2t..2t+1)) stored transposed: lane l gives the address of row l % 8 of matrix l / 8, which receives
// the matrix's column l % 8.
__device__ __forceinline__ void stsm_x4_t(void* p, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
#if KDAKIT_WGMMA_ARCH
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr(p)),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
#else
  __trap();
#endif
}

// Register writes before this fence are seen by the warpgroup MMAs issued after it.
__device__ __forceinline__ void wgmma_fence() {
#if KDAKIT_WGMMA_ARCH
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if KDAKIT_WGMMA_ARCH
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if KDAKIT_WGMMA_ARCH
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Shared-memory writes of this thread (cp.async, st.shared) made visible to the asynchronous proxy that the MMAs read
// through; before the barrier that hands the tile over.
__device__ __forceinline__ void fence_proxy_async() {
#if KDAKIT_WGMMA_ARCH
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Pins a register's value at this point of the instruction stream: the compiler may not move its reads or writes
// across (accumulators and A fragments around the asynchronous MMAs).
__device__ __forceinline__ void pin(float& x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void pin(uint32_t& x) { asm volatile("" : "+r"(x)::"memory"); }
template <int N>
__device__ __forceinline__ void pin(FragC (&c)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) pin(c[i].x[e]);
}
__device__ __forceinline__ void pin(FragA& a) {
#pragma unroll
  for (int e = 0; e < 4; ++e) pin(a.x[e]);
}

// d += A B for a 64 x N tile (TRANS_B = 0: B K-major; 1: N-major).
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16(FragC (&d)[8], const FragA& a, uint64_t desc_b) {
#if KDAKIT_WGMMA_ARCH
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
      : "+f"(d[0].x[0]), "+f"(d[0].x[1]), "+f"(d[0].x[2]), "+f"(d[0].x[3]),
        "+f"(d[1].x[0]), "+f"(d[1].x[1]), "+f"(d[1].x[2]), "+f"(d[1].x[3]),
        "+f"(d[2].x[0]), "+f"(d[2].x[1]), "+f"(d[2].x[2]), "+f"(d[2].x[3]),
        "+f"(d[3].x[0]), "+f"(d[3].x[1]), "+f"(d[3].x[2]), "+f"(d[3].x[3]),
        "+f"(d[4].x[0]), "+f"(d[4].x[1]), "+f"(d[4].x[2]), "+f"(d[4].x[3]),
        "+f"(d[5].x[0]), "+f"(d[5].x[1]), "+f"(d[5].x[2]), "+f"(d[5].x[3]),
        "+f"(d[6].x[0]), "+f"(d[6].x[1]), "+f"(d[6].x[2]), "+f"(d[6].x[3]),
        "+f"(d[7].x[0]), "+f"(d[7].x[1]), "+f"(d[7].x[2]), "+f"(d[7].x[3])
      : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "l"(desc_b), "n"(TRANS_B));
#else
  __trap();
#endif
}

template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16(FragC (&d)[16], const FragA& a, uint64_t desc_b) {
#if KDAKIT_WGMMA_ARCH
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"
      : "+f"(d[0].x[0]), "+f"(d[0].x[1]), "+f"(d[0].x[2]), "+f"(d[0].x[3]),
        "+f"(d[1].x[0]), "+f"(d[1].x[1]), "+f"(d[1].x[2]), "+f"(d[1].x[3]),
        "+f"(d[2].x[0]), "+f"(d[2].x[1]), "+f"(d[2].x[2]), "+f"(d[2].x[3]),
        "+f"(d[3].x[0]), "+f"(d[3].x[1]), "+f"(d[3].x[2]), "+f"(d[3].x[3]),
        "+f"(d[4].x[0]), "+f"(d[4].x[1]), "+f"(d[4].x[2]), "+f"(d[4].x[3]),
        "+f"(d[5].x[0]), "+f"(d[5].x[1]), "+f"(d[5].x[2]), "+f"(d[5].x[3]),
        "+f"(d[6].x[0]), "+f"(d[6].x[1]), "+f"(d[6].x[2]), "+f"(d[6].x[3]),
        "+f"(d[7].x[0]), "+f"(d[7].x[1]), "+f"(d[7].x[2]), "+f"(d[7].x[3]),
        "+f"(d[8].x[0]), "+f"(d[8].x[1]), "+f"(d[8].x[2]), "+f"(d[8].x[3]),
        "+f"(d[9].x[0]), "+f"(d[9].x[1]), "+f"(d[9].x[2]), "+f"(d[9].x[3]),
        "+f"(d[10].x[0]), "+f"(d[10].x[1]), "+f"(d[10].x[2]), "+f"(d[10].x[3]),
        "+f"(d[11].x[0]), "+f"(d[11].x[1]), "+f"(d[11].x[2]), "+f"(d[11].x[3]),
        "+f"(d[12].x[0]), "+f"(d[12].x[1]), "+f"(d[12].x[2]), "+f"(d[12].x[3]),
        "+f"(d[13].x[0]), "+f"(d[13].x[1]), "+f"(d[13].x[2]), "+f"(d[13].x[3]),
        "+f"(d[14].x[0]), "+f"(d[14].x[1]), "+f"(d[14].x[2]), "+f"(d[14].x[3]),
        "+f"(d[15].x[0]), "+f"(d[15].x[1]), "+f"(d[15].x[2]), "+f"(d[15].x[3])
      : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "l"(desc_b), "n"(TRANS_B));
#else
  __trap();
#endif
}

}  // namespace kdakit::cuda
