// The chunked forward's launch plan for one call: the kernels' shapes, the context-parallel cut, the workspace
// layout. A pure function of the call, the device's facts and the developer overrides: made once per call, read by
// the workspace query and the launch alike, and tested on the CPU (tests/cpp/cuda/test_forward_plan.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/plan.h"
#include "cuda/device.h"
#include "cuda/forward/tile_size.h"
#include "cuda/tuning.h"

namespace kdakit::cuda {

struct ForwardLaunch {
  ForwardConfig cfg;
  int VP = 64;             // V padded to 64 columns (the u workspace rows)
  std::size_t esz = 2;     // operand bytes: 2 (bf16 inputs), 4 (float16 and float32 inputs)
  int64_t slots = 0;       // chunk slots of the prepare grid and the workspace (an upper bound of the real chunks)
  // Prepare CTAs (per v-head) past the chunk slots, which zero the output rows of the padded token tail
  // [cu_seqlens[N], T) (lengths known on the host; without them the surplus of `slots` over the chunks covers it).
  int64_t tail_slots = 0;
  // Context parallelism (ForwardArgs::seg_target): off when seg_target == 1 and not a split context-parallel call
  // (cp_phase: its segment workspace exists with one segment too; seg_ld > 0 where the segment workspace exists).
  int seg_target = 1, seg_min_chunks = 0, seg_ld = 0;
  int cp_phase = 0;        // kdakit::CpPhase
  int64_t segments = 0;    // segment slots (the sequences without cuts)
  bool ordered = false;    // the recurrence runs the sequences longest first (ForwardArgs::seq_order)
  // Workspace layout: byte offsets of each part (256-byte aligned) and the total.
  std::size_t off_offsets = 0, off_w = 0, off_qg = 0, off_kg = 0, off_u = 0, off_a = 0, off_alo = 0, off_gam = 0;
  std::size_t off_seg_offsets = 0, off_seg = 0, off_order = 0;
  std::size_t total = 0;
};

// One part of a workspace: the field that takes its byte offset, and its bytes.
struct WorkspacePart {
  std::size_t* off;
  std::size_t bytes;
};

// The forward's workspace parts in its own layout order (chunk offsets first), sized from fp's shape fields (slots,
// cfg, VP, esz, segments, seg_ld, ordered). The forward lays them out one after another; the backward places them
// among its own parts (backward/plan.h).
std::vector<WorkspacePart> forward_workspace_parts(ForwardLaunch& fp, const Problem& pr);

// Throws InvalidArgument for inputs the kernels do not take and CudaError where no tile fits the shared memory.
ForwardLaunch plan_forward_launch(const ForwardParams& p, const detail::Plan& plan, const DeviceInfo& device,
                                  const Tuning& tuning);

// Shared memory per block of the prepare kernel and of the recurrence for q, k, v of dtype `in`, g of dtype `g` and a
// configuration.
ForwardSmem forward_smem(DType in, DType g, const ForwardConfig& cfg);

}  // namespace kdakit::cuda
