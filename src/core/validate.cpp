// Validation of every op's params. Each error names the argument, what was expected and what was received.
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "common/plan.h"
#include "kdakit/error.h"

namespace kdakit {
namespace detail {

namespace {

[[noreturn]] void fail(const std::string& arg, const std::string& msg) { throw InvalidArgument(arg, msg); }

std::string dims(std::initializer_list<int64_t> v) {
  std::string s = "[";
  bool first = true;
  for (int64_t x : v) {
    s += (first ? "" : ",") + (x < 0 ? std::string("*") : std::to_string(x));
    first = false;
  }
  return s + "]";
}

void require_present(const TensorView& t, const char* name) {
  if (!t.present()) fail(name, "is required but was not given");
}

void require_ndim(const TensorView& t, const char* name, int ndim, const char* layout) {
  if (t.ndim != ndim) {
    fail(name, "expected a " + std::to_string(ndim) + "-D tensor " + layout + ", got shape " + t.shape_str());
  }
}

// Shape check with -1 as wildcard; `layout` names the dims, e.g. "[B,T,H,K]".
void require_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> expect,
                   const char* layout) {
  require_ndim(t, name, static_cast<int>(expect.size()), layout);
  int i = 0;
  for (int64_t e : expect) {
    if (e >= 0 && t.shape[i] != e) {
      fail(name, std::string("expected shape ") + layout + " = " + dims(expect) + ", got " + t.shape_str());
    }
    ++i;
  }
}

void require_float(const TensorView& t, const char* name) {
  if (!is_floating(t.dtype)) {
    fail(name, std::string("expected a float32, float16, bfloat16 or float64 tensor, got ") + dtype_name(t.dtype));
  }
}

void require_state_dtype(const TensorView& t, const char* name) {
  if (t.dtype != DType::kFloat32 && t.dtype != DType::kBFloat16 && t.dtype != DType::kFloat64) {
    fail(name, std::string("expected a float32 or bfloat16 state, got ") + dtype_name(t.dtype));
  }
}

void require_index(const TensorView& t, const char* name) {
  if (!is_index(t.dtype)) fail(name, std::string("expected an int32 or int64 tensor, got ") + dtype_name(t.dtype));
}

void require_device(const TensorView& t, const char* name, const Problem& pr) {
  if (t.device != pr.device || (t.device == Device::kCUDA && t.device_index != pr.device_index)) {
    auto where = [](Device d, int i) {
      return d == Device::kCPU ? std::string("cpu") : "cuda:" + std::to_string(i);
    };
    fail(name, "expected a tensor on " + where(pr.device, pr.device_index) + " (the device of q), got one on " +
                   where(t.device, t.device_index));
  }
}

void require_data(const TensorView& t, const char* name) {
  if (t.data == nullptr && t.numel() > 0) fail(name, "has " + std::to_string(t.numel()) + " elements but a null data pointer");
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 0) fail(name, "has a negative size in shape " + t.shape_str());
    if (t.strides[i] < 0) fail(name, "negative strides are not supported, got strides " + t.strides_str());
  }
}

void require_unit_last_stride(const TensorView& t, const char* name) {
  if (t.ndim > 0 && t.shape[t.ndim - 1] > 1 && t.strides[t.ndim - 1] != 1) {
    fail(name, "expected the last dimension to be contiguous (stride 1), got strides " + t.strides_str() +
                   " for shape " + t.shape_str());
  }
}

// HV (or HV*K) parameters are read as flat vectors.
void require_flat(const TensorView& t, const char* name, int64_t numel, const char* what) {
  require_float(t, name);
  if (t.numel() != numel) {
    fail(name, "expected " + std::to_string(numel) + " elements (" + what + "), got shape " + t.shape_str());
  }
  if (!t.is_contiguous()) fail(name, "expected a contiguous tensor, got strides " + t.strides_str());
}

