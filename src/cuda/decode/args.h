// Kernel arguments of the CUDA decode / speculative verify, filled on the host (decode/run.cu) from
// kdakit::DecodeParams and the call's plan (decode/plan.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/common/args.h"
#include "cuda/decode/tile_size.h"

namespace kdakit::cuda {

// A token tensor's rows for the one-token form: the element offset of (row, head) is row * rs + head * sh, where a
// row is a batch row (fixed length: at most one token) or a token (cu_seqlens: one batch row). 32 bits: the host
// checked that every element's offset fits.
struct OneRows {
  void* p = nullptr;
  int rs = 0, sh = 0;
  __device__ __forceinline__ int offset(int row, int h) const { return row * rs + h * sh; }
};

// Everything the one-token form reads, packed into at most 192 bytes (DecodeArgs::one, the first bytes of the general
// kernel's argument block, and the whole argument block of decode_one_kernel).
// - Few constant-cache lines: a kernel's parameters are read through the constant cache, and every line the first
//   reads touch is a miss on the chain of a short kernel.
// - At most 192 bytes: launches with larger argument blocks sometimes took longer from the event before to the event
//   after, depending on where they fell in the command stream; blocks of up to 192 bytes never did
//   (docs/perf-notes.md has the measurements).
// Hence 32-bit strides, 16-bit small strides and counts, a state head's block dense (KP * V elements) and the
// small fields in bits; the host takes the general form where a call does not fit (DecodeConfig::one).
struct DecodeOneArgs {
  OneRows q, k, g, v, beta, out;                     // q, k: head h = hv >> group_shift (or hv / group)
  const float* A_log = nullptr;                      // [HV] float32, or absent
  const float* dt_bias = nullptr;                    // [HV * K] float32 (16-byte aligned), or absent
  const void* state_indices = nullptr;               // [>= N] int32 or int64 (kIdx64), or absent (slot n)
  const int* cu_seqlens = nullptr;                   // [N + 1] int32, or absent (fixed length: at most one token)
  const void* initial = nullptr;                     // pool dtype, or absent
  void* final_state = nullptr;
  const void* has_initial_state = nullptr;           // [N] any integer/bool dtype (rare: read through DynPtr)
  // Both states' slot stride (elements; the host checked they agree); head hv's block starts hv * KP * V further.
  int slot_stride = 0;
  int slots = 0;     // the pool's slots: ids outside [0, slots) are padding
  int pad_slot = -1;  // StateIO::pad_slot_id
  // cu_seqlens: the tokens of the inputs when the last CTA row (blockIdx.x == N) zeroes the padded tail [cu[N], tokens);
  // 0: no tail CTA.
  int tokens = 0;
  float scale = 1.f, lower_bound = -5.f;
  uint16_t idx_stride = 0, cu_stride = 0, has_stride = 0;
  uint16_t group = 1;
  uint16_t V = 0;
  // Staged tiles on Hopper (this form's, and the general form's whole tiles): each CTA prefetches into L2 the state
  // tile of the CTA this many places later in launch order (one per SM: a CTA that starts soon after this one,
  // docs/perf-notes.md); 0: no prefetch. Set for every launch, as the tiling below.
  uint16_t prefetch_ahead = 0;
  int8_t group_shift = -1;
  // Bits 0-3: the column groups per CTA tile (passes; > 1: the state is staged in shared memory by cp.async). Bits
  // 4-7: vt_shift; > 0: the V tiles (a power of two) of one (sequence, head) are adjacent in launch order, in
  // blockIdx.x's low vt_shift bits (else blockIdx.z), so that the CTAs of one state block run together
  // (DecodeLaunch::vt_shift).
  uint8_t tiling = 1;
  // Bits 0-1: q, k, v and out's DType; kSide32: g and beta are float32 (else q's dtype); kIdx64: int64 slot ids;
  // bits 4-7: has_initial_state's DType.
  uint8_t dtypes = 0;
  uint8_t flags = 0;   // gate mode (bits 0-1) and the kFlag bits below

