// Kernel arguments of the CUDA chunked forward, derived on the host from kdakit::ForwardParams.
#pragma once

#include <cstdint>

#include "cuda/common/io.cuh"

namespace kdakit::cuda {

// Compile-time shape of the kernels chosen for a call.
struct ForwardConfig {
  int chunk = 64;  // 32 or 64
  int KP = 64;     // K padded: 64, 128, 256
  int BV = 64;     // value columns per recurrence CTA: 16, 32, 64, 128
  bool one_stage = false;  // the recurrence without its prefetch stage (devices with less shared memory)
  bool wgmma = false;      // the recurrence by warpgroup MMAs (sm_90, bf16, chunk 64, K <= 128, BV 64 or 128)
};

// Shared memory per block (bytes) the forward's kernels need for a configuration.
struct ForwardSmem {
  size_t prepare = 0, recurrence = 0;
};

// Varlen batches of at most this many sequences (and no context-parallel cuts) run the recurrence longest first; the
// chunk-offsets kernel (one block of this many threads) ranks them.
constexpr int kMaxOrdered = 1024;

struct TokenTensor {  // [B,T,heads,dim] with a contiguous last dimension
  const void* p = nullptr;
  int64_t sb = 0, st = 0, sh = 0;
  __host__ __device__ int64_t offset(int64_t b, int64_t t, int64_t h) const { return b * sb + t * st + h * sh; }
};

struct ForwardArgs {
  // Inputs.
  TokenTensor q, k, v, g;
  DynPtr beta;
  int64_t beta_sb = 0, beta_st = 0, beta_sh = 0;
  DynPtr A_log, dt_bias;
  int gate_mode = 0;  // 0 pre-gated, 1 softplus, 2 lower bound
  float lower_bound = -5.f;
  float scale = 1.f;
  bool l2norm = false, beta_sigmoid = false, neg_eigval = false;
  bool vec_qk = false;  // q and k rows may be copied in 16-byte pieces (aligned base, strides and K)
  bool vec_v = false;   // likewise v rows (aligned base, strides and V)
  bool vec_g = false;   // likewise g rows (aligned base, strides and K)
  bool pair_qk = false; // q and k elements may be read in aligned pairs (base and strides even in elements)
  bool pair_g = false;  // likewise g
  bool vec_out = false;  // bf16 output rows may be written in 16-byte pieces (aligned base and strides, V % 8 == 0)
  int B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0, group = 1, N = 0;
  DynPtr cu_seqlens;  // absent: fixed length
  int chunk = 64;

  // Workspace: chunk offsets [N+1], then per (chunk slot, v-head) tiles.
  int64_t* chunk_offsets = nullptr;
  int64_t num_slots = 0;  // chunk slots the workspace holds (an upper bound of the real chunks)
  void* ws_w = nullptr;   // [slot][HV][C][KP] Elem
  void* ws_qg = nullptr;  // [slot][HV][C][KP] Elem (scale folded in)
  void* ws_kg = nullptr;  // [slot][HV][C][KP] Elem
  void* ws_u = nullptr;   // [slot][HV][C][VP] Elem
  void* ws_a = nullptr;   // [slot][HV][C][C] Elem (scale folded in, zero above the diagonal)
  void* ws_alo = nullptr; // [slot][HV][C][C] bf16 operands only: Aqk - bf16(Aqk), so Aqk v_new runs on hi + lo
  float* ws_gam = nullptr;  // [slot][HV][KP]
  int KP = 64, VP = 64;

  // Intra-card context parallelism (SPEC §7.5 algebra): a long sequence is cut into chunk-aligned segments whose
  // recurrences run side by side. A scan gives each segment (but the last) its end state from zero, E, and its
  // transition M (K x K); a merge chains S_start(s+1) = M_s S_start(s) + E_s; then every segment runs the ordinary
  // recurrence from its start state. Whether and how a sequence is cut depends on its own length only (and on
  // seg_target, fixed by the head count and the device), so a sequence's result does not depend on its batch.
  int seg_target = 1;        // segments a long sequence is cut into (1: none)
  int seg_min_chunks = 0;    // a sequence is cut only if it has >= 2 seg_min_chunks chunks; segments are >= this
  int64_t* seg_offsets = nullptr;  // [N+1] segments of the sequences before n (with seg_target > 1)
  // [N] the recurrence's sequence order, longest first (varlen batches without cuts, N <= kMaxOrdered): the longest
  // chains start first. Results do not depend on it (every CTA's work is independent of the others).
  int32_t* seq_order = nullptr;
  int64_t num_segments = 0;  // segment slots of the grid and of ws_seg (an upper bound of the real segments)
  float* ws_seg = nullptr;   // [segment][HV][KP][seg_ld] fp32: columns [0, VT*BV) E or a start state, then M
  int seg_ld = 0;

  // Sequence n's segments: their count, and the chunks of each but the last (nch: the sequence's chunks).
  __host__ __device__ __forceinline__ int64_t segments_of(int64_t nch, int64_t& per) const {
    if (seg_target <= 1 || nch < 2 * int64_t(seg_min_chunks)) {
      per = nch;
      return 1;
    }
    per = (nch + seg_target - 1) / seg_target;
    if (per < seg_min_chunks) per = seg_min_chunks;
    return (nch + per - 1) / per;
  }

  // States.
  bool vk = false;
  StateRef initial, final_state;
  DynPtr state_indices, has_initial_state;
  DynPtr inter;  // intermediate states [B|1,NT,HV,*,*]
  int64_t inter_sb = 0, inter_sc = 0, inter_sh = 0;

  // Output [B,T,HV,V].
  DynPtr out;
  int64_t out_sb = 0, out_st = 0, out_sh = 0;

  // Sequence n: batch row, first token, length.
  __device__ __forceinline__ void sequence(int n, int64_t& b, int64_t& t0, int64_t& len) const {
    if (cu_seqlens.present()) {
      b = 0;
      t0 = cu_seqlens.load_int(n);
      len = cu_seqlens.load_int(n + 1) - t0;
    } else {
      b = n;
      t0 = 0;
      len = T;
    }
  }
};

}  // namespace kdakit::cuda
