// Kernel arguments of the CUDA chunked forward, filled on the host (forward/run.cu) from kdakit::ForwardParams and
// the call's plan (forward/plan.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/args.h"
#include "cuda/cp/segments.h"

namespace kdakit::cuda {

struct ForwardArgs : KdaArgs {
  // Inputs q, k, v (one dtype, the kernels' InT), g (float32, or 16 bits: bfloat16 or float16, read as it is by the
  // prepare kernel's GB instantiation) and beta [B,T,HV] (any float dtype).
  TokenRows q, k, v, g, beta;
  bool vec_qk = false;  // q and k rows may be copied in 16-byte pieces (aligned base, strides and K)
  bool vec_v = false;   // likewise v rows (aligned base, strides and V)
  bool vec_g = false;   // likewise g rows (aligned base, strides and K, in g's elements)
  bool pair_qk = false; // q and k elements may be read in aligned pairs (base and strides even in elements)
  bool pair_g = false;  // likewise g (in g's elements)
  bool vec_out = false;  // bf16 output rows may be written in 16-byte pieces (aligned base and strides, V % 8 == 0)
  int chunk = 64;

  // Workspace: chunk offsets [N+1], then per (chunk slot, v-head) tiles.
  int64_t* chunk_offsets = nullptr;
  int64_t num_slots = 0;  // chunk slots the workspace holds (an upper bound of the real chunks)
  int64_t tail_slots = 0; // prepare CTAs past them (ForwardLaunch::tail_slots): the padded token tail's zero rows
  void* ws_w = nullptr;   // [slot][HV][C][KP] Elem
  void* ws_qg = nullptr;  // [slot][HV][C][KP] Elem (scale folded in)
  void* ws_kg = nullptr;  // [slot][HV][C][KP] Elem
  void* ws_u = nullptr;   // [slot][HV][C][VP] Elem
  void* ws_a = nullptr;   // [slot][HV][C][C] Elem (scale folded in, zero above the diagonal)
  void* ws_alo = nullptr; // [slot][HV][C][C] bf16 operands only: Aqk - bf16(Aqk), so Aqk v_new runs on hi + lo
  // Optional [slot][HV][C][VP] bf16 (bf16 operands, the backward's prepare): u - bf16(u). The backward's
  // v_new = u - w h_c cancels most of u, so u rounded once to bf16 would carry its rounding into every gradient; with
  // it, u's product takes Tm diag(beta) as hi + lo too (its rounding carried into dk and dv).
  void* ws_ulo = nullptr;
  // Optional [slot][HV][C][KP] bf16 each (bf16 operands, the backward's prepare): qg - bf16(qg) and kg - bf16(kg). The
  // reverse scan's dv_new = kg dS and dS += qg^T dO take them, so that dbeta and dh0 do not carry kg's and qg's
  // roundings.
  void* ws_qglo = nullptr;
  void* ws_kglo = nullptr;
  float* ws_gam = nullptr;  // [slot][HV][KP]
  float* ws_tm = nullptr;   // optional [slot][HV][C][C] fp32: Tm = (I + L)^-1, zero above the diagonal (the backward)
  int KP = 64, VP = 64;

  // Intra-card context parallelism (spec §7.5 algebra; cp/segments.h): a long sequence is cut into chunk-aligned
  // segments whose recurrences run side by side. A scan gives each segment (but the last) its end state from zero,
  // E, and its transition M (K x K); a merge chains S_start(s+1) = M_s S_start(s) + E_s; then every segment runs the
  // ordinary recurrence from its start state.
  int seg_target = 1;        // segments a long sequence is cut into (1: none)
  int seg_min_chunks = 0;    // a sequence is cut only if it has >= 2 seg_min_chunks chunks; segments are >= this
  int64_t* seg_offsets = nullptr;  // [N+1] segments of the sequences before n (with seg_target > 1)
  // [N] the recurrence's sequence order, longest first (varlen batches without cuts, N <= kMaxOrdered): the longest
  // chains start first. Results do not depend on it (every CTA's work is independent of the others).
  int32_t* seq_order = nullptr;
  int64_t num_segments = 0;  // segment slots of the grid and of ws_seg (an upper bound of the real segments)
  float* ws_seg = nullptr;   // [segment][HV][KP][seg_ld] fp32: columns [0, VT*BV) E or a start state, then M
  int seg_ld = 0;
  // Multi-device context parallelism (kdakit::CpPhase, one sequence): kCpSummary scans every segment (the last, and
  // M of the first, too) and folds them into cp_summary [HV][K][V + K]; kCpFinish skips the prepare and the scan
  // (their workspace is the summary call's), seeds the merge with the handed-over state (initial) and runs the
  // recurrence.
  int cp_phase = 0;
  float* cp_summary = nullptr;
  // The chunk-start states only (the backward's recompute): the value-row recurrence skips the output products, their
  // tiles and stores; `out` is then scratch that may stay unwritten.
  bool states_only = false;

  // Sequence n's segments: their count, and the chunks of each but the last (nch: the sequence's chunks).
  __host__ __device__ __forceinline__ int64_t segments_of(int64_t nch, int64_t& per) const {
    return cuda::segments_of(nch, seg_target, seg_min_chunks, per);
  }

  // States.
  bool vk = false;
  StateRef initial, final_state;
  DynPtr state_indices, has_initial_state;  // rows past N are not read
  int64_t pad_slot_id = -1;                 // StateIO::pad_slot_id

  // Sequence n's state slot: n without indices; with them state_indices[n], or -1 where that slot is padding (spec
  // §1.7: negative, pad_slot_id, or outside a state pool, which device-side ids the host could not check may be). A
  // padding sequence reads and writes no state, and its outputs and chunk states are zeros.
  __device__ __forceinline__ int64_t state_slot(int n) const {
    if (!state_indices.present()) return n;
    const int64_t s = state_indices.load_int(n);
    const bool pad = s < 0 || s == pad_slot_id || (initial.present() && s >= initial.slots) ||
                     (final_state.present() && s >= final_state.slots);
    return pad ? -1 : s;
  }
  DynPtr inter;  // intermediate states [B|1,NT,HV,*,*]
  int64_t inter_sb = 0, inter_sc = 0, inter_sh = 0;

  TokenRows out;  // [B,T,HV,V], any float dtype
};

struct ForwardLaunch;  // forward/plan.h
struct ForwardConfig;  // forward/tile_size.h

// The kernel arguments of a planned forward call whose workspace starts at `ws` (forward/run.cu); the backward's
// prepare and state pass run the forward's kernels with them.
ForwardArgs forward_args(const ForwardParams& p, const detail::Plan& plan, const ForwardLaunch& fp, char* ws);

// The forward's launches for inputs of dtype `in` (forward/run.cu; the kernels are instantiated per input dtype).
void launch_forward_for(DType in, const ForwardArgs& a, const ForwardConfig& cfg, cudaStream_t stream);

}  // namespace kdakit::cuda
