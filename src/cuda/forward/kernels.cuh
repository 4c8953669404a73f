// The CUDA chunked forward (sm_80+, mma.sync): the algorithm of src/cpu/chunked.cpp split in two kernels.
//
//   prepare_kernel    (chunk, v-head) per CTA, all state-independent work: L2 norm, gate, beta, the anchored
//                     intra-chunk matrices P (-> Aqk) and L, the inverse Tm = (I + L)^-1, and w, u, qg, kg,
//                     gamma written to the workspace.
//   recurrence_kernel (sequence, v-head, V tile) per CTA, the serial part: the fp32 state lives in registers
//                     and each chunk does v_new = u - w S, o = qg S + Aqk v_new, S = gamma S + kg^T v_new.
//
// Elem is the operand type of every matrix product: bf16 (one MMA per k-step) for bf16 inputs, float (split
// into hi + lo bf16, three MMAs) for float16 and float32 inputs. Gates are carried in log2 units.
#pragma once

#include <type_traits>

#include "common/kda_math.h"
#include "cuda/common/mma.cuh"
#include "cuda/common/wgmma.cuh"
#include "cuda/forward/args.h"

namespace kdakit::cuda {

constexpr float kLog2e = 1.4426950408889634f;
// Diagonal blocks are factorised around their middle row while every exponent stays within +-64 nats.
constexpr float kMaxAnchorLog2 = 64.0f * kLog2e;

template <typename Elem>
constexpr int smem_pad() { return std::is_same<Elem, float>::value ? 4 : 8; }

template <typename Elem>
__device__ __forceinline__ Elem to_elem(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 to_elem<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ float to_elem<float>(float v) { return v; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The gate of SPEC §3 in log2 units, with the per-head constants (exp(A_log), lower_bound log2 e) hoisted out of
// the per-element work and the sigmoid's exponential and division on the special function unit (relative error
// ~2^-21, far below the bf16/fp32 tolerances; the precise libm path cost ~45 instructions per element).
struct GateLog2 {
  int mode = 0;     // 0 pre-gated, 1 softplus, 2 lower bound
  float a = 1.f;    // exp(A_log) (1 without A_log)
  float ak = kLog2e; // a log2 e
  float coef = 0.f; // mode 1: -exp(A_log) log2 e; mode 2: lower_bound log2 e
  __device__ __forceinline__ GateLog2(int m, float A_log, bool has_A_log, float lower_bound) : mode(m) {
    a = has_A_log ? expf(A_log) : 1.f;
    ak = a * kLog2e;
    coef = mode == 1 ? -ak : lower_bound * kLog2e;
  }
  // x = raw gate + dt_bias (mode 1, 2) or the natural-log gate itself (mode 0).
  template <int MODE>
  __device__ __forceinline__ float eval(float x) const {
    if constexpr (MODE == 0) return x * kLog2e;
    else if constexpr (MODE == 1) return coef * (x > 20.f ? x : log1pf(fast_exp2(x * kLog2e)));
    else return __fdividef(coef, 1.f + fast_exp2(-ak * x));  // coef * sigmoid(a x); 0 when the exponent overflows
  }
  __device__ __forceinline__ float operator()(float x) const {
    return mode == 0 ? eval<0>(x) : (mode == 1 ? eval<1>(x) : eval<2>(x));
  }
  // f(std::integral_constant<int, mode>): the per-element loops take the mode at compile time (one branch per call).
  template <typename F>
  __device__ __forceinline__ void dispatch(F&& f) const {
    if (mode == 0) f(std::integral_constant<int, 0>());
    else if (mode == 1) f(std::integral_constant<int, 1>());
    else f(std::integral_constant<int, 2>());
  }
};

// Bump allocation of dynamic shared memory with 16-byte alignment.
struct SmemCursor {
  char* p;
  template <typename T>
  __device__ __forceinline__ T* take(int count) {
    T* r = reinterpret_cast<T*>(p);
    p += (static_cast<size_t>(count) * sizeof(T) + 15) & ~size_t(15);
    return r;
  }
};

// ---- chunk offsets ---------------------------------------------------------------------------------------
// chunk_offsets[n] = number of chunks of the sequences before n, and the longest-first order. One block of
// kMaxOrdered threads; sequences split over threads.
__global__ void chunk_offsets_kernel(const ForwardArgs a);

// ---- prepare ---------------------------------------------------------------------------------------------

// Shared memory of prepare_kernel. The elementwise pass covers a slice of SW = min(KP, 128) dimensions at once
// (K = 256: two slices, the intra-chunk products accumulating over both). Slice phase:
//   sQx, sKx [C][LDS]       A operands of P and L: q and k of each 16-row block decayed to the block's anchor (its
//                           row 8; the block's first row where the exact path takes its diagonal block)
//   sKd      [C][LDS]       B operand of the diagonal blocks: k decayed from the anchor (k e^-s)
//   sKb      [KB_ROWS][LDS] B operands of the off-diagonal blocks: for each block a, the rows of every earlier block
//                           decayed to a's anchor, rows [0, 16 a) at kb_offset(a)
// STAGED (bf16 inputs with bf16 operands, float32 with float): the slice's raw q, k and g are first copied into sQx,
// sKd and sKx in the tiles' own layout, and each thread reads its elements there before it overwrites them with its
// operands (float16 inputs, whose raw rows are narrower than the float tiles, read global memory instead).
// Phase B reuses the bytes: L / Tm in fp32 [C][LDL] and the inverse's scratch, Tm diag(beta) [C][LDC], then the w / u
// steps' B operands, copied while the epilogue and the inverse run: k e^G [KP / 64][C][LD64] and two 64-column v
// slices [2][C][LD64].
template <typename InT, typename Elem, int C, int KP>
struct PrepareLayout {
  static constexpr int NSUB = C / 16;
  static constexpr int SW = KP < 128 ? KP : 128;  // dimensions per slice
  static constexpr int NKS = KP / SW;             // slices
  static constexpr int PAD = smem_pad<Elem>();
  static constexpr int LDS = SW + PAD;
  static constexpr int LD64 = 64 + PAD;
  static constexpr int LDC = C + PAD;
  static constexpr int LDL = C + 8;  // even (float2 fragment loads) and 8 mod 32 banks
  static constexpr int LDY = 12;     // the inverse's per-warp [32][LDY] intermediate: conflict-free B fragments
  static constexpr int KB_ROWS = 8 * NSUB * (NSUB - 1);
  static constexpr bool STAGED = sizeof(InT) == sizeof(Elem);
  static constexpr size_t r16(size_t b) { return (b + 15) & ~size_t(15); }
  static constexpr size_t slice_bytes() { return r16(sizeof(Elem) * (3 * C + KB_ROWS) * LDS); }
  static constexpr size_t tb_offset() { return r16(4 * C * LDL) + r16(4 * 4 * 32 * LDY); }
  static constexpr size_t b64_bytes() { return r16(sizeof(Elem) * C * LD64); }  // a [C][LD64] operand slice
  static constexpr size_t ks_offset() { return tb_offset() + r16(sizeof(Elem) * C * LDC); }
  static constexpr size_t v_offset() { return ks_offset() + (KP / 64) * b64_bytes(); }
  static constexpr size_t phase_b_bytes() { return v_offset() + 2 * b64_bytes(); }
  static constexpr size_t union_bytes() { return slice_bytes() > phase_b_bytes() ? slice_bytes() : phase_b_bytes(); }
  // The exact path's per-warp [16][17] fp32 scratch sits in the (then unused) diagonal B rows of its block.
  static_assert(sizeof(Elem) * 16 * LDS >= 2 * 16 * 17 * 4, "exact-path scratch fits a block's sKd rows");
  // About 81 KB for bf16 inputs with C = 64, K <= 128: two CTAs per SM.
  static constexpr size_t bytes() { return union_bytes() + 2 * r16(4 * NSUB * SW) + 3 * r16(4 * C) + r16(4 * 2 * NSUB); }
};

constexpr int kPrepareThreads = 256;

// First row of row block a's off-diagonal B operand in sKb (row block a needs rows [0, 16a)).
__host__ __device__ constexpr int kb_offset(int a) { return 8 * a * (a - 1); }
// Copies rows [0, nrows) x cols [0, cols) of a token tensor into columns [0, WIDTH) of a smem tile [C][ld] (InT),
// zero elsewhere. vec: 16-byte copies are legal (aligned base, strides and cols). Each thread keeps one 16-byte
// column piece and walks a compile-time number of rows by pointer increments (the 64-bit offset arithmetic per piece
// was ~10 instructions).
template <typename InT, int C, int WIDTH>
__device__ __forceinline__ void stage_rows(InT* dst, int ld, const InT* src, const TokenTensor& t, int64_t b,
                                           int64_t row0, int h, int nrows, int cols, bool vec) {
  constexpr int EPC = 16 / sizeof(InT), PIECES = WIDTH / EPC, STEP = kPrepareThreads / PIECES;
  static_assert(WIDTH % EPC == 0 && kPrepareThreads % PIECES == 0 && C % STEP == 0,
                "whole pieces, a fixed piece per thread, whole row steps");
  const int c0 = (threadIdx.x % PIECES) * EPC, r0 = threadIdx.x / PIECES;
  const InT* s = src + t.offset(b, row0 + r0, h) + c0;
  InT* d = dst + r0 * ld + c0;
  const int64_t step = STEP * t.st;
  if (vec) {
    const int rows = c0 < cols ? nrows : 0;  // a piece is wholly inside K or wholly past it
#pragma unroll
    for (int i = 0; i < C / STEP; ++i, s += step, d += STEP * ld) {
      if (r0 + i * STEP < rows) cp_async16(d, s);
      else *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
    }
  } else {
#pragma unroll 1
    for (int i = 0; i < C / STEP; ++i, s += step, d += STEP * ld) {
      const bool in = r0 + i * STEP < nrows;
#pragma unroll
      for (int j = 0; j < EPC; ++j) d[j] = in && c0 + j < cols ? s[j] : InT(0.f);
    }
  }
}

// Elements d and d + 1 of a row (p points at element d) as floats: one paired load where `pair` (an aligned pair,
// both elements present), else element loads with absent elements (ok0 / ok1 false: past K) reading zero.
template <typename InT>
__device__ __forceinline__ float2 load_pair(const InT* p, bool ok0, bool ok1, bool pair) {
  if (pair) {
    if constexpr (std::is_same<InT, float>::value) {
      return *reinterpret_cast<const float2*>(p);
    } else if constexpr (std::is_same<InT, __nv_bfloat16>::value) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
      return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
    } else {
      return __half22float2(*reinterpret_cast<const __half2*>(p));
    }
  }
  return make_float2(ok0 ? to_float(p[0]) : 0.f, ok1 ? to_float(p[1]) : 0.f);
}

__device__ __forceinline__ float2 operator+(float2 x, float2 y) { return make_float2(x.x + y.x, x.y + y.y); }
__device__ __forceinline__ float2 operator-(float2 x, float2 y) { return make_float2(x.x - y.x, x.y - y.y); }
__device__ __forceinline__ float2 operator*(float2 x, float2 y) { return make_float2(x.x * y.x, x.y * y.y); }
__device__ __forceinline__ float2 operator*(float2 x, float s) { return make_float2(x.x * s, x.y * s); }
__device__ __forceinline__ float2 exp2_2(float2 x) { return make_float2(fast_exp2(x.x), fast_exp2(x.y)); }
// Sum of squares of the elements in 16 bytes of InT.
template <typename InT>
__device__ __forceinline__ float sum_squares16(const uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same<InT, float>::value) {
      const float x = __uint_as_float(w[i]);
      s += x * x;
    } else if constexpr (std::is_same<InT, __nv_bfloat16>::value) {
      const float lo = __uint_as_float(w[i] << 16), hi = __uint_as_float(w[i] & 0xffff0000u);
      s += lo * lo + hi * hi;
    } else {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      s += f.x * f.x + f.y * f.y;
    }
  }
  return s;
}


