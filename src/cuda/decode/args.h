// Kernel arguments of the CUDA decode / speculative verify, derived on the host from kdakit::DecodeParams
// (src/cuda/backend.cu, `decode`).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/common/io.cuh"

namespace kdakit::cuda {

// Warps per CTA are chosen at run time (1, 2 or 4); every warp owns kDecodeWarpCols value columns per pass, and a
// CTA makes 1, 2 or 4 passes over column groups of its tile (run time too), so a CTA tile has up to
// kDecodeMaxTileCols value columns.
constexpr int kDecodeWarpCols = 8;
constexpr int kDecodeMaxWarps = 4;
constexpr int kDecodeMaxPasses = 4;
constexpr int kDecodeMaxTileCols = kDecodeMaxWarps * kDecodeWarpCols * kDecodeMaxPasses;

// Shared memory of the staged state tile of one CTA: every thread stages its own KP / 4 state elements per pass
// (16-byte pieces of the pool's dtype, `pool_bytes` per element).
__host__ __device__ constexpr size_t decode_state_tile_bytes(int KP, int pool_bytes, int nthreads, int passes) {
  return size_t(passes) * size_t(nthreads) * size_t(KP / 4) * size_t(pool_bytes);
}

// A token tensor [B,T,heads,dim] (or beta [B,T,HV]) whose element type is known at run time.
struct DecodeRows {
  const void* p = nullptr;
  DType dtype = DType::kFloat32;
  int64_t sb = 0, st = 0, sh = 0;
  bool vec = false;  // 8-element pieces at multiples of 8 may be read as 16-byte vectors (aligned base and strides)
  __host__ __device__ int64_t offset(int64_t b, int64_t t, int64_t h) const { return b * sb + t * st + h * sh; }
};

// A state tensor [P,HV,K,V] (or v-first [P,HV,V,K]) with dense per-head blocks, float32 or bfloat16.
struct DecodeState {
  void* p = nullptr;
  DType dtype = DType::kFloat32;
  int64_t slot_stride = 0, head_stride = 0;
  int64_t slots = 0;  // rows P; slot ids outside [0, P) are neither read nor written
  bool vec = false;   // the kernel's vector accesses are aligned for this tensor
  __host__ __device__ bool present() const { return p != nullptr; }
  __host__ __device__ int64_t block(int64_t slot, int64_t hv) const { return slot * slot_stride + hv * head_stride; }
};

// Compile-time shape (KP, layout) and launch shape of the kernel chosen for a call.
struct DecodeConfig {
  int KP = 128;       // K padded: 64, 128, 256
  bool vk = true;     // v-first state layout [.., V, K]
  int warps = 4;      // 1, 2 or 4 per CTA
  int passes = 1;     // 1, 2 or 4 column groups per CTA tile
  size_t smem = 0;    // dynamic shared memory, bytes
  bool full = false;  // whole tiles: K == KP, V a multiple of the CTA tile, staged state, state outputs in the pool's
                      // dtype and aligned (the kernel's FULL form, without masks)
  bool one = false;   // at most one token per sequence (the kernel's ONE form, register preparation): K == KP <= 128,
                      // whole V tiles, vector-aligned q, k, g rows, states absent or aligned in the pool's
                      // dtype, 1-D or no slot indices, no per-token states
  bool one_entry = false;  // ... and every sequence is known to have at most one token: decode_one_kernel
};

// Dynamic shared memory of one CTA, byte offsets (host and device agree on it). Float rows: q * scale / |q|,
// k / |k| and exp(gate) [tb][KP]; v and beta [tb][bv] (bv: the CTA tile's columns, all passes); q.k [tb];
// per-token slots (int) [tb]; the head's dt_bias [KP] and A_log; then the staged state tile (`state_bytes`, 0 when
// the state is not staged). Inputs are copied raw into the tail of their float row (bf16/fp16: the second half;
// fp32: the row itself) and widened in place.
struct DecodeSmem {
  size_t q, k, a, v, beta, qk, slot, bias, a_log, state, total;
  __host__ __device__ DecodeSmem(int KP, int tb, int bv, size_t state_bytes) : q(0) {
    const size_t row = 4 * size_t(tb) * KP, cols = 4 * size_t(tb) * bv, one = (4 * size_t(tb) + 15) & ~size_t(15);
    k = q + row;
    a = k + row;
    v = a + row;
    beta = v + cols;
    qk = beta + cols;
    slot = qk + one;
    bias = slot + one;
    a_log = bias + 4 * size_t(KP);
    state = a_log + 16;
    total = state + state_bytes;
  }
};

// A token tensor's rows for the one-token form: the element offset of (row, head) is row * rs + head * sh, where a
// row is a batch row (fixed length: at most one token) or a token (cu_seqlens: one batch row). 32 bits: the host
// checked that every element's offset fits.
struct OneRows {
  void* p = nullptr;
  int rs = 0, sh = 0;
  __device__ __forceinline__ int offset(int row, int h) const { return row * rs + h * sh; }
};

// Everything the one-token form reads, packed into at most 192 bytes (DecodeArgs::one, the first member of the
// general kernel's argument block, and the whole argument block of decode_one_kernel).
// - Few constant-cache lines: a kernel's parameters are read through the constant cache, and every line the first
//   reads touch is a miss on the chain of a short kernel (ncu, T1 N1 H16 fp32: imc_miss stalls ~1.5 per issued
//   instruction with the 11 lines of the general block; 5 with the first packed form of 304 bytes).
// - At most 192 bytes: launches with larger argument blocks (224 bytes and up) sometimes take 0.3-1.1 us longer from
//   the event before to the event after, depending on where they fall in the command stream; blocks of up to 192
//   bytes never did (tools/gpu/launch_args.py, docs/perf-notes.md).
// Hence 32-bit strides, 16-bit small strides and counts, a state head's block dense (KP * V elements) and the
// small fields in bits; the host takes the general form where a call does not fit (DecodeConfig::one).
struct DecodeOneArgs {
  OneRows q, k, g, v, beta, out;                     // q, k: head h = hv >> group_shift (or hv / group)
  const float* A_log = nullptr;                      // [HV] float32, or absent
  const float* dt_bias = nullptr;                    // [HV * K] float32 (16-byte aligned), or absent
  const int* state_indices = nullptr;                // [N] int32, or absent (slot n)
  const int* cu_seqlens = nullptr;                   // [N + 1] int32, or absent (fixed length: at most one token)
  const void* initial = nullptr;                     // pool dtype, or absent
  void* final_state = nullptr;
  const void* has_initial_state = nullptr;           // [N] any integer/bool dtype (rare: read through DynPtr)
  int initial_slot_stride = 0, final_slot_stride = 0;  // elements; head hv's block starts hv * KP * V further
  int initial_slots = 0, final_slots = 0;
  float scale = 1.f, lower_bound = -5.f;
  uint16_t idx_stride = 0, cu_stride = 0, has_stride = 0;
  uint16_t group = 1;
  uint16_t V = 0;
  // Staged form on Hopper: each CTA prefetches into L2 the state tile of the CTA this many places later in launch
  // order (one per SM: a CTA that starts soon after this one, docs/perf-notes.md); 0: no prefetch.
  uint16_t prefetch_ahead = 0;
  int8_t group_shift = -1;
  uint8_t passes = 1;  // column groups per CTA tile; > 1: the state is staged in shared memory (cp.async)
  uint8_t dtypes = 0;  // q, k, g, v, beta and out (bits 0-3), has_initial_state (bits 4-7): DType values
  uint8_t flags = 0;   // gate mode (bits 0-1) and the kFlag bits below

