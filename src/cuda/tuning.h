// Developer overrides of the CUDA backend's choices, for tuning tools and tests. Every one is read from the
// environment in one place (`Tuning::from_environment`), once per process and again on `reload_tuning()`.
// None of them changes a result: each picks among launch shapes that give the same bits (tested), or lowers a limit.
//
//   KDAKIT_FORWARD_BV=16|32|64|128      the recurrence's V tile (values the configuration does not have are ignored)
//   KDAKIT_FORWARD_WGMMA=0              no warpgroup MMAs in the recurrence on Hopper (A/B timing)
//   KDAKIT_FORWARD_SEGMENTS=<n>         the context-parallel cut's target segment count (1: no cuts)
//   KDAKIT_FORWARD_SEGMENT_TOKENS=<n>   the shortest segment, in tokens (default 4096)
//   KDAKIT_SMEM_LIMIT=<bytes>           shared memory per block below the device's (emulates smaller GPUs)
//   KDAKIT_BACKWARD_GRAD_CACHE=0        the backward's gradient kernel without its dP/dL cache (A/B timing)
//   KDAKIT_BACKWARD_WGMMA=0             no warpgroup MMAs in the backward on Hopper (A/B timing)
//   KDAKIT_BACKWARD_SCAN_BV=16|32|64    the reverse scan's value tile, where it fits (else the planner's choice;
//                                       16 and 32 take the mma.sync scan on Hopper)
//   KDAKIT_DECODE_WARPS=1|2|4           warps per decode CTA
//   KDAKIT_DECODE_PASSES=1|2|4          column groups per decode CTA tile
//   KDAKIT_DECODE_GENERAL=<any>         the decode's masked general form, never the whole-tile or one-token forms
//   KDAKIT_DECODE_PREFETCH=<x>          the staged decode tiles' L2 prefetch distance, CTAs per SM (0: off)
//   KDAKIT_DECODE_ONE_STAGED=0|1        the one-token decode's state through shared memory at one pass (or not)
#pragma once

namespace kdakit::cuda {

struct Tuning {
  int forward_bv = 0;             // 0: the planner's choice
  bool forward_wgmma = true;
  int forward_segments = -1;      // < 0: the planner's choice
  int forward_segment_tokens = 4096;
  long smem_limit = 0;            // 0: the device's limit
  bool backward_grad_cache = true;  // false: never the gradient kernel's cached form
  bool backward_wgmma = true;       // false: never the backward's warpgroup-MMA kernels
  int backward_scan_bv = 0;         // 0: the planner's choice
  int decode_warps = 0;           // 0: the planner's choice
  int decode_passes = 0;          // 0: the planner's choice
  bool decode_general = false;
  float decode_prefetch = 1.f;    // CTAs per SM
  int decode_one_staged = -1;     // < 0: the planner's choice
  bool decode_kv_regs = true;     // false: bf16 [K,V] multi-token tiles pass by pass (DecodeLaunch::kv_regs)
  int decode_wide_kv = -1;        // < 0: the planner's choice; 0: never the wide bf16 [K,V] tiles; 4 or 8: their
                                  // columns per thread (DecodeConfig::wide_kv)
  int decode_vt_inner = -1;       // 0: V tiles in blockIdx.z; else the planner's choice (DecodeLaunch::vt_shift)

  static Tuning from_environment();
};

// The overrides in effect (read once); reload_tuning() reads the environment again.
const Tuning& tuning();
void reload_tuning();

}  // namespace kdakit::cuda