// One doubling level of the inverse of a unit lower triangular [C][LDL] fp32 tile whose diagonal blocks of 16 rows
// already hold their inverses: for each pair of row blocks of S = 16 * MT rows (top at `top`, bottom at top + S), the
// bottom-left block B becomes -D^-1 B A^-1, where A^-1 and D^-1 are the pair's (already inverted) diagonal blocks.
// Warps [0, (C / 2S) * (S / 8)) each compute 8 columns; every thread of the CTA must call it (two barriers).
template <int C, int LDL, int LDY, int MT>
__device__ __forceinline__ void inverse_level(float* sT, float* sY) {
  constexpr int S = 16 * MT, TILES = S / 8, TASKS = (C / (2 * S)) * TILES;
  static_assert(TASKS <= kPrepareThreads / 32 && TASKS <= 4, "one task per warp, four scratch tiles");
  const int warp = threadIdx.x >> 5;
  FragC t[MT][1];
  int r0 = 0, c0 = 0;
  if (warp < TASKS) {
    const int top = 2 * S * (warp / TILES), nt = warp % TILES;
    r0 = top + S;
    c0 = top + 8 * nt;
    float* y = sY + warp * 32 * LDY;
    // Y = B A^-1 (columns c0..c0 + 7); A^-1 is lower triangular, so rows above the column's 16-block are zero.
    FragC acc[MT][1];
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m][0].zero();
    const int kskip = (8 * nt) / 16;
    warp_gemm<float, MT, 1, false, true>(acc, sT, LDL, r0, sT, LDL, c0, top + 16 * kskip, MT - kskip);
    for_each_acc<MT, 1>([&](int m, int, int e, int row, int col) {
      if ((e & 1) == 0) *reinterpret_cast<float2*>(y + row * LDY + col) = make_float2(acc[m][0].x[e], acc[m][0].x[e + 1]);
    });
    __syncwarp();
    // -D^-1 Y (the A tile starts at D^-1's first column, so that k indexes both D^-1's columns and Y's rows)
#pragma unroll
    for (int m = 0; m < MT; ++m) t[m][0].zero();
    warp_gemm<float, MT, 1, false, true>(t, sT + r0, LDL, r0, y, LDY, 0, 0, MT);
  }
  __syncthreads();  // every reader of B (and of the diagonal blocks) is done
  if (warp < TASKS) {
    for_each_acc<MT, 1>([&](int m, int, int e, int row, int col) {
      if ((e & 1) == 0) {
        *reinterpret_cast<float2*>(sT + (r0 + row) * LDL + c0 + col) = make_float2(-t[m][0].x[e], -t[m][0].x[e + 1]);
      }
    });
  }
  __syncthreads();
}
// bf16 operands: two CTAs per SM (81 KB of shared memory, up to 128 registers). Float operands need twice the tiles:
// one CTA.
template <typename InT, typename Elem, int C, int KP>
__global__ void __launch_bounds__(kPrepareThreads, sizeof(Elem) == 2 ? 2 : 1) prepare_kernel(const ForwardArgs a) {
  using L = PrepareLayout<InT, Elem, C, KP>;
  using Op = Operand<Elem>;
  constexpr int NSUB = L::NSUB, SW = L::SW, NKS = L::NKS, LDS = L::LDS, PAIRS = SW / 2;
  constexpr int NOFF = NSUB > 1 ? 2 * (NSUB - 1) : 2, NTH = kPrepareThreads;
  const int64_t slot = blockIdx.x;
  const int hv = blockIdx.y;
  if (slot >= a.chunk_offsets[a.N]) return;
  int lo = 0, hi = a.N;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (a.chunk_offsets[mid] <= slot) lo = mid; else hi = mid;
  }
  const int n = lo;
  int64_t b, t0, len;
  a.sequence(n, b, t0, len);
  const int64_t c = slot - a.chunk_offsets[n];
  const int64_t row0 = t0 + c * C;
  const int nrows = static_cast<int>(min(static_cast<int64_t>(C), len - c * C));
  const int h = hv / a.group;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const InT* qp = static_cast<const InT*>(a.q.p);
  const InT* kp = static_cast<const InT*>(a.k.p);
  const InT* gp = static_cast<const InT*>(a.g.p);
  const InT* vp = static_cast<const InT*>(a.v.p);
  const int64_t ws_tile = (slot * a.HV + hv);
  Elem* ws_qg = static_cast<Elem*>(a.ws_qg) + ws_tile * C * KP;
  Elem* ws_kg = static_cast<Elem*>(a.ws_kg) + ws_tile * C * KP;
  Elem* ws_w = static_cast<Elem*>(a.ws_w) + ws_tile * C * KP;
  Elem* ws_u = static_cast<Elem*>(a.ws_u) + ws_tile * C * a.VP;
  Elem* ws_a = static_cast<Elem*>(a.ws_a) + ws_tile * C * C;
  Elem* ws_alo = sizeof(Elem) == 2 ? static_cast<Elem*>(a.ws_alo) + ws_tile * C * C : nullptr;
  float* ws_gam = a.ws_gam + ws_tile * KP;

  extern __shared__ __align__(16) char smem_raw[];
  char* uni = smem_raw;
  Elem* sQx = reinterpret_cast<Elem*>(uni);  // slice phase (see PrepareLayout)
  Elem* sKx = sQx + C * LDS;
  Elem* sKd = sKx + C * LDS;
  Elem* sKb = sKd + C * LDS;
  float* sLT = reinterpret_cast<float*>(uni);                          // phase B: [C][LDL] L, then Tm
  float* sY = reinterpret_cast<float*>(uni + L::r16(4 * C * L::LDL));  // phase B: the inverse's [4 warps][32][LDY]
  Elem* sTb = reinterpret_cast<Elem*>(uni + L::tb_offset());  // phase B: [C][LDC] Tm diag(beta)
  Elem* sKs = reinterpret_cast<Elem*>(uni + L::ks_offset());  // phase B: [KP / 64][C][LD64] k e^G, from ws_w
  Elem* sVb = reinterpret_cast<Elem*>(uni + L::v_offset());   // phase B: [2][C][LD64] 64-column slices of v
  SmemCursor cur{smem_raw + L::union_bytes()};
  float* sTot = cur.take<float>(NSUB * SW);   // [NSUB][SW] block totals of the gates (log2) in the current slice
  float* sLam8 = cur.take<float>(NSUB * SW);  // [NSUB][SW] gates of each block's rows 0..8 (up to its anchor)
  float* sRq = cur.take<float>(C);
  float* sRk = cur.take<float>(C);
  float* sBeta = cur.take<float>(C);
  int* sMax = cur.take<int>(2 * NSUB);  // per slice parity: each block's largest anchor exponent (float bits)
  // The slice's raw q, k and g, staged in the tiles' layout (STAGED): slice 0's copies are issued first, so that they
  // are in flight with everything else the CTA loads.
  auto stage_slice = [&](int d0) {
    stage_rows<InT, C, SW>(reinterpret_cast<InT*>(sQx), LDS, qp + d0, a.q, b, row0, h, nrows, a.K - d0, a.vec_qk);
    stage_rows<InT, C, SW>(reinterpret_cast<InT*>(sKd), LDS, kp + d0, a.k, b, row0, h, nrows, a.K - d0, a.vec_qk);
    stage_rows<InT, C, SW>(reinterpret_cast<InT*>(sKx), LDS, gp + d0, a.g, b, row0, hv, nrows, a.K - d0, a.vec_g);
    cp_async_commit();
  };
  if constexpr (L::STAGED) stage_slice(0);
  // The reciprocal L2 norms of the chunk's q and k rows (TPR threads a row, 16-byte pieces): from the staged tiles
  // where one slice holds the whole rows (K <= 128), else from global memory straight into registers.
  constexpr bool NORMS_STAGED = L::STAGED && NKS == 1;
  auto norms = [&]() {
    constexpr int EPC = 16 / sizeof(InT), TPR = NTH / (2 * C), PIECES = KP / (EPC * TPR);
    static_assert(NTH % (2 * C) == 0 && KP % (EPC * TPR) == 0, "whole pieces per thread");
    const int task = tid / TPR, part = tid % TPR, r = task >> 1;
    const bool is_k = task & 1;
    float ss = 0.f;
    if constexpr (NORMS_STAGED) {  // zero past the rows and K
      const InT* row = reinterpret_cast<const InT*>(is_k ? sKd : sQx) + r * LDS;
#pragma unroll
      for (int j = 0; j < PIECES; ++j) ss += sum_squares16<InT>(*reinterpret_cast<const uint4*>(row + (j * TPR + part) * EPC));
    } else if (r < nrows) {
      const TokenTensor& tt = is_k ? a.k : a.q;
      const InT* row = (is_k ? kp : qp) + tt.offset(b, row0 + r, h);
#pragma unroll 8
      for (int j = 0; j < PIECES; ++j) {
        const int c0 = (j * TPR + part) * EPC;
        if (a.vec_qk) {
          if (c0 < a.K) ss += sum_squares16<InT>(*reinterpret_cast<const uint4*>(row + c0));
        } else {
#pragma unroll
          for (int e = 0; e < EPC; ++e) {
            const float x = c0 + e < a.K ? to_float(row[c0 + e]) : 0.f;
            ss += x * x;
          }
        }
      }
    }
#pragma unroll
    for (int o = 1; o < TPR; o <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (part == 0) {
      const float rs = r < nrows ? (a.l2norm ? rsqrtf(ss + static_cast<float>(math::kL2NormEps)) : 1.f) : 0.f;
      (is_k ? sRk : sRq)[r] = rs;
    }
  };
  // Stage 0: beta, and the norms where they come from global memory.
  for (int r = tid; r < C; r += NTH) {
    float bt = 0.f;
    if (r < nrows) {
      bt = math::beta_value(a.beta.load(b * a.beta_sb + (row0 + r) * a.beta_st + hv * a.beta_sh), a.beta_sigmoid,
                            a.neg_eigval);
    }
    sBeta[r] = bt;
  }
  if (tid < 2 * NSUB) sMax[tid] = 0;
  if constexpr (!NORMS_STAGED) norms();
  const GateLog2 gate(a.gate_mode, a.A_log.present() ? a.A_log.load(hv) : 0.f, a.A_log.present(), a.lower_bound);
  if constexpr (L::STAGED) cp_async_wait<0>();  // slice 0 (each thread's own copies; the barrier publishes them)
  __syncthreads();

  // Warp roles in the matrix stages: row block ab; role 0 computes P (-> Aqk), role 1 computes L.
  FragC acc[1][NOFF], dacc[1][2];
#pragma unroll
  for (int i = 0; i < NOFF; ++i) acc[0][i].zero();
  dacc[0][0].zero();
  dacc[0][1].zero();
  const int ab = warp & 3, role = warp >> 2;
  const bool has_block = ab < NSUB;
  // Elementwise roles: thread (esb, pair) owns dimensions dl and dl + 1 of each slice in the 16 rows of block esb, so
  // its gates and their sums along the rows stay in registers, and every value it writes is a pair (one 32-bit
  // shared-memory store, a warp's workspace store covering 128 contiguous bytes).
  const int esb = tid / PAIRS, dl = 2 * (tid % PAIRS);
  const bool ew = esb < NSUB;
  const int er0 = 16 * esb;                                 // the block's first row
  const int valid = ew ? max(0, min(16, nrows - er0)) : 0;  // its rows in the sequence
  const InT* qrow = qp + a.q.offset(b, row0 + er0, h) + dl;
  const InT* krow = kp + a.k.offset(b, row0 + er0, h) + dl;
  const InT* grow = gp + a.g.offset(b, row0 + er0, hv) + dl;

  for (int ks = 0; ks < NKS; ++ks) {
    const int d0 = ks * SW, d = d0 + dl;
    const bool ok0 = d < a.K, ok1 = d + 1 < a.K;
    int* maxs = sMax + (ks & 1) * NSUB;
    if constexpr (L::STAGED) {
      if (ks > 0) {  // the previous slice's readers are past its last barrier
        stage_slice(d0);
        cp_async_wait<0>();
        __syncthreads();
      }
    }
    if constexpr (NORMS_STAGED) norms();  // read in (ii), past the next barrier
    // Raw elements d, d + 1 of row i of the thread's block: staged (zero past the rows and K), or from global memory.
    const InT* sraw_q = reinterpret_cast<const InT*>(sQx) + er0 * LDS + dl;
    const InT* sraw_k = reinterpret_cast<const InT*>(sKd) + er0 * LDS + dl;
    const InT* sraw_g = reinterpret_cast<const InT*>(sKx) + er0 * LDS + dl;
    const bool pq = a.pair_qk && ok1, pg = a.pair_g && ok1;
    auto raw = [&](const InT* staged, const InT* global, int64_t st, bool pair, int i) {
      if constexpr (L::STAGED) return load_pair<InT>(staged + i * LDS, true, true, true);
      else return i < valid ? load_pair<InT>(global + d0 + i * st, ok0, ok1, pair) : make_float2(0.f, 0.f);
    };
    // (i) The thread's gates (log2 units; zero past the sequence and past K), its block's total, the block's sum up
    //     to its anchor (rows 0..8) and after it (rows 9..15), and the block's largest anchor exponent |G_i - G_8|.
    float2 x[16], tot = make_float2(0.f, 0.f), lam8 = tot, s9 = tot;
    if (ew) {
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = raw(sraw_g, grow, a.g.st, pg, i);  // all loads first
      float2 bias = make_float2(0.f, 0.f);
      if (a.gate_mode != 0 && a.dt_bias.present()) {
        const int64_t bo = int64_t(hv) * a.K + d;
        bias = make_float2(ok0 ? a.dt_bias.load(bo) : 0.f, ok1 ? a.dt_bias.load(bo + 1) : 0.f);
      }
      gate.dispatch([&](auto mode) {
        constexpr int M = decltype(mode)::value;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const bool row = i < valid;
          x[i] = make_float2(row && ok0 ? gate.template eval<M>(x[i].x + bias.x) : 0.f,
                             row && ok1 ? gate.template eval<M>(x[i].y + bias.y) : 0.f);
        }
      });
      float2 lam = x[0], lmin = lam, lmax = lam;
#pragma unroll
      for (int i = 1; i < 16; ++i) {
        lam = lam + x[i];
        if (i == 8) lam8 = lam;
        if (i >= 9) s9 = s9 + x[i];
        lmin = make_float2(fminf(lmin.x, lam.x), fminf(lmin.y, lam.y));
        lmax = make_float2(fmaxf(lmax.x, lam.x), fmaxf(lmax.y, lam.y));
      }
      tot = lam;
      const float ms = warp_max(fmaxf(fmaxf(lmax.x - lam8.x, lam8.x - lmin.x), fmaxf(lmax.y - lam8.y, lam8.y - lmin.y)));
      if (lane == 0) atomicMax(&maxs[esb], __float_as_int(ms));
      *reinterpret_cast<float2*>(sTot + esb * SW + dl) = tot;
      *reinterpret_cast<float2*>(sLam8 + esb * SW + dl) = lam8;
    }
    __syncthreads();
    if (tid < NSUB) sMax[((ks + 1) & 1) * NSUB + tid] = 0;  // the other parity's maxima were last read a barrier ago

    // (ii) Operands and the chunk-level outputs. A block is "fast" when every anchor exponent is within
    //      kMaxAnchorLog2 (always, for bounded gates): its A operands are q e^(G_i - G_8), k e^(G_i - G_8), its
    //      diagonal B operand k e^(G_8 - G_j). Otherwise (exact path) its A operands take the block's first row as
    //      anchor and the diagonal block runs on CUDA cores below. The off-diagonal B operands of a later block a are
    //      k_j e^(G_anchor(a) - G_j): this block's suffix sums, the totals strictly between, and a's rows up to its
    //      anchor. Every factor is a sum of gates over exactly the rows it spans (no difference of cumulative sums
    //      beyond the anchored range, where both terms stay within kMaxAnchorLog2).
    if (ew) {
      bool fast_blk[NSUB];
#pragma unroll
      for (int cb = 0; cb < NSUB; ++cb) fast_blk[cb] = __int_as_float(maxs[cb]) <= kMaxAnchorLog2;
      float2 before = make_float2(0.f, 0.f), after = before, fb[NSUB];
      {
        float2 mid = before;
#pragma unroll
        for (int cb = 0; cb < NSUB; ++cb) {
          const float2 t = *reinterpret_cast<const float2*>(sTot + cb * SW + dl);
          fb[cb] = make_float2(0.f, 0.f);
          if (cb < esb) before = before + t;
          if (cb > esb) {
            const float2 l8 =
                fast_blk[cb] ? *reinterpret_cast<const float2*>(sLam8 + cb * SW + dl) : make_float2(0.f, 0.f);
            fb[cb] = exp2_2(mid + l8);
            mid = mid + t;
            after = after + t;
          }
        }
      }
      const bool fast = fast_blk[esb];
      const float2 eA = exp2_2(fast ? before + lam8 : before);  // chunk start -> the A operands' anchor
      const float2 eAs = eA * a.scale, ea = exp2_2(after);
      if (esb == 0) *reinterpret_cast<float2*>(ws_gam + d) = exp2_2(tot + after);
      Elem* tq = sQx + er0 * LDS + dl;
      Elem* tk = sKx + er0 * LDS + dl;
      Elem* gq = ws_qg + er0 * KP + d;
      Elem* gw = ws_w + er0 * KP + d;  // k e^G: read back slice by slice for w, then overwritten
      Elem* gk = ws_kg + er0 * KP + d;
      auto store_kb = [&](int i, float2 kx) {  // this row's off-diagonal B operands for every later block
#pragma unroll
        for (int cb = 1; cb < NSUB; ++cb) {
          if (cb > esb) {
            const float2 v = kx * fb[cb];
            Op::store2(sKb + (kb_offset(cb) + er0 + i) * LDS + dl, v.x, v.y);
          }
        }
      };
      if (fast) {
        Elem* td = sKd + er0 * LDS + dl;
        float2 rho = make_float2(0.f, 0.f);  // gates of the block's rows after row i
#pragma unroll
        for (int i = 15; i >= 0; --i) {
          const float2 qv = raw(sraw_q, qrow, a.q.st, pq, i) * sRq[er0 + i];
          const float2 kv = raw(sraw_k, krow, a.k.st, pq, i) * sRk[er0 + i];
          const float2 s = s9 - rho;  // G_i - G_8, both sums within the anchored range
          const float2 es = exp2_2(s), ems = exp2_2(make_float2(-s.x, -s.y)), kx = kv * exp2_2(rho);
          const float2 aq = qv * es, ak = kv * es, bd = kv * ems;
          Op::store2(tq + i * LDS, aq.x, aq.y);
          Op::store2(tk + i * LDS, ak.x, ak.y);
          Op::store2(td + i * LDS, bd.x, bd.y);
          store_kb(i, kx);
          const float2 oq = aq * eAs, ow = ak * eA, ok = kx * ea;
          Op::store2(gq + i * KP, oq.x, oq.y);
          Op::store2(gw + i * KP, ow.x, ow.y);
          Op::store2(gk + i * KP, ok.x, ok.y);
          rho = rho + x[i];
        }
      } else {
        float2 lam = make_float2(0.f, 0.f);  // gates of rows 0..i
#pragma unroll 1
        for (int i = 0; i < 16; ++i) {
          lam = lam + x[i];
          const float2 qv = raw(sraw_q, qrow, a.q.st, pq, i) * sRq[er0 + i];
          const float2 kv = raw(sraw_k, krow, a.k.st, pq, i) * sRk[er0 + i];
          const float2 e = exp2_2(lam), aq = qv * e, ak = kv * e;
          Op::store2(tq + i * LDS, aq.x, aq.y);
          Op::store2(tk + i * LDS, ak.x, ak.y);
          const float2 oq = aq * eAs, ow = ak * eA;
          Op::store2(gq + i * KP, oq.x, oq.y);
          Op::store2(gw + i * KP, ow.x, ow.y);
        }
        float2 rho = make_float2(0.f, 0.f);
#pragma unroll 1
        for (int i = 15; i >= 0; --i) {
          const float2 kv = raw(sraw_k, krow, a.k.st, pq, i) * sRk[er0 + i];
          const float2 kx = kv * exp2_2(rho), ok = kx * ea;
          store_kb(i, kx);
          Op::store2(gk + i * KP, ok.x, ok.y);
          rho = rho + x[i];
        }
      }
    }
    __syncthreads();

    // (iii) P and L: off-diagonal blocks against the earlier blocks' B operands, then the diagonal block.
    if (has_block && ab > 0) {
      warp_gemm<Elem, 1, NOFF, false, false>(acc, role == 0 ? sQx : sKx, LDS, 16 * ab, sKb + kb_offset(ab) * LDS, LDS,
                                             0, 0, SW / 16, ab);
    }
    if (has_block) {
      if (__int_as_float(maxs[ab]) <= kMaxAnchorLog2) {
        warp_gemm<Elem, 1, 2, false, false>(dacc, role == 0 ? sQx : sKx, LDS, 16 * ab, sKd + 16 * ab * LDS, LDS, 0, 0,
                                            SW / 16);
      } else {
        // Exact path: decay(i, j) = prod_{t=j+1..i} exp2(g_t) per dimension, on CUDA cores, lanes taking dimensions
        // lane + 32 u of the slice. Rare (hard resets, unbounded gates), so it reads q, k and the raw gates again and
        // keeps its [16][17] sums in its block's diagonal B rows, which the fast path alone writes.
        float* ex = reinterpret_cast<float*>(sKd + 16 * ab * LDS) + role * 16 * 17;
        for (int e = lane; e < 16 * 17; e += 32) ex[e] = 0.f;
        __syncwarp();
        for (int u = 0; u < SW / 32; ++u) {
          const int dd = d0 + lane + 32 * u;
          const bool okd = dd < a.K;
          const float bias =
              (a.gate_mode != 0 && a.dt_bias.present() && okd) ? a.dt_bias.load(int64_t(hv) * a.K + dd) : 0.f;
          float kk[16], al[16];
          for (int j = 0; j < 16; ++j) {
            const int r = 16 * ab + j;
            const bool in = okd && r < nrows;
            kk[j] = in ? to_float(kp[a.k.offset(b, row0 + r, h) + dd]) * sRk[r] : 0.f;
            al[j] = in ? fast_exp2(gate(to_float(gp[a.g.offset(b, row0 + r, hv) + dd]) + bias)) : 1.f;
          }
          for (int i = 0; i < 16; ++i) {
            const int r = 16 * ab + i;
            float xi = kk[i];  // q_i (role 0) or k_i (role 1)
            if (role == 0) xi = okd && r < nrows ? to_float(qp[a.q.offset(b, row0 + r, h) + dd]) * sRq[r] : 0.f;
            float dec = 1.f;
            for (int j = i; j >= 0; --j) {
              if (j < i) dec *= al[j + 1];
              const float pp = warp_sum(xi * kk[j] * dec);
              if (lane == 0) ex[i * 17 + j] += pp;
            }
          }
        }
        __syncwarp();
        for_each_acc<1, 2>([&](int, int nt, int e, int row, int col) {
          const bool in = role == 0 ? col <= row : col < row;
          dacc[0][nt].x[e] += in ? ex[row * 17 + col] : 0.f;
        });
      }
    }
    __syncthreads();
  }
  // Phase B's copies, in flight during the epilogue and the inverse: k e^G of every 64-column step from the w tile of
  // the workspace (written in the slice phase; the barriers since order it; each w step then overwrites its columns
  // with w) and v's first two 64-column slices.
  constexpr int NK64 = KP / 64;
  const int VS = a.VP / 64;
  auto stage_v = [&](int it) {  // v columns [64 it, 64 it + 64) into buffer it % 2
    Elem* dst = sVb + (it & 1) * C * L::LD64;
    if constexpr (std::is_same<InT, Elem>::value) {  // raw copy: 16-byte cp.async where aligned and in range
      stage_rows<InT, C, 64>(dst, L::LD64, vp + 64 * it, a.v, b, row0, hv, nrows, min(64, a.V - 64 * it), a.vec_v);
    } else {
      constexpr int PER = C * 64 / NTH;
      float vals[PER];
#pragma unroll
      for (int j = 0; j < PER; ++j) {  // every load issued before any store
        const int e = tid + NTH * j, r = e >> 6, vv = 64 * it + (e & 63);
        vals[j] = (r < nrows && vv < a.V) ? to_float(vp[a.v.offset(b, row0 + r, hv) + vv]) : 0.f;
      }
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        const int e = tid + NTH * j;
        dst[(e >> 6) * L::LD64 + (e & 63)] = to_elem<Elem>(vals[j]);
      }
    }
  };
  {
    constexpr int EPC_E = 16 / sizeof(Elem), PIECES = 64 / EPC_E, STEP = NTH / PIECES;
    static_assert(C % STEP == 0, "whole row steps");
    const int cc = (tid % PIECES) * EPC_E, r0 = tid / PIECES;
#pragma unroll
    for (int st = 0; st < NK64; ++st) {
#pragma unroll
      for (int i = 0; i < C / STEP; ++i) {
        const int r = r0 + i * STEP;
        cp_async16(sKs + (st * C + r) * L::LD64 + cc, ws_w + r * KP + 64 * st + cc);
      }
    }
    stage_v(0);
    if (VS > 1) stage_v(1);
    cp_async_commit();
  }

  // Epilogue of the intra-chunk matrices: Aqk = scale * tril(P) to the workspace, L (strictly lower, rows scaled by
  // beta) to shared memory over the slice scratch (free since the last barrier). Each warp writes whole rows of its
  // row block, zeros above the diagonal included, in pairs (and 16-byte zeros), so no clearing pass is needed.
  if (has_block) {
    const int r0 = 16 * ab, upper = C - 16 * (ab + 1);
    if (role == 0) {
      // bf16 operands: Aqk as hi + lo (the hi tile is the plain rounding). With one token (T = 1) the two S terms of
      // the output largely cancel, and Aqk's rounding is the largest error left (tools/rounding_model.py).
      auto store_a = [&](int off, float x0, float x1) {
        if constexpr (sizeof(Elem) == 2) {
          uint32_t hi, lo;
          split_pack(x0, x1, hi, lo);
          *reinterpret_cast<uint32_t*>(ws_a + off) = hi;
          *reinterpret_cast<uint32_t*>(ws_alo + off) = lo;
        } else {
          Op::store2(ws_a + off, x0, x1);
        }
      };
      for_each_acc<1, NOFF>([&](int, int nt, int e, int row, int col) {
        if (2 * ab > nt && (e & 1) == 0) {
          store_a((r0 + row) * C + col, a.scale * acc[0][nt].x[e], a.scale * acc[0][nt].x[e + 1]);
        }
      });
      for_each_acc<1, 2>([&](int, int nt, int e, int row, int col) {
        if ((e & 1) == 0) {
          store_a((r0 + row) * C + r0 + col, col <= row ? a.scale * dacc[0][nt].x[e] : 0.f,
                  col + 1 <= row ? a.scale * dacc[0][nt].x[e + 1] : 0.f);
        }
      });
      constexpr int EPC_E = 16 / sizeof(Elem);
      const int pieces = upper / EPC_E;
      for (int e = lane; e < 16 * pieces; e += 32) {
        const int off = (r0 + e / pieces) * C + 16 * (ab + 1) + (e % pieces) * EPC_E;
        *reinterpret_cast<uint4*>(ws_a + off) = make_uint4(0u, 0u, 0u, 0u);
        if constexpr (sizeof(Elem) == 2) *reinterpret_cast<uint4*>(ws_alo + off) = make_uint4(0u, 0u, 0u, 0u);
      }
    } else {
      for_each_acc<1, NOFF>([&](int, int nt, int e, int row, int col) {
        if (2 * ab > nt && (e & 1) == 0) {
          const float bt = sBeta[r0 + row];
          *reinterpret_cast<float2*>(sLT + (r0 + row) * L::LDL + col) =
              make_float2(bt * acc[0][nt].x[e], bt * acc[0][nt].x[e + 1]);
        }
      });
      for_each_acc<1, 2>([&](int, int nt, int e, int row, int col) {
        if ((e & 1) == 0) {
          const float bt = sBeta[r0 + row];
          *reinterpret_cast<float2*>(sLT + (r0 + row) * L::LDL + r0 + col) =
              make_float2(col < row ? bt * dacc[0][nt].x[e] : 0.f, col + 1 < row ? bt * dacc[0][nt].x[e + 1] : 0.f);
        }
      });
      for (int e = lane; e < 16 * (upper / 4); e += 32) {
        const int q4 = upper / 4;
        *reinterpret_cast<float4*>(sLT + (r0 + e / q4) * L::LDL + 16 * (ab + 1) + 4 * (e % q4)) =
            make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  }
  __syncthreads();

  // Tm = (I + L)^-1. Diagonal 16x16 blocks by forward substitution (lane j solves column j), in place.
  if (has_block && role == 0) {
    float x[16];
    if (lane < 16) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        float s = i == lane ? 1.f : 0.f;
#pragma unroll
        for (int mm = 0; mm < 16; ++mm) {
          if (mm < i) s -= sLT[(16 * ab + i) * L::LDL + 16 * ab + mm] * x[mm];
        }
        x[i] = s;
      }
    }
    __syncwarp();
    if (lane < 16) {
#pragma unroll
      for (int i = 0; i < 16; ++i) sLT[(16 * ab + i) * L::LDL + 16 * ab + lane] = x[i];
    }
  }
  __syncthreads();
  // Off-diagonal blocks by doubling, [A 0; B D]^-1 = [A^-1 0; -D^-1 B A^-1, D^-1]: 16-row pairs, then (C = 64) the
  // 32-row halves. The products run on the tensor cores with fp32 operands split as hi + lo bf16 (about 16
  // significant bits, the float-input path's precision). A warp owns 8 columns of a level's result and keeps
  // Y = B A^-1 in a private scratch tile; the block's readers finish before any result overwrites B.
  static_assert(NSUB == 2 || NSUB == 4, "the doubling inverse covers chunks of 32 or 64 rows");
  inverse_level<C, L::LDL, L::LDY, 1>(sLT, sY);
  if constexpr (NSUB == 4) inverse_level<C, L::LDL, L::LDY, 2>(sLT, sY);
  // Tm * diag(beta) as the A operand of w and u.
  for (int e = tid; e < C * C / 2; e += NTH) {
    const int i = e / (C / 2), j = 2 * (e % (C / 2));
    const float2 t = *reinterpret_cast<const float2*>(sLT + i * L::LDL + j);
    Op::store2(sTb + i * L::LDC + j, j <= i ? t.x * sBeta[j] : 0.f, j + 1 <= i ? t.y * sBeta[j + 1] : 0.f);
  }
  // w = Tm diag(beta) (k exp2(G)) by role-0 warps and u = Tm diag(beta) v by role-1 warps, 64 columns a step.
  cp_async_wait<0>();
  __syncthreads();
  for (int it = 0; it < (NK64 > VS ? NK64 : VS); ++it) {
    if (it >= 2 && it < VS) {  // V > 128: the later v slices take turns in the two buffers
      __syncthreads();         // step it - 2 is done with the buffer
      stage_v(it);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
    }
    const bool w_step = role == 0 && it < NK64, u_step = role == 1 && it < VS;
    if (has_block && (w_step || u_step)) {
      FragC out[1][8];
#pragma unroll
      for (int i = 0; i < 8; ++i) out[0][i].zero();
      const Elem* bsrc = w_step ? sKs + it * C * L::LD64 : sVb + (it & 1) * C * L::LD64;
      warp_gemm<Elem, 1, 8, false, true>(out, sTb, L::LDC, 16 * ab, bsrc, L::LD64, 0, 0, ab + 1);
      Elem* dst = w_step ? ws_w + (16 * ab) * KP + 64 * it : ws_u + (16 * ab) * a.VP + 64 * it;
      const int ldd = w_step ? KP : a.VP;
      for_each_acc<1, 8>([&](int, int nt, int e, int row, int col) {
        if ((e & 1) == 0) Op::store2(dst + row * ldd + col, out[0][nt].x[e], out[0][nt].x[e + 1]);
      });
    }
  }
}

