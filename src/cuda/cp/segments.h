// Intra-card context parallelism (spec §7.5): how a long sequence is cut into chunk-aligned segments whose
// recurrences run side by side. Plain C++ (host planner and kernels).
#pragma once

#include <cstdint>

#include "common/kda_math.h"

namespace kdakit::cuda {

// ForwardArgs::cp_phase and BackwardArgs::cp_phase values (kdakit::CpPhase: multi-device context parallelism).
constexpr int kCpSummary = 1, kCpFinish = 2;

// The cut of one sequence of nch chunks: its segment count, and the chunks of each segment but the last (`per`).
// A sequence is cut only if it has at least 2 * min_chunks chunks, into at most `target` segments of at least
// min_chunks chunks each. It depends on the sequence's own length and on target (fixed by the head count and the
// device), so a sequence's result does not depend on its batch.
KDA_HD int64_t segments_of(int64_t nch, int target, int min_chunks, int64_t& per) {
  if (target <= 1 || nch < 2 * int64_t(min_chunks)) {
    per = nch;
    return 1;
  }
  per = (nch + target - 1) / target;
  if (per < min_chunks) per = min_chunks;
  return (nch + per - 1) / per;
}

// The segment pre-scan's transition tiles per (segment, head): the CTAs of BV columns that give M (K of them), at
// least one however wide the tile (a 128-column tile covers KP = 64).
constexpr int segment_transition_tiles(int KP, int BV) { return (KP + BV - 1) / BV; }

}  // namespace kdakit::cuda
