// The decode's launch plan for one call: the form (general, whole-tile, one-token, the one-token entry), the CTA tile
// (warps, passes), the staging and the alignment facts the kernel relies on. A pure function of the call, the
// device's facts and the developer overrides, tested on the CPU (tests/cpp/cuda/test_decode_plan.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/plan.h"
#include "cuda/device.h"
#include "cuda/tuning.h"

namespace kdakit::cuda {

// Compile-time shape (KP, layout) and launch shape of the kernel chosen for a call.
struct DecodeConfig {
  int KP = 128;            // K padded: 64, 128, 256
  bool vk = true;          // v-first state layout [.., V, K]
  int warps = 4;           // 1, 2 or 4 per CTA
  int passes = 1;          // 1, 2 or 4 column groups per CTA tile
  std::size_t smem = 0;    // dynamic shared memory, bytes
  bool full = false;       // whole tiles: K == KP, V a multiple of the CTA tile, staged state, state outputs in the
                           // pool's dtype and aligned (the kernel's FULL form, without masks)
  bool one = false;        // at most one token per sequence (decode_one_kernel, register preparation): K == KP <=
                           // 128, whole V tiles, vector-aligned q, k, g rows, states absent or aligned in the pool's
                           // dtype, 1-D or no slot indices, no per-token states
  bool one_multi = false;  // ... where a sequence may have more than one token (device cu_seqlens of at most N tokens):
                           // the MULTI instance, which runs such a sequence token by token
  bool one_staged = false; // the one-token form stages the state in shared memory (always with passes > 1)
  int wide_kv = 0;          // bf16 [K,V] whole tiles at K = 128 of multi-token sequences: columns per thread (4 or 8;
                           // 0: not wide), 16 times as many per CTA, the state in registers across tokens and stored
                           // by the threads holding it (wide_kv.cuh; a FULL form, not staged)
};

struct DecodeLaunch {
  DecodeConfig cfg;
  bool bf16_pool = false;   // the pool's dtype (fixes the kernel's vector width: 16 bytes of its elements)
  int tb = 16;              // tokens staged at a time
  int vtiles = 1;           // CTA tiles along V
  bool stage_state = false; // the initial state tile goes to shared memory by cp.async
  // 16-byte vector accesses are aligned for these states / token rows (DecodeArgs' `vec` flags).
  bool initial_vec = false, final_vec = false, token_states_vec = false;
  bool q_vec = false, k_vec = false, v_vec = false, g_vec = false, beta_vec = false;
  int prefetch_ahead = 0;   // the staged tiles' L2 prefetch distance in CTAs (0: none; one-token and FULL forms)
  // cu_seqlens whose end the host cannot see at T: one more CTA row (blockIdx.x == N) zeroes the outputs of the padded
  // token tail [cu[N], T) (StateIO's padding rule).
  bool tail_cta = false;
  // bf16 [K,V] whole tiles of multi-token sequences at <= 2 passes: the general form keeps every pass's state in
  // registers across tokens and stages each state output once for all passes (twice the staged tile's shared memory).
  bool kv_regs = false;
  // The general form's grid puts the V tiles (a power of two) of one (sequence, head) next to each other in launch
  // order, in blockIdx.x's low vt_shift bits (0: blockIdx.z), so that the CTAs writing one state block run together.
  int vt_shift = 0;
};

// Throws InvalidArgument for inputs or states the kernels do not take.
DecodeLaunch plan_decode_launch(const DecodeParams& p, const detail::Plan& plan, const DeviceInfo& device,
                                const Tuning& tuning);

}  // namespace kdakit::cuda