// ---- recurrence ------------------------------------------------------------------------------------------

template <typename Elem, int KP, int BV, bool ONE_STAGE = false>
struct RecurrenceLayout {
  static constexpr int PAD = smem_pad<Elem>();
  static constexpr int LDK = KP + PAD, LDB = BV + PAD, LDA = 64 + PAD;
  // Two stages (the next chunk's tiles prefetched) where they fit; 128-column tiles (one CTA per head: a single wave
  // where 64-column tiles would need 1-2) fit one.
  // ONE_STAGE: devices with less shared memory per block than Hopper (A100, sm_86/89) drop the prefetch stage.
  static constexpr int STAGES = (!ONE_STAGE && sizeof(Elem) == 2 && KP <= 128 && BV <= 64) ? 2 : 1;
  // Split operands at K = 256 do not fit three [64][KP] tiles: w, qg and kg then take turns in one buffer.
  static constexpr bool ONE_TILE = sizeof(Elem) == 4 && KP > 128;
  static constexpr int TILES = ONE_TILE ? 1 : 3;
  // bf16 operands also take Aqk's lo tile (Aqk v_new on hi + lo; see the prepare kernel's epilogue).
  static constexpr bool SPLIT_A = sizeof(Elem) == 2;
  static constexpr size_t stage_bytes() {
    return sizeof(Elem) * (TILES * 64 * LDK + 64 * LDB + (SPLIT_A ? 2 : 1) * 64 * LDA) + 4 * KP;
  }
  static constexpr size_t stage_stride() { return (stage_bytes() + 15) & ~size_t(15); }
  // bf16 operands keep the chunk-start state as hi + lo tiles (two MMAs for w S and qg S): rounded once to bf16,
  // the state's error would dominate outputs that are mostly the initial-state term (T = 1).
  static constexpr bool SPLIT_S = sizeof(Elem) == 2;
  static constexpr size_t bytes() {
    return STAGES * stage_stride() + sizeof(Elem) * ((SPLIT_S ? 2 : 1) * KP * LDB + 64 * LDB) + 64;
  }
};