// A state tensor [P,HV,K,V] (or [P,HV,V,K]) whose per-head block is dense.
void require_state(const TensorView& t, const char* name, const Problem& pr, StateLayout layout, int64_t rows) {
  const bool vk = layout == StateLayout::kVK;
  const char* desc = vk ? "[N,HV,V,K] (state_v_first)" : "[N,HV,K,V]";
  require_shape(t, name, {rows, pr.HV, vk ? pr.V : pr.K, vk ? pr.K : pr.V}, desc);
  require_data(t, name);
  require_device(t, name, pr);
  if (t.strides[3] != 1 || t.strides[2] != t.shape[3]) {
    fail(name, "each head's state block must be dense (strides [*,*," + std::to_string(t.shape[3]) + ",1]), got " +
                   t.strides_str());
  }
}

void require_tensor(const TensorView& t, const char* name, const Problem& pr, std::initializer_list<int64_t> shape,
                    const char* layout, bool unit_last_stride = true) {
  require_present(t, name);
  require_shape(t, name, shape, layout);
  require_float(t, name);
  require_data(t, name);
  require_device(t, name, pr);
  if (unit_last_stride) require_unit_last_stride(t, name);
}

// Host copy of the sequence boundaries, with its checks.
void read_cu_seqlens(const KdaInputs& in, Plan& plan) {
  Problem& pr = plan.pr;
  const TensorView* src = nullptr;
  const char* name = "cu_seqlens";
  if (in.cu_seqlens_host.present()) {
    src = &in.cu_seqlens_host;
    name = "cu_seqlens_cpu";
  } else if (in.cu_seqlens.device == Device::kCPU) {
    src = &in.cu_seqlens;
  }
  if (!src) return;  // device-only boundaries: checked by the backend after its copy
  plan.cu.resize(pr.N + 1);
  for (int64_t i = 0; i <= pr.N; ++i) plan.cu[i] = read_int(*src, i);
  if (plan.cu[0] != 0) fail(name, "must start at 0, got " + std::to_string(plan.cu[0]));
  for (int64_t i = 0; i < pr.N; ++i) {
    if (plan.cu[i + 1] < plan.cu[i]) {
      fail(name, "must be non-decreasing, got " + std::to_string(plan.cu[i]) + " then " +
                     std::to_string(plan.cu[i + 1]) + " at index " + std::to_string(i + 1));
    }
  }
  // Tokens past the last boundary are padding (a batch padded to a captured size): at most T, not exactly T.
  if (plan.cu[pr.N] > pr.T) {
    fail(name, "last entry must not exceed the number of tokens T = " + std::to_string(pr.T) + " (q.shape[1]), got " +
                   std::to_string(plan.cu[pr.N]));
  }
  plan.cu_known = true;
}