  static constexpr uint8_t kSide32 = 4, kIdx64 = 8;
  static constexpr uint8_t kL2Norm = 4, kBetaSigmoid = 8, kNegEigval = 16, kBetaCols = 32;
  static constexpr uint8_t kOneToken = 64;  // fixed length T = 1 (else 0; with cu_seqlens: unused)
  static constexpr uint8_t kStaged = 128;   // the state is staged in shared memory (cp.async): always where passes > 1
  __host__ __device__ DType in_dtype() const { return static_cast<DType>(dtypes & 3); }
  __host__ __device__ bool side32() const { return (dtypes & kSide32) != 0; }
  __host__ __device__ bool idx64() const { return (dtypes & kIdx64) != 0; }
  __host__ __device__ DType has_dtype() const { return static_cast<DType>(dtypes >> 4); }
  __host__ __device__ int gate_mode() const { return flags & 3; }
  __host__ __device__ bool l2norm() const { return (flags & kL2Norm) != 0; }
  __host__ __device__ bool beta_sigmoid() const { return (flags & kBetaSigmoid) != 0; }
  __host__ __device__ bool neg_eigval() const { return (flags & kNegEigval) != 0; }
  __host__ __device__ bool beta_cols() const { return (flags & kBetaCols) != 0; }
  __host__ __device__ int T() const { return (flags & kOneToken) != 0 ? 1 : 0; }
  __host__ __device__ bool staged() const { return (flags & kStaged) != 0; }
  // Slot n's id (int32 or int64 indices; ids beyond int32 are outside any pool the form takes: padding).
  __device__ __forceinline__ int slot_of(int n) const {
    if (idx64()) {
      const int64_t s = __ldg(static_cast<const long long*>(state_indices) + int64_t(n) * idx_stride);
      return s >= 0 && s < slots ? static_cast<int>(s) : -1;
    }
    return __ldg(static_cast<const int*>(state_indices) + n * int(idx_stride));
  }
  __host__ __device__ int passes() const { return tiling & 15; }
  __host__ __device__ int vt_shift() const { return tiling >> 4; }
  __host__ void set_tiling(int passes_, int vt_shift_) { tiling = static_cast<uint8_t>(passes_ | (vt_shift_ << 4)); }
  // The CTA's sequence row, V tile, and the number of sequence rows of the grid (vt_shift above).
  __device__ __forceinline__ int cta_row() const { return static_cast<int>(blockIdx.x >> vt_shift()); }
  __device__ __forceinline__ int cta_vtile() const {
    return vt_shift() > 0 ? static_cast<int>(blockIdx.x & ((1u << vt_shift()) - 1)) : static_cast<int>(blockIdx.z);
  }
  __device__ __forceinline__ int grid_rows() const { return static_cast<int>(gridDim.x >> vt_shift()); }
  // Whether a slot id reads and writes nothing (StateIO's padding rule).
  __device__ __forceinline__ bool padding(int slot) const { return slot < 0 || slot == pad_slot || slot >= slots; }
};
static_assert(sizeof(DecodeOneArgs) <= 192, "DecodeOneArgs: at most 192 bytes (see above)");

// The general kernel's argument block starts with the one-token form's packed arguments (see DecodeOneArgs), whose
// tiling fields (passes, vt_shift, prefetch_ahead) it reads too.
struct DecodeOneHead {
  DecodeOneArgs one;
};

struct DecodeArgs : DecodeOneHead, KdaArgs {
  // Inputs. q, k, v share one dtype (bf16, fp16 or fp32); g and beta have their own.
  TokenRows q, k, v, g, beta;

  // States. Slot rules as in src/cpu/state.h (plan_slots).
  StateRef initial, final_state;
  StateRef token_states;     // [B*T,HV,*,*]: the state after every token (row b*T + t)
  DynPtr state_indices;      // [N] or [N,T_max]
  int64_t idx_s0 = 0, idx_s1 = 0;
  bool idx_2d = false;
  int64_t idx_cols = 0;      // T_max of 2-D indices
  DynPtr num_accepted;       // [N], needs 2-D indices
  int64_t acc_stride = 0;
  DynPtr has_initial_state;  // [N]
  int64_t has_stride = 0;

  TokenRows out;  // [B,T,HV,V]
  int64_t pad_slot = -1;  // StateIO::pad_slot_id
  // cu_seqlens: the CTA row blockIdx.x == N zeroes the outputs of the padded token tail [cu[N], T) (tail_cta).
  bool tail_cta = false;

  // Tiling: the grid is N * HV * vtiles CTAs of 32 * warps threads; a CTA tile is passes * 8 * warps value
  // columns, processed 8 * warps columns per pass; tokens are staged tb at a time. stage_state: the initial state
  // tile goes to shared memory by asynchronous 16-byte copies, all issued up front (needs initial.vec).
  int vtiles = 1;
  int passes = 1;
  bool stage_state = false;
  bool beta_cols = false;  // beta [B,T,HV,V] (one per value column) instead of [B,T,HV]
  int tb = 16;
  // bf16 [K,V] whole tiles (FULL) at <= 2 passes: every pass's state in registers across tokens, the state outputs
  // staged through the tile and a second buffer of its size after it (DecodeLaunch::kv_regs).
  bool kv_regs = false;
};

}  // namespace kdakit::cuda
