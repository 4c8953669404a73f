// Kernel arguments of the CUDA backward's own kernels, filled on the host (backward/run.cu) from kdakit::BackwardParams
// and the call's plan (backward/plan.h). The forward's prepare and state pass take ForwardArgs.
#pragma once

#include <cstdint>

#include "cuda/common/args.h"
#include "cuda/cp/segments.h"

namespace kdakit::cuda {

// The chunk-start states: the forward's, recomputed into the workspace (fp32), or the caller's saved ones
// (BackwardParams::chunk_states, any float dtype); [B|1, NT, HV, *, *] in the layout of BackwardParams::layout.
struct ChunkStates : DynPtr {
  int64_t sb = 0, sc = 0, sh = 0;
  // The block of chunk ci of sequence n (batch row b, global chunk slot `slot`).
  __host__ __device__ __forceinline__ int64_t block(bool varlen, int64_t b, int64_t ci, int64_t slot, int hv) const {
    return (varlen ? slot * sc : b * sb + ci * sc) + hv * sh;
  }
};

struct BackwardArgs : KdaArgs {
  TokenRows q, k, v, g, beta, d_out;  // inputs (q, k, v of the kernels' InT; the rest of any float dtype)
  TokenRows dq, dk, dv, dg, dbeta;    // gradients, any float dtype
  DynPtr dA_log, ddt_bias;            // gradients (absent without A_log / dt_bias or a pre-gated g)
  StateRef d_final, d_initial;        // [N,HV,*,*]; absent without dht / an initial state
  bool vk = false;                    // state layout [V,K]
  int chunk = 64, KP = 64, VP = 64;
  int nks = 1;                        // 16-key slices of the gradient kernel
  bool scan_writes = true;            // the scan writes dh_c and dv_new (false: d_initial_state only)
  // kdakit::CpPhase (one sequence). kCpSummary: the pre-scan runs every segment from zero with its M^T (segment 0
  // only for d_initial), and the merge folds them into d_initial; no final scan (uncut: the scan alone, writing
  // nothing but d_initial). kCpFinish: no pre-scan; the merge starts one step later (the last segment's slot from
  // d_final); then the usual scan.
  int cp_phase = 0;
  int64_t* chunk_offsets = nullptr;   // [N+1], the forward's chunk-offsets kernel
  int64_t num_slots = 0;              // chunk slots (an upper bound of the chunks)

  // The reverse scan's segments: the forward's cut of the same call (ForwardArgs::seg_target; its chunk-offsets
  // kernel wrote seg_offsets), so a sequence's cut depends on its own length only. Absent (seg_offsets null) where
  // the forward cuts nothing: one scan per sequence.
  int seg_target = 1, seg_min_chunks = 0;
  const int64_t* seg_offsets = nullptr;  // [N+1]
  int64_t num_segments = 0;              // segment slots (an upper bound of the segments)
  float* ws_seg = nullptr;  // [segment][HV][KP][seg_ld] f32: columns [0, seg_ld - KP) E_s or a merged end gradient,
  int seg_ld = 0;           // then M_s^T's K columns
  __host__ __device__ __forceinline__ int64_t segments_of(int64_t nch, int64_t& per) const {
    return cuda::segments_of(nch, seg_target, seg_min_chunks, per);
  }

  // The forward's prepare tiles (Elem: bf16 for bf16 inputs, else float; the layouts of ForwardArgs).
  const void *ws_w = nullptr, *ws_qg = nullptr, *ws_kg = nullptr, *ws_u = nullptr, *ws_a = nullptr,
             *ws_alo = nullptr;
  const __nv_bfloat16* ws_ulo = nullptr;  // bf16 tiles: u - bf16(u) ([slot][HV][C][VP]), ForwardArgs::ws_ulo
  // bf16 tiles: qg - bf16(qg), kg - bf16(kg) ([slot][HV][C][KP]), ForwardArgs::ws_qglo / ws_kglo; the scan's.
  const __nv_bfloat16 *ws_qglo = nullptr, *ws_kglo = nullptr;
  const float* ws_gam = nullptr;  // [slot][HV][KP]
  const float* ws_tm = nullptr;   // [slot][HV][C][C]
  ChunkStates h;

  // The backward's own workspace (backward/plan.h has the shapes).
  float *ws_dh = nullptr, *ws_dvnew = nullptr, *ws_vnew = nullptr, *ws_dbv = nullptr, *ws_dP = nullptr,
        *ws_dL = nullptr, *ws_dq = nullptr, *ws_dk = nullptr, *ws_dkg = nullptr, *ws_dgam = nullptr,
        *ws_dbeta = nullptr, *ws_dA = nullptr, *ws_ddt = nullptr;

  // Chunk slot s's tile index (s, hv) of the [slot][HV] workspace parts.
  __host__ __device__ __forceinline__ int64_t tile(int64_t slot, int hv) const { return slot * HV + hv; }
  // The token row b * T + t of the [row][HV] workspace parts.
  __host__ __device__ __forceinline__ int64_t row(int64_t b, int64_t t) const { return b * T + t; }
};

}  // namespace kdakit::cuda