// Checks shared by all ops: q, k, v, g, beta, gate parameters, flags, varlen.
Plan plan_inputs(const KdaInputs& in, bool headwise_beta_allowed) {
  Plan plan;
  Problem& pr = plan.pr;
  require_present(in.q, "q");
  require_ndim(in.q, "q", 4, "[B,T,H,K]");
  pr.device = in.q.device;
  pr.device_index = in.q.device_index;
  pr.B = in.q.shape[0];
  pr.T = in.q.shape[1];
  pr.H = in.q.shape[2];
  pr.K = in.q.shape[3];
  require_tensor(in.q, "q", pr, {-1, -1, -1, -1}, "[B,T,H,K]");
  if (pr.K < 1 || pr.K > kMaxHeadDim) {
    fail("q", "head dimension K must be in [1, " + std::to_string(kMaxHeadDim) + "], got K = " + std::to_string(pr.K));
  }
  if (pr.H < 1) fail("q", "needs at least one head, got shape " + in.q.shape_str());
  require_present(in.k, "k");
  if (in.k.ndim != 4 || in.k.shape[0] != pr.B || in.k.shape[1] != pr.T || in.k.shape[2] != pr.H || in.k.shape[3] != pr.K) {
    fail("k", "expected the shape of q " + in.q.shape_str() + ", got " + in.k.shape_str());
  }
  require_tensor(in.k, "k", pr, {pr.B, pr.T, pr.H, pr.K}, "[B,T,H,K]");
  if (in.k.dtype != in.q.dtype) {
    fail("k", std::string("expected the dtype of q (") + dtype_name(in.q.dtype) + "), got " + dtype_name(in.k.dtype));
  }
  require_present(in.v, "v");
  require_ndim(in.v, "v", 4, "[B,T,HV,V]");
  pr.HV = in.v.shape[2];
  pr.V = in.v.shape[3];
  require_tensor(in.v, "v", pr, {pr.B, pr.T, -1, -1}, "[B,T,HV,V]");
  if (pr.HV < 1 || pr.HV % pr.H != 0) {
    fail("v", "number of value heads HV = " + std::to_string(pr.HV) +
                  " must be a positive multiple of the q/k heads H = " + std::to_string(pr.H) + " (GVA)");
  }
  if (pr.V < 1 || pr.V > kMaxHeadDim) {
    fail("v", "head dimension V must be in [1, " + std::to_string(kMaxHeadDim) + "], got V = " + std::to_string(pr.V));
  }
  pr.group = pr.HV / pr.H;
  require_present(in.g, "g");
  require_tensor(in.g, "g", pr, {pr.B, pr.T, pr.HV, pr.K}, "[B,T,HV,K]");
  require_present(in.beta, "beta");
  if (headwise_beta_allowed && in.beta.ndim == 4) {
    require_tensor(in.beta, "beta", pr, {pr.B, pr.T, pr.HV, pr.V}, "[B,T,HV,V]");
  } else {
    require_tensor(in.beta, "beta", pr, {pr.B, pr.T, pr.HV},
                   headwise_beta_allowed ? "[B,T,HV] (or [B,T,HV,V])" : "[B,T,HV]", /*unit_last_stride=*/false);
  }
  if (!std::isfinite(in.scale)) fail("scale", "must be finite, got " + std::to_string(in.scale));

  // Gate.
  const GateParams& gate = in.gate;
  switch (gate.mode) {
    case GateMode::kPreGated:
      if (gate.A_log.present()) fail("A_log", "was given but the gate is not computed in kernel (use_gate_in_kernel=False)");
      if (gate.dt_bias.present()) fail("dt_bias", "was given but the gate is not computed in kernel (use_gate_in_kernel=False)");
      break;
    case GateMode::kSoftplus:
      if (!gate.A_log.present()) {
        fail("A_log", "is required by the in-kernel gate -exp(A_log)*softplus(g + dt_bias) (use_gate_in_kernel "
                      "without lower_bound); pass A_log or a lower_bound");
      }
      break;
    case GateMode::kLowerBound:
      if (!std::isfinite(gate.lower_bound) || !(gate.lower_bound < 0.0f)) {
        fail("lower_bound", "must be a finite negative number, got " + std::to_string(gate.lower_bound));
      }
      break;
    default:
      fail("gate", "unknown gate mode " + std::to_string(static_cast<int>(gate.mode)));
  }
  if (gate.A_log.present()) {
    require_flat(gate.A_log, "A_log", pr.HV, "one per value head HV");
    require_device(gate.A_log, "A_log", pr);
  }
  if (gate.dt_bias.present()) {
    require_flat(gate.dt_bias, "dt_bias", pr.HV * pr.K, "HV*K, indexed hv*K + d");
    require_device(gate.dt_bias, "dt_bias", pr);
  }
  if (in.allow_neg_eigval && !in.beta_sigmoid) {
    fail("allow_neg_eigval", "requires use_beta_sigmoid_in_kernel=True (beta = 2*sigmoid(beta))");
  }

  // Sequences.
  if (in.cu_seqlens.present()) {
    pr.varlen = true;
    require_ndim(in.cu_seqlens, "cu_seqlens", 1, "[N+1]");
    require_index(in.cu_seqlens, "cu_seqlens");
    require_data(in.cu_seqlens, "cu_seqlens");
    require_device(in.cu_seqlens, "cu_seqlens", pr);
    if (in.cu_seqlens.shape[0] < 1) fail("cu_seqlens", "needs at least one entry, got shape " + in.cu_seqlens.shape_str());
    if (pr.B != 1) {
      fail("cu_seqlens", "variable-length inputs are packed with batch size 1, got q.shape[0] = " + std::to_string(pr.B));
    }
    pr.N = in.cu_seqlens.shape[0] - 1;
    if (in.cu_seqlens_host.present()) {
      const TensorView& h = in.cu_seqlens_host;
      require_ndim(h, "cu_seqlens_cpu", 1, "[N+1]");
      require_index(h, "cu_seqlens_cpu");
      require_data(h, "cu_seqlens_cpu");
      if (h.device != Device::kCPU) fail("cu_seqlens_cpu", "must be a host (CPU) tensor");
      if (h.shape[0] != pr.N + 1) {
        fail("cu_seqlens_cpu", "expected " + std::to_string(pr.N + 1) + " entries like cu_seqlens, got " +
                                   std::to_string(h.shape[0]));
      }
    }
    read_cu_seqlens(in, plan);
    pr.T_max = -1;
    if (plan.cu_known) {
      for (int64_t n = 0; n < pr.N; ++n) plan.max_len = std::max(plan.max_len, plan.cu[n + 1] - plan.cu[n]);
      pr.T_max = plan.max_len;
    }
  } else {
    if (in.cu_seqlens_host.present()) fail("cu_seqlens_cpu", "was given without cu_seqlens");
    pr.N = pr.B;
    pr.T_max = pr.T;
    plan.cu.resize(pr.N + 1);
    for (int64_t n = 0; n <= pr.N; ++n) plan.cu[n] = n * pr.T;
    plan.cu_known = true;
    plan.max_len = pr.T;
  }
  return plan;
}

