// The decode's one-token form: calls whose sequences have at most one token (the engines' decode step), or varlen calls
// of at most N tokens whose lengths live on the device (a longer sequence then runs token by token). Each thread
// loads and prepares in registers exactly the inputs it uses, with no barrier; its state goes straight to registers
// (one pass) or, at large batches (STAGED), through the thread's own slots of a staged tile (docs/ARCHITECTURE.md).
#pragma once

#include "common/kda_math.h"
#include "cuda/common/gate.cuh"
#include "cuda/decode/inputs.cuh"
#include "cuda/decode/token_math.cuh"

namespace kdakit::cuda {
namespace decode_detail {

// The whole call for this CTA's tile (all its passes). Its sequence has at most one token, or (MULTI: varlen calls
// of at most N tokens whose lengths the host could not read) any number, a longer one run token by token, each token
// exactly as a one-token sequence's (the same loads, preparation and token math, the state in registers between
// tokens, as the general form keeps it). Needs what the host checked (DecodeConfig::one): K == KP, whole V tiles,
// vector-aligned token rows and states in the pool's dtype, 1-D or no slot indices, no per-token states, q, k, v,
// g, beta and out of one dtype (In), dt_bias and A_log float32. Element types are compile-time here: at small batches a CTA's time is mostly the fetch of the
// instructions it runs (docs/perf-notes.md), and run-time dtype switches per load multiply them.
// A sequence's scalars for the one-token form, loaded before anything waits (int32 slot ids and cu_seqlens: the
// host checked). The slot's load starts the chain slot -> state -> token math, so it is the kernel's first load.
// row: the token tensors' row of its token (OneRows): the token with cu_seqlens, the batch row n otherwise.
// pad: the sequence is padding (its slot is, or it is the padded token tail): zero outputs, no state.
struct OneTokenSeq {
  int slot1, has, row, len;
  bool pad;
  __device__ __forceinline__ explicit OneTokenSeq(const DecodeOneArgs& o) {
    const int n = o.cta_row();
    const bool tail = o.tokens > 0 && n == o.grid_rows() - 1;  // the padded token tail's CTA row
    slot1 = o.state_indices != nullptr && !tail ? o.slot_of(n) : n;
    pad = tail || (o.state_indices != nullptr && o.padding(slot1));
    has = 1;
    if (o.has_initial_state != nullptr && !tail) {
      has = static_cast<int>(
          DynPtr{const_cast<void*>(o.has_initial_state), o.has_dtype()}.load_int(n * int(o.has_stride)));
    }
    if (o.cu_seqlens != nullptr) {
      row = __ldg(o.cu_seqlens + n * int(o.cu_stride));
      len = (tail ? o.tokens : __ldg(o.cu_seqlens + (n + 1) * int(o.cu_stride))) - row;
    } else {
      row = n;
      len = o.T();
    }
  }
};

// A padding sequence's outputs: zeros at this CTA's columns of its len rows.
template <typename In>
__device__ __forceinline__ void zero_rows(const DecodeOneArgs& o, int row, int len, int hv, int col0, int ncols) {
  for (int e = threadIdx.x; e < len * ncols; e += blockDim.x) {
    const int r = e / ncols, c = e - r * ncols;
    static_cast<In*>(o.out.p)[o.out.offset(row + r, hv) + col0 + c] = from_float<In>(0.f);
  }
}

// Side: g and beta's element type (In, or float32 next to 16-bit inputs).
template <typename PoolT, bool VK, int KP, bool STAGED, bool MULTI, typename In, typename Side>
__device__ __forceinline__ void decode_one_token(const DecodeOneArgs& o, const OneTokenSeq& sq_) {
  using L = Tile<PoolT, VK, KP>;
  constexpr int ND = L::ND, NJ = L::NJ, KL = L::KL;
  constexpr int RUN = VK ? L::VEC : (ND < 8 ? ND : 8);  // consecutive keys of a thread per load (load_run)
  // The gate: the 4 threads that differ only in their columns (lane bits 3-4 v-first, 0-1 [K,V]) hold the same keys;
  // each computes a quarter of them and takes the rest by shuffles (the softplus is the preparation's longest part).
  constexpr int QN = ND / 4;
  static_assert(QN <= RUN, "a quarter of a thread's keys lies in one run");
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int hv = static_cast<int>(blockIdx.y);
  const int h = o.group_shift >= 0 ? hv >> o.group_shift : hv / o.group;
  // The CTA tile: `passes` column groups of bv = 8 * warps columns (STAGED; one otherwise); this warp's columns of
  // pass p start at wcol0 + p * bv. The thread's keys, and so its q, k and gate, are the same in every pass.
  const int passes = STAGED ? o.passes() : 1, bv = (blockDim.x >> 5) * kDecodeWarpCols;
  const int wcol0 = o.cta_vtile() * bv * passes + warp * kDecodeWarpCols;
  const bool one_range = VK || passes * bv == int(o.V);  // the CTA tile is one contiguous range of the pool

  // Token inputs: every load is issued before any is used (the inputs' offsets do not depend on the slot; with
  // cu_seqlens they wait for the sequence's start).
  const int slot1 = sq_.slot1, has = sq_.has, row = sq_.row, len = sq_.len;
  if (sq_.pad) {
    zero_rows<In>(o, row, len, hv, o.cta_vtile() * bv * passes, bv * passes);
    return;
  }
  LaterTile later;
  if constexpr (STAGED) later.locate<VK, KP>(o, one_range);
  if (!MULTI && len > 1) return;  // not reached: without MULTI the host knows every length
  const bool tok = MULTI ? len >= 1 : len == 1;
  const bool multi = MULTI && len > 1;
  // v and beta at this thread's NJ columns of pass p, loaded one pass ahead of their use. beta per head (not per
  // column): one value, activated once.
  float xq[ND], xk[ND], xg[QN], bias[QN], xv[NJ], xb[NJ], nq_raw[KL], nk_raw[KL];
  float beta_head = 0.f;
  const int dd0 = (VK ? (lane >> 3) : (lane & 3)) * QN;  // the first of this thread's gate keys (slot index)
  const int gkey = key_of<L, VK>(dd0, lane);
  float alog = 0.f;
  const In* v = nullptr;
  const Side* bt = nullptr;
  auto load_v_beta = [&](int p, float (&xv_)[NJ], float (&xb_)[NJ]) {
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) {
      const int c = p * bv + col_of<L, VK>(jj, lane);
      xv_[jj] = to_float(__ldg(v + c));
      if (o.beta_cols()) xb_[jj] = to_float(__ldg(bt + c));
    }
  };
  // Token r's q and k at the thread's keys and the norms' keys, and its gate inputs. Offsets in 32 bits (the host
  // checked that every token tensor's do), pointers advanced by compile-time steps.
  auto load_qkg = [&](int r) {
    const In* q = static_cast<const In*>(o.q.p) + o.q.offset(r, h);
    const In* k = static_cast<const In*>(o.k.p) + o.k.offset(r, h);
    const int d0 = key_of<L, VK>(0, lane);
#pragma unroll
    for (int j = 0; j < ND / RUN; ++j) {
      const int dr = key_of<L, VK>(j * RUN, 0) - key_of<L, VK>(0, 0);  // compile-time
      load_run<RUN>(q + d0 + dr, &xq[j * RUN]);
      load_run<RUN>(k + d0 + dr, &xk[j * RUN]);
    }
#pragma unroll
    for (int i = 0; i < KL; ++i) {  // the norms' keys (norm_sums): loaded beside the thread's own, in flight together
      nq_raw[i] = to_float(__ldg(q + lane + 32 * i));
      nk_raw[i] = to_float(__ldg(k + lane + 32 * i));
    }
    load_run<QN>(static_cast<const Side*>(o.g.p) + o.g.offset(r, hv) + gkey, xg);
  };
  // Token r's v and beta rows; beta per head loaded here (activated in the preparation).
  auto locate_v_beta = [&](int r) {
    v = static_cast<const In*>(o.v.p) + o.v.offset(r, hv) + wcol0;
    bt = static_cast<const Side*>(o.beta.p) + o.beta.offset(r, hv) + (o.beta_cols() ? wcol0 : 0);
    if (!o.beta_cols()) beta_head = to_float(__ldg(bt));
  };
  if (tok) {
    load_qkg(row);
    if (o.gate_mode() != 0 && o.dt_bias != nullptr) {
      load_run<QN>(o.dt_bias + hv * KP + gkey, bias);
    } else {
#pragma unroll
      for (int i = 0; i < QN; ++i) bias[i] = 0.f;
    }
    alog = o.A_log != nullptr ? __ldg(o.A_log + hv) : 0.f;
    locate_v_beta(row);
    load_v_beta(0, xv, xb);
  }