// Warps: warp = (row group w4 in 0..3) + 4 * (column group). Each warp owns 16 chunk rows of v_new and o and
// KP/4 state rows, for its column group of the CTA's BV value columns: 16 columns per warp from BV = 32 on (16 warps
// at BV = 64: the chunk step is a latency chain, and more warps per scheduler hide more of it), 8 at BV = 16.
template <int BV>
struct RecurrenceWarps {
  static constexpr int GROUPS = BV >= 64 ? 4 : 2;
  static constexpr int THREADS = 128 * GROUPS;
  static constexpr int COLS = BV / GROUPS;  // columns per warp
};

// Finds the sequence of segment slot g (seg_offsets[n] <= g < seg_offsets[n+1]; without cuts the g-th sequence of
// seq_order where it is given); false past the last segment.
__device__ __forceinline__ bool segment_sequence(const ForwardArgs& a, int64_t g, int& n, int64_t& s) {
  if (a.seg_offsets == nullptr) {
    n = a.seq_order != nullptr ? a.seq_order[g] : static_cast<int>(g);
    s = 0;
    return true;
  }
  if (g >= a.seg_offsets[a.N]) return false;
  int lo = 0, hi = a.N;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (a.seg_offsets[mid] <= g) lo = mid; else hi = mid;
  }
  n = lo;
  s = g - a.seg_offsets[lo];
  return true;
}