// Chunk-start states [B,NT,HV,K,V] (varlen [1,NT_total,...]; v-first per layout) with dense blocks.
void require_chunk_states(const TensorView& h, const char* name, const Plan& plan, StateLayout layout, int chunk_size) {
  const Problem& pr = plan.pr;
  const bool vk = layout == StateLayout::kVK;
  const int64_t nt = pr.varlen ? (plan.cu_known ? pr.num_chunks : -1) : (pr.T + chunk_size - 1) / chunk_size;
  require_tensor(h, name, pr, {pr.varlen ? 1 : pr.B, nt, pr.HV, vk ? pr.V : pr.K, vk ? pr.K : pr.V},
                 vk ? "[B,NT,HV,V,K]" : "[B,NT,HV,K,V]");
  if (h.strides[3] != h.shape[4] || (h.shape[4] > 1 && h.strides[4] != 1)) {
    fail(name, std::string("each state block must be dense, got strides ") + h.strides_str());
  }
}

void plan_chunks(Plan& plan, int chunk_size) {
  if (!plan.cu_known) return;
  plan.chunk_offsets.assign(plan.pr.N + 1, 0);
  for (int64_t n = 0; n < plan.pr.N; ++n) {
    const int64_t len = plan.cu[n + 1] - plan.cu[n];
    plan.chunk_offsets[n + 1] = plan.chunk_offsets[n] + (len + chunk_size - 1) / chunk_size;
  }
  plan.pr.num_chunks = plan.chunk_offsets[plan.pr.N];
}

