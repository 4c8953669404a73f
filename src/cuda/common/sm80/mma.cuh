// Warp-level tensor-core helpers (sm_80+): ldmatrix, mma.sync m16n8k16 bf16 with fp32 accumulation, and
// shared-memory tile GEMMs with three operand precisions:
//   Elem = __nv_bfloat16: operands rounded to bf16 once, one MMA per k-step (fragments by ldmatrix);
//   Elem = float:         operands split as hi + lo bf16 pairs, three MMAs per k-step (hi*hi + hi*lo + lo*hi),
//                         about 16 significant bits per operand: the path for float16 inputs;
//   Elem = Float3Split:   float storage split as hi + mid + lo, six MMAs per k-step, float32's 24 bits: the
//                         path for float32 inputs.
//
// Fragment layouts (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4):
//   A (16x16, row-major):  a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16x8,  k x n):      b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g)
//   C (16x8):              c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cstdint>
#include <type_traits>

#include "cuda/common/math.cuh"
#include "cuda/common/sm80/cp_async.cuh"

namespace kdakit::cuda {

struct FragA { uint32_t x[4]; };
struct FragB { uint32_t x[2]; };
struct FragC {
  float x[4];
  __device__ __forceinline__ void zero() { x[0] = x[1] = x[2] = x[3] = 0.f; }
};

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x2_t(uint32_t (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}

__device__ __forceinline__ void mma_bf16(FragC& c, const FragA& a, const FragB& b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c.x[0]), "+f"(c.x[1]), "+f"(c.x[2]), "+f"(c.x[3])
      : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(b.x[0]), "r"(b.x[1]));
}

// ---- Operand storage in shared memory: row-major tiles with a row stride `ld` (elements). ----------------
// For bf16 tiles the row stride must keep 16-byte alignment; a stride of cols + 8 avoids bank conflicts.

template <typename Elem>
struct Operand;

template <>
struct Operand<__nv_bfloat16> {
  static constexpr int kSplit = 1;
  // A fragment (16x16 at row m0, col k0) of a row-major [M][K] tile.
  __device__ __forceinline__ static void load_a(FragA (&a)[1], const __nv_bfloat16* s, int ld, int m0, int k0) {
    const int lane = threadIdx.x & 31;
    const int r = m0 + (lane & 7) + ((lane >> 3) & 1) * 8, c = k0 + (lane >> 4) * 8;
    ldsm_x4(a[0].x, s + r * ld + c);
  }
  // A fragment of A = S^T where S is a row-major [K][M] tile (element (m, k) at S[k][m]).
  __device__ __forceinline__ static void load_a_t(FragA (&a)[1], const __nv_bfloat16* s, int ld, int m0, int k0) {
    const int lane = threadIdx.x & 31;
    // matrices: (m0-7,k0-7), (m8-15,k0-7), (m0-7,k8-15), (m8-15,k8-15); stored transposed -> rows are k
    const int k = k0 + (lane & 7) + (lane >> 4) * 8, m = m0 + ((lane >> 3) & 1) * 8;
    ldsm_x4_t(a[0].x, s + k * ld + m);
  }
  // B fragments for two n-tiles (n0..n0+15) at k0, from a row-major [N][K] tile (B^T stored).
  __device__ __forceinline__ static void load_b_nk(FragB (&b)[2][1], const __nv_bfloat16* s, int ld, int k0, int n0) {
    const int lane = threadIdx.x & 31;
    const int n = n0 + (lane & 7) + (lane >> 4) * 8, k = k0 + ((lane >> 3) & 1) * 8;
    uint32_t r[4];
    ldsm_x4(r, s + n * ld + k);
    b[0][0].x[0] = r[0]; b[0][0].x[1] = r[1]; b[1][0].x[0] = r[2]; b[1][0].x[1] = r[3];
  }
  // B fragment of one n-tile (n0..n0+7): from [N][K], or from [K][N].
  __device__ __forceinline__ static void load_b1_nk(FragB (&b)[1], const __nv_bfloat16* s, int ld, int k0, int n0) {
    const int lane = threadIdx.x & 31;
    const int n = n0 + (lane & 7), k = k0 + ((lane >> 3) & 1) * 8;
    ldsm_x2(b[0].x, s + n * ld + k);
  }
  __device__ __forceinline__ static void load_b1_kn(FragB (&b)[1], const __nv_bfloat16* s, int ld, int k0, int n0) {
    const int lane = threadIdx.x & 31;
    const int k = k0 + (lane & 7) + ((lane >> 3) & 1) * 8;
    ldsm_x2_t(b[0].x, s + k * ld + n0);
  }
  // B fragments for two n-tiles from a row-major [K][N] tile.
  __device__ __forceinline__ static void load_b_kn(FragB (&b)[2][1], const __nv_bfloat16* s, int ld, int k0, int n0) {
    const int lane = threadIdx.x & 31;
    const int k = k0 + (lane & 7) + ((lane >> 3) & 1) * 8, n = n0 + (lane >> 4) * 8;
    uint32_t r[4];
    ldsm_x4_t(r, s + k * ld + n);
    b[0][0].x[0] = r[0]; b[0][0].x[1] = r[1]; b[1][0].x[0] = r[2]; b[1][0].x[1] = r[3];
  }
  __device__ __forceinline__ static void mma(FragC& c, const FragA (&a)[1], const FragB (&b)[1]) {
    mma_bf16(c, a[0], b[0]);
  }
  __device__ __forceinline__ static void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
  __device__ __forceinline__ static void store2(__nv_bfloat16* p, float v0, float v1) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
  }
};