// A recurrence CTA's work: blockIdx.x = (segment slot, v-head, tile), tiles fastest; the sequence, its chunks in this
// segment, and whether the tile is a transition tile (SCAN: the K / BV extra tiles that give M). False when the CTA
// has nothing to do (past the last segment; the scan of a sequence's last segment; M of segment 0).
struct RecurrenceTile {
  int VT, tile, hv, n, vt, ncols;  // ncols: valid columns (value rows) of this tile's kind
  int64_t gseg, seg, b, t0, len, nch_all, c_begin, c_end, base;
  bool trans;
};
template <int KP, int BV, bool SCAN>
__device__ __forceinline__ bool recurrence_tile(const ForwardArgs& a, RecurrenceTile& w) {
  const int C = a.chunk;
  w.VT = (a.V + BV - 1) / BV;
  const int TILES = SCAN ? w.VT + KP / BV : w.VT;
  int64_t idx = blockIdx.x;
  w.tile = static_cast<int>(idx % TILES);
  idx /= TILES;
  w.hv = static_cast<int>(idx % a.HV);
  w.gseg = idx / a.HV;  // segment slot
  if (!segment_sequence(a, w.gseg, w.n, w.seg)) return false;
  a.sequence(w.n, w.b, w.t0, w.len);
  w.nch_all = (w.len + C - 1) / C;
  int64_t per;
  const int64_t nseg = a.segments_of(w.nch_all, per);
  w.c_begin = w.seg * per;
  w.c_end = min(w.nch_all, w.c_begin + per);  // this segment's chunks
  w.trans = SCAN && w.tile >= w.VT;
  if (SCAN && (w.seg == nseg - 1 || (w.trans && w.seg == 0))) return false;  // no scan of last segments; seg 0: no M
  w.vt = w.trans ? w.tile - w.VT : w.tile;
  w.ncols = w.trans ? a.K : a.V;
  w.base = a.chunk_offsets[w.n];
  return true;
}

// A recurrence stage in shared memory: one chunk's workspace tiles, laid out by each kernel's layout.
template <typename Elem>
struct RecurrenceStage {
  Elem *w, *q, *k, *u, *a, *alo;
  float* gam;
};

// Rows [0, C) of a [C][KP] workspace tile into a stage tile of row stride LDK: a compile-time number of steps over the
// 64-row maximum (unrolled, constant address steps).
template <typename Elem, int KP, int LDK, int NT>
__device__ __forceinline__ void copy_ws_tile(Elem* dst, const Elem* src, int C) {
  constexpr int EPC = 16 / sizeof(Elem), KC = KP / EPC;
#pragma unroll
  for (int i = 0; i < (64 * KC + NT - 1) / NT; ++i) {
    const int e = threadIdx.x + i * NT, r = e / KC, c = (e % KC) * EPC;
    if (r < C) cp_async16(dst + r * LDK + c, src + r * KP + c);
  }
}

// Rows [0, C) of a [C][KC] workspace tile into a swizzled stage tile (wgmma.cuh, bf16): each 8 lanes copy one
// 128-byte row (a permutation of one row's pieces in shared memory: no bank conflicts).
template <typename Elem, int KC, int NT>
__device__ __forceinline__ void copy_ws_swizzled(Elem* dst, const Elem* src, int C) {
  static_assert(sizeof(Elem) == 2, "swizzled stage tiles hold bf16 operands");
  constexpr int KB = KC / 8, RS = NT / KB;  // 16-byte pieces per row; rows per pass (a multiple of 8: same swizzle)
  static_assert(NT % KB == 0 && RS % 8 == 0 && 64 % RS == 0, "whole 8-row groups per pass");
  const int r = threadIdx.x / KB, c = (threadIdx.x % KB) * 8;
  Elem* d = dst + swizzled_offset(r, c);
  const Elem* g = src + r * KC + c;
#pragma unroll
  for (int i = 0; i < 64 / RS; ++i) {
    if (r + i * RS < C) cp_async16(d + i * RS * 64, g + i * RS * KC);
  }
}

// Chunk ci's workspace tiles into stage t as one commit group: w; qg (not SCAN) and kg unless ONE_TILE (they take
// turns in w's buffer later); the tile's BV columns of u (transition tiles have u = 0); Aqk and its lo tile (not
// SCAN); gamma. SWIZZLED: w, qg, kg, Aqk in the swizzled layout of the warpgroup MMAs (chunk 64), else row-major
// with row strides LDK / LDA.
template <typename Elem, int KP, int BV, int NT, int LDK, int LDB, int LDA, bool SPLIT_A, bool ONE_TILE, bool SCAN,
          bool SWIZZLED = false>
__device__ __forceinline__ void issue_chunk(const ForwardArgs& a, const RecurrenceTile& rt, int64_t ci,
                                            const RecurrenceStage<Elem>& t) {
  constexpr int EPC = 16 / sizeof(Elem);
  const int C = a.chunk, tid = threadIdx.x;
  const int64_t wtile = (rt.base + ci) * a.HV + rt.hv;
  auto tile_of = [&](void* ws) { return static_cast<const Elem*>(ws) + wtile * C * KP; };
  if constexpr (SWIZZLED) {
    copy_ws_swizzled<Elem, KP, NT>(t.w, tile_of(a.ws_w), C);
    if constexpr (!SCAN) copy_ws_swizzled<Elem, KP, NT>(t.q, tile_of(a.ws_qg), C);
    copy_ws_swizzled<Elem, KP, NT>(t.k, tile_of(a.ws_kg), C);
  } else {
    copy_ws_tile<Elem, KP, LDK, NT>(t.w, tile_of(a.ws_w), C);
    if constexpr (!ONE_TILE) {
      if constexpr (!SCAN) copy_ws_tile<Elem, KP, LDK, NT>(t.q, tile_of(a.ws_qg), C);
      copy_ws_tile<Elem, KP, LDK, NT>(t.k, tile_of(a.ws_kg), C);
    }
  }
  if (!rt.trans) {
    const Elem* gu = static_cast<const Elem*>(a.ws_u) + wtile * C * a.VP + rt.vt * BV;
    constexpr int BC = BV / EPC;
#pragma unroll
    for (int i = 0; i < (64 * BC + NT - 1) / NT; ++i) {
      const int e = tid + i * NT, r = e / BC, c = (e % BC) * EPC;
      if (r < C) cp_async16(t.u + r * LDB + c, gu + r * a.VP + c);
    }
  }
  if constexpr (!SCAN && SWIZZLED) {
    copy_ws_swizzled<Elem, 64, NT>(t.a, static_cast<const Elem*>(a.ws_a) + wtile * C * C, C);
    copy_ws_swizzled<Elem, 64, NT>(t.alo, static_cast<const Elem*>(a.ws_alo) + wtile * C * C, C);
  } else if constexpr (!SCAN) {
    const Elem* ga = static_cast<const Elem*>(a.ws_a) + wtile * C * C;
    const Elem* galo = static_cast<const Elem*>(a.ws_alo) + wtile * C * C;
    const int AC = C / EPC;
    for (int e = tid; e < C * AC; e += NT) {
      const int r = e / AC, c = (e % AC) * EPC;
      cp_async16(t.a + r * LDA + c, ga + r * C + c);
      if constexpr (SPLIT_A) cp_async16(t.alo + r * LDA + c, galo + r * C + c);
    }
  }
  const float* gg = a.ws_gam + wtile * KP;
  for (int e = tid; e < KP / 4; e += NT) cp_async16(t.gam + 4 * e, gg + 4 * e);
  cp_async_commit();
}