// initial_state / final_state / state_indices / has_initial_state.
void check_state_io(const StateIO& st, const Plan& plan, bool allow_2d_indices) {
  const Problem& pr = plan.pr;
  if (st.layout != StateLayout::kKV && st.layout != StateLayout::kVK) {
    fail("state_v_first", "unknown state layout " + std::to_string(static_cast<int>(st.layout)));
  }
  const bool indexed = st.state_indices.present();
  const int64_t rows = indexed ? -1 : pr.N;
  if (st.initial_state.present()) {
    require_state(st.initial_state, "initial_state", pr, st.layout, rows);
    require_state_dtype(st.initial_state, "initial_state");
  }
  if (st.final_state.present()) {
    require_state(st.final_state, "final_state", pr, st.layout, rows);
    require_state_dtype(st.final_state, "final_state");
  }
  if (st.initial_state.present() && st.final_state.present() && st.initial_state.data == st.final_state.data) {
    const TensorView& a = st.initial_state;
    const TensorView& b = st.final_state;
    bool same = a.dtype == b.dtype;
    for (int i = 0; i < 4 && same; ++i) same = a.shape[i] == b.shape[i] && a.strides[i] == b.strides[i];
    if (!same) fail("final_state", "shares memory with initial_state (in place) but differs in dtype, shape or strides");
  }
  if (st.pad_slot_id < -1) {
    fail("pad_slot_id", "must be -1 (the default) or a slot id >= 0, got " + std::to_string(st.pad_slot_id));
  }
  if (indexed) {
    const TensorView& idx = st.state_indices;
    if (!st.initial_state.present() && !st.final_state.present()) {
      fail("ssm_state_indices", "was given but there is no state pool (initial_state or final_state)");
    }
    require_index(idx, "ssm_state_indices");
    require_data(idx, "ssm_state_indices");
    require_device(idx, "ssm_state_indices", pr);
    if (idx.ndim == 2 && !allow_2d_indices) {
      fail("ssm_state_indices", "expected a 1-D tensor [N] (one slot per sequence) for the chunked forward, got shape " +
                                    idx.shape_str());
    }
    if (idx.ndim != 1 && idx.ndim != 2) {
      fail("ssm_state_indices", std::string("expected shape [N]") + (allow_2d_indices ? " or [N,T_max]" : "") +
                                    ", got " + idx.shape_str());
    }
    // Rows past N (a batch padded to a captured size) are ignored.
    if (idx.shape[0] < pr.N) {
      fail("ssm_state_indices", "expected one row per sequence (N = " + std::to_string(pr.N) +
                                    "; rows past N are ignored), got shape " + idx.shape_str());
    }
    if (idx.ndim == 2 && plan.cu_known && idx.shape[1] < plan.max_len) {
      fail("ssm_state_indices", "has " + std::to_string(idx.shape[1]) + " slots per sequence but the longest sequence has " +
                                    std::to_string(plan.max_len) + " tokens");
    }
    if (idx.device == Device::kCPU) {
      const int64_t cols = idx.ndim == 2 ? idx.shape[1] : 1;
      for (int64_t n = 0; n < pr.N; ++n) {
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t slot = idx.ndim == 2 ? read_int(idx, n, c) : read_int(idx, n);
          if (slot == st.pad_slot_id) continue;  // padding, whatever the pool's size
          if (slot < -1) {
            fail("ssm_state_indices", "slot " + std::to_string(slot) + " of sequence " + std::to_string(n) +
                                          " is invalid (padding is -1 or pad_slot_id = " +
                                          std::to_string(st.pad_slot_id) + ")");
          }
          for (const TensorView* pool : {&st.initial_state, &st.final_state}) {
            if (pool->present() && slot >= pool->shape[0]) {
              fail("ssm_state_indices", "slot " + std::to_string(slot) + " of sequence " + std::to_string(n) +
                                            " is out of range for a state pool of " + std::to_string(pool->shape[0]) +
                                            " slots");
            }
          }
        }
      }
    }
  }
  if (st.has_initial_state.present()) {
    const TensorView& m = st.has_initial_state;
    if (!st.initial_state.present()) fail("has_initial_state", "was given but there is no initial_state");
    require_ndim(m, "has_initial_state", 1, "[N]");
    if (m.shape[0] < pr.N) {
      fail("has_initial_state", "expected " + std::to_string(pr.N) +
                                    " entries (one per sequence; entries past N are ignored), got " + m.shape_str());
    }
    if (!is_index(m.dtype) && m.dtype != DType::kBool && m.dtype != DType::kUInt8) {
      fail("has_initial_state", std::string("expected a bool or integer tensor, got ") + dtype_name(m.dtype));
    }
    require_data(m, "has_initial_state");
    require_device(m, "has_initial_state", pr);
  }
}

void check_chunk_options(int chunk_size, bool safe_gate, const KdaInputs& in) {
  if (chunk_size != 32 && chunk_size != 64) {
    fail("chunk_size", "`chunk_size` must be either 32 or 64, got " + std::to_string(chunk_size));
  }
  if (safe_gate && in.gate.mode != GateMode::kPreGated) {
    if (in.gate.mode != GateMode::kLowerBound) {
      fail("lower_bound", "safe_gate=True with use_gate_in_kernel=True needs the lower-bound gate (lower_bound "
                          "in [-5, 0)), got lower_bound=None");
    }
    if (!(in.gate.lower_bound >= -5.0f && in.gate.lower_bound < 0.0f)) {
      fail("lower_bound", "safe_gate=True needs lower_bound in [-5, 0), got " + std::to_string(in.gate.lower_bound));
    }
  }
}

}  // namespace