  // The slot (ids outside the pool: neither read nor written), then the state's loads. One pass: straight into
  // registers. Several (large batches): the whole CTA tile is issued now as cp.async copies into shared memory, so
  // the bytes in flight are bounded by shared memory rather than registers. v-first: into each thread's own slots,
  // one group per pass, which cp.async.wait_group alone orders; [K,V]: by row segments of the whole tile (full
  // cache lines per copy instruction, where a pass's columns are a fraction of each row), one group and a barrier,
  // and written back the same way after the last pass.
  const int rslot = o.initial == nullptr || has == 0 ? -1 : slot1;  // not padding: a slot of the pool (or n)
  const int wslot = o.final_state == nullptr ? -1 : slot1;
  const Place pf = place_of<L, VK>(KP, o.V, wcol0, lane);
  auto place = [&](int p) {  // pass p: bv columns further (VK: rows of K elements; [K,V]: elements)
    return Place{pf.off + p * bv * (VK ? KP : 1), pf.step, 1 << 20, 1 << 20};
  };
  const size_t head_block = size_t(hv) * KP * o.V;  // dense heads (the host checked)
  const PoolT* src =
      rslot >= 0 ? static_cast<const PoolT*>(o.initial) + int64_t(rslot) * o.slot_stride + head_block : nullptr;
  extern __shared__ __align__(16) char one_smem[];
  char* staged = one_smem + size_t(tid) * 16;  // this thread's slots
  const int pass_bytes = L::NVEC * static_cast<int>(blockDim.x) * 16;  // v-first: a pass's slots
  const int tile_col0 = o.cta_vtile() * bv * passes;  // the CTA tile's first column
  float S[NJ][ND];
  auto zero_state = [&]() {
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) {
#pragma unroll
      for (int dd = 0; dd < ND; ++dd) S[jj][dd] = 0.f;
    }
  };
  if (STAGED) {
    if (rslot >= 0) {
      if constexpr (VK) {
        for (int p = 0; p < passes; ++p) {
          issue_block_async<PoolT, KP>(src, place(p), staged + size_t(p) * pass_bytes, blockDim.x);
          cp_async_commit();
        }
      } else {  // the whole CTA tile by row segments, one group (state_io.cuh, KvRows)
        issue_rows_async<PoolT, KP>(src + tile_col0, o.V, one_smem, blockDim.x, 16, passes);
        cp_async_commit();
      }
    }
    later.prefetch<PoolT, VK, KP>(o, passes * bv, one_range);
  } else if (rslot >= 0) {
    load_block<PoolT, VK, KP>(S, src, place(0), true);
  } else {
    zero_state();
  }