// SCAN = false: the recurrence of one segment (the whole sequence unless it is cut) for one V tile: outputs,
// intermediate states, and the final state from the last segment; the start state is the caller's (segment 0) or the
// merged one. SCAN = true: the context-parallel pre-scan of a segment that is not a sequence's last: no outputs; the
// value tiles run from zero (segment 0: from the caller's state) and give E; the K / BV extra "transition" tiles
// run the same recurrence with u = 0 from the identity and give M. Both end in ws_seg.
template <typename Elem, int KP, int BV, bool SCAN, bool ONE_STAGE = false>
__global__ void __launch_bounds__(RecurrenceWarps<BV>::THREADS) recurrence_kernel(const ForwardArgs a) {
  using L = RecurrenceLayout<Elem, KP, BV, ONE_STAGE>;
  using Op = Operand<Elem>;
  constexpr int NT = RecurrenceWarps<BV>::THREADS;
  constexpr int HB = RecurrenceWarps<BV>::COLS;  // columns per warp
  constexpr int MT = KP / 64, NTV = HB / 8, ROWS = KP / 4;
  const int C = a.chunk;
  RecurrenceTile rt;
  if (!recurrence_tile<KP, BV, SCAN>(a, rt)) return;
  const int VT = rt.VT, hv = rt.hv, n = rt.n, vt = rt.vt, ncols = rt.ncols;
  const int64_t gseg = rt.gseg, seg = rt.seg, b = rt.b, t0 = rt.t0, len = rt.len, nch_all = rt.nch_all;
  const int64_t c_begin = rt.c_begin, c_end = rt.c_end, base = rt.base;
  const bool trans = rt.trans;
  const int tid = threadIdx.x, warp = tid >> 5, w4 = warp & 3, cb = (warp >> 2) * HB;
  const int v0 = vt * BV + cb;  // this warp's first value (or key, for transition tiles) column
  // ws_seg rows of a segment slot: columns [0, VT*BV) values, then the K transition columns.
  auto seg_row = [&](int64_t g, int d) { return a.ws_seg + ((g * a.HV + hv) * KP + d) * a.seg_ld; };
  const int seg_col0 = trans ? VT * BV : 0;

  extern __shared__ __align__(16) char smem_raw[];
  using Stage = RecurrenceStage<Elem>;
  auto stage = [&](int st) {
    Stage t;
    char* p = smem_raw + st * L::stage_stride();
    t.w = reinterpret_cast<Elem*>(p);
    t.q = L::ONE_TILE ? t.w : t.w + 64 * L::LDK;
    t.k = L::ONE_TILE ? t.w : t.q + 64 * L::LDK;
    t.u = t.w + L::TILES * 64 * L::LDK;
    t.a = t.u + 64 * L::LDB;
    t.alo = t.a + 64 * L::LDA;  // SPLIT_A only
    t.gam = reinterpret_cast<float*>(t.a + (L::SPLIT_A ? 2 : 1) * 64 * L::LDA);
    return t;
  };
  Elem* sS = reinterpret_cast<Elem*>(smem_raw + L::STAGES * L::stage_stride());  // [KP][LDB]
  Elem* sSlo = sS + KP * L::LDB;                                                 // [KP][LDB] (SPLIT_S)
  Elem* sVn = sS + (L::SPLIT_S ? 2 : 1) * KP * L::LDB;                           // [64][LDB]

  // Slots: read initial_state[slot] and write final_state[slot]; -1 neither.
  int64_t slot = n;
  if (a.state_indices.present()) slot = a.state_indices.load_int(n);
  const bool read = seg == 0 && a.initial.ptr.present() && slot >= 0 &&
                    (!a.has_initial_state.present() || a.has_initial_state.load_int(n) != 0);
  const bool write = !SCAN && c_end == nch_all && a.final_state.ptr.present() && slot >= 0;

  // The start state: the caller's (segment 0), the merged one (later segments: S_start(s) sits in slot g - 1), zero
  // (scan value tiles of later segments) or the identity (transition tiles).
  FragC S[MT][NTV];
  for_each_acc<MT, NTV>([&](int mt, int nt, int e, int row, int col) {
    const int d = w4 * ROWS + row, v = v0 + col;
    float x = 0.f;
    if (trans) {
      x = d == v && d < a.K ? 1.f : 0.f;
    } else if (d < a.K && v < a.V) {
      if (read) x = a.initial.ptr.load(a.initial.offset(slot, hv, d, v, a.K, a.V, a.vk));
      else if (!SCAN && seg > 0) x = seg_row(gseg - 1, d)[v];
    }
    S[mt][nt].x[e] = x;
  });

  auto issue = [&](int64_t ci, int st) {  // in ONE_TILE mode only w of the three [C][KP] tiles
    issue_chunk<Elem, KP, BV, NT, L::LDK, L::LDB, L::LDA, L::SPLIT_A, L::ONE_TILE, SCAN>(a, rt, ci, stage(st));
  };
  auto reload = [&](Elem* dst, void* ws, int64_t ci) {  // ONE_TILE: swap the next tile in
    __syncthreads();
    copy_ws_tile<Elem, KP, L::LDK, NT>(dst, static_cast<const Elem*>(ws) + ((base + ci) * a.HV + hv) * C * KP, C);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
  };

  if (c_begin < c_end) issue(c_begin, 0);
  for (int64_t ci = c_begin; ci < c_end; ++ci) {
    const int st = L::STAGES == 2 ? static_cast<int>((ci - c_begin) & 1) : 0;
    cp_async_wait<0>();
    __syncthreads();  // chunk ci visible; every warp is done with chunk ci-1
    if (L::STAGES == 2 && ci + 1 < c_end) issue(ci + 1, st ^ 1);
    const Stage t = stage(st);
    const int nrows = static_cast<int>(min(static_cast<int64_t>(C), len - ci * C));

    // The chunk-start state: to the intermediate states, to shared memory (B operand), then decayed.
    const bool inter = !SCAN && a.inter.present();
    const int64_t inter_base = a.cu_seqlens.present() ? (base + ci) * a.inter_sc : b * a.inter_sb + ci * a.inter_sc;
    if (inter) {
      for_each_acc<MT, NTV>([&](int mt, int nt, int e, int row, int col) {
        const int d = w4 * ROWS + row, v = v0 + col;
        if (d < a.K && v < a.V) {
          a.inter.store(inter_base + hv * a.inter_sh + (a.vk ? int64_t(v) * a.K + d : int64_t(d) * a.V + v),
                        S[mt][nt].x[e]);
        }
      });
    }
    for_each_acc<MT, NTV>([&](int mt, int nt, int e, int row, int col) {
      const int d = w4 * ROWS + row;
      if ((e & 1) == 0) {
        const float x0 = S[mt][nt].x[e], x1 = S[mt][nt].x[e + 1];
        if constexpr (L::SPLIT_S) {
          uint32_t hi, lo;
          split_pack(x0, x1, hi, lo);
          *reinterpret_cast<uint32_t*>(sS + d * L::LDB + cb + col) = hi;
          *reinterpret_cast<uint32_t*>(sSlo + d * L::LDB + cb + col) = lo;
        } else {
          Op::store2(sS + d * L::LDB + cb + col, x0, x1);
        }
      }
    });
    {
      // A thread's accumulators cover 2 * MT state rows: load each row's decay once.
      const int g = (threadIdx.x & 31) >> 2;
      float gam[MT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        gam[mt][0] = t.gam[w4 * ROWS + 16 * mt + g];
        gam[mt][1] = t.gam[w4 * ROWS + 16 * mt + g + 8];
      }
      for_each_acc<MT, NTV>([&](int mt, int nt, int e, int, int) { S[mt][nt].x[e] *= gam[mt][e >> 1]; });
    }
    __syncthreads();

    // v_new = u - w S and o = qg S for this warp's 16 rows and columns.
    FragC vn[1][NTV], o[1][NTV];
#pragma unroll
    for (int i = 0; i < NTV; ++i) { vn[0][i].zero(); o[0][i].zero(); }
    const bool rows_here = 16 * w4 < C;
    if (rows_here) {
      constexpr int NP = NTV > 1 ? NTV / 2 : 1;
      warp_gemm<Elem, 1, NTV, false, true, L::SPLIT_S>(vn, t.w, L::LDK, 16 * w4, sS + cb, L::LDB, 0, 0, KP / 16, NP,
                                                       sSlo + cb);
      if constexpr (!L::ONE_TILE && !SCAN) {
        warp_gemm<Elem, 1, NTV, false, true, L::SPLIT_S>(o, t.q, L::LDK, 16 * w4, sS + cb, L::LDB, 0, 0, KP / 16, NP,
                                                         sSlo + cb);
      }
      for_each_acc<1, NTV>([&](int, int nt, int e, int row, int col) {
        if ((e & 1) == 0) {
          const int r = 16 * w4 + row, c = cb + col;
          float u0 = 0.f, u1 = 0.f;
          if (!trans) u0 = to_float(t.u[r * L::LDB + c]), u1 = to_float(t.u[r * L::LDB + c + 1]);
          Op::store2(sVn + r * L::LDB + c, u0 - vn[0][nt].x[e], u1 - vn[0][nt].x[e + 1]);
        }
      });
    }
    if constexpr (L::ONE_TILE && !SCAN) {
      reload(t.w, a.ws_qg, ci);
      if (rows_here) warp_gemm<Elem, 1, NTV, false, true>(o, t.w, L::LDK, 16 * w4, sS + cb, L::LDB, 0, 0, KP / 16);
    } else {
      __syncthreads();
    }
    if (!SCAN && rows_here) {
      if constexpr (L::SPLIT_A) {
        warp_gemm<Elem, 1, NTV, false, true>(o, t.alo, L::LDA, 16 * w4, sVn + cb, L::LDB, 0, 0, w4 + 1);
      }
      warp_gemm<Elem, 1, NTV, false, true>(o, t.a, L::LDA, 16 * w4, sVn + cb, L::LDB, 0, 0, w4 + 1);
      const int64_t orow0 = b * a.out_sb + (t0 + ci * C) * a.out_st + hv * a.out_sh;
      with_typed(a.out, [&](auto* op) {
        using OutT = std::remove_pointer_t<decltype(op)>;
        for_each_acc<1, NTV>([&](int, int nt, int e, int row, int col) {
          const int r = 16 * w4 + row, v = v0 + col;
          if (r < nrows && v < a.V) op[orow0 + r * a.out_st + v] = from_float<OutT>(o[0][nt].x[e]);
        });
      });
    }
    // S += kg^T v_new for this warp's state rows and columns.
    if constexpr (L::ONE_TILE) reload(t.w, a.ws_kg, ci);
    warp_gemm<Elem, MT, NTV, true, true>(S, t.k, L::LDK, w4 * ROWS, sVn + cb, L::LDB, 0, 0, C / 16);
    if (L::STAGES == 1 && ci + 1 < c_end) {
      __syncthreads();
      issue(ci + 1, 0);
    }
  }
  if (SCAN) {  // E (value tiles) or M (transition tiles) of this segment
    for_each_acc<MT, NTV>([&](int mt, int nt, int e, int row, int col) {
      const int d = w4 * ROWS + row, v = v0 + col;
      if (d < KP && v < ncols) seg_row(gseg, d)[seg_col0 + v] = S[mt][nt].x[e];
    });
  }
  if (write) {
    for_each_acc<MT, NTV>([&](int mt, int nt, int e, int row, int col) {
      const int d = w4 * ROWS + row, v = v0 + col;
      if (d < a.K && v < a.V) {
        a.final_state.ptr.store(a.final_state.offset(slot, hv, d, v, a.K, a.V, a.vk), S[mt][nt].x[e]);
      }
    });
  }
}

// ---- recurrence with value rows per warp (K <= 128) ---------------------------------------------------------
// The same chunk step with the state transposed: warp w of a CTA owns value rows [16 w, 16 w + 16) of the CTA's BV
// columns for every key (S^T: 16 x KP fp32 accumulators). An accumulator tile pair (m16 x n8, n8) is laid out as an
// m16 x k16 A fragment, so each product takes the state or v_new as its A operand straight from registers and only
// the workspace tiles (w, qg, kg, Aqk) are B operands from shared memory:
//   v_new^T = u^T - S^T w^T,   o^T = S^T qg^T + v_new^T Aqk^T,   S^T = S^T diag(gamma) + v_new^T kg.
// The warps share nothing within a chunk step: no state tiles in shared memory, no barrier but the stage hand-over,
// and half the shared-memory reads of recurrence_kernel's 16 x 16 warp tiles (whose S and v_new operands went through
// shared memory and were read by four warps each). Products, roundings and their k order are those of
// recurrence_kernel (bf16 operands: the chunk-start state as hi + lo, v_new rounded once, Aqk as hi + lo).
// KP <= 128: the state takes KP / 2 registers per thread.
// WG (Hopper, bf16, chunk 64, BV = 64 or 128): the same products as warpgroup MMAs (wgmma.cuh): each group of four
// warps (64 value rows) issues them together with its register A fragments, and the workspace tiles, stored in the
// 128-byte-swizzled layout, are read from shared memory once per warpgroup instead of once per warp (ldmatrix). The
// MMAs run asynchronously: the state's decay overlaps the first products.
template <typename Elem, int KP, int BV, bool ONE_STAGE = false, bool WG = false>
struct VrowsLayout {
  static_assert(!WG || (sizeof(Elem) == 2 && BV % 64 == 0), "warpgroup MMAs: bf16 operands, whole warpgroups");
  static constexpr int PAD = smem_pad<Elem>();
  static constexpr int LDK = WG ? KP : KP + PAD, LDB = BV + PAD, LDA = WG ? 64 : 64 + PAD;
  static constexpr int WARPS = BV / 16, THREADS = 32 * WARPS;
  // Two stages (the next chunk's tiles prefetched) for bf16 operands; ONE_STAGE for devices with less shared memory.
  static constexpr int STAGES = (!ONE_STAGE && sizeof(Elem) == 2) ? 2 : 1;
  static constexpr bool SPLIT_A = sizeof(Elem) == 2;  // Aqk's lo tile (bf16 operands)
  static constexpr size_t stage_bytes() {
    return sizeof(Elem) * (3 * 64 * LDK + 64 * LDB + (SPLIT_A ? 2 : 1) * 64 * LDA) + 4 * KP;
  }
  // WG: the swizzled tiles (w, qg, kg at 64 * KP, u, Aqk, its lo tile) start at multiples of 1024 bytes from a base
  // aligned in the kernel (hence the 1 KB of slack).
  static constexpr size_t ALIGN = WG ? 1024 : 16;
  static_assert(!WG || (64 * LDB * sizeof(Elem)) % 1024 == 0, "u tile keeps the swizzled tiles 1024-byte aligned");
  static constexpr size_t stage_stride() { return (stage_bytes() + ALIGN - 1) & ~(ALIGN - 1); }
  // WG: a [64][LDB] bf16 tile after the stages stages the outputs (ForwardArgs::vec_out).
  static constexpr size_t bytes() { return STAGES * stage_stride() + (WG ? 1024 + 64 * LDB * sizeof(Elem) : 0); }
};