// The halves of a context-parallel forward (CpPhase): CUDA, one sequence, no other state outputs.
static void check_cp_phase(const ForwardParams& p, const Problem& pr) {
  const int phase = static_cast<int>(p.cp_phase);
  if (phase < 0 || phase > 2) fail("cp_phase", "expected kNone, kSummary or kFinish (0, 1, 2), got " + std::to_string(phase));
  if (p.cp_phase == CpPhase::kNone) {
    if (p.cp_summary.present()) fail("cp_summary", "is written by a cp_phase kSummary call only, but cp_phase is kNone");
    return;
  }
  if (pr.device != Device::kCUDA) {
    fail("cp_phase", "the split context-parallel forward runs on CUDA tensors only, got CPU tensors");
  }
  if (pr.varlen) fail("cu_seqlens", "is not taken with cp_phase: pass the one sequence as [1, T, ...]");
  if (pr.N != 1) fail("cp_phase", "takes one sequence per call, got " + std::to_string(pr.N));
  if (p.intermediate_states.present()) fail("intermediate_states", "is not taken with cp_phase");
  if (p.state.final_state.present()) fail("final_state", "is not taken with cp_phase (kSummary writes cp_summary)");
  if (p.state.state_indices.present()) fail("state_indices", "is not taken with cp_phase");
  if (p.state.has_initial_state.present()) fail("has_initial_state", "is not taken with cp_phase");
  if (p.cp_phase == CpPhase::kSummary) {
    if (p.state.initial_state.present()) {
      fail("initial_state", "a kSummary call starts from zero; the handed-over state goes to the kFinish call");
    }
    require_present(p.cp_summary, "cp_summary");
    require_shape(p.cp_summary, "cp_summary", {pr.HV, pr.K, pr.V + pr.K}, "[HV,K,V+K]");
    if (p.cp_summary.dtype != DType::kFloat32) {
      fail("cp_summary", std::string("expected a float32 tensor, got ") + dtype_name(p.cp_summary.dtype));
    }
    require_data(p.cp_summary, "cp_summary");
    require_device(p.cp_summary, "cp_summary", pr);
    if (!p.cp_summary.is_contiguous()) fail("cp_summary", "expected a contiguous tensor, got strides " + p.cp_summary.strides_str());
  } else if (p.cp_summary.present()) {
    fail("cp_summary", "is written by the kSummary call only, not by kFinish");
  }
}

Plan plan_forward(const ForwardParams& p) {
  Plan plan = plan_inputs(p.in, /*headwise_beta_allowed=*/false);
  const Problem& pr = plan.pr;
  check_chunk_options(p.chunk_size, p.safe_gate, p.in);
  plan_chunks(plan, p.chunk_size);
  check_state_io(p.state, plan, /*allow_2d_indices=*/false);
  require_tensor(p.out, "out", pr, {pr.B, pr.T, pr.HV, pr.V}, "[B,T,HV,V]");
  if (p.intermediate_states.present()) {
    require_chunk_states(p.intermediate_states, "intermediate_states", plan, p.state.layout, p.chunk_size);
  }
  check_cp_phase(p, pr);
  if (p.workspace_bytes > 0 && p.workspace == nullptr) fail("workspace", "workspace_bytes > 0 but workspace is null");
  return plan;
}

