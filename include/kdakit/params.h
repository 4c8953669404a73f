// Parameters of the three KDA operations: the chunked forward (prefill / training forward), its backward,
// and decode / speculative verify. One struct per op carries every option from Python to the kernel.
//
// Shapes (spec §1.1): q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K]; beta [B,T,HV]; HV % H == 0 and
// v-head hv reads q/k head hv / (HV/H). With `cu_seqlens` ([N+1]) the batch must be 1 and holds N packed
// sequences; otherwise N = B. A state is [K,V] per (sequence, v-head), or [V,K] in the v-first layout.
#pragma once

#include <cstdint>

#include "kdakit/export.h"
#include "kdakit/tensor.h"

namespace kdakit {

constexpr int kMaxHeadDim = 256;

enum class StateLayout : int32_t {
  kKV = 0,  // [.., K, V]: element (dk, dv) at dk*V + dv (FLA's default)
  kVK = 1,  // [.., V, K]: "v-first", what serving engines store (FLA's state_v_first=True)
};

enum class GateMode : int32_t {
  kPreGated = 0,    // g is the per-token natural-log decay itself (expected <= 0)
  kSoftplus = 1,    // gate = -exp(A_log[hv]) * softplus(g + dt_bias)        (A_log required)
  kLowerBound = 2,  // gate = lower_bound * sigmoid(exp(A_log[hv]) * (g + dt_bias)); A_log optional
};

struct KDAKIT_API GateParams {
  GateMode mode = GateMode::kPreGated;
  TensorView A_log;    // HV elements, any contiguous shape (e.g. [HV] or [1,1,HV,1]); float dtype
  TensorView dt_bias;  // HV*K elements, [HV*K] or [HV,K]; optional; float dtype
  float lower_bound = -5.0f;  // used by kLowerBound; must be < 0
};

// The inputs every op shares.
struct KDAKIT_API KdaInputs {
  TensorView q, k;  // [B,T,H,K]
  TensorView v;     // [B,T,HV,V]
  TensorView g;     // [B,T,HV,K]: log-decay (kPreGated) or the raw gate input
  TensorView beta;  // [B,T,HV] (decode also accepts a per-value-column beta [B,T,HV,V])
  float scale = 0.0f;  // required; the usual value is default_scale(K) = K^-0.5
  GateParams gate;
  bool qk_l2norm = false;         // q, k <- x * rsqrt(sum x^2 + 1e-6) per head, in kernel
  bool beta_sigmoid = false;      // beta is a logit: beta <- sigmoid(beta)
  bool allow_neg_eigval = false;  // beta <- 2 * sigmoid(beta); requires beta_sigmoid
  TensorView cu_seqlens;          // optional [N+1] int32/int64 on the tensors' device
  TensorView cu_seqlens_host;     // optional host copy of cu_seqlens (spares a device-to-host copy)
};

// Where states come from and go to. Sequence n reads initial_state[slot(n)] and writes
// final_state[slot(n)], with slot(n) = n without indices and state_indices[n] with them.
// Padding (CUDA-graph batches, spec §1.7): a slot equal to pad_slot_id, or negative, is padding. A sequence whose
// slot is padding reads and writes no state and its outputs are zeros; a per-token write slot (2-D indices) that
// is padding is skipped. Slot ids on the device that lie outside the pool are treated as padding (checking them
// would need a synchronisation); host-visible ones raise. state_indices, has_initial_state and num_accepted_tokens
// may have more rows than sequences (the extra rows are ignored), and with cu_seqlens the tokens past cu_seqlens[N]
// are padding (zero outputs).
// Passing the same tensor as initial and final state updates a state pool in place.
struct KDAKIT_API StateIO {
  StateLayout layout = StateLayout::kKV;
  TensorView initial_state;      // optional [P,HV,K,V] (or [P,HV,V,K]); float32 or bfloat16
  TensorView final_state;        // optional, same shape rules and dtypes
  TensorView state_indices;      // optional int32/int64: [N] (forward, decode) or [N,T_max] (decode)
  TensorView has_initial_state;  // optional [N] bool/uint8/int32/int64: false starts from zero
  int64_t pad_slot_id = -1;      // >= -1; -1 (the default) or vLLM's NULL_BLOCK_ID 0
};

// The two halves of a forward (and of a backward: BackwardParams::cp_phase) under multi-device context parallelism
// (spec §7.6), CUDA only, one sequence per call.
// kSummary: the work that does not depend on the start state, and the sequence's contribution to the later ranks,
// written to ForwardParams::cp_summary, [HV, K, V + K] float32: row d holds S_ext[d, :] (the end state from a zero
// start) then M[d, :] (the transition: end = M S_start + S_ext, spec §7.2); no outputs. kFinish: the outputs from
// state.initial_state (the state the earlier ranks hand over; absent: zero), on the workspace that the kSummary call of
// the same inputs left, untouched in between.
enum class CpPhase : int32_t {
  kNone = 0,
  kSummary = 1,
  kFinish = 2,
};

struct KDAKIT_API ForwardParams {
  KdaInputs in;
  StateIO state;
  int chunk_size = 64;     // 32 or 64
  bool safe_gate = false;  // caller promises gates in [lower_bound, 0); validates lower_bound (spec §3.4)
  TensorView out;          // required [B,T,HV,V], any float dtype
  // Optional [B,NT,HV,K,V] (varlen: [1,NT_total,HV,K,V]; v-first per state.layout): the state at the
  // start of every chunk. Float dtype.
  TensorView intermediate_states;
  CpPhase cp_phase = CpPhase::kNone;  // see CpPhase
  TensorView cp_summary;              // kSummary: [HV, K, V + K] float32, contiguous
  void* workspace = nullptr;  // see forward_workspace_size()
  std::size_t workspace_bytes = 0;
};

struct KDAKIT_API BackwardParams {
  KdaInputs in;
  StateLayout layout = StateLayout::kKV;
  TensorView initial_state;  // optional [N,HV,K,V] (or v-first), as in the forward
  int chunk_size = 64;
  bool safe_gate = false;
  TensorView d_out;          // required [B,T,HV,V]
  TensorView d_final_state;  // optional [N,HV,K,V] (or v-first)
  // Optional: the forward's chunk-start states of these inputs (ForwardParams::intermediate_states, [B,NT,HV,K,V],
  // varlen [1,NT_total,HV,K,V], in `layout`), read instead of recomputed (FLA's disable_recompute). Float dtype;
  // float32 keeps the gradients' precision (a bfloat16 copy rounds every state).
  TensorView chunk_states;
  // Gradients (outputs). dq, dk, dv, dg, dbeta are required; the others follow their inputs:
  TensorView dq, dk;          // [B,T,H,K]
  TensorView dv;              // [B,T,HV,V]
  TensorView dg;              // [B,T,HV,K] (w.r.t. the raw gate input when the gate is in kernel)
  TensorView dbeta;           // [B,T,HV] (w.r.t. the logit when beta_sigmoid)
  TensorView dA_log;          // required iff gate.A_log is given and the gate is in kernel; A_log's shape
  TensorView ddt_bias;        // required iff gate.dt_bias is given and the gate is in kernel
  TensorView d_initial_state; // required iff initial_state is given (or d_initial_state_only)
  // Only d_initial_state: the gradient with respect to the start state, which depends on neither the state's value
  // nor v (the recurrence is linear in the state). dq, dk, dv, dg, dbeta, dA_log, ddt_bias and chunk_states must
  // be absent, d_initial_state present; initial_state may be absent. (Context parallelism's backward exchange.)
  bool d_initial_state_only = false;
  // The halves of a backward under multi-device context parallelism (CUDA only, one sequence per call, not with
  // d_initial_state_only). kSummary: the work that does not depend on d_final_state (the forward's recompute, the
  // reverse scan's segments), and, where d_initial_state is given, that gradient for a zero d_final_state: what the
  // earlier ranks fold in. d_final_state and the other gradient outputs must be absent. kFinish: every gradient for
  // d_final_state, on the workspace that the kSummary call of the same inputs left, untouched in between.
  CpPhase cp_phase = CpPhase::kNone;
  void* workspace = nullptr;  // see backward_workspace_size()
  std::size_t workspace_bytes = 0;
};

// Decode and speculative verify: a few tokens per sequence against a state pool.
// With 2-D state_indices [N,T_max] the state is read from slot state_indices[n, a_n - 1]
// (a_n = num_accepted_tokens[n], or 1 without it) and written after every token t to
// state_indices[n, t]; with 1-D indices it is read from and written to slot state_indices[n].
struct KDAKIT_API DecodeParams {
  KdaInputs in;
  StateIO state;
  TensorView num_accepted_tokens;  // optional [N] int32/int64, 1 <= a_n <= T_max; needs 2-D indices
  TensorView out;                  // required [B,T,HV,V]
  // Optional [B*T,HV,K,V] (or v-first): the state after every token, for committing an accepted prefix
  // later (verify: leave state.final_state empty so the committed pool is not touched).
  TensorView token_states;
};

inline float default_scale(int64_t head_dim_k) {
  return head_dim_k > 0 ? 1.0f / __builtin_sqrtf(static_cast<float>(head_dim_k)) : 0.0f;
}

}  // namespace kdakit