// Float tiles (float storage) split into P bf16 parts per operand. P = 2: hi + lo, three MMAs (hi*hi + hi*lo +
// lo*hi), about 16 significant bits. P = 3: hi + mid + lo, six MMAs (every part product down to 2^-16 of hi*hi),
// float32's 24 bits. The tile pointer's type only names the storage (float or Float3Split, both 4-byte floats).
template <int P>
struct SplitOperand {
  static constexpr int kSplit = P;
  template <typename S>
  __device__ __forceinline__ static const float* f(const S* s) { return reinterpret_cast<const float*>(s); }
  template <typename S>
  __device__ __forceinline__ static float* f(S* s) { return reinterpret_cast<float*>(s); }
  // Two elements into word x of the P fragments' parts.
  template <typename Frag>
  __device__ __forceinline__ static void put(Frag (&fr)[P], int x, float v0, float v1) {
    uint32_t w[P];
    split_parts<P>(v0, v1, w);
#pragma unroll
    for (int i = 0; i < P; ++i) fr[i].x[x] = w[i];
  }
  template <typename Frag>
  __device__ __forceinline__ static void pair(const float* p, Frag (&fr)[P], int x) {
    const float2 v = *reinterpret_cast<const float2*>(p);
    put(fr, x, v.x, v.y);
  }
  template <typename Frag>
  __device__ __forceinline__ static void pair_strided(const float* p, int stride, Frag (&fr)[P], int x) {
    put(fr, x, p[0], p[stride]);
  }
  template <typename S>
  __device__ __forceinline__ static void load_a(FragA (&a)[P], const S* st, int ld, int m0, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float* p = f(st) + (m0 + g) * ld + k0 + 2 * t;
    pair(p, a, 0);
    pair(p + 8 * ld, a, 1);
    pair(p + 8, a, 2);
    pair(p + 8 * ld + 8, a, 3);
  }
  template <typename S>
  __device__ __forceinline__ static void load_a_t(FragA (&a)[P], const S* st, int ld, int m0, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float* p = f(st) + (k0 + 2 * t) * ld + m0 + g;  // element (m, k) at s[k][m]
    pair_strided(p, ld, a, 0);
    pair_strided(p + 8, ld, a, 1);
    pair_strided(p + 8 * ld, ld, a, 2);
    pair_strided(p + 8 * ld + 8, ld, a, 3);
  }
  template <typename S>
  __device__ __forceinline__ static void load_b_nk(FragB (&b)[2][P], const S* st, int ld, int k0, int n0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float* p = f(st) + (n0 + 8 * j + g) * ld + k0 + 2 * t;
      pair(p, b[j], 0);
      pair(p + 8, b[j], 1);
    }
  }
  template <typename S>
  __device__ __forceinline__ static void load_b1_nk(FragB (&b)[P], const S* st, int ld, int k0, int n0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float* p = f(st) + (n0 + g) * ld + k0 + 2 * t;
    pair(p, b, 0);
    pair(p + 8, b, 1);
  }
  template <typename S>
  __device__ __forceinline__ static void load_b1_kn(FragB (&b)[P], const S* st, int ld, int k0, int n0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float* p = f(st) + (k0 + 2 * t) * ld + n0 + g;
    pair_strided(p, ld, b, 0);
    pair_strided(p + 8 * ld, ld, b, 1);
  }
  template <typename S>
  __device__ __forceinline__ static void load_b_kn(FragB (&b)[2][P], const S* st, int ld, int k0, int n0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float* p = f(st) + (k0 + 2 * t) * ld + n0 + 8 * j + g;
      pair_strided(p, ld, b[j], 0);
      pair_strided(p + 8 * ld, ld, b[j], 1);
    }
  }
  // Small terms first. P = 3 leaves out mid*lo, lo*mid and lo*lo (2^-24 of hi*hi and below).
  __device__ __forceinline__ static void mma(FragC& c, const FragA (&a)[P], const FragB (&b)[P]) {
    if constexpr (P == 3) {
      mma_bf16(c, a[2], b[0]);
      mma_bf16(c, a[0], b[2]);
      mma_bf16(c, a[1], b[1]);
      mma_bf16(c, a[1], b[0]);
      mma_bf16(c, a[0], b[1]);
    } else {
      mma_bf16(c, a[1], b[0]);
      mma_bf16(c, a[0], b[1]);
    }
    mma_bf16(c, a[0], b[0]);
  }
  template <typename S>
  __device__ __forceinline__ static void store(S* p, float v) { *f(p) = v; }
  template <typename S>
  __device__ __forceinline__ static void store2(S* p, float v0, float v1) {
    *reinterpret_cast<float2*>(f(p)) = make_float2(v0, v1);
  }
};

