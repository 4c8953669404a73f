// The chunked forward's state-independent kernel (sm_80+, mma.sync), one CTA per (chunk, v-head): L2 norm, gate,
// beta, the anchored intra-chunk matrices P (-> Aqk) and L, the inverse Tm = (I + L)^-1, and w, u, qg, kg, gamma
// written to the workspace for the recurrence (docs/ARCHITECTURE.md).
#pragma once

#include "common/kda_math.h"
#include "cuda/common/gate.cuh"
#include "cuda/common/seqlen.cuh"
#include "cuda/forward/prepare_tiles.cuh"

namespace kdakit::cuda {

// bf16 operands: two CTAs per SM (81 KB of shared memory, up to 128 registers). Float operands need twice the tiles:
// one CTA. GB: g's width (GRaw, with_g_type), 4 for float32, 2 for bfloat16 / float16. LO (bf16 operands, the
// backward's prepare): the lo parts of qg and kg (ForwardArgs::ws_qglo, ws_kglo), and where ws_ulo is set u's lo part
// with Tm diag(beta) as hi + lo in u's product.
template <typename InT, typename Elem, int C, int KP, int GB, bool LO = false>
__global__ void __launch_bounds__(kPrepareThreads, sizeof(Elem) == 2 ? 2 : 1) prepare_kernel(const ForwardArgs a) {
  static_assert(!LO || sizeof(Elem) == 2, "lo parts of bf16 operands");
  using L = PrepareLayout<sizeof(InT), sizeof(Elem), C, KP, GB>;
  using Op = Operand<Elem>;
  constexpr int NSUB = L::NSUB, SW = L::SW, NKS = L::NKS, LDS = L::LDS, PAIRS = SW / 2;
  constexpr int NOFF = NSUB > 1 ? 2 * (NSUB - 1) : 2, NTH = kPrepareThreads;
  const int64_t slot = blockIdx.x;
  const int hv = blockIdx.y;
  int64_t first;
  const int n = chunk_owner(a, a.chunk_offsets, C, slot, first);
  if (n < 0) {  // past the chunks: the padded token tail's output rows, if any
    zero_tail_rows<C>(a, slot - a.chunk_offsets[a.N], hv);
    return;
  }
  int64_t b, t0, len;
  sequence(a, n, b, t0, len);
  const int64_t c = slot - first;
  const int64_t row0 = t0 + c * C;
  const int nrows = static_cast<int>(min(static_cast<int64_t>(C), len - c * C));
  if (a.state_slot(n) < 0) {  // padding: zero outputs and chunk state; the recurrence skips the sequence
    zero_padding_chunk(a, b, row0, nrows, slot, c, hv);
    return;
  }
  const int h = hv / a.group;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const InT* qp = static_cast<const InT*>(a.q.p);
  const InT* kp = static_cast<const InT*>(a.k.p);
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
  Elem* sQx = reinterpret_cast<Elem*>(uni);  // slice phase (see PrepareLayout: sQx, sKd, sKx, sKb)
  Elem* sKd = sQx + C * LDS;
  Elem* sKx = sKd + C * LDS;
  Elem* sKb = sKx + C * LDS;
  using GR = GRaw<GB>;
  GR* sG = reinterpret_cast<GR*>(uni + L::g_offset());  // STAGED: the slice's raw g rows [C][LDG], over sKx and sKb
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
  // The slice's raw q, k and g, staged in the tiles' layout (STAGED; g in its own width, its bits copied as they
  // are): slice 0's copies are issued first, so that they are in flight with everything else the CTA loads.
  auto stage_slice = [&](int d0) {
    stage_rows<InT, C, SW>(reinterpret_cast<InT*>(sQx), LDS, qp + d0, a.q, b, row0, h, nrows, a.K - d0, a.vec_qk);
    stage_rows<InT, C, SW>(reinterpret_cast<InT*>(sKd), LDS, kp + d0, a.k, b, row0, h, nrows, a.K - d0, a.vec_qk);
    stage_rows<GR, C, SW>(sG, L::LDG, static_cast<const GR*>(a.g.p) + d0, a.g, b, row0, hv, nrows, a.K - d0,
                          a.vec_g);
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
      const TokenRows& tt = is_k ? a.k : a.q;
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
      bt = math::beta_value(a.beta.load(a.beta.offset(b, row0 + r, hv)), a.beta_sigmoid,
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
  const int64_t grow = a.g.offset(b, row0 + er0, hv) + dl;  // element offset of the thread's g row in a.g

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
    const bool pq = a.pair_qk && ok1, pg = a.pair_g && ok1;
    auto raw = [&](const InT* staged, const InT* global, int64_t st, bool pair, int i) {
      if constexpr (L::STAGED) return load_pair<InT>(staged + i * LDS, true, true, true);
      else return i < valid ? load_pair<InT>(global + d0 + i * st, ok0, ok1, pair) : make_float2(0.f, 0.f);
    };
    // (i) The thread's gates (log2 units; zero past the sequence and past K), its block's total, the block's sum up
    //     to its anchor (rows 0..8) and after it (rows 9..15), and the block's largest anchor exponent |G_i - G_8|.
    float2 x[16], tot = make_float2(0.f, 0.f), lam8 = tot, s9 = tot;
    if (ew) {
      with_g_type<GB>(a.g, [&](auto tag) {  // g of its own dtype: staged, or from global memory
        using GT = typename decltype(tag)::type;
        const GT* sg = reinterpret_cast<const GT*>(sG) + er0 * L::LDG + dl;
        const GT* gg = static_cast<const GT*>(a.g.p) + grow + d0;
#pragma unroll
        for (int i = 0; i < 16; ++i) {  // all loads first
          if constexpr (L::STAGED) x[i] = load_pair<GT>(sg + i * L::LDG, true, true, true);
          else x[i] = i < valid ? load_pair<GT>(gg + i * a.g.st, ok0, ok1, pg) : make_float2(0.f, 0.f);
        }
      });
      float2 bias = make_float2(0.f, 0.f);
      if (a.gate_mode != GateMode::kPreGated && a.dt_bias.present()) {
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
      // LO: qg and kg also as lo parts, hi + lo exact in fp32.
      const int64_t lo_at = ws_tile * C * KP + er0 * KP + d;
      Elem* gql = LO ? static_cast<Elem*>(a.ws_qglo) + lo_at : nullptr;
      Elem* gkl = LO ? static_cast<Elem*>(a.ws_kglo) + lo_at : nullptr;
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
          if constexpr (LO) store_hi_lo(gq + i * KP, gql + i * KP, oq.x, oq.y);
          else Op::store2(gq + i * KP, oq.x, oq.y);
          Op::store2(gw + i * KP, ow.x, ow.y);
          if constexpr (LO) store_hi_lo(gk + i * KP, gkl + i * KP, ok.x, ok.y);
          else Op::store2(gk + i * KP, ok.x, ok.y);
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
          if constexpr (LO) store_hi_lo(gq + i * KP, gql + i * KP, oq.x, oq.y);
          else Op::store2(gq + i * KP, oq.x, oq.y);
          Op::store2(gw + i * KP, ow.x, ow.y);
        }
        float2 rho = make_float2(0.f, 0.f);
#pragma unroll 1
        for (int i = 15; i >= 0; --i) {
          const float2 kv = raw(sraw_k, krow, a.k.st, pq, i) * sRk[er0 + i];
          const float2 kx = kv * exp2_2(rho), ok = kx * ea;
          store_kb(i, kx);
          if constexpr (LO) store_hi_lo(gk + i * KP, gkl + i * KP, ok.x, ok.y);
          else Op::store2(gk + i * KP, ok.x, ok.y);
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
              (a.gate_mode != GateMode::kPreGated && a.dt_bias.present() && okd) ? a.dt_bias.load(int64_t(hv) * a.K + dd) : 0.f;
          float kk[16], al[16];
          for (int j = 0; j < 16; ++j) {
            const int r = 16 * ab + j;
            const bool in = okd && r < nrows;
            kk[j] = in ? to_float(kp[a.k.offset(b, row0 + r, h) + dd]) * sRk[r] : 0.f;
            al[j] = in ? fast_exp2(gate(load_g<GB>(a.g, a.g.offset(b, row0 + r, hv) + dd) + bias)) : 1.f;
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
      // the output largely cancel, and Aqk's rounding is the largest error left (docs/perf-notes.md).
      auto store_a = [&](int off, float x0, float x1) {
        if constexpr (sizeof(Elem) == 2) {
          store_hi_lo(ws_a + off, ws_alo + off, x0, x1);
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
  // Tm * diag(beta) as the A operand of w and u; Tm itself to the workspace when asked (the backward's gradients).
  // LO with u's lo part asked for: u's product takes Tm diag(beta) as hi + lo (its rounding once to bf16 would carry
  // into dk and dv); the lo tile goes over L / Tm once every thread has read it.
  float* ws_tm = a.ws_tm != nullptr ? a.ws_tm + ws_tile * C * C : nullptr;
  const bool tb_lo = LO && a.ws_ulo != nullptr;
  Elem* sTblo = reinterpret_cast<Elem*>(uni);  // [C][LDC] over L / Tm (tb_lo)
  auto tm_pair = [&](int e, float2& tb, float2& tm) {  // pair e of Tm diag(beta) and of Tm (zero above the diagonal)
    const int i = e / (C / 2), j = 2 * (e % (C / 2));
    const float2 t = *reinterpret_cast<const float2*>(sLT + i * L::LDL + j);
    tm = make_float2(j <= i ? t.x : 0.f, j + 1 <= i ? t.y : 0.f);
    tb = make_float2(j <= i ? t.x * sBeta[j] : 0.f, j + 1 <= i ? t.y * sBeta[j + 1] : 0.f);
    if (ws_tm != nullptr) *reinterpret_cast<float2*>(ws_tm + i * C + j) = tm;
    return i * L::LDC + j;
  };
  if constexpr (LO) {
    constexpr int TB_PAIRS = C * C / 2 / NTH;  // pairs a thread forms
    static_assert(TB_PAIRS * NTH == C * C / 2, "whole passes of the CTA");
    static_assert(sizeof(Elem) * C * L::LDC <= 4 * C * L::LDL, "Tm diag(beta)'s lo tile fits over L / Tm");
    uint32_t lo[TB_PAIRS];
#pragma unroll
    for (int k = 0; k < TB_PAIRS; ++k) {
      float2 tb, tm;
      const int o = tm_pair(tid + k * NTH, tb, tm);
      uint32_t h;
      split_pack(tb.x, tb.y, h, lo[k]);
      *reinterpret_cast<uint32_t*>(sTb + o) = h;
    }
    cp_async_wait<0>();
    __syncthreads();
    if (tb_lo) {
#pragma unroll
      for (int k = 0; k < TB_PAIRS; ++k) {
        const int e = tid + k * NTH;
        *reinterpret_cast<uint32_t*>(sTblo + (e / (C / 2)) * L::LDC + 2 * (e % (C / 2))) = lo[k];
      }
      __syncthreads();
    }
  } else {
    for (int e = tid; e < C * C / 2; e += NTH) {
      float2 tb, tm;
      const int o = tm_pair(e, tb, tm);
      Op::store2(sTb + o, tb.x, tb.y);
    }
    cp_async_wait<0>();
    __syncthreads();
  }
  // w = Tm diag(beta) (k exp2(G)) by role-0 warps and u = Tm diag(beta) v by role-1 warps, 64 columns a step.
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
      if (LO && u_step && tb_lo) {
        warp_gemm<Elem, 1, 8, false, true>(out, sTblo, L::LDC, 16 * ab, bsrc, L::LD64, 0, 0, ab + 1);
      }
      warp_gemm<Elem, 1, 8, false, true>(out, sTb, L::LDC, 16 * ab, bsrc, L::LD64, 0, 0, ab + 1);
      Elem* dst = w_step ? ws_w + (16 * ab) * KP + 64 * it : ws_u + (16 * ab) * a.VP + 64 * it;
      const int ldd = w_step ? KP : a.VP;
      // u's lo part where the backward asks for it (LO): the same hi, rounded to nearest.
      Elem* lo = LO && u_step && a.ws_ulo != nullptr
                     ? static_cast<Elem*>(a.ws_ulo) + ws_tile * C * a.VP + (16 * ab) * a.VP + 64 * it
                     : nullptr;
      for_each_acc<1, 8>([&](int, int nt, int e, int row, int col) {
        if ((e & 1) == 0) {
          if (lo != nullptr) {
            uint32_t h, l;
            split_pack(out[0][nt].x[e], out[0][nt].x[e + 1], h, l);
            *reinterpret_cast<uint32_t*>(dst + row * ldd + col) = h;
            *reinterpret_cast<uint32_t*>(lo + row * ldd + col) = l;
          } else {
            Op::store2(dst + row * ldd + col, out[0][nt].x[e], out[0][nt].x[e + 1]);
          }
        }
      });
    }
  }
}

}  // namespace kdakit::cuda