// The A fragment (m16 x k16) of accumulator n-tiles c0 (k 0..7) and c1 (k 8..15): split into hi + lo bf16 (a[0],
// a[1]) or rounded once to bf16 (a[0]).
template <bool SPLIT>
__device__ __forceinline__ void acc_to_a(const FragC& c0, const FragC& c1, FragA (&a)[SPLIT ? 2 : 1]) {
  if constexpr (SPLIT) {
    split_pack(c0.x[0], c0.x[1], a[0].x[0], a[1].x[0]);
    split_pack(c0.x[2], c0.x[3], a[0].x[1], a[1].x[1]);
    split_pack(c1.x[0], c1.x[1], a[0].x[2], a[1].x[2]);
    split_pack(c1.x[2], c1.x[3], a[0].x[3], a[1].x[3]);
  } else {
    a[0].x[0] = pack_bf16(c0.x[0], c0.x[1]);
    a[0].x[1] = pack_bf16(c0.x[2], c0.x[3]);
    a[0].x[2] = pack_bf16(c1.x[0], c1.x[1]);
    a[0].x[3] = pack_bf16(c1.x[2], c1.x[3]);
  }
}

// c += A B with A split as hi + lo (the state): bf16 operands B in one part (lo product first), float operands B
// split too (Operand<float>::mma, three MMAs).
template <typename Elem>
__device__ __forceinline__ void mma_split_a(FragC& c, const FragA (&a)[2], const FragB (&b)[Operand<Elem>::kSplit]) {
  if constexpr (sizeof(Elem) == 2) {
    mma_bf16(c, a[1], b[0]);
    mma_bf16(c, a[0], b[0]);
  } else {
    Operand<Elem>::mma(c, a, b);
  }
}

// SCAN as in recurrence_kernel (the context-parallel pre-scan: E from value tiles, M from transition tiles).
template <typename Elem, int KP, int BV, bool SCAN, bool ONE_STAGE = false, bool WG = false>
__global__ void __launch_bounds__(VrowsLayout<Elem, KP, BV>::THREADS) recurrence_vrows_kernel(const ForwardArgs a) {
  using L = VrowsLayout<Elem, KP, BV, ONE_STAGE, WG>;
  using Op = Operand<Elem>;
  static_assert(KP <= 128, "the transposed state holds KP / 2 registers per thread");
  constexpr int NT = L::THREADS;
  constexpr int ND = KP / 8;   // state n-tiles (keys)
  constexpr int NC = 64 / 8;   // chunk-row n-tiles at the 64-row maximum
  constexpr int SP = Op::kSplit;
  constexpr bool SPLIT_V = sizeof(Elem) == 4;  // v_new as an A operand: split (float operands) or rounded once
  const int C = a.chunk;
  RecurrenceTile rt;
  if (!recurrence_tile<KP, BV, SCAN>(a, rt)) return;
  const int VT = rt.VT, hv = rt.hv, n = rt.n, vt = rt.vt, ncols = rt.ncols;
  const int64_t gseg = rt.gseg, seg = rt.seg, b = rt.b, t0 = rt.t0, len = rt.len, nch_all = rt.nch_all;
  const int64_t c_begin = rt.c_begin, c_end = rt.c_end, base = rt.base;
  const bool trans = rt.trans;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int r0 = 16 * warp;     // this warp's first row within the tile
  const int v0 = vt * BV + r0;  // ... as a value (or key, for transition tiles) index
  auto seg_row = [&](int64_t g, int d) { return a.ws_seg + ((g * a.HV + hv) * KP + d) * a.seg_ld; };
  const int seg_col0 = trans ? VT * BV : 0;

  extern __shared__ __align__(16) char smem_raw[];
  char* const smem = smem_raw + ((L::ALIGN - (smem_addr(smem_raw) & (L::ALIGN - 1))) & (L::ALIGN - 1));
  using Stage = RecurrenceStage<Elem>;
  auto stage = [&](int st) {
    Stage t;
    char* p = smem + st * L::stage_stride();
    t.w = reinterpret_cast<Elem*>(p);
    t.q = t.w + 64 * L::LDK;
    t.k = t.q + 64 * L::LDK;
    t.u = t.k + 64 * L::LDK;
    t.a = t.u + 64 * L::LDB;
    t.alo = t.a + 64 * L::LDA;  // SPLIT_A only
    t.gam = reinterpret_cast<float*>(t.a + (L::SPLIT_A ? 2 : 1) * 64 * L::LDA);
    return t;
  };
  Elem* const sO = reinterpret_cast<Elem*>(smem + L::STAGES * L::stage_stride());  // WG: [64][LDB] outputs

  int64_t slot = n;
  if (a.state_indices.present()) slot = a.state_indices.load_int(n);
  const bool read = seg == 0 && a.initial.ptr.present() && slot >= 0 &&
                    (!a.has_initial_state.present() || a.has_initial_state.load_int(n) != 0);
  const bool write = !SCAN && c_end == nch_all && a.final_state.ptr.present() && slot >= 0;

  // S^T: accumulator (nd, e) holds value row v0 + row, key col (for_each_acc coordinates). State accesses switch on
  // the dtype once (with_typed), not per element: this code runs once per CTA from a cold instruction cache, and a
  // switch per element made it ~70 KB.
  FragC S[ND];
  auto state_at = [&](int d, int v) { return a.vk ? int64_t(v) * a.K + d : int64_t(d) * a.V + v; };
  if (!trans && read) {
    with_typed(a.initial.ptr, [&](const auto* sp) {
      sp += slot * a.initial.slot_stride + hv * a.initial.head_stride;
      for_each_acc<1, ND>([&](int, int nd, int e, int row, int d) {
        const int v = v0 + row;
        S[nd].x[e] = d < a.K && v < a.V ? static_cast<float>(sp[state_at(d, v)]) : 0.f;
      });
    });
  } else {
    for_each_acc<1, ND>([&](int, int nd, int e, int row, int d) {
      const int v = v0 + row;
      float x = 0.f;
      if (trans) x = d == v && d < a.K ? 1.f : 0.f;
      else if (!SCAN && seg > 0 && d < a.K && v < a.V) x = seg_row(gseg - 1, d)[v];
      S[nd].x[e] = x;
    });
  }

  auto issue = [&](int64_t ci, int st) {
    issue_chunk<Elem, KP, BV, NT, L::LDK, L::LDB, L::LDA, L::SPLIT_A, false, SCAN, WG>(a, rt, ci, stage(st));
  };
  // S^T = S^T diag(gamma).
  auto decay = [&](const Stage& t) {
    const int t2 = 2 * (lane & 3);
#pragma unroll
    for (int nd = 0; nd < ND; ++nd) {
      const float2 gm = *reinterpret_cast<const float2*>(t.gam + 8 * nd + t2);
      S[nd].x[0] *= gm.x;
      S[nd].x[1] *= gm.y;
      S[nd].x[2] *= gm.x;
      S[nd].x[3] *= gm.y;
    }
  };

  const int NCC = C / 8;  // chunk-row n-tiles of this chunk size (WG: 8)
  if (c_begin < c_end) issue(c_begin, 0);
  for (int64_t ci = c_begin; ci < c_end; ++ci) {
    const int st = L::STAGES == 2 ? static_cast<int>((ci - c_begin) & 1) : 0;
    cp_async_wait<0>();
    if constexpr (WG) fence_proxy_async();  // the MMAs read the stage through the asynchronous proxy
    __syncthreads();  // chunk ci visible; every warp is done with chunk ci-1's stage
    if (L::STAGES == 2 && ci + 1 < c_end) issue(ci + 1, st ^ 1);
    const Stage t = stage(st);
    const int nrows = static_cast<int>(min(static_cast<int64_t>(C), len - ci * C));

    if (!SCAN && a.inter.present()) {  // the chunk-start state
      const int64_t inter_base =
          a.cu_seqlens.present() ? (base + ci) * a.inter_sc : b * a.inter_sb + ci * a.inter_sc;
      with_typed(a.inter, [&](auto* ip) {
        using IT = std::remove_pointer_t<decltype(ip)>;
        ip += inter_base + hv * a.inter_sh;
        for_each_acc<1, ND>([&](int, int nd, int e, int row, int d) {
          const int v = v0 + row;
          if (d < a.K && v < a.V) ip[state_at(d, v)] = from_float<IT>(S[nd].x[e]);
        });
      });
    }

    // v_new^T = u^T - S^T w^T and o^T = S^T qg^T: the state's A fragment split once per key step, both products.
    FragC vn[NC], o[NC];
#pragma unroll
    for (int i = 0; i < NC; ++i) { vn[i].zero(); o[i].zero(); }
    if constexpr (WG) {
      // Every key step's A fragments first (they stay untouched until the MMAs are done), then per key step the lo
      // products and the hi products, as below.
      FragA sa[KP / 16][2];
#pragma unroll
      for (int kd = 0; kd < KP / 16; ++kd) {
        acc_to_a<true>(S[2 * kd], S[2 * kd + 1], sa[kd]);
        pin(sa[kd][0]);
        pin(sa[kd][1]);
      }
      pin(vn);
      pin(o);
      const uint64_t dw = wgmma_desc_k_major(t.w), dq = wgmma_desc_k_major(t.q);
      wgmma_fence();
#pragma unroll
      for (int kd = 0; kd < KP / 16; ++kd) {
#pragma unroll
        for (int part = 0; part < 2; ++part) {
          wgmma_m64n64k16<0>(vn, sa[kd][1 - part], wgmma_k_step(dw, 16 * kd));
          if constexpr (!SCAN) wgmma_m64n64k16<0>(o, sa[kd][1 - part], wgmma_k_step(dq, 16 * kd));
        }
      }
      wgmma_commit();
      decay(t);  // S itself is not an operand of these products
      wgmma_wait<0>();
      pin(vn);
      pin(o);
#pragma unroll
      for (int kd = 0; kd < KP / 16; ++kd) {
        pin(sa[kd][0]);
        pin(sa[kd][1]);
      }
    }
    if constexpr (!WG) {
#pragma unroll
      for (int kd = 0; kd < KP / 16; ++kd) {
        FragA sa[2];
        acc_to_a<true>(S[2 * kd], S[2 * kd + 1], sa);
        FragB bw[NC / 2][2][SP], bq[NC / 2][2][SP];
#pragma unroll
        for (int p = 0; p < NC / 2; ++p) {
          if (2 * p < NCC) {
            Op::load_b_nk(bw[p], t.w, L::LDK, 16 * kd, 16 * p);
            if constexpr (!SCAN) Op::load_b_nk(bq[p], t.q, L::LDK, 16 * kd, 16 * p);
          }
        }
        // In-order issue: every accumulator's lo product, then every hi product, so that no MMA waits for the one
        // just before it (bf16 operands; float operands take their three MMAs per accumulator in turn).
#pragma unroll
        for (int part = 0; part < (sizeof(Elem) == 2 ? 2 : 1); ++part) {
#pragma unroll
          for (int p = 0; p < NC / 2; ++p) {
            if (2 * p < NCC) {
#pragma unroll
              for (int j = 0; j < 2; ++j) {
                if constexpr (sizeof(Elem) == 2) {
                  mma_bf16(vn[2 * p + j], sa[1 - part], bw[p][j][0]);
                  if constexpr (!SCAN) mma_bf16(o[2 * p + j], sa[1 - part], bq[p][j][0]);
                } else {
                  mma_split_a<Elem>(vn[2 * p + j], sa, bw[p][j]);
                  if constexpr (!SCAN) mma_split_a<Elem>(o[2 * p + j], sa, bq[p][j]);
                }
              }
            }
          }
        }
      }
    }
    for_each_acc<1, NC>([&](int, int nt, int e, int row, int r) {  // r: chunk row
      float u = 0.f;
      if (!trans && r < C) u = to_float(t.u[r * L::LDB + r0 + row]);
      vn[nt].x[e] = r < C ? u - vn[nt].x[e] : 0.f;
    });
    FragA va[NC / 2][SPLIT_V ? 2 : 1];  // v_new^T as A fragments (k = chunk rows)
#pragma unroll
    for (int kt = 0; kt < NC / 2; ++kt) acc_to_a<SPLIT_V>(vn[2 * kt], vn[2 * kt + 1], va[kt]);

    if constexpr (WG) {
      // S^T += v_new^T kg (kg read N-major), then o^T += v_new^T Aqk^T over every source block (the blocks above the
      // diagonal are zero: exact), lo tile first, as below.
      pin(S);
      pin(o);
#pragma unroll
      for (int kt = 0; kt < NC / 2; ++kt) pin(va[kt][0]);
      const uint64_t dk = wgmma_desc_n_major(t.k), dalo = wgmma_desc_k_major(t.alo), da = wgmma_desc_k_major(t.a);
      wgmma_fence();
#pragma unroll
      for (int kt = 0; kt < NC / 2; ++kt) {
        if constexpr (KP == 128) wgmma_m64n128k16<1>(S, va[kt][0], wgmma_n_step(dk, 16 * kt));
        else wgmma_m64n64k16<1>(S, va[kt][0], wgmma_n_step(dk, 16 * kt));
      }
      if constexpr (!SCAN) {
#pragma unroll
        for (int part = 0; part < 2; ++part) {
#pragma unroll
          for (int kt = 0; kt < NC / 2; ++kt) wgmma_m64n64k16<0>(o, va[kt][0], wgmma_k_step(part ? da : dalo, 16 * kt));
        }
      }
      wgmma_commit();
      wgmma_wait<0>();
      pin(S);
      pin(o);
#pragma unroll
      for (int kt = 0; kt < NC / 2; ++kt) pin(va[kt][0]);
    } else if constexpr (!SCAN) {  // o^T += v_new^T Aqk^T (Aqk is zero above the diagonal: source rows <= target rows)
      // The lo tile's products over every source block, then the hi tile's: recurrence_kernel's order, so that both
      // kernels give the same bits (the tile width, chosen from the batch, must not change a result).
#pragma unroll
      for (int part = L::SPLIT_A ? 0 : 1; part < 2; ++part) {
        const Elem* sa_ = part == 0 ? t.alo : t.a;
#pragma unroll
        for (int kt = 0; kt < NC / 2; ++kt) {
#pragma unroll
          for (int p = kt; p < NC / 2; ++p) {
            if (2 * p < NCC) {
              FragB bb[2][SP];
              Op::load_b_nk(bb, sa_, L::LDA, 16 * kt, 16 * p);
              Op::mma(o[2 * p], va[kt], bb[0]);
              Op::mma(o[2 * p + 1], va[kt], bb[1]);
            }
          }
        }
      }
    }
    const int64_t orow0 = b * a.out_sb + (t0 + ci * C) * a.out_st + hv * a.out_sh;
    if constexpr (WG && !SCAN) {
      if (a.vec_out) {
        // The warp's 16 value columns x 64 chunk rows transposed through shared memory (stmatrix), then 16-byte rows
        // to the output.
        __syncwarp();  // this warp's reads of the previous chunk's tile are done
        const int m = lane >> 3, i = lane & 7;
#pragma unroll
        for (int p = 0; p < NC / 2; ++p) {
          const FragC &c0 = o[2 * p], &c1 = o[2 * p + 1];
          stsm_x4_t(sO + (16 * p + 8 * (m >> 1) + i) * L::LDB + r0 + 8 * (m & 1), pack_bf16(c0.x[0], c0.x[1]),
                    pack_bf16(c0.x[2], c0.x[3]), pack_bf16(c1.x[0], c1.x[1]), pack_bf16(c1.x[2], c1.x[3]));
        }
        __syncwarp();
        Elem* op = static_cast<Elem*>(a.out.p) + orow0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int q = lane + 32 * j, r = q >> 1, h = 8 * (q & 1);
          if (r < nrows && v0 + h < a.V) {
            *reinterpret_cast<uint4*>(op + r * a.out_st + v0 + h) =
                *reinterpret_cast<const uint4*>(sO + r * L::LDB + r0 + h);
          }
        }
      }
    }
    if (!SCAN && !(WG && a.vec_out)) {
      with_typed(a.out, [&](auto* op) {
        using OutT = std::remove_pointer_t<decltype(op)>;
        for_each_acc<1, NC>([&](int, int nt, int e, int row, int r) {
          const int v = v0 + row;
          if (r < nrows && v < a.V) op[orow0 + r * a.out_st + v] = from_float<OutT>(o[nt].x[e]);
        });
      });
    }

    // S^T = S^T diag(gamma) + v_new^T kg (WG: done above).
    if constexpr (!WG) {
      decay(t);
#pragma unroll
      for (int kt = 0; kt < NC / 2; ++kt) {
        if (2 * kt < NCC) {
#pragma unroll
          for (int np = 0; np < ND / 2; ++np) {
            FragB bk[2][SP];
            Op::load_b_kn(bk, t.k, L::LDK, 16 * kt, 16 * np);
            Op::mma(S[2 * np], va[kt], bk[0]);
            Op::mma(S[2 * np + 1], va[kt], bk[1]);
          }
        }
      }
    }
    if (L::STAGES == 1 && ci + 1 < c_end) {
      __syncthreads();
      issue(ci + 1, 0);
    }
  }
  if (SCAN) {  // E (value tiles) or M (transition tiles) of this segment
    for_each_acc<1, ND>([&](int, int nd, int e, int row, int d) {
      const int v = v0 + row;
      if (d < KP && v < ncols) seg_row(gseg, d)[seg_col0 + v] = S[nd].x[e];
    });
  }
  if (write) {
    with_typed(a.final_state.ptr, [&](auto* sp) {
      using ST = std::remove_pointer_t<decltype(sp)>;
      sp += slot * a.final_state.slot_stride + hv * a.final_state.head_stride;
      for_each_acc<1, ND>([&](int, int nd, int e, int row, int d) {
        const int v = v0 + row;
        if (d < a.K && v < a.V) sp[state_at(d, v)] = from_float<ST>(S[nd].x[e]);
      });
    });
  }
}