template <>
struct Operand<float> : SplitOperand<2> {};
template <>
struct Operand<Float3Split> : SplitOperand<3> {};

// c += A B with B split into PB parts: A in one part (bf16, exact or rounded once) takes the smallest B part first;
// A split alike (SA == PB) takes the split operand's MMAs.
template <int SA, int PB>
__device__ __forceinline__ void mma_split_b(FragC& c, const FragA (&a)[SA], const FragB (&b)[PB]) {
  if constexpr (SA == 1) {
#pragma unroll
    for (int i = PB - 1; i >= 0; --i) mma_bf16(c, a[0], b[i]);
  } else {
    static_assert(SA == PB, "A and B split alike");
    SplitOperand<PB>::mma(c, a, b);
  }
}

// The tiles' element type for inputs of type InT: bf16 for bf16 inputs; float storage for the others, split into
// three bf16 parts in the products for float32 inputs (Float3Split: float32's precision) and two for float16 ones.
template <typename InT>
using TileElem = std::conditional_t<std::is_same<InT, __nv_bfloat16>::value, __nv_bfloat16,
                                    std::conditional_t<std::is_same<InT, float>::value, Float3Split, float>>;

// The operand of float quantities that are not inputs (states, their gradients, intermediate matrices): split like
// the inputs' element type Elem, with at least two parts.
template <typename Elem>
using FloatOperand = Operand<std::conditional_t<std::is_same<Elem, Float3Split>::value, Float3Split, float>>;

