// The backward's gradient kernel (the key side of src/cpu/chunk_gradients.cpp and the activations' chains), one CTA
// per (chunk, v-head): the rows' facts once (beta, the L2 norms), then 16-key slices in turn: the slice's q, k
// (L2-normalised over all K) and gates with their sub-chunk sums and each diagonal block's algorithm; its products
// with the states (dqg, dkbg, dkg and rowsum(S dH), from state_products_sm80.cuh); the intra-chunk products through
// dP and dL (intra_sm80.cuh, 16 x 16 block products on tensor cores), from the slice's anchored exponentials; then per
// (row, key) dq, dk of this v-head (to the workspace: the GVA sum and the L2 norm's backward come after), beta's
// key-side part, the gate gradient summed as the CPU sums it, and the gate's chain to the raw input with per-chunk
// partial sums of dA_log and ddt_bias.
#pragma once

#include <cstring>
#include <type_traits>

#include "cuda/backward/intra_sm80.cuh"
#include "cuda/backward/wy_sm80.cuh"

namespace kdakit::cuda {
namespace grad {

// The in-kernel gate and its derivatives: the expressions of math::gate_value and math::gate_grad (the same bits),
// exp(A_log) taken once per head. `e` stands for both exp(A_log) and the lower-bound gate's scale a, which is 1
// without A_log as exp(0) is.
struct Gate {
  int mode;
  bool has_A;
  float e, lb;
  __device__ __forceinline__ Gate(const BackwardArgs& a, int hv)
      : mode(static_cast<int>(a.gate_mode)), has_A(a.A_log.present()), lb(a.lower_bound) {
    e = expf(has_A ? a.A_log.load(hv) : 0.f);
  }
  __device__ __forceinline__ float value(float x) const {
    return mode == 1 ? -e * math::softplus(x) : lb * math::sigmoid(e * x);
  }
  // g: value(x), which is also d gate / dA_log of the softplus gate.
  __device__ __forceinline__ void grad(float x, float g, float& d_dx, float& d_dA) const {
    if (mode == 1) {
      d_dx = -e * math::softplus_grad(x);
      d_dA = g;
      return;
    }
    const float s = math::sigmoid(e * x), ds = lb * s * (1.f - s);
    d_dx = ds * e;
    d_dA = has_A ? ds * e * x : 0.f;
  }
};

// A vector of B bytes (4, 8 or 16) for one load.
template <int B>
struct VecBytes;
template <>
struct VecBytes<4> { using type = uint32_t; };
template <>
struct VecBytes<8> { using type = uint2; };
template <>
struct VecBytes<16> { using type = uint4; };

// The pieces of a slice's rows (C rows of 16 keys, elements of T) for vector loads: EPC elements each, the size that
// gives every thread of the CTA one piece (at most 16 bytes), so that the puts (the gate's evaluation among them)
// spread over all warps before the barrier that follows.
template <typename T, int C>
struct SlicePiece {
  static constexpr int KS = kBwdKSlice, EPC_MAX = 16 / sizeof(T), EPC_ALL = C * KS / kBwdThreads;
  static constexpr int EPC = EPC_ALL < 2 ? 2 : (EPC_ALL < EPC_MAX ? EPC_ALL : EPC_MAX), PIECES = KS / EPC;
  using Vec = typename VecBytes<EPC * sizeof(T)>::type;
  static constexpr bool ONE = C * PIECES <= kBwdThreads;  // at most one piece a thread
};

// Piece e of a slice's rows in two steps, its bytes held in a uint4 between them: load_piece issues the load,
// put_piece makes the puts (slice_rows, and the loads a slice ahead).
template <typename T, int C>
__device__ __forceinline__ uint4 load_piece(const TokenRows& t, const ChunkOf& ch, int head, int K, int d0,
                                            int e = threadIdx.x) {
  using SP = SlicePiece<T, C>;
  const int r = e / SP::PIECES, c = (e % SP::PIECES) * SP::EPC;
  uint4 u = make_uint4(0u, 0u, 0u, 0u);
  if (e < C * SP::PIECES && r < ch.nrows && d0 + c < K) {
    const T* p = static_cast<const T*>(t.p) + t.offset(ch.b, ch.row0, head) + d0 + r * t.st + c;
    const typename SP::Vec v = __ldg(reinterpret_cast<const typename SP::Vec*>(p));
    memcpy(&u, &v, sizeof(v));
  }
  return u;
}
template <typename T, int C, typename Put>
__device__ __forceinline__ void put_piece(uint4 u, int e, int nrows, int K, int d0, Put&& put) {
  using SP = SlicePiece<T, C>;
  const int r = e / SP::PIECES, c = (e % SP::PIECES) * SP::EPC;
  if (e >= C * SP::PIECES) return;
  const bool in = r < nrows && d0 + c < K;
  T v[SP::EPC];
  memcpy(v, &u, sizeof(v));
#pragma unroll
  for (int i = 0; i < SP::EPC; ++i) put(r, c + i, to_float(v[i]), in);
}

// Keys d0..d0 + 15 of the chunk's rows of token tensor t (elements of T, head `head`, C rows): put(r, dl, value, in)
// for each, value zero past nrows and K (in false). SlicePiece's vector loads where the rows allow 16-byte ones
// (vec), else an element at a time.
template <typename T, int C, typename Put>
__device__ __forceinline__ void slice_rows(const TokenRows& t, bool vec, const ChunkOf& ch, int head, int K, int d0,
                                           Put&& put) {
  constexpr int KS = kBwdKSlice, PIECES = SlicePiece<T, C>::PIECES;
  const T* p = static_cast<const T*>(t.p) + t.offset(ch.b, ch.row0, head) + d0;  // the slice's first row
  if (vec) {  // K is a multiple of 16 / sizeof(T), so of EPC: a piece is within K or past it
    for (int e = threadIdx.x; e < C * PIECES; e += kBwdThreads) {
      put_piece<T, C>(load_piece<T, C>(t, ch, head, K, d0, e), e, ch.nrows, K, d0, put);
    }
  } else {
    for (int e = threadIdx.x; e < C * KS; e += kBwdThreads) {
      const int r = e / KS, dl = e % KS;
      const bool in = r < ch.nrows && d0 + dl < K;
      put(r, dl, in ? to_float(p[r * t.st + dl]) : 0.f, in);
    }
  }
}

struct SlicePieces {
  uint4 q, k, g;
  float dgam;
};

}  // namespace grad

// Two CTAs a multiprocessor where the shared memory allows it (the register file then caps a thread at 128). CACHE:
// dP and dL split once into shared memory (bwd_grad_smem), else each block product rebuilds its fragments. CHUNK is
// the chunk size (a.chunk): the tiles' places in shared memory and the block loops' bounds are then compile-time, so
// their addresses fold into the instructions' offsets instead of taking registers.
template <typename InT, bool CACHE, int CHUNK>
__global__ void __launch_bounds__(kBwdThreads, 2) backward_grad_kernel(const BackwardArgs a) {
  constexpr int LDK = kBwdLdk, KS = kBwdKSlice, C = CHUNK, P = FloatOperand<TileElem<InT>>::kSplit;
  static_assert(P == bwd_split_parts(std::is_same<InT, float>::value), "the planner's dP/dL cache size");
  static_assert(C == 32 || C == 64, "the chunk sizes of the backward");
  const int64_t slot = blockIdx.x;
  const int hv = blockIdx.y;
  ChunkOf ch;
  if (!chunk_of(a, slot, ch)) return;
  const int K = a.K, nrows = ch.nrows, NSUB = (nrows + 15) / 16;
  const int h = hv / a.group, tid = threadIdx.x;
  const int64_t tile = a.tile(slot, hv);
  const float* dP = a.ws_dP + tile * C * C;
  const float* dL = a.ws_dL + tile * C * C;

  extern __shared__ __align__(16) float smem[];
  GradSlice s;
  __nv_bfloat16* dpl = reinterpret_cast<__nv_bfloat16*>(smem);  // CACHE: dP's P parts, dL's P parts
  {
    float* p = smem + (CACHE ? bwd_grad_dpl_cache(C, P) / sizeof(float) : 0);
    auto take = [&p](int n) { float* r = p; p += n; return r; };
    constexpr int tl = C * LDK;
    s.q = take(tl); s.k = take(tl); s.g = take(tl); s.el = take(tl); s.er = take(tl); s.es = take(tl);
    s.xin = take(tl);
    float* uni = take(static_cast<int>(bwd_grad_intra(C)));
    s.dqr = uni; s.dkr = uni + tl; s.dkc = uni + 2 * tl; s.arow = uni + 3 * tl; s.bcol = uni + 4 * tl;
    s.dgp = uni + 5 * tl; s.cpart = uni + 6 * tl; s.wc = uni + 7 * tl;
    s.dG = s.arow;  // a_row and b_col are consumed by the pair sums before the assembly writes these
    s.kgt = s.bcol;
    s.beta = take(C); s.rq = take(C); s.rk = take(C);
    s.tot = take(4 * KS); s.etot = take(4 * KS); s.gam = take(KS); s.dgam = take(KS);
    s.ebefore = take(4 * KS); s.eafter = take(4 * KS);
    s.bias = take(kMaxHeadDim); s.pdiag = take(C);
    s.maxexp = reinterpret_cast<int*>(take(4));
    s.red = take(kBwdRowGroups);
  }

  // The chunk's constants of every slice: dt_bias's keys (the in-kernel gate's raw input) and P's diagonal.
  const bool in_kernel = a.gate_mode != GateMode::kPreGated, has_bias = in_kernel && a.dt_bias.present();
  for (int d = tid; d < K; d += kBwdThreads) s.bias[d] = has_bias ? a.dt_bias.load(int64_t(hv) * K + d) : 0.f;
  for (int r = tid; r < C; r += kBwdThreads) s.pdiag[r] = r < nrows ? dP[r * C + r] : 0.f;
  // Rows: beta and the L2 norms' reciprocals (a warp per row, over all K).
  for (int i = tid; i < C; i += kBwdThreads) {
    s.beta[i] = i < nrows ? math::beta_value(a.beta.load(a.beta.offset(ch.b, ch.row0 + i, hv)), a.beta_sigmoid,
                                             a.neg_eigval)
                          : 0.f;
  }
  for (int r = tid >> 5; r < C; r += kBwdRowGroups) {
    float sq = 0.f, sk = 0.f;
    if (r < nrows && a.l2norm) {
      const int64_t qo = a.q.offset(ch.b, ch.row0 + r, h), ko = a.k.offset(ch.b, ch.row0 + r, h);
      for (int d = tid & 31; d < K; d += 32) {
        const float x = token_at<InT>(a.q, qo, d), y = token_at<InT>(a.k, ko, d);
        sq += x * x;
        sk += y * y;
      }
    }
    sq = warp_sum(sq);
    sk = warp_sum(sk);
    if ((tid & 31) == 0) {
      const float eps = static_cast<float>(math::kL2NormEps);
      s.rq[r] = r < nrows ? (a.l2norm ? 1.f / sqrtf(sq + eps) : 1.f) : 0.f;
      s.rk[r] = r < nrows ? (a.l2norm ? 1.f / sqrtf(sk + eps) : 1.f) : 0.f;
    }
  }
  if constexpr (CACHE) {  // the strictly lower parts of dP and dL in the chunk's rows, split into P parts
    // Every load of the thread first (IT pairs of each matrix), then the splits and stores.
    constexpr int IT = C * C / 2 / kBwdThreads;
    static_assert((C * C / 2) % kBwdThreads == 0, "whole rounds of pairs");
    float2 pv[IT], lv[IT];
#pragma unroll
    for (int i = 0; i < IT; ++i) {
      const int e = tid + i * kBwdThreads, r = e / (C / 2), c = 2 * (e % (C / 2));
      const bool in = r < nrows;
      pv[i] = in ? *reinterpret_cast<const float2*>(dP + r * C + c) : make_float2(0.f, 0.f);
      lv[i] = in ? *reinterpret_cast<const float2*>(dL + r * C + c) : make_float2(0.f, 0.f);
    }
#pragma unroll
    for (int i = 0; i < IT; ++i) {
      const int e = tid + i * kBwdThreads, r = e / (C / 2), c = 2 * (e % (C / 2)), o = r * kBwdDplLd + c;
      uint32_t* w = reinterpret_cast<uint32_t*>(dpl + o);
      const int m = C * kBwdDplLd / 2;  // one matrix, in 32-bit words
      uint32_t wp[P], wl[P];
      split_parts<P>(c < r ? pv[i].x : 0.f, c + 1 < r ? pv[i].y : 0.f, wp);
      split_parts<P>(c < r ? lv[i].x : 0.f, c + 1 < r ? lv[i].y : 0.f, wl);
#pragma unroll
      for (int j = 0; j < P; ++j) {
        w[j * m] = wp[j];
        w[(P + j) * m] = wl[j];
      }
    }
  }
  const intra::DplSource<CACHE, P> dpl_src{dP, dL, dpl, C, nrows};
  const grad::Gate gate(a, hv);
  constexpr int QK_EPC = 16 / sizeof(InT);
  const bool q_vec = rows_vec(a.q, QK_EPC, K), k_vec = rows_vec(a.k, QK_EPC, K);
  // Rows that allow 16-byte loads (and g of 2 or 4 bytes) take each slice's loads one slice ahead (SlicePieces),
  // issued for slice 0 here and for each next slice before the current one's gate gradient; other rows load each
  // slice when it starts (slice_rows). The same values either way.
  const bool g16 = a.g.dtype == DType::kBFloat16 || a.g.dtype == DType::kFloat16;
  const bool ahead = q_vec && k_vec && (g16 || a.g.dtype == DType::kFloat32) && rows_vec(a.g, g16 ? 8 : 4, K);
  static_assert(grad::SlicePiece<InT, C>::ONE && grad::SlicePiece<uint16_t, C>::ONE && grad::SlicePiece<float, C>::ONE,
                "the loads a slice ahead hold one piece a thread");
  grad::SlicePieces next{};
  auto fetch = [&](int d0) {
    next.q = grad::load_piece<InT, C>(a.q, ch, h, K, d0);
    next.k = grad::load_piece<InT, C>(a.k, ch, h, K, d0);
    next.g = g16 ? grad::load_piece<uint16_t, C>(a.g, ch, hv, K, d0) : grad::load_piece<float, C>(a.g, ch, hv, K, d0);
    next.dgam = tid < KS && d0 + tid < K ? a.ws_dgam[tile * K + d0 + tid] : 0.f;
  };
  if (ahead) fetch(0);
  __syncthreads();  // the rows' facts written
  // The 16-key slices in turn, each ending in its own partial sums (dbeta's key part, dA_log); the rows' facts above
  // are the chunk's, taken once. A slice's first writes (the slice tiles, maxexp, dgam) touch nothing that the
  // previous slice reads after its last barrier (block_sum's), which is the ddt part's read of dgp.
  for (int ks = 0; ks < a.nks; ++ks) {
    const int d0 = ks * KS;
    // The slice: q and k normalised; the gates, each evaluated once, with their raw inputs x = g + dt_bias for the
    // chain; rowsum(S dH) of its keys.
    if (tid < 4) s.maxexp[tid] = 0;
    auto put_q = [&](int r, int dl, float v, bool) { s.q[r * LDK + dl] = v * s.rq[r]; };
    auto put_k = [&](int r, int dl, float v, bool) { s.k[r * LDK + dl] = v * s.rk[r]; };
    auto put_g = [&](int r, int dl, float raw, bool in) {
      const int o = r * LDK + dl;
      if (!in_kernel) {
        s.g[o] = raw;  // zero outside
        return;
      }
      const float x = raw + (has_bias && in ? s.bias[d0 + dl] : 0.f);
      s.xin[o] = x;
      s.g[o] = in ? gate.value(x) : 0.f;
    };
    if (ahead) {
      if (tid < KS) s.dgam[tid] = next.dgam;
      grad::put_piece<InT, C>(next.q, tid, nrows, K, d0, put_q);
      grad::put_piece<InT, C>(next.k, tid, nrows, K, d0, put_k);
      with_typed(a.g, [&](auto* gp) {
        using G = std::remove_cv_t<std::remove_pointer_t<decltype(gp)>>;
        if constexpr (sizeof(G) == 2 || sizeof(G) == 4) grad::put_piece<G, C>(next.g, tid, nrows, K, d0, put_g);
      });
    } else {
      if (tid < KS) s.dgam[tid] = d0 + tid < K ? a.ws_dgam[tile * K + d0 + tid] : 0.f;
      grad::slice_rows<InT, C>(a.q, q_vec, ch, h, K, d0, put_q);
      grad::slice_rows<InT, C>(a.k, k_vec, ch, h, K, d0, put_k);
      with_typed(a.g, [&](auto* gp) {
        using G = std::remove_cv_t<std::remove_pointer_t<decltype(gp)>>;
        grad::slice_rows<G, C>(a.g, rows_vec(a.g, 16 / sizeof(G), K), ch, hv, K, d0, put_g);
      });
    }
    __syncthreads();
    // The sub-chunk sums (chunk_sums of the CPU), kept as the exponentials the products take: exp(lam) (inclusive
    // prefix), exp(rho) (exclusive suffix), exp(+-sigma) (around the block's middle row m; only read in factorised
    // blocks, where |sigma| <= 64), exp(total). Each sum is a sum of the gates themselves over exactly its rows (never
    // a difference of two sums), so a huge gate costs no precision. Four lanes per (block, key), lane j holding the
    // block's rows 4 j .. 4 j + 3: its own rows' running sums, then the other lanes' totals in a fixed order. A
    // warp's lanes are j = lane / 8 over (blocks 2 bp and 2 bp + 1) x (4 keys), so that the rows 4 apart of its eight
    // (block, key) columns fall on distinct banks.
    {
      static_assert(4 * (kBwdMaxChunk / 16) * KS == kBwdThreads && KS == 16 && kBwdLdk % 32 == 17,
                    "one pass of four lanes per (block, key); conflict-free columns at a row stride of 17");
      const int lane = tid & 31, warp = tid >> 5, j = lane >> 3, q = lane & 7;
      const int blk = 2 * (warp >> 2) + (q >> 2), dl = 4 * (warp & 3) + (q & 3), s0 = 16 * blk;
      const int cnt = blk < NSUB ? min(16, nrows - s0) : 0, m = min(8, cnt - 1);
      float v[4], lam[4], rho[4], up[4], down[4];
      float all = 0.f, after_m = 0.f, to_m = 0.f;  // this lane's totals: every row, rows > m, rows <= m
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int p = 4 * j + i;
        v[i] = p < cnt ? s.g[(s0 + p) * LDK + dl] : 0.f;
        all += v[i];
        lam[i] = all;
        after_m += p > m ? v[i] : 0.f;
        up[i] = after_m;
        to_m += p <= m ? v[i] : 0.f;
      }
      float later = 0.f, later_to_m = 0.f;  // this lane's rows after row i: every one, those <= m
#pragma unroll
      for (int i = 3; i >= 0; --i) {
        const int p = 4 * j + i;
        rho[i] = later;
        down[i] = later_to_m;
        later += v[i];
        later_to_m += p <= m ? v[i] : 0.f;
      }
      float ta[4], tu[4], td[4];  // every lane's totals, from lane 0 to 3
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        ta[k] = __shfl_sync(0xffffffffu, all, q + 8 * k);
        tu[k] = __shfl_sync(0xffffffffu, after_m, q + 8 * k);
        td[k] = __shfl_sync(0xffffffffu, to_m, q + 8 * k);
      }
      float before_a = 0.f, before_u = 0.f, after_a = 0.f, after_d = 0.f;  // the earlier lanes' totals, the later ones'
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (k < j) {
          before_a += ta[k];
          before_u += tu[k];
        }
      }
#pragma unroll
      for (int k = 3; k >= 0; --k) {
        if (k > j) {
          after_a += ta[k];
          after_d += td[k];
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int p = 4 * j + i;
        lam[i] = before_a + lam[i];  // over s0..p
        rho[i] = rho[i] + after_a;   // over p+1..
        up[i] = before_u + up[i];    // over m+1..p
        down[i] = down[i] + after_d;  // over p+1..m
        if (p < cnt) {
          const int o = (s0 + p) * LDK + dl;
          const float sigma = p > m ? up[i] : p < m ? -down[i] : 0.f;
          s.el[o] = expf(lam[i]);
          s.er[o] = expf(rho[i]);
          s.es[o] = expf(sigma);
        }
      }
      // The block's algorithm for this slice, from the largest anchor exponent over the slice's own keys: a slice's
      // products read only its own keys' exponentials, so the factorised form is exact wherever the slice's
      // exponents allow it, and the decision needs no pass over the other keys' gates. (The CPU decides per block
      // over all keys; both forms are exact to fp32 where they apply.) Row 15's up sum is every row after m, row
      // 0's down sum every row from 1 to m.
      if (blk < NSUB && j == 3) {
        s.tot[blk * KS + dl] = lam[3];  // the positions past the block's rows add zeros
        s.etot[blk * KS + dl] = expf(lam[3]);
      }
      const float up15 = __shfl_sync(0xffffffffu, up[3], q + 24);
      if (blk < NSUB && j == 0) {
        const float mx = fmaxf(0.f, fmaxf(-up15, -down[0]));
        atomicMax(&s.maxexp[blk], __float_as_int(mx));  // non-negative floats order as their bits
      }
    }
    __syncthreads();
    // Per key: gamma = exp(the chunk's total), and the products of exp(total) over the blocks before and after each
    // block (in increasing block order, from 1).
    if (tid < KS) {
      float t = 0.f;
      for (int blk = 0; blk < NSUB; ++blk) t += s.tot[blk * KS + tid];
      s.gam[tid] = expf(t);
      for (int blk = 0; blk < NSUB; ++blk) {
        float before = 1.f, after = 1.f;
        for (int c = 0; c < blk; ++c) before *= s.etot[c * KS + tid];
        for (int c = blk + 1; c < NSUB; ++c) after *= s.etot[c * KS + tid];
        s.ebefore[blk * KS + tid] = before;
        s.eafter[blk * KS + tid] = after;
      }
    }
    // (No barrier: the products read etot, not what this step writes; the assembly, after their barriers, does.)
    // The products with the states (backward_state_products_kernel: dqg and dkbg in the dq and dk parts, which this
    // element's results overwrite, and dkg) for all of a thread's elements, loaded between the block products and the
    // pair sums so that they are in flight during the pair sums.
    constexpr int EPT = kBwdMaxChunk * KS / kBwdThreads;  // elements a thread, at the largest chunk
    static_assert(kBwdThreads % KS == 0 && (32 * KS) % kBwdThreads == 0, "whole element rounds for every chunk");
    const int64_t rs = int64_t(a.HV) * K, part0 = (a.row(ch.b, ch.row0) * a.HV + hv) * K + d0;
    float dqg[EPT], dkbg[EPT], dkg[EPT];
    intra_products(s, dpl_src, C, nrows, NSUB, [&] {
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        const int e = tid + i * kBwdThreads, r = e / KS, dl = e % KS;
        const bool in = e < C * KS && r < nrows && d0 + dl < K;
        const int64_t o = part0 + r * rs + dl;
        dqg[i] = in ? a.ws_dq[o] : 0.f;
        dkbg[i] = in ? a.ws_dk[o] : 0.f;
        dkg[i] = in ? a.ws_dkg[o] : 0.f;
      }
    });

    // Assembly per (row, key); beta's key-side part summed over the slice's keys (16 lanes a row).
    {
      const int64_t bs = int64_t(a.HV) * (1 + a.nks), beta0 = (a.row(ch.b, ch.row0) * a.HV + hv) * (1 + a.nks) + 1 + ks;
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        const int e = tid + i * kBwdThreads;  // C * KS is a multiple of the block: the same rounds in every thread
        if (e >= C * KS) break;
        const int r = e / KS, dl = e % KS, d = d0 + dl, blk = r / 16;
        float db = 0.f;
        if (r < nrows) {
          const int x = r * LDK + dl;
          const float eg = s.el[x] * s.ebefore[blk * KS + dl], egl = s.er[x] * s.eafter[blk * KS + dl];
          const float kd = s.k[x], qd = s.q[x], bt = s.beta[r], pd = s.pdiag[r];
          db = kd * s.dkr[x] + dkbg[i] * kd * eg;
          const float dk_kg = egl * dkg[i], dq_g = eg * dqg[i], dk_g = bt * eg * dkbg[i];
          const float dq = s.dqr[x] + dq_g + pd * kd;
          const float dk = dk_g + bt * s.dkr[x] + s.dkc[x] + pd * qd + dk_kg;
          s.dG[x] = qd * dq_g + kd * dk_g;
          s.kgt[x] = kd * dk_kg;
          if (d < K) {
            const int64_t o = part0 + r * rs + dl;
            a.ws_dq[o] = dq;
            a.ws_dk[o] = dk;
          }
        }
#pragma unroll
        for (int o = KS / 2; o > 0; o >>= 1) db += __shfl_xor_sync(0xffffffffu, db, o);
        if (dl == 0 && r < nrows) a.ws_dbeta[beta0 + r * bs] = db;
      }
    }
    __syncthreads();
    if (ahead && ks + 1 < a.nks) fetch(d0 + KS);  // in flight during this slice's gate gradient and sums
    // The gate gradient per key: the pairs' part, the chunk-start terms summed in reverse, the kg terms forward over
    // the earlier rows, and the state's decay on every row (dg written over dgp). A half-warp per key, position p
    // holding the rows p R .. p R + R - 1.
    {
      constexpr int RMAX = kBwdMaxChunk / 16;
      static_assert(kBwdThreads / 16 == KS, "a half-warp per key of the slice");
      const int dl = tid >> 4, p = half_warp::position(), R = (C + 15) / 16, r0 = p * R;
      float dG[RMAX], kg[RMAX], own_dG = 0.f, own_kg = 0.f;
#pragma unroll
      for (int i = 0; i < RMAX; ++i) {
        const bool in = i < R && r0 + i < nrows;
        dG[i] = in ? s.dG[(r0 + i) * LDK + dl] : 0.f;
        kg[i] = in ? s.kgt[(r0 + i) * LDK + dl] : 0.f;
        own_dG += dG[i];
        own_kg += kg[i];
      }
      float rev = half_warp::from_next(half_warp::suffix(own_dG));     // the later positions' rows
      float fwd = half_warp::from_previous(half_warp::prefix(own_kg));  // the earlier positions' rows
      const float last = s.gam[dl] * s.dgam[dl];
#pragma unroll
      for (int i = RMAX - 1; i >= 0; --i) {  // rev: rows >= r
        rev += dG[i];
        dG[i] = rev;
      }
#pragma unroll
      for (int i = 0; i < RMAX; ++i) {  // fwd: rows < r
        const int o = (r0 + i) * LDK + dl;
        if (i < R && r0 + i < nrows) s.dgp[o] = (s.dgp[o] + dG[i]) + (fwd + last);
        fwd += kg[i];
      }
    }
    __syncthreads();
    // The gate's chain to the raw input (spec §4.2 B8) and dg; partial sums of dA_log (the CTA) and ddt_bias (per
    // key).
    float dA = 0.f;
    with_typed(a.dg, [&](auto* out) {  // one dtype branch a slice
      using G = std::remove_pointer_t<decltype(out)>;
      const int64_t row0 = a.dg.offset(ch.b, ch.row0, hv), rstride = a.dg.st;
      for (int e = tid; e < nrows * KS; e += kBwdThreads) {
        const int r = e / KS, dl = e % KS, d = d0 + dl, o = r * LDK + dl;
        if (d >= K) continue;
        float dg = s.dgp[o];
        if (in_kernel) {
          float d_dx, d_dA;
          gate.grad(s.xin[o], s.g[o], d_dx, d_dA);
          dA += dg * d_dA;
          dg *= d_dx;
          s.dgp[o] = dg;
        }
        out[row0 + r * rstride + d] = from_float<G>(dg);
      }
    });
    dA = block_sum(dA, s.red);
    if (tid == 0) a.ws_dA[tile * a.nks + ks] = dA;
    {  // ddt_bias's part per key: a half-warp per key (block_sum's barriers have ordered the chain's writes)
      const int dl = tid >> 4, p = half_warp::position();
      float acc = 0.f;
      for (int r = p; r < nrows; r += 16) acc += s.dgp[r * LDK + dl];
      acc = half_warp::sum(acc);
      if (p == 0 && d0 + dl < K) a.ws_ddt[tile * K + d0 + dl] = acc;
    }
  }
}

}  // namespace kdakit::cuda