// The halves of a context-parallel backward (CpPhase): CUDA, one sequence; kSummary writes d_initial_state alone.
static void check_backward_cp_phase(const BackwardParams& p, const Problem& pr) {
  const int phase = static_cast<int>(p.cp_phase);
  if (phase < 0 || phase > 2) fail("cp_phase", "expected kNone, kSummary or kFinish (0, 1, 2), got " + std::to_string(phase));
  if (p.cp_phase == CpPhase::kNone) return;
  if (pr.device != Device::kCUDA) {
    fail("cp_phase", "the split context-parallel backward runs on CUDA tensors only, got CPU tensors");
  }
  if (pr.varlen) fail("cu_seqlens", "is not taken with cp_phase: pass the one sequence as [1, T, ...]");
  if (pr.N != 1) fail("cp_phase", "takes one sequence per call, got " + std::to_string(pr.N));
  if (p.d_initial_state_only) fail("d_initial_state_only", "is not taken with cp_phase (kSummary computes d_initial_state)");
  if (p.cp_phase != CpPhase::kSummary) return;
  if (p.d_final_state.present()) {
    fail("d_final_state", "a kSummary call runs from a zero d_final_state; the later ranks' gradient goes to kFinish");
  }
  const std::pair<const TensorView*, const char*> later[] = {
      {&p.dq, "dq"}, {&p.dk, "dk"}, {&p.dv, "dv"}, {&p.dg, "dg"}, {&p.dbeta, "dbeta"}, {&p.dA_log, "dA_log"},
      {&p.ddt_bias, "ddt_bias"}};
  for (const auto& [view, name] : later) {
    if (view->present()) fail(name, "must be absent with cp_phase kSummary (the kFinish call writes it)");
  }
  if (p.d_initial_state.present()) {
    require_state(p.d_initial_state, "d_initial_state", pr, p.layout, pr.N);
    require_float(p.d_initial_state, "d_initial_state");
  }
}

Plan plan_backward(const BackwardParams& p) {
  Plan plan = plan_inputs(p.in, /*headwise_beta_allowed=*/false);
  const Problem& pr = plan.pr;
  check_chunk_options(p.chunk_size, p.safe_gate, p.in);
  plan_chunks(plan, p.chunk_size);
  StateIO st;
  st.layout = p.layout;
  st.initial_state = p.initial_state;
  check_state_io(st, plan, false);
  require_tensor(p.d_out, "d_out", pr, {pr.B, pr.T, pr.HV, pr.V}, "[B,T,HV,V]");
  if (p.d_final_state.present()) {
    require_state(p.d_final_state, "d_final_state", pr, p.layout, pr.N);
    require_float(p.d_final_state, "d_final_state");
  }
  check_backward_cp_phase(p, pr);
  if (p.cp_phase == CpPhase::kSummary) {
    if (p.chunk_states.present()) require_chunk_states(p.chunk_states, "chunk_states", plan, p.layout, p.chunk_size);
    if (p.workspace_bytes > 0 && p.workspace == nullptr) fail("workspace", "workspace_bytes > 0 but workspace is null");
    return plan;
  }
  if (p.d_initial_state_only) {
    const std::pair<const TensorView*, const char*> unused[] = {
        {&p.dq, "dq"}, {&p.dk, "dk"}, {&p.dv, "dv"}, {&p.dg, "dg"}, {&p.dbeta, "dbeta"}, {&p.dA_log, "dA_log"},
        {&p.ddt_bias, "ddt_bias"}, {&p.chunk_states, "chunk_states"}};
    for (const auto& [view, name] : unused) {
      if (view->present()) fail(name, "must be absent with d_initial_state_only (only d_initial_state is computed)");
    }
    if (!p.d_initial_state.present()) fail("d_initial_state", "is required with d_initial_state_only");
    require_state(p.d_initial_state, "d_initial_state", pr, p.layout, pr.N);
    require_float(p.d_initial_state, "d_initial_state");
    if (p.workspace_bytes > 0 && p.workspace == nullptr) fail("workspace", "workspace_bytes > 0 but workspace is null");
    return plan;
  }
  if (p.chunk_states.present()) require_chunk_states(p.chunk_states, "chunk_states", plan, p.layout, p.chunk_size);
  require_tensor(p.dq, "dq", pr, {pr.B, pr.T, pr.H, pr.K}, "[B,T,H,K]");
  require_tensor(p.dk, "dk", pr, {pr.B, pr.T, pr.H, pr.K}, "[B,T,H,K]");
  require_tensor(p.dv, "dv", pr, {pr.B, pr.T, pr.HV, pr.V}, "[B,T,HV,V]");
  require_tensor(p.dg, "dg", pr, {pr.B, pr.T, pr.HV, pr.K}, "[B,T,HV,K]");
  require_tensor(p.dbeta, "dbeta", pr, {pr.B, pr.T, pr.HV}, "[B,T,HV]", false);
  const bool gate_in_kernel = p.in.gate.mode != GateMode::kPreGated;
  auto pair = [&](const TensorView& x, const TensorView& dx, const char* xname, const char* dxname, int64_t numel,
                  const char* what) {
    const bool needed = x.present() && gate_in_kernel;
    if (needed && !dx.present()) fail(dxname, std::string("is required because ") + xname + " is given");
    if (!needed && dx.present()) fail(dxname, std::string("was given but ") + xname + " is absent");
    if (needed) {
      require_flat(dx, dxname, numel, what);
      require_device(dx, dxname, pr);
    }
  };
  pair(p.in.gate.A_log, p.dA_log, "A_log", "dA_log", pr.HV, "one per value head HV");
  pair(p.in.gate.dt_bias, p.ddt_bias, "dt_bias", "ddt_bias", pr.HV * pr.K, "HV*K");
  if (p.initial_state.present() && !p.d_initial_state.present()) {
    fail("d_initial_state", "is required because initial_state is given");
  }
  if (!p.initial_state.present() && p.d_initial_state.present()) {
    fail("d_initial_state", "was given but initial_state is absent");
  }
  if (p.d_initial_state.present()) {
    require_state(p.d_initial_state, "d_initial_state", pr, p.layout, pr.N);
    require_float(p.d_initial_state, "d_initial_state");
  }
  if (p.workspace_bytes > 0 && p.workspace == nullptr) fail("workspace", "workspace_bytes > 0 but workspace is null");
  return plan;
}