// acc[mt][nt] += A[m0 + 16 mt, k] * B[k, n0 + 8 nt] over k in [k0, k0 + 16 * ksteps), for the first
// 2 * np_count n-tiles. A_T: A is stored transposed ([K][M]); B_KN: B is stored [K][N] (otherwise [N][K]).
// B_LO: B is the sum of two tiles with the same layout, sb (hi) and sb_lo (lo); each A fragment is loaded once and
// multiplies both (the lo product first).
template <typename Elem, int MT, int NT, bool A_T, bool B_KN, bool B_LO = false>
__device__ __forceinline__ void warp_gemm(FragC (&acc)[MT][NT], const Elem* sa, int lda, int m0, const Elem* sb,
                                          int ldb, int n0, int k0, int ksteps, int np_count = NT > 1 ? NT / 2 : 1,
                                          const Elem* sb_lo = nullptr) {
  using Op = Operand<Elem>;
  static_assert(NT == 1 || NT % 2 == 0, "n-tiles come in pairs, or alone");
  for (int ks = 0; ks < ksteps; ++ks) {
    const int k = k0 + 16 * ks;
    FragA a[MT][Op::kSplit];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if constexpr (A_T) Op::load_a_t(a[mt], sa, lda, m0 + 16 * mt, k);
      else Op::load_a(a[mt], sa, lda, m0 + 16 * mt, k);
    }
    if constexpr (NT == 1) {
      FragB b[Op::kSplit];
      if constexpr (B_LO) {
        if constexpr (B_KN) Op::load_b1_kn(b, sb_lo, ldb, k, n0);
        else Op::load_b1_nk(b, sb_lo, ldb, k, n0);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) Op::mma(acc[mt][0], a[mt], b);
      }
      if constexpr (B_KN) Op::load_b1_kn(b, sb, ldb, k, n0);
      else Op::load_b1_nk(b, sb, ldb, k, n0);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) Op::mma(acc[mt][0], a[mt], b);
    } else {
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        if (np >= np_count) break;
        FragB b[2][Op::kSplit];
        if constexpr (B_LO) {
          if constexpr (B_KN) Op::load_b_kn(b, sb_lo, ldb, k, n0 + 16 * np);
          else Op::load_b_nk(b, sb_lo, ldb, k, n0 + 16 * np);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            Op::mma(acc[mt][2 * np], a[mt], b[0]);
            Op::mma(acc[mt][2 * np + 1], a[mt], b[1]);
          }
        }
        if constexpr (B_KN) Op::load_b_kn(b, sb, ldb, k, n0 + 16 * np);
        else Op::load_b_nk(b, sb, ldb, k, n0 + 16 * np);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Op::mma(acc[mt][2 * np], a[mt], b[0]);
          Op::mma(acc[mt][2 * np + 1], a[mt], b[1]);
        }
      }
    }
  }
}

// Visits the (row, col) coordinates of a thread's accumulator elements: f(mt, nt, i, row, col) with
// row/col relative to the warp tile origin.
template <int MT, int NT, typename F>
__device__ __forceinline__ void for_each_acc(F&& f) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) f(mt, nt, i, 16 * mt + g + 8 * (i >> 1), 8 * nt + 2 * t + (i & 1));
}

// Stores a thread's accumulators of 1 x NT tiles whose rows are values (v0 + row) and whose columns are keys
// (for_each_acc coordinates) into a dense [keys][V] block p: element (key d, value v) at d V + v, keys >= K and values
// >= V skipped. One base pointer a thread and a multiple of V a tile, instead of the element's offset per store.
template <typename T, int NT>
__device__ __forceinline__ void store_acc_key_rows(T* p, const FragC (&acc)[NT], int v0, int K, int V) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, va = v0 + g;
  const bool ok_a = va < V, ok_b = va + 8 < V;
  T* const base = p + int64_t(2 * t) * V + va;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int d = 8 * nt + 2 * t;
    T* const q = base + int64_t(8 * nt) * V;
    if (d < K) {
      if (ok_a) q[0] = from_float<T>(acc[nt].x[0]);
      if (ok_b) q[8] = from_float<T>(acc[nt].x[2]);
    }
    if (d + 1 < K) {
      if (ok_a) q[V] = from_float<T>(acc[nt].x[1]);
      if (ok_b) q[V + 8] = from_float<T>(acc[nt].x[3]);
    }
  }
}

}  // namespace kdakit::cuda