  // The preparation, once for all passes: the same operations in the same order as the general path (norm_sums,
  // its preparation and token math), so that a sequence's bits do not depend on which form ran it.
  float gv[ND], qkn = 0.f;
  auto prepare = [&]() {
    float sq, sk, qk;
    norm_sums<KL>(nq_raw, nk_raw, sq, sk, qk);
    const float eps = static_cast<float>(math::kL2NormEps);
    const bool l2 = o.l2norm();
    const float qs = (l2 ? rsqrtf(sq + eps) : 1.f) * o.scale, nk = l2 ? rsqrtf(sk + eps) : 1.f;
    qkn = qk * qs * nk;
    if (!o.beta_cols()) beta_head = beta_fast(beta_head, o.beta_sigmoid(), o.neg_eigval());
#pragma unroll
    for (int dd = 0; dd < ND; ++dd) {
      xq[dd] *= qs;
      xk[dd] *= nk;
    }
    const GateLog2 gate(static_cast<GateMode>(o.gate_mode()), alog, o.A_log != nullptr, o.lower_bound);
    float gq[QN];
    gate.exp_gates<QN>(xg, bias, gq);
#pragma unroll
    for (int dd = 0; dd < ND; ++dd) {
      const int from = VK ? (dd / QN) * 8 + (lane & 7) : (lane & ~3) | (dd / QN);
      gv[dd] = __shfl_sync(0xffffffffu, gq[dd % QN], from);
    }
  };
  if (tok) prepare();
  const int orow = tok ? o.out.offset(row, hv) + wcol0 : 0;
  // The token at output row offset orow_, on pass p's columns: S *= exp(g); kS and qS in one pass; e = beta (v - kS);
  // o = qS + (q.k) e; S += k e^T.
  auto token_step = [&](int p, int orow_) {
    constexpr int GRP = L::GRP;
    float e[NJ];
    token_sums_e<L, VK>(S, [&](int dd, float (&q_)[GRP], float (&k_)[GRP], float (&g_)[GRP]) {
#pragma unroll
      for (int i = 0; i < GRP; ++i) {
        q_[i] = xq[dd + i];
        k_[i] = xk[dd + i];
        g_[i] = gv[dd + i];
      }
    }, [&](int jj, float pk, float pq, bool store) {
      const float bj = o.beta_cols() ? beta_fast(xb[jj], o.beta_sigmoid(), o.neg_eigval()) : beta_head;
      const float ej = bj * (xv[jj] - pk);
      if (store) static_cast<In*>(o.out.p)[orow_ + p * bv + col_of<L, VK>(jj, lane)] = from_float<In>(fmaf(qkn, ej, pq));
      return ej;
    }, e);
    token_update<L>(S, [&](int dd, float (&k_)[GRP]) {
#pragma unroll
      for (int i = 0; i < GRP; ++i) k_[i] = xk[dd + i];
    }, e);
  };

