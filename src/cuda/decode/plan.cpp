#include "cuda/decode/plan.h"

#include <algorithm>
#include <string>

#include "cuda/checks.h"
#include "cuda/decode/tile_size.h"
#include "kdakit/error.h"

namespace kdakit::cuda {
namespace {

// 16-byte copies of 8-element pieces at multiples of 8 (bf16/fp16) or of 4-element pieces (fp32) need an
// aligned base and strides; size-1 dimensions never move the pointer.
bool rows_vectorizable(const TensorView& t) {
  const int64_t epc = 16 / static_cast<int64_t>(dtype_size(t.dtype));
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  for (int i = 0; i + 1 < t.ndim; ++i) {
    if (t.shape[i] > 1 && t.strides[i] % epc != 0) return false;
  }
  return true;
}

bool token_rows_vec(const TensorView& t) { return t.ndim == 4 && rows_vectorizable(t); }

// A state the kernel reads or writes (a view of an empty pool may have no data).
bool has_data(const TensorView& t) { return t.present() && t.data != nullptr; }

// Whether the kernel's vector accesses are aligned for a state tensor: `vec_elems` elements per vector access of the
// kernel's mapping; `row`: the contiguous dimension (K for the v-first layout, V otherwise), whose multiples every
// vector offset is built from. Absent states: false.
bool state_vec(const TensorView& t, const char* name, int64_t vec_elems, int64_t row) {
  if (!t.present()) return false;
  if (t.dtype != DType::kFloat32 && t.dtype != DType::kBFloat16) {
    throw InvalidArgument(name, std::string("the CUDA decode reads and writes float32 or bfloat16 states, got ") +
                                    dtype_name(t.dtype) + (t.dtype == DType::kFloat64 ? " (float64 runs on the CPU)" : ""));
  }
  const int64_t slot_stride = t.strides[0], head_stride = t.strides[1];
  const int64_t align = std::min<int64_t>(16, vec_elems * static_cast<int64_t>(dtype_size(t.dtype)));
  return reinterpret_cast<uintptr_t>(t.data) % align == 0 && (t.shape[0] <= 1 || slot_stride % vec_elems == 0) &&
         (t.shape[1] <= 1 || head_stride % vec_elems == 0) && row % vec_elems == 0;
}

}  // namespace

DecodeLaunch plan_decode_launch(const DecodeParams& p, const detail::Plan& plan, const DeviceInfo& device,
                                const Tuning& tuning) {
  require_kernel_dtypes(p.in);
  const Problem& pr = plan.pr;
  const StateIO& st = p.state;
  DecodeLaunch d;
  const bool vk = st.layout == StateLayout::kVK;
  const TensorView& pool = st.initial_state.present() ? st.initial_state : st.final_state;
  d.bf16_pool = pool.present() && pool.dtype == DType::kBFloat16;
  const int64_t vec = d.bf16_pool ? 8 : 4;
  const int64_t row = vk ? pr.K : pr.V;
  d.initial_vec = state_vec(st.initial_state, "initial_state", vec, row);
  d.final_vec = state_vec(st.final_state, "final_state", vec, row);
  d.token_states_vec = state_vec(p.token_states, "token_states", vec, row);
  if (pr.N == 0) return d;
  d.q_vec = token_rows_vec(p.in.q);
  d.k_vec = token_rows_vec(p.in.k);
  d.v_vec = token_rows_vec(p.in.v);
  d.g_vec = token_rows_vec(p.in.g);
  d.beta_vec = token_rows_vec(p.in.beta);
  // A state output takes the pool's fast paths where it has the pool's dtype and vector alignment.
  auto same_as_pool = [&](const TensorView& t, bool t_vec) { return !has_data(t) || (t.dtype == pool.dtype && t_vec); };

  // Launch shape. Every warp owns 8 value columns; CTAs of 4 warps (fewer only where V has fewer columns) share the
  // staged token inputs and split the per-CTA chain (staging, preparation) over more warps. Smaller CTAs for small
  // batches spread them over more SMs but lengthen each CTA's chain: 4 warps were faster at every N of the
  // benchmark (docs/perf-notes.md).
  DecodeConfig& cfg = d.cfg;
  cfg.KP = pr.K <= 64 ? 64 : (pr.K <= 128 ? 128 : 256);
  cfg.vk = vk;
  const int64_t col_warps = (pr.V + kDecodeWarpCols - 1) / kDecodeWarpCols;
  const int sms = device.sm_count;
  int warps = kDecodeMaxWarps;
  while (warps > 1 && warps / 2 >= col_warps) warps /= 2;
  if (tuning.decode_warps) warps = tuning.decode_warps;  // developer override; results do not change
  cfg.warps = warps;
  const int bv = warps * kDecodeWarpCols;
  // Tokens staged at a time: the longest sequence when known (any sequence is at most T long), up to 16. Device-side
  // cu_seqlens of at most one token per sequence on average (T <= N: the engines' varlen decode) stage one token at a
  // time where the general form runs them (the one-token form's conditions do not hold): its staging then leaves the
  // most room for the state tile.
  // 2-D slot indices bound every sequence's length by their columns (T_max, spec §5.4): device cu_seqlens of verify
  // calls then stage T_max tokens, not 16.
  const bool count_one = pr.varlen && !plan.cu_known && pr.T <= pr.N;
  const int64_t longest = plan.cu_known ? plan.max_len : (pr.T_max > 0 ? std::min(pr.T, pr.T_max) : pr.T);
  const int tb_max = cfg.KP <= 128 ? 16 : 8;
  d.tb = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(count_one ? 1 : longest, tb_max)));
  d.tail_cta = pr.varlen && !(plan.cu_known && !plan.cu.empty() && plan.cu.back() == pr.T);
  // The state tile is staged in shared memory (cp.async, all issued up front) where the pool allows 16-byte copies,
  // so the loads in flight per SM are bounded by shared memory, not registers. Passes: a CTA tile of up to 32 KB of
  // state (2 x 32 fp32 or 4 x 32 bf16 columns of K = 128), which puts >= 128 KB of loads in flight per SM, where the
  // grid still has >= 16 CTAs per SM (large batches); tiles up to 16 KB where it has >= 3 per SM (mid-size batches:
  // fewer, longer CTAs than one pass, without a 32 KB tile's serial chain); one pass otherwise (small batches:
  // latency). Within the dynamic shared memory a launch gets without opting in.
  d.stage_state = has_data(st.initial_state) && d.initial_vec;
  const int pool_bytes = d.bf16_pool ? 2 : 4;
  auto smem_of = [&](int passes) {
    const std::size_t tile = d.stage_state ? decode_staged_bytes(cfg.KP, pool_bytes, 32 * warps, passes) : 0;
    return DecodeSmem(cfg.KP, d.tb, bv * passes, tile).total;
  };
  if (smem_of(1) > kDecodeSmemLimit) d.stage_state = false;  // K = 256 fp32 with 8 staged tokens: registers only
  const int64_t col_tiles = (pr.V + bv - 1) / bv;  // CTA tiles of one pass
  int passes = 1;
  for (const int P : {4, 2}) {
    if (!d.stage_state) break;
    const std::size_t tile = decode_state_tile_bytes(cfg.KP, pool_bytes, 32 * warps, P);
    if (P > col_tiles || tile > 32768 || smem_of(P) > kDecodeSmemLimit) continue;
    // bf16 [K,V] tiles of longer sequences run pass by pass (the state stays fp32 between tokens), each state output
    // two barriers per pass: four passes were slower than two (docs/perf-notes.md).
    if (P > 2 && !vk && d.bf16_pool && longest > 1) continue;
    if (pr.N * pr.HV * ((col_tiles + P - 1) / P) < (tile > 16384 ? 16 : 3) * int64_t(sms)) continue;
    passes = P;
    break;
  }
  // One token per sequence (serving decode): the register-prepared form, where its conditions hold
  // (DecodeConfig::one). Without known lengths (device cu_seqlens) a call of at most N tokens still takes it; a
  // longer sequence's CTAs then run it token by token in the same launch (DecodeConfig::one_multi). Its tile: below.
  const bool at_most_one = longest <= 1 || count_one;
  const auto aligned16 = [](const TensorView& t) { return reinterpret_cast<uintptr_t>(t.data) % 16 == 0; };
  const auto offsets32 = [](const TensorView& t) {  // every element's offset fits an int
    int64_t last = 0;
    for (int i = 0; i < t.ndim; ++i) last += (t.shape[i] - 1) * std::max<int64_t>(t.strides[i], 0);
    return last < (int64_t(1) << 31) - 16;
  };
  const auto int32_or_absent = [](const TensorView& t) { return !t.present() || t.dtype == DType::kInt32; };
  // g and beta: both in q's dtype, or both float32 (the engines' fp32 gate next to 16-bit activations).
  const DType side = p.in.g.dtype;
  const bool side_ok = side == p.in.beta.dtype && (side == p.in.q.dtype || side == DType::kFloat32);
  const TensorView& idx = st.state_indices;
  const int64_t idx_s0 = idx.present() ? idx.strides[0] : 0;
  const bool idx_2d = idx.present() && idx.ndim == 2;
  const int64_t cu_stride = p.in.cu_seqlens.present() ? p.in.cu_seqlens.strides[0] : 1;
  const int64_t has_stride = st.has_initial_state.present() ? st.has_initial_state.strides[0] : 0;
  const bool one_dtypes = side_ok && p.out.dtype == p.in.q.dtype && int32_or_absent(p.in.cu_seqlens) &&
                          (!p.in.gate.A_log.present() || p.in.gate.A_log.dtype == DType::kFloat32) &&
                          (!p.in.gate.dt_bias.present() ||
                           (p.in.gate.dt_bias.dtype == DType::kFloat32 && aligned16(p.in.gate.dt_bias)));
  const bool one_offsets = offsets32(p.in.q) && offsets32(p.in.k) && offsets32(p.in.v) && offsets32(p.in.g) &&
                           offsets32(p.in.beta) && offsets32(p.out) &&
                           pr.N * std::max({idx_s0, cu_stride, has_stride}) < (int64_t(1) << 31) - 16;
  // The one-token form's CTA tile: several passes (the state staged in shared memory, up to a 32 KB tile per CTA: more
  // bytes in flight than registers hold) where the grid keeps at least two CTAs per SM; one pass (the state straight
  // to registers, the shortest chain) below that (sweep: docs/perf-notes.md).
  auto one_tile_fits = [&](int P) {
    return d.stage_state && pr.V % (int64_t(bv) * P) == 0 &&
           decode_state_tile_bytes(cfg.KP, pool_bytes, 32 * warps, P) <= 32768 && smem_of(P) <= kDecodeSmemLimit;
  };
  int one_passes = 1;
  for (const int P : {4, 2}) {
    if (one_tile_fits(P) && pr.N * pr.HV * (col_tiles / P) >= 2 * int64_t(sms)) {
      one_passes = P;
      break;
    }
  }
  if (tuning.decode_passes) {
    one_passes = tuning.decode_passes;
    while (one_passes > 1 && !one_tile_fits(one_passes)) one_passes /= 2;
  }
  // DecodeOneArgs' packing: 16-bit strides of the per-sequence scalars, 32-bit slot strides and counts, and each
  // state's head blocks dense (a slot's heads one after another, as engines' pools have them; a slot may be padded).
  const auto u16 = [](int64_t v) { return v >= 0 && v <= 0xffff; };
  const auto packs = [&](const TensorView& t) {
    return !has_data(t) || (t.strides[0] >= 0 && t.strides[0] < (int64_t(1) << 31) && t.shape[0] < (int64_t(1) << 31) &&
                            (pr.HV <= 1 || t.strides[1] == pr.K * pr.V));
  };
  // One slot stride for both states (DecodeOneArgs::slot_stride), slot ids and T in 32 bits.
  const bool one_stride = !has_data(st.initial_state) || !has_data(st.final_state) ||
                          (st.initial_state.strides[0] == st.final_state.strides[0] &&
                           st.initial_state.shape[0] == st.final_state.shape[0]);
  const bool one_packs = u16(idx_s0) && u16(cu_stride) && u16(has_stride) && u16(pr.V) && u16(pr.group) &&
                         packs(st.initial_state) && packs(st.final_state) && one_stride &&
                         st.pad_slot_id < (int64_t(1) << 31) && pr.T < (int64_t(1) << 31) - 1;
  cfg.one = at_most_one && cfg.KP <= 128 && pr.K == cfg.KP && pr.V % (int64_t(bv) * one_passes) == 0 && d.q_vec &&
            d.k_vec && d.g_vec && one_dtypes && one_offsets && one_packs &&
            same_as_pool(st.initial_state, d.initial_vec) && same_as_pool(st.final_state, d.final_vec) &&
            !has_data(p.token_states) && !idx_2d && !tuning.decode_general;
  if (cfg.one) {
    passes = one_passes;
    // [K,V] tiles go through shared memory at one pass too: copies by whole 16-byte pieces of rows and ldmatrix,
    // where direct loads take one 4-byte piece per key (state_io.cuh, Tile).
    cfg.one_staged = passes > 1 || (!cfg.vk && one_tile_fits(1));
    if (tuning.decode_one_staged >= 0) {
      cfg.one_staged = passes > 1 || (tuning.decode_one_staged == 1 && one_tile_fits(1));
    }
  } else if (tuning.decode_passes) {
    passes = tuning.decode_passes;
    while (passes > 1 && smem_of(passes) > kDecodeSmemLimit) passes /= 2;
  }
  cfg.passes = passes;
  d.vtiles = static_cast<int>((pr.V + int64_t(bv) * passes - 1) / (int64_t(bv) * passes));
  // The grid is (N, HV, vtiles): y and z are limited to 65535 (vtiles <= V / 8 <= 32).
  if (pr.N >= 0x7fffffff) {  // N + 1 CTA rows with a tail row
    throw InvalidArgument("q", "at most 2147483647 sequences per decode call, got " + std::to_string(pr.N));
  }
  if (pr.HV > 65535) {
    throw InvalidArgument("v", "at most 65535 value heads for the CUDA decode, got " + std::to_string(pr.HV));
  }
  cfg.one_multi = cfg.one && longest > 1;
  // The one-token form needs shared memory only for a staged state.
  cfg.smem = !cfg.one ? smem_of(passes)
             : cfg.one_staged ? decode_staged_bytes(cfg.KP, pool_bytes, 32 * warps, passes)
                            : 0;
  cfg.full = d.stage_state && pr.K == cfg.KP && pr.V % (int64_t(bv) * passes) == 0 &&
             same_as_pool(st.final_state, d.final_vec) && same_as_pool(p.token_states, d.token_states_vec) &&
             !tuning.decode_general;
  // bf16 [K,V] whole tiles of multi-token sequences: every pass's state in registers across tokens (two passes at most),
  // the state outputs staged through twice the tile's shared memory.
  const std::size_t kv_regs_smem =
      DecodeSmem(cfg.KP, d.tb, bv * passes, 2 * decode_staged_bytes(cfg.KP, pool_bytes, 32 * warps, passes)).total;
  d.kv_regs = cfg.full && !cfg.one && !vk && d.bf16_pool && cfg.KP == 128 && longest > 1 && passes <= 2 &&
              kv_regs_smem <= kDecodeSmemLimit && tuning.decode_kv_regs;
  if (d.kv_regs) cfg.smem = kv_regs_smem;
  // ... or, at four warps and whole wide tiles, the wide tiles: the state loaded and every state output stored by the
  // threads holding it, no staging (DecodeConfig::wide_kv).
  const int wide_nj = tuning.decode_wide_kv < 0 ? 8 : tuning.decode_wide_kv;
  const int wide_cols = decode_wide_kv_cols(wide_nj);
  const int wide_passes = wide_cols / bv;
  if (wide_nj > 0 && cfg.full && !cfg.one && !vk && d.bf16_pool && cfg.KP == 128 && longest > 1 &&
      warps == kDecodeMaxWarps && pr.V % wide_cols == 0 &&
      (tuning.decode_passes == 0 || tuning.decode_passes == wide_passes)) {
    cfg.wide_kv = wide_nj;
    d.kv_regs = false;
    cfg.passes = wide_passes;
    d.vtiles = static_cast<int>(pr.V / wide_cols);
    cfg.smem = DecodeSmem(cfg.KP, d.tb, wide_cols, 0).total;
  }
  // Staged tiles on Hopper (the one-token form's, and the general form's whole tiles): each CTA prefetches into L2
  // (bulk prefetch) the tile of the CTA one per SM later in launch order (Tuning::decode_prefetch CTAs per SM; 0: off;
  // the results do not change). Not with kv_regs: those three-CTA launches were slower with it (docs/perf-notes.md).
  const int ahead_ctas = device.compute_capability >= 90 ? static_cast<int>(tuning.decode_prefetch * sms + 0.5f) : 0;
  if (cfg.one || (cfg.full && !d.kv_regs)) d.prefetch_ahead = std::clamp(ahead_ctas, 0, 0xffff);
  // The V tiles of one (sequence, head) next to each other in launch order (DecodeLaunch::vt_shift): the CTAs writing
  // one state block then run at the same time (docs/perf-notes.md).
  if (tuning.decode_vt_inner != 0 && d.vtiles > 1 && (d.vtiles & (d.vtiles - 1)) == 0) {
    int shift = 0;
    while ((1 << shift) < d.vtiles) ++shift;
    if (((pr.N + 1) << shift) < (int64_t(1) << 31)) d.vt_shift = shift;
  }
  return d;
}

}  // namespace kdakit::cuda