// ---- segment merge (context parallelism) -------------------------------------------------------------------
// Per (sequence, v-head, 8 value columns), in order over the sequence's segments: S_start(s+1) = M_s S_start(s) + E_s
// in fp32, written over E_s (segment s + 1 reads its start state from slot s). S_start(1) = E_0 is already in place
// (the scan of segment 0 starts from the caller's state). Narrow column blocks: the chain over segments is serial,
// so the CTAs of one step should fill the SMs and each do little (B1 T65536 H8: 128 CTAs).
constexpr int kMergeThreads = 256;
constexpr int kMergeCols = 8;   // state columns per CTA
constexpr int kMergeKeys = 32;  // keys of M staged at a time

template <int KP>
struct MergeLayout {
  static constexpr int LDS = kMergeCols + 1, LDM = kMergeKeys + 1;
  static constexpr size_t bytes() { return sizeof(float) * (KP * LDS + KP * LDM); }
};

template <int KP>
__global__ void __launch_bounds__(kMergeThreads) segment_merge_kernel(const ForwardArgs a) {
  using L = MergeLayout<KP>;
  constexpr int RG = kMergeThreads / kMergeCols, RPT = KP / RG;  // row groups; rows per thread
  const int VT_cols = a.seg_ld - KP;  // value columns of a slot
  const int CB = (VT_cols + kMergeCols - 1) / kMergeCols;
  int64_t idx = blockIdx.x;
  const int cb = static_cast<int>(idx % CB);
  idx /= CB;
  const int hv = static_cast<int>(idx % a.HV);
  const int n = static_cast<int>(idx / a.HV);
  int64_t b, t0, len, per;
  a.sequence(n, b, t0, len);
  const int64_t nseg = a.segments_of((len + a.chunk - 1) / a.chunk, per);
  if (nseg <= 2) return;
  extern __shared__ __align__(16) char smem_raw[];
  float* sS = reinterpret_cast<float*>(smem_raw);  // [KP][LDS] S_start(s), this CTA's columns
  float* sM = sS + KP * L::LDS;                     // [KP][LDM] M_s, keys e0 .. e0 + kMergeKeys - 1
  const int tid = threadIdx.x, j = tid % kMergeCols, rg = tid / kMergeCols;
  const int col = cb * kMergeCols + j;
  const bool col_in = col < a.V;
  auto row = [&](int64_t g, int d) { return a.ws_seg + ((g * a.HV + hv) * KP + d) * a.seg_ld; };
  const int64_t g0 = a.seg_offsets[n];
  for (int64_t s = 1; s + 1 < nseg; ++s) {
    const int64_t g = g0 + s;
    for (int e = rg; e < KP; e += RG) sS[e * L::LDS + j] = col_in && e < a.K ? row(g - 1, e)[col] : 0.f;
    float acc[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int d = rg + RG * i;
      acc[i] = col_in && d < a.K ? row(g, d)[col] : 0.f;
    }
    for (int e0 = 0; e0 < a.K; e0 += kMergeKeys) {
      __syncthreads();  // sS written; the previous block of M consumed
      for (int x = tid; x < KP * kMergeKeys; x += kMergeThreads) {
        const int d = x / kMergeKeys, e = x % kMergeKeys;  // a warp reads one row's 32 keys (128 bytes)
        sM[d * L::LDM + e] = d < a.K && e0 + e < a.K ? row(g, d)[VT_cols + e0 + e] : 0.f;
      }
      __syncthreads();
#pragma unroll 8
      for (int e = 0; e < kMergeKeys; ++e) {
        const float sv = sS[(e0 + e) * L::LDS + j];
#pragma unroll
        for (int i = 0; i < RPT; ++i) acc[i] = fmaf(sM[(rg + RG * i) * L::LDM + e], sv, acc[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int d = rg + RG * i;
      if (col_in && d < a.K) row(g, d)[col] = acc[i];
    }
    __syncthreads();  // S_start(s+1) visible to the CTA before it is read as the next S_start
  }
}

}  // namespace kdakit::cuda