  for (int p = 0; p < passes; ++p) {
    if (STAGED) {
      if (rslot >= 0) {
        if constexpr (VK) {  // this pass's copies are complete once at most the later passes' groups are in flight
          cp_async_wait(passes - 1 - p);
          load_block_staged<PoolT, KP>(S, src, place(p), staged + size_t(p) * pass_bytes, blockDim.x);
        } else {
          if (p == 0) {
            cp_async_wait(0);
            __syncthreads();  // the tile's rows were copied by other threads
          }
          load_rows_staged<PoolT, KP>(S, one_smem, blockDim.x, p, passes);
        }
      } else {
        zero_state();
      }
    }
    float nv[NJ], nb[NJ];
    if (tok && !multi && p + 1 < passes) load_v_beta(p + 1, nv, nb);
    if (multi) {
      // Token by token on this pass's columns; pass 0's first token was prepared above.
#pragma unroll 1
      for (int t = 0; t < len; ++t) {
        if (p > 0 || t > 0) {
          load_qkg(row + t);
          locate_v_beta(row + t);
          load_v_beta(p, xv, xb);
          prepare();
        }
        token_step(p, o.out.offset(row + t, hv) + wcol0);
      }
    } else if (tok) {
      token_step(p, orow);
    }
    if (wslot >= 0) {
      PoolT* dst = static_cast<PoolT*>(o.final_state) + int64_t(wslot) * o.slot_stride + head_block;
      if constexpr (!VK && STAGED) {  // into the tile, in place; written by row segments after the last pass
        stage_block_out<PoolT, KP>(S, one_smem, blockDim.x, p, passes);
        if (p + 1 == passes) {
          __syncthreads();
          store_rows<PoolT, KP, false>(dst + tile_col0, o.V, one_smem, blockDim.x, passes);
        }
      } else {
        store_block_t<PoolT, L, VK, false>(S, dst, place(p), true);
      }
    }
    if (tok && !multi && p + 1 < passes) {
#pragma unroll
      for (int i = 0; i < NJ; ++i) {
        xv[i] = nv[i];
        xb[i] = nb[i];
      }
    }
  }
}