  static constexpr uint8_t kL2Norm = 4, kBetaSigmoid = 8, kNegEigval = 16, kBetaCols = 32;
  static constexpr uint8_t kOneToken = 64;  // fixed length T = 1 (else 0; with cu_seqlens: unused)
  __host__ __device__ DType in_dtype() const { return static_cast<DType>(dtypes & 15); }
  __host__ __device__ DType has_dtype() const { return static_cast<DType>(dtypes >> 4); }
  __host__ __device__ int gate_mode() const { return flags & 3; }
  __host__ __device__ bool l2norm() const { return (flags & kL2Norm) != 0; }
  __host__ __device__ bool beta_sigmoid() const { return (flags & kBetaSigmoid) != 0; }
  __host__ __device__ bool neg_eigval() const { return (flags & kNegEigval) != 0; }
  __host__ __device__ bool beta_cols() const { return (flags & kBetaCols) != 0; }
  __host__ __device__ int T() const { return (flags & kOneToken) != 0 ? 1 : 0; }
};
static_assert(sizeof(DecodeOneArgs) <= 192, "DecodeOneArgs: at most 192 bytes (see above)");

struct DecodeArgs {
  DecodeOneArgs one;  // first: see DecodeOneArgs

  // Inputs. q, k, v, g share one dtype (bf16, fp16 or fp32); beta has its own.
  DecodeRows q, k, v, g, beta;
  bool beta_cols = false;  // beta [B,T,HV,V] (one per value column) instead of [B,T,HV]
  DynPtr A_log, dt_bias;
  int gate_mode = 0;  // 0 pre-gated, 1 softplus, 2 lower bound
  float lower_bound = -5.f;
  float scale = 1.f;
  bool l2norm = false, beta_sigmoid = false, neg_eigval = false;
  int B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0, group = 1, N = 0;
  DynPtr cu_seqlens;  // absent: fixed length
  int64_t cu_stride = 1;

  // States. Slot rules as in src/cpu/state.h (plan_slots).
  DecodeState initial, final_state;
  DecodeState token_states;  // [B*T,HV,*,*]: the state after every token (row b*T + t)
  DynPtr state_indices;      // [N] or [N,T_max]
  int64_t idx_s0 = 0, idx_s1 = 0;
  bool idx_2d = false;
  int64_t idx_cols = 0;      // T_max of 2-D indices
  DynPtr num_accepted;       // [N], needs 2-D indices
  int64_t acc_stride = 0;
  DynPtr has_initial_state;  // [N]
  int64_t has_stride = 0;

  // Output [B,T,HV,V].
  DynPtr out;
  int64_t out_sb = 0, out_st = 0, out_sh = 0;

  // Tiling: the grid is N * HV * vtiles CTAs of 32 * warps threads; a CTA tile is passes * 8 * warps value
  // columns, processed 8 * warps columns per pass; tokens are staged tb at a time. stage_state: the initial state
  // tile goes to shared memory by asynchronous 16-byte copies, all issued up front (needs initial.vec).
  int vtiles = 1;
  int passes = 1;
  bool stage_state = false;
  int tb = 16;

  // Sequence n: batch row, first token, length.
  __device__ __forceinline__ void sequence(int n, int64_t& b, int64_t& t0, int64_t& len) const {
    if (cu_seqlens.present()) {
      b = 0;
      t0 = cu_seqlens.load_int(n * cu_stride);
      len = cu_seqlens.load_int((n + 1) * cu_stride) - t0;
      if (len < 0) len = 0;
    } else {
      b = n;
      t0 = 0;
      len = T;
    }
  }
};

}  // namespace kdakit::cuda