Plan plan_decode(const DecodeParams& p) {
  Plan plan = plan_inputs(p.in, /*headwise_beta_allowed=*/true);
  const Problem& pr = plan.pr;
  check_state_io(p.state, plan, /*allow_2d_indices=*/true);
  const TensorView& idx = p.state.state_indices;
  if (idx.present() && idx.ndim == 2) plan.pr.T_max = idx.shape[1];
  if (p.num_accepted_tokens.present()) {
    const TensorView& a = p.num_accepted_tokens;
    if (!idx.present() || idx.ndim != 2) {
      fail("num_accepted_tokens", "needs 2-D ssm_state_indices [N,T_max] (the slot to read is indices[n, a_n - 1])");
    }
    require_ndim(a, "num_accepted_tokens", 1, "[N]");
    require_index(a, "num_accepted_tokens");
    require_data(a, "num_accepted_tokens");
    require_device(a, "num_accepted_tokens", pr);
    if (a.shape[0] < pr.N) {
      fail("num_accepted_tokens", "expected " + std::to_string(pr.N) +
                                      " entries (one per sequence; entries past N are ignored), got " + a.shape_str());
    }
    if (a.device == Device::kCPU) {
      for (int64_t n = 0; n < pr.N; ++n) {
        const int64_t v = read_int(a, n);
        if (v < 1 || v > idx.shape[1]) {
          fail("num_accepted_tokens", "entry " + std::to_string(n) + " is " + std::to_string(v) + ", expected 1.." +
                                          std::to_string(idx.shape[1]));
        }
      }
    }
  }
  require_tensor(p.out, "out", pr, {pr.B, pr.T, pr.HV, pr.V}, "[B,T,HV,V]");
  if (p.token_states.present()) {
    require_state(p.token_states, "token_states", pr, p.state.layout, pr.B * pr.T);
    require_float(p.token_states, "token_states");
  }
  return plan;
}

}  // namespace detail

Problem validate(const ForwardParams& p) { return detail::plan_forward(p).pr; }
Problem validate(const BackwardParams& p) { return detail::plan_backward(p).pr; }
Problem validate(const DecodeParams& p) { return detail::plan_decode(p).pr; }

}  // namespace kdakit
