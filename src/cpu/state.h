// State blocks in memory ([K,V] or v-first [V,K], fp32/bf16/...) to and from a dense [K][V] array.
#pragma once

#include <cstdint>

#include "common/plan.h"
#include "cpu/dtype.h"

namespace kdakit::cpu {

// `off` is the offset of the block's first element; the block is dense.
template <class Acc>
inline void load_state_block(const TensorView& t, int64_t off, StateLayout layout, int64_t K, int64_t V, Acc* S) {
  for (int64_t d = 0; d < K; ++d) {
    for (int64_t j = 0; j < V; ++j) {
      const int64_t e = layout == StateLayout::kKV ? d * V + j : j * K + d;
      S[d * V + j] = load_elem<Acc>(t.data, t.dtype, off + e);
    }
  }
}

template <class Acc>
inline void store_state_block(const TensorView& t, int64_t off, StateLayout layout, int64_t K, int64_t V, const Acc* S) {
  for (int64_t d = 0; d < K; ++d) {
    for (int64_t j = 0; j < V; ++j) {
      const int64_t e = layout == StateLayout::kKV ? d * V + j : j * K + d;
      store_elem<Acc>(t.data, t.dtype, off + e, S[d * V + j]);
    }
  }
}

// Offset of the state of (slot, hv) in a [P,HV,*,*] tensor.
inline int64_t state_offset(const TensorView& t, int64_t slot, int64_t hv) {
  return slot * t.strides[0] + hv * t.strides[1];
}

// A slot id that names no state: negative, or the caller's pad_slot_id (spec §1.7).
inline bool is_padding_slot(int64_t slot, int64_t pad_slot_id) { return slot < 0 || slot == pad_slot_id; }

// Which pool slots sequence n reads and writes (spec §1.7, §5.4 and StateIO's contract).
struct SlotPlan {
  bool padding = false;  // the sequence's slot is padding: no state read or written, outputs are zeros
  int64_t read = -1;     // slot to read the initial state from; -1: start from zero
  int64_t write = -1;    // slot for the final state (1-D indices or none); -1: do not write
  bool per_token = false;  // 2-D indices: write after every token to indices[n, t] (unless that is padding)
};

inline SlotPlan plan_slots(const StateIO& st, const TensorView* num_accepted, int64_t n) {
  SlotPlan s;
  const TensorView& idx = st.state_indices;
  if (!idx.present()) {
    s.read = st.initial_state.present() ? n : -1;
    s.write = st.final_state.present() ? n : -1;
  } else if (idx.ndim == 1) {
    const int64_t slot = detail::read_int(idx, n);
    if (is_padding_slot(slot, st.pad_slot_id)) {
      s.padding = true;
      return s;
    }
    s.read = st.initial_state.present() ? slot : -1;
    s.write = st.final_state.present() ? slot : -1;
  } else {
    const int64_t a = (num_accepted && num_accepted->present()) ? detail::read_int(*num_accepted, n) : 1;
    const int64_t slot = detail::read_int(idx, n, a - 1);
    if (is_padding_slot(slot, st.pad_slot_id)) {
      s.padding = true;
      return s;
    }
    s.read = st.initial_state.present() ? slot : -1;
    s.per_token = st.final_state.present();
  }
  if (s.read >= 0 && st.has_initial_state.present() && detail::read_int(st.has_initial_state, n) == 0) s.read = -1;
  return s;
}

// A zero state block (the per-token and chunk states of padding); the block is dense.
template <class Acc>
inline void store_zero_block(const TensorView& t, int64_t off, int64_t K, int64_t V) {
  for (int64_t e = 0; e < K * V; ++e) store_elem<Acc>(t.data, t.dtype, off + e, Acc(0));
}

}  // namespace kdakit::cpu