// A sequence of more than one token in a MULTI launch: a function of its own (arguments by value, so that the kernel
// does not copy its parameters to local memory), whose registers and spills leave the one-token body's alone.
template <typename PoolT, bool VK, int KP, bool STAGED, typename In, typename Side>
__device__ __noinline__ void decode_one_multi(const DecodeOneArgs o, const OneTokenSeq seq) {
  decode_one_token<PoolT, VK, KP, STAGED, true, In, Side>(o, seq);
}

// The one-token form for this CTA: the sequence's scalars, then the body for q's dtype. STAGED: the state staged in
// shared memory over o.passes() passes; a compile-time flag, so that the one-pass body (small batches, where a CTA's
// time follows the code it fetches) carries no code of the staged one. MULTI: a longer sequence, if any, runs token by
// token (decode_one_multi).
template <typename PoolT, bool VK, int KP, bool STAGED, bool MULTI>
__device__ __forceinline__ void decode_one_call(const DecodeOneArgs& o) {
  const OneTokenSeq seq(o);  // before the dispatch, which waits for a kernel parameter
  const DType in_dt = o.in_dtype();
  if (MULTI && seq.len > 1 && !seq.pad) {
    if (in_dt == DType::kBFloat16) {
      if (o.side32()) decode_one_multi<PoolT, VK, KP, STAGED, __nv_bfloat16, float>(o, seq);
      else decode_one_multi<PoolT, VK, KP, STAGED, __nv_bfloat16, __nv_bfloat16>(o, seq);
    } else if (in_dt == DType::kFloat16) {
      if (o.side32()) decode_one_multi<PoolT, VK, KP, STAGED, __half, float>(o, seq);
      else decode_one_multi<PoolT, VK, KP, STAGED, __half, __half>(o, seq);
    } else {
      decode_one_multi<PoolT, VK, KP, STAGED, float, float>(o, seq);
    }
    return;
  }
  if (in_dt == DType::kBFloat16) {
    if (o.side32()) decode_one_token<PoolT, VK, KP, STAGED, false, __nv_bfloat16, float>(o, seq);
    else decode_one_token<PoolT, VK, KP, STAGED, false, __nv_bfloat16, __nv_bfloat16>(o, seq);
  } else if (in_dt == DType::kFloat16) {
    if (o.side32()) decode_one_token<PoolT, VK, KP, STAGED, false, __half, float>(o, seq);
    else decode_one_token<PoolT, VK, KP, STAGED, false, __half, __half>(o, seq);
  } else {
    decode_one_token<PoolT, VK, KP, STAGED, false, float, float>(o, seq);
  }
}

}  // namespace decode_detail

// The one-token form's kernel: it takes only the packed DecodeOneArgs (at most 192 bytes, DecodeArgs' first bytes), so
// its launch carries a small argument block. MULTI (varlen calls of at most N tokens whose lengths live on the device):
// a longer sequence, if any, runs token by token in the same launch.
template <typename PoolT, bool VK, int KP, bool STAGED, bool MULTI>
__global__ void __launch_bounds__(kDecodeMaxWarps * 32, 4) decode_one_kernel(const DecodeOneArgs o) {
  decode_detail::decode_one_call<PoolT, VK, KP, STAGED, MULTI>(o);
}

}  // namespace kdakit::cuda
