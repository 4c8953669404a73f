// The decode / speculative-verify kernel's general form: any number of tokens per sequence, 2-D slot indices and
// per-token states, states of any supported dtype and alignment (docs/ARCHITECTURE.md).
#pragma once

#include "common/kda_math.h"
#include "cuda/common/gate.cuh"
#include "cuda/common/seqlen.cuh"
#include "cuda/decode/inputs.cuh"
#include "cuda/decode/token_math.cuh"
#include "cuda/decode/wide_kv.cuh"

namespace kdakit::cuda {


// Registers: with KP <= 128 five CTAs of 4 warps fit an SM (<= 96 registers) without spills; KP = 256 holds twice
// the state per thread. The state loads in flight are not bounded by registers: the tile is staged in shared memory.
// [K,V] tiles at KP = 128 (row-segment offsets beside whole tiles, per-row masks beside others) take up to 128
// (four CTAs).
// bf16 [K,V] whole tiles at KP = 128 hold two passes' states across tokens (KV_REGS below): three CTAs (up to 168
// registers), without spills. WIDE (wide_kv.cuh): 16 WIDE fp32 state registers per thread, two CTAs at 8 columns,
// four at 4.
template <typename PoolT, bool VK, int KP, bool FULL, int WIDE>
constexpr int decode_min_blocks() {
  if (WIDE) return WIDE == 8 ? 2 : 4;
  if (!VK && KP == 128 && FULL && !std::is_same<PoolT, float>::value) return 3;
  return KP > 128 ? 2 : (!VK && KP == 128 ? 4 : 5);
}

// The read slot of the CTA a.one.prefetch_ahead places later in launch order (state_io.cuh, later_place), with its head
// and V tile, for the L2 prefetch of its staged tile: the slot rules below (1-D or 2-D indices with accepted
// counts), -1 where that CTA reads no state (past the grid, the padded-tail row, padding ids). has_initial_state is
// not read: a prefetch of a tile that goes unread costs bandwidth, not results.
__device__ __forceinline__ int later_read_slot(const DecodeArgs& a, unsigned& hv, unsigned& vt) {
  unsigned x, y, z;
  if (!decode_detail::later_place(a.one.prefetch_ahead, x, y, z)) return -1;
  const int vs = a.one.vt_shift();
  const int64_t n = int64_t(x >> vs);
  vt = vs > 0 ? x & ((1u << vs) - 1) : z;
  hv = y;
  if (a.tail_cta && n == a.N) return -1;
  int64_t slot = n;
  if (a.state_indices.present()) {
    if (a.idx_2d) {
      const int64_t acc = a.num_accepted.present() ? a.num_accepted.load_int(n * a.acc_stride) : 1;
      slot = acc >= 1 && acc <= a.idx_cols ? a.state_indices.load_int(n * a.idx_s0 + (acc - 1) * a.idx_s1) : -1;
    } else {
      slot = a.state_indices.load_int(n * a.idx_s0);
    }
  }
  return slot < 0 || slot == a.pad_slot || slot >= a.initial.slots ? -1 : static_cast<int>(slot);
}

// The kernel takes its arguments by value (not __grid_constant__): ptxas then reads them from the constant bank at
// every use instead of holding them in registers across the token loop.
//
// FULL (run-time facts the host checked): K == KP, the V tiles are whole, the state is staged, and every state
// output has the pool's dtype and vector alignment. The tile's places then need no K / V masks and fold to
// constants, where the masked form spends most of its instructions on such bookkeeping (docs/perf-notes.md).
//
// WIDE (DecodeConfig::wide_kv, FULL bf16 [K,V] at KP = 128; 0: not wide): columns per thread; the state in registers
// across tokens, 16 WIDE columns per CTA, loaded and stored by its threads (wide_kv.cuh); not staged.
template <typename PoolT, bool VK, int KP, bool FULL, int WIDE = 0>
__global__ void __launch_bounds__(kDecodeMaxWarps * 32, (decode_min_blocks<PoolT, VK, KP, FULL, WIDE>()))
    decode_kernel(const DecodeArgs a) {
  using namespace decode_detail;
  static_assert(WIDE == 0 || (FULL && !VK && KP == 128 && std::is_same<PoolT, __nv_bfloat16>::value),
                "wide tiles: whole bf16 [K,V] tiles at K = 128");
  using L = Tile<PoolT, VK, KP>;
  constexpr int ND = L::ND, NJ = L::NJ, KL = L::KL, GRP = L::GRP;
  constexpr int MC = kDecodeMaxTileCols / 32;  // tile columns per lane in the preparation
  // FULL: K, V and the staging are known to the compiler (V only through "every tile is whole"). [K,V] tiles are
  // staged only whole (by rows, FULL); masked ones are read from global memory.
  const bool stage_state = WIDE == 0 && (FULL || (VK && a.stage_state));
  const int Kc = FULL ? KP : a.K, Vc = FULL ? (1 << 30) : a.V;
  const int nthreads = blockDim.x, nw = nthreads >> 5, bv = nw * kDecodeWarpCols;
  const int passes = a.passes, bvt = bv * passes;  // columns per pass; columns of the CTA tile
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // Grid (N, HV, vtiles): no divisions on the way to the slot load.
  const int n = a.one.cta_row(), hv = static_cast<int>(blockIdx.y), vt = a.one.cta_vtile();
  const int h = hv / a.group;
  const int col0 = vt * bvt;  // the CTA's first value column

  extern __shared__ __align__(16) char smem[];
  const int tb = a.tb;
  const int es = a.q.dtype == DType::kFloat32 ? 4 : 2, ges = a.g.dtype == DType::kFloat32 ? 4 : 2,
            bes = a.beta.dtype == DType::kFloat32 ? 4 : 2;
  const DecodeSmem lay(KP, tb, bvt,
                       stage_state ? decode_staged_bytes(KP, int(sizeof(PoolT)), nthreads, passes) * (a.kv_regs ? 2 : 1)
                                   : 0);
  // The key rows: raw inputs in key order, widened in place into the threads' read order (key_pos).
  float* sQ = reinterpret_cast<float*>(smem + lay.q);     // [tb][KP] q * scale / |q|
  float* sK = reinterpret_cast<float*>(smem + lay.k);     // [tb][KP] k / |k|
  float* sA = reinterpret_cast<float*>(smem + lay.a);     // [tb][KP] exp(gate)
  float* sV = reinterpret_cast<float*>(smem + lay.v);     // [tb][bvt] v of the CTA's columns
  float* sB = reinterpret_cast<float*>(smem + lay.beta);  // [tb][bvt] beta of the CTA's columns
  float* sQK = reinterpret_cast<float*>(smem + lay.qk);   // [tb] q.k (normalised, scaled)
  int* sSlot = reinterpret_cast<int*>(smem + lay.slot);   // [tb] per-token slot (2-D indices)
  char* sState = smem + lay.state + size_t(tid) * 16;     // this thread's staged state vectors
  const DType in_dt = a.q.dtype, g_dt = a.g.dtype;

  // Per-sequence scalars: every load is issued before any is used. Slot rules: src/cpu/state.h (plan_slots).
  // tail: the CTA row past the sequences, which zeroes the outputs of the padded token tail [cu[N], T).
  const bool tail = a.tail_cta && n == a.N;
  const bool idx2d = a.state_indices.present() && a.idx_2d;
  const bool per_token = idx2d && a.final_state.present();  // 2-D indices write the state after every token
  const int64_t slot1 = a.state_indices.present() && !idx2d && !tail ? a.state_indices.load_int(n * a.idx_s0) : n;
  const int64_t acc = idx2d && a.num_accepted.present() && !tail ? a.num_accepted.load_int(n * a.acc_stride) : 1;
  const int64_t has = a.has_initial_state.present() && !tail ? a.has_initial_state.load_int(n * a.has_stride) : 1;
  // The head's gate parameters, into registers now (they go to shared memory once the state's copies are issued):
  // in flight with the slot loads, not after them.
  constexpr int NBIAS = KP / 32;  // dt_bias values per thread (CTAs have 32 threads or more)
  float bias_r[NBIAS];
  const bool use_bias = a.gate_mode != GateMode::kPreGated && a.dt_bias.present();
#pragma unroll
  for (int i = 0; i < NBIAS; ++i) {
    const int d = tid + i * nthreads;
    bias_r[i] = use_bias && d < Kc ? a.dt_bias.load(int64_t(hv) * Kc + d) : 0.f;
  }
  const float alog_r = tid == 0 && a.A_log.present() ? a.A_log.load(hv) : 0.f;
  // FULL tiles: the later CTA's slot, loaded beside this CTA's scalars; its tile's L2 prefetch is issued after this
  // CTA's own copies (as in the one-token form: one range by thread 0, or one row per key thread).
  const bool later_one_range = VK || bvt == a.V;
  int later_slot = -1;
  unsigned later_hv = 0, later_vt = 0;
  if constexpr (FULL) {
    if (a.one.prefetch_ahead > 0 && tid < (later_one_range ? 1 : KP)) later_slot = later_read_slot(a, later_hv, later_vt);
  }
  int64_t b64, t064, len64;
  if (tail) {
    b64 = 0;
    t064 = a.cu_seqlens.load_int(int64_t(a.N) * a.cu_stride);
    len64 = t064 < a.T ? a.T - t064 : 0;
  } else {
    sequence(a, n, b64, t064, len64);
  }
  const int b = static_cast<int>(b64), t0 = static_cast<int>(t064), len = static_cast<int>(len64);  // < 2^31

  // Step 1 of a token batch: raw inputs into shared memory by asynchronous copies, all in flight at once, committed
  // as one group. The scalars (headwise beta, per-token slots) go through registers; `commit` stores them once they
  // are needed.
  float beta_raw = 0.f;
  int tok_slot = -1;
  auto stage = [&](int i0, int nb) {
    const int64_t s0 = int64_t(t0) + i0;
    // Tensor i (q, k, g, v, then beta per column) is copied by warp i % nw: the tensors' address arithmetic runs
    // in parallel on the warps, not one after the other on every thread.
    const int ntensors = a.beta_cols ? 5 : 4;
    for (int i = warp; i < ntensors; i += nw) {
      const bool rows_k = i < 3;  // q, k, g: K columns; v, beta: the tile's columns
      const TokenRows& t = i == 0 ? a.q : i == 1 ? a.k : i == 2 ? a.g : i == 3 ? a.v : a.beta;
      const size_t off = i == 0 ? lay.q : i == 1 ? lay.k : i == 2 ? lay.a : i == 3 ? lay.v : lay.beta;
      stage_rows(smem + off, t, i == 4 ? bes : i == 2 ? ges : es, i == 0 || i == 1 ? h : hv, b, s0, nb, rows_k ? 0 : col0,
                 rows_k ? KP : bvt, rows_k ? Kc : Vc, lane, 32);
    }
    if (!a.beta_cols && tid < nb) {  // one value per head, activated in step 2
      beta_raw = load_scalar(a.beta.p, a.beta.dtype, a.beta.offset(b, s0 + tid, hv));
    }
    if (per_token && tid < nb) {
      const int64_t t = i0 + tid;  // ids outside the pool: no write (as -1)
      const int64_t w = t < a.idx_cols ? a.state_indices.load_int(n * a.idx_s0 + t * a.idx_s1) : -1;
      tok_slot = w >= 0 && w < a.final_state.slots && w != a.pad_slot ? static_cast<int>(w) : -1;
    }
    cp_async_commit();
  };
  // `pending`: cp.async groups committed after the batch's that may stay in flight (the state tile's passes).
  auto commit = [&](int nb, int pending) {
    if (!a.beta_cols && tid < nb) sB[tid * bvt] = beta_raw;
    if (per_token && tid < nb) sSlot[tid] = tok_slot;
    cp_async_wait(pending);
    __syncthreads();
  };
  if (len > 0) stage(0, static_cast<int>(len < tb ? len : tb));  // before the state: it does not wait for the slots

  // The slots. A sequence whose (read) slot is padding -- pad_slot, negative, or outside the pool (the host cannot
  // check device-side ids without a synchronisation) -- reads and writes no state and its outputs are zeros.
  int64_t rslot64 = slot1, wslot64 = idx2d ? -1 : slot1;
  if (idx2d) rslot64 = acc >= 1 && acc <= a.idx_cols ? a.state_indices.load_int(n * a.idx_s0 + (acc - 1) * a.idx_s1) : -1;
  bool pad = tail;
  if (a.state_indices.present()) {
    const int64_t pool_slots = a.initial.present() ? a.initial.slots : a.final_state.slots;
    pad = pad || rslot64 < 0 || rslot64 == a.pad_slot || rslot64 >= pool_slots;
  }
  if (pad) {
    cp_async_wait(0);  // the token rows' copies land before the CTA's shared memory is released
    for (int e = tid; e < len * bvt; e += nthreads) {
      const int r = e / bvt, c = e - r * bvt;
      if (col0 + c < a.V) a.out.store(a.out.offset(b, int64_t(t0) + r, hv) + col0 + c, 0.f);
    }
    if (a.token_states.present()) {  // rows of a padding sequence's tokens hold zeros
      const int ncols = a.V - col0 < bvt ? a.V - col0 : bvt;
      for (int r = 0; r < len; ++r) {
        const int64_t blk = a.token_states.block(int64_t(b) * a.T + t0 + r, hv);
        for (int e = tid; e < a.K * ncols; e += nthreads) {
          const int d = e / ncols, c = col0 + (e - d * ncols);
          a.token_states.store(blk + (VK ? int64_t(c) * a.K + d : int64_t(d) * a.V + c), 0.f);
        }
      }
    }
    return;
  }
  if (!a.initial.present() || has == 0) rslot64 = -1;
  if (!a.final_state.present() || wslot64 < 0 || wslot64 >= a.final_state.slots) wslot64 = -1;
  const int rslot = static_cast<int>(rslot64), wslot = static_cast<int>(wslot64);  // -1 or a slot of the pool (int32)
  const bool has_src = rslot >= 0;
  auto src = [&]() { return static_cast<const PoolT*>(a.initial.p) + a.initial.block(rslot, hv); };

  // The state tile: with stage_state every pass's copies are issued here, one cp.async group per pass (empty ones
  // too, so that the group count is the same for every thread), and stay in flight while the token inputs are
  // prepared and while earlier passes compute.
  // ROWS ([K,V] whole tiles): staged in row order, copied and written by row segments (state_io.cuh, KvRows).
  // WHOLE (fp32 pools, or at most one token): the whole CTA tile in one group, kept in shared memory throughout:
  // each token runs the passes on it (ldmatrix in, stmatrix back), and state outputs are written by whole row
  // segments, two barriers per output instead of two per pass. Between tokens the state then lives in the pool's
  // dtype, so a bf16 pool's longer sequences take the passes one by one instead (the state in fp32 registers across
  // tokens), each pass its own tile (or, with KV_REGS, all passes' tiles at once).
  constexpr bool ROWS = FULL && !VK;
  const bool whole = WIDE == 0 && ROWS && !a.kv_regs && (std::is_same<PoolT, float>::value || len <= 1);  // CTA-uniform
  const int tile_vecs = L::NVEC * nthreads * 16 + (ROWS ? int(kDecodeKvRowPad) : 0);  // bytes of one pass
  char* sTile = smem + lay.state;
  // Where a warp's vectors lie (FULL: K = KP and no masks, so offsets and bounds are compile-time where possible).
  auto place = [&](int wcol0) {
    if constexpr (FULL) {
      const Place pf = place_of<L, VK>(KP, a.V, wcol0, lane);  // [K,V]: V is the row stride
      return Place{pf.off, pf.step, 1 << 20, 1 << 20};
    } else {
      return place_of<L, VK>(Kc, Vc, wcol0, lane);
    }
  };
  // FULL without an initial state: the copies zero-fill the tile (no zeroing branch per pass).
  const PoolT* from = has_src ? src() + (VK ? 0 : col0) : static_cast<const PoolT*>(a.initial.p);
  if (whole) {
    issue_rows_async<PoolT, KP>(from, a.V, sTile, nthreads, has_src ? 16 : 0, passes);
    cp_async_commit();
  } else if (stage_state) {
    for (int p = 0; p < passes; ++p) {
      if constexpr (ROWS) {
        issue_rows_async<PoolT, KP>(has_src ? from + p * bv : from, a.V, sTile + size_t(p) * tile_vecs, nthreads,
                                    has_src ? 16 : 0, 1);
      } else if constexpr (VK) {
        if (FULL || has_src) {
          issue_block_async<PoolT, KP>(has_src ? src() : static_cast<const PoolT*>(a.initial.p),
                                       place(col0 + p * bv + warp * kDecodeWarpCols), sState + size_t(p) * tile_vecs,
                                       nthreads, has_src ? 16 : 0);
        }
      }
      cp_async_commit();
    }
  }
  const int state_groups = whole ? 1 : stage_state ? passes : 0;
  if (later_slot >= 0) {
    prefetch_tile_l2<PoolT, KP>(static_cast<const PoolT*>(a.initial.p) + a.initial.block(later_slot, later_hv), a.V,
                                later_vt, bvt, later_one_range);
  }

  // The head's gate parameters to shared memory (read by step 2 of every batch).
  float* sBias = reinterpret_cast<float*>(smem + lay.bias);
  float* sAlog = reinterpret_cast<float*>(smem + lay.a_log);
#pragma unroll
  for (int i = 0; i < NBIAS; ++i) {
    const int d = tid + i * nthreads;
    if (d < KP) sBias[d] = bias_r[i];
  }
  if (tid == 0) *sAlog = alog_r;

  // Steps 1-2 for the batch of nb tokens from i0: staged (the first batch's copies were issued above; `first`), then
  // prepared in shared memory.
  auto prepare = [&](int i0, int nb, bool first) {
    if (!first) {
      __syncthreads();  // the previous batch's readers are done
      stage(i0, nb);
      commit(nb, 0);
    } else {
      commit(nb, state_groups);
    }

    // 2. Per token, one warp each for (a) the L2 norms and q.k, (b) the gate and (c) v and the beta
    //    activation (three tasks: at T = 1 three of four warps work, and the gate's chain is not followed by
    //    v's). A warp reads its raw values into registers before widening them in place (__syncwarp between).
    for (int task = warp; task < 3 * nb; task += nw) {
      const int tt = task / 3, kind = task - 3 * tt;
      if (kind == 0) {
        float* q = sQ + tt * KP;
        float* k = sK + tt * KP;
        const char* rq = reinterpret_cast<const char*>(q) + (4 - es) * KP;
        const char* rk = reinterpret_cast<const char*>(k) + (4 - es) * KP;
        float xq[KL], xk[KL];
#pragma unroll
        for (int i = 0; i < KL; ++i) {
          xq[i] = raw_at(rq, in_dt, lane + 32 * i);
          xk[i] = raw_at(rk, in_dt, lane + 32 * i);
        }
        float sq, sk, qk;
        norm_sums<KL>(xq, xk, sq, sk, qk);
        const float eps = static_cast<float>(math::kL2NormEps);
        const float nq = a.l2norm ? rsqrtf(sq + eps) : 1.f;
        const float nk = a.l2norm ? rsqrtf(sk + eps) : 1.f;
        const float qs = nq * a.scale;
        __syncwarp();  // every lane has read its raw values
#pragma unroll
        for (int i = 0; i < KL; ++i) {
          q[key_pos<L, VK>(lane + 32 * i)] = xq[i] * qs;
          k[key_pos<L, VK>(lane + 32 * i)] = xk[i] * nk;
        }
        if (lane == 0) sQK[tt] = qk * qs * nk;
      } else if (kind == 1) {
        float* g = sA + tt * KP;
        const char* rg = reinterpret_cast<const char*>(g) + (4 - ges) * KP;
        float x[KL];
#pragma unroll
        for (int i = 0; i < KL; ++i) x[i] = raw_at(rg, g_dt, lane + 32 * i);
        const GateLog2 gate(a.gate_mode, *sAlog, a.A_log.present(), a.lower_bound);
        __syncwarp();
#pragma unroll
        for (int i = 0; i < KL; ++i) {
          const int d = lane + 32 * i;
          // keys past K hold zero state; any finite factor works
          g[key_pos<L, VK>(d)] = d < Kc ? fast_exp2(gate(a.gate_mode != GateMode::kPreGated ? x[i] + sBias[d] : x[i])) : 0.f;
        }
      } else {  // v and beta of the tile's columns
        float* v = sV + tt * bvt;
        float* bt = sB + tt * bvt;
        const char* rv = reinterpret_cast<const char*>(v) + (4 - es) * bvt;
        const char* rb = reinterpret_cast<const char*>(bt) + (4 - bes) * bvt;
        float xv[MC], xb[MC];
#pragma unroll
        for (int i = 0; i < MC; ++i) {
          const int c = lane + 32 * i;
          xv[i] = xb[i] = 0.f;
          if (c < bvt) {
            xv[i] = raw_at(rv, in_dt, c);
            xb[i] = a.beta_cols ? raw_at(rb, a.beta.dtype, c) : bt[0];
          }
        }
        __syncwarp();
#pragma unroll
        for (int i = 0; i < MC; ++i) {
          const int c = lane + 32 * i;
          if (c < bvt) {
            v[c] = xv[i];
            bt[c] = beta_fast(xb[i], a.beta_sigmoid, a.neg_eigval);
          }
        }
      }
    }
    __syncthreads();
  };

  // 3. Token tt of the batch from i0 on the state of the pass starting at tile column pc0, in registers. With a bf16
  // pool (OUT_VIA_SMEM) its outputs replace the token's v in shared memory (each column's v is read only by the lanes
  // of its column group, one warp, before the __syncwarp) and leave by `flush_outputs`, one dtype dispatch per element
  // a CTA stores instead of the store code in every thread's token step; an fp32 pool's token step has spare issue
  // slots, and there the direct store is faster (docs/perf-notes.md).
  constexpr bool OUT_VIA_SMEM = !std::is_same<PoolT, float>::value;
  auto run_token = [&](int tt, int i0, int pc0, float (&S)[NJ][ND]) {
    const float* q = sQ + tt * KP;
    const float* k = sK + tt * KP;
    const float* g = sA + tt * KP;
    const float qk = sQK[tt];
    if constexpr (OUT_VIA_SMEM) {
      token_step_smem_out<L, L, VK>(S, q, k, g, sV + tt * bvt, sB + tt * bvt, qk, [&](int jj) {
        return pc0 + warp * kDecodeWarpCols + col_of<L, VK>(jj, lane);  // column within the CTA tile
      });
    } else {
      const int64_t orow = a.out.offset(b, int64_t(t0) + i0 + tt, hv) + col0;
      float e[NJ];
      token_sums_e<L, VK>(S, staged_keys<L, VK>(q, k, g, lane), [&](int jj, float pk, float pq, bool store) {
        const int cl = pc0 + warp * kDecodeWarpCols + col_of<L, VK>(jj, lane);  // column within the CTA tile
        const float ej = sB[tt * bvt + cl] * (sV[tt * bvt + cl] - pk);
        if (store && col0 + cl < Vc) a.out.store(orow + cl, fmaf(qk, ej, pq));
        return ej;
      }, e);
      token_update<L>(S, [&](int dd, float (&k_)[GRP]) { load_keys<GRP>(k + key_unit<L, VK>(dd, lane), k_); }, e);
    }
  };
  // With OUT_VIA_SMEM, the outputs of tokens [i0, i0 + nb) in tile columns [c_lo, c_hi) from shared memory
  // (CTA-uniform calls: the barrier publishes every warp's outputs; the next batch's staging waits at its own barrier).
  auto flush_outputs = [&](int i0, int nb, int c_lo, int c_hi) {
    if constexpr (!OUT_VIA_SMEM) return;
    __syncthreads();
    const int ncols = c_hi - c_lo;
    for (int el = tid; el < nb * ncols; el += nthreads) {
      const int r = el / ncols, c = c_lo + (el - r * ncols);
      if (col0 + c < Vc) a.out.store(a.out.offset(b, int64_t(t0) + i0 + r, hv) + col0 + c, sV[r * bvt + c]);
    }
  };

  // WIDE: tokens outer, the state in fp32 registers across tokens, every state output stored from them.
  if constexpr (WIDE > 0) {
    const int c = wide_kv_col<WIDE>(warp, lane);
    float S[WIDE][KP / 8];
    auto put = [&](const StateRef& st, int64_t block) {
      wide_kv_store<KP, WIDE>(static_cast<PoolT*>(st.p) + block + col0, a.V, c, lane, S);
    };
    {
      typename WideKvTile<KP, WIDE>::Raw raw[KP / 8];
      if (has_src) wide_kv_load<KP, WIDE>(src() + col0, a.V, c, lane, raw);
      if (len > 0) prepare(0, static_cast<int>(len < tb ? len : tb), true);  // under the state loads
      wide_kv_widen<KP, WIDE>(raw, has_src, S);
    }
    for (int i0 = 0; i0 < len; i0 += tb) {
      const int nb = static_cast<int>(len - i0 < tb ? len - i0 : tb);
      if (i0 > 0) prepare(i0, nb, false);
      for (int tt = 0; tt < nb; ++tt) {
        wide_kv_token<KP, WIDE>(S, sQ + tt * KP, sK + tt * KP, sA + tt * KP, sV + tt * bvt, sB + tt * bvt, sQK[tt], c);
        if (a.token_states.present()) put(a.token_states, a.token_states.block(int64_t(b) * a.T + t0 + i0 + tt, hv));
        if (per_token && sSlot[tt] >= 0) put(a.final_state, a.final_state.block(sSlot[tt], hv));
      }
      flush_outputs(i0, nb, 0, bvt);
    }
    if (wslot >= 0) put(a.final_state, a.final_state.block(wslot, hv));
    return;
  }

  // bf16 [K,V] whole tiles of longer sequences at one or two passes (KV_REGS, the host's choice): tokens outer, every
  // pass's state in fp32 registers across tokens (so the per-pass order's numbers, to the bit), each state output
  // staged for all passes at once and written by row segments. One barrier per output: the staging alternates between
  // the tile and a second buffer after it, so a buffer is written again only after every thread passed the barrier of
  // the output in between (its reads of the buffer are done). A warp's ldmatrix / stmatrix words are its own.
  if constexpr (ROWS && KP == 128 && !std::is_same<PoolT, float>::value) {
    if (a.kv_regs) {
      float S2[2][NJ][ND];
      const size_t second = size_t(passes) * tile_vecs;  // the second buffer's offset from the tile
      bool buf = false;
      auto load_regs = [&]() {
        cp_async_wait(0);
        __syncthreads();  // the tile's rows were copied by other threads
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          if (p < passes) load_rows_staged<PoolT, KP>(S2[p], sTile + size_t(p) * tile_vecs, nthreads, 0, 1);
        }
      };
      auto store_regs = [&](const StateRef& st, int64_t block) {  // CTA-uniform calls
        char* sm = sTile + (buf ? second : 0);
        buf = !buf;
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          if (p < passes) stage_block_out<PoolT, KP>(S2[p], sm + size_t(p) * tile_vecs, nthreads, 0, 1);
        }
        __syncthreads();
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          if (p < passes) {
            store_rows<PoolT, KP>(static_cast<PoolT*>(st.p) + block + col0 + p * bv, a.V, sm + size_t(p) * tile_vecs,
                                  nthreads, 1);
          }
        }
      };
      if (len <= 0) load_regs();  // an empty sequence: its final state is its initial state
      for (int i0 = 0; i0 < len; i0 += tb) {
        const int nb = static_cast<int>(len - i0 < tb ? len - i0 : tb);
        prepare(i0, nb, i0 == 0);
        if (i0 == 0) load_regs();
        for (int tt = 0; tt < nb; ++tt) {
#pragma unroll
          for (int p = 0; p < 2; ++p) {
            if (p < passes) run_token(tt, i0, p * bv, S2[p]);
          }
          if (a.token_states.present()) {
            store_regs(a.token_states, a.token_states.block(int64_t(b) * a.T + t0 + i0 + tt, hv));
          }
          if (per_token && sSlot[tt] >= 0) store_regs(a.final_state, a.final_state.block(sSlot[tt], hv));
        }
        flush_outputs(i0, nb, 0, bvt);
      }
      if (wslot >= 0) store_regs(a.final_state, a.final_state.block(wslot, hv));
      return;
    }
  }

  if (whole) {
    // The whole tile's rows to a state output (CTA-uniform calls): every thread's words are in by the first barrier,
    // and the tile is not written again before the second.
    auto store_tile = [&](const StateRef& st, int64_t block, bool again) {
      __syncthreads();
      store_rows<PoolT, KP>(static_cast<PoolT*>(st.p) + block + col0, a.V, sTile, nthreads, passes);
      if (again) __syncthreads();
    };
    for (int i0 = 0; i0 < len; i0 += tb) {
      const int nb = static_cast<int>(len - i0 < tb ? len - i0 : tb);
      prepare(i0, nb, i0 == 0);
      if (i0 == 0) {
        cp_async_wait(0);
        __syncthreads();  // the tile's rows were copied by other threads
      }
      for (int tt = 0; tt < nb; ++tt) {
        for (int p = 0; p < passes; ++p) {
          float S[NJ][ND];
          load_rows_staged<PoolT, KP>(S, sTile, nthreads, p, passes);
          run_token(tt, i0, p * bv, S);
          stage_block_out<PoolT, KP>(S, sTile, nthreads, p, passes);
        }
        if (a.token_states.present()) {
          store_tile(a.token_states, a.token_states.block(int64_t(b) * a.T + t0 + i0 + tt, hv), true);
        }
        if (per_token && sSlot[tt] >= 0) store_tile(a.final_state, a.final_state.block(sSlot[tt], hv), true);
      }
      flush_outputs(i0, nb, 0, bvt);
    }
    if (len <= 0) cp_async_wait(0);  // an empty sequence: its final state is its initial state
    if (wslot >= 0) store_tile(a.final_state, a.final_state.block(wslot, hv), false);
    return;
  }

  // A state output of the pass starting at tile column pc0 (ROWS: by row segments through the pass's tile, whose
  // state is in registers by now; the calls are CTA-uniform, as their barriers need).
  auto store_state = [&](const StateRef& st, int64_t block, int pc0, const Place& pl, const float (&S)[NJ][ND]) {
    if constexpr (ROWS) {
      store_tile_rows<PoolT, KP>(S, static_cast<PoolT*>(st.p) + block + col0 + pc0, a.V,
                                 sTile + size_t(pc0 / bv) * tile_vecs, nthreads);
    } else {
      store_block<PoolT, L, VK, FULL>(S, st, block, pl);
    }
  };

  // A sequence of one batch (len <= tb, every serving call) prepares its tokens once for all passes; longer ones
  // stage and prepare every batch again in every pass.
  const bool multi = len > tb;
  for (int p = 0; p < passes; ++p) {
    const int pc0 = p * bv;                                  // the pass's first column within the tile
    const int wcol0 = col0 + pc0 + warp * kDecodeWarpCols;  // this warp's first value column
    const Place pl = place(wcol0);
    float S[NJ][ND];
    // The pass's state into registers: its own copies are complete once at most the later passes' groups are in
    // flight. Without an initial state: zero.
    auto load_pass = [&]() {
      if (stage_state) {
        cp_async_wait(passes - 1 - p);
        if constexpr (ROWS) {
          __syncthreads();  // the pass's rows were copied by other threads
          load_rows_staged<PoolT, KP>(S, sTile + size_t(p) * tile_vecs, nthreads, 0, 1);
        } else if constexpr (VK) {
          if (FULL || has_src) load_block_staged<PoolT, KP>(S, src(), pl, sState + size_t(p) * tile_vecs, nthreads);
        }
      } else if (has_src) {
        load_block<PoolT, VK, KP>(S, src(), pl, a.initial.vec);  // never FULL
      }
      if (!FULL && !has_src) {
#pragma unroll
        for (int jj = 0; jj < NJ; ++jj) {
#pragma unroll
          for (int dd = 0; dd < ND; ++dd) S[jj][dd] = 0.f;
        }
      }
    };
    if (len <= 0) load_pass();  // an empty sequence: its final state is its initial state
    for (int i0 = 0; i0 < len; i0 += tb) {
      const int nb = static_cast<int>(len - i0 < tb ? len - i0 : tb);
      if (p == 0 || multi) prepare(i0, nb, p == 0 && i0 == 0);
      if (i0 == 0) load_pass();  // after the first preparation, which the state's copies overlap
      for (int tt = 0; tt < nb; ++tt) {
        run_token(tt, i0, pc0, S);
        if (a.token_states.present()) {
          store_state(a.token_states, a.token_states.block(int64_t(b) * a.T + t0 + i0 + tt, hv), pc0, pl, S);
        }
        if (per_token) {
          const int w = sSlot[tt];
          if (w >= 0) store_state(a.final_state, a.final_state.block(w, hv), pc0, pl, S);
        }
      }
      if (multi) flush_outputs(i0, nb, pc0, pc0 + bv);  // this batch is staged again for the next pass
    }
    if (wslot >= 0) store_state(a.final_state, a.final_state.block(wslot, hv), pc0, pl, S);
  }
  if (!multi && len > 0) flush_outputs(0, len, 0, bvt);  // one batch, prepared once for every pass
}

}  // namespace kdakit::cuda
