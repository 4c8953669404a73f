// Tile shapes and shared-memory layouts of the chunked forward's kernels, as compile-time functions of the element
// sizes, the chunk and the tiles: the kernels lay out their shared memory by them and the planner (forward/plan.cpp)
// sizes launches by them, without including a kernel. Plain C++ (host and device).
#pragma once

#include <cstddef>

#include "common/kda_math.h"
#include "cuda/common/static_switch.h"

namespace kdakit::cuda {

// Compile-time shape of the kernels chosen for a call.
struct ForwardConfig {
  int chunk = 64;          // 32 or 64
  int KP = 64;             // K padded: 64, 128, 256
  int BV = 64;             // value columns per recurrence CTA: 16, 32, 64, 128
  bool one_stage = false;  // the recurrence without its prefetch stage (devices with less shared memory)
  bool wgmma = false;      // the recurrence by warpgroup MMAs (sm_90, bf16, chunk 64, K <= 128, BV 64 or 128)
  bool prepare_only = false;  // the chunk offsets and the prepare kernel alone (the backward with saved states)
};

// Shared memory per block (bytes) the forward's kernels need for a configuration.
struct ForwardSmem {
  std::size_t prepare = 0, recurrence = 0;
};

// Varlen batches of at most this many sequences (and no context-parallel cuts) run the recurrence longest first; the
// chunk-offsets kernel (one block of this many threads) ranks them.
constexpr int kMaxOrdered = 1024;

constexpr int kPrepareThreads = 256;

// Row padding of shared-memory operand tiles: a stride of cols + 8 (bf16) or + 4 (float) avoids bank conflicts.
constexpr int smem_pad(int elem_bytes) { return elem_bytes == 4 ? 4 : 8; }

// Shared memory of prepare_kernel (IN_BYTES: the size of q, k and v's dtype; ELEM_BYTES: the operands', 2 for bf16, 4
// for float; G_BYTES: g's, 2 for bfloat16 or float16, 4 for float32). The elementwise pass covers a slice of
// SW = min(KP, 128) dimensions at once (K = 256: two slices, the intra-chunk products accumulating over both). Slice
// phase, in this order:
//   sQx, sKx [C][LDS]       A operands of P and L: q and k of each 16-row block decayed to the block's anchor (its
//                           row 8; the block's first row where the exact path takes its diagonal block)
//   sKd      [C][LDS]       B operand of the diagonal blocks: k decayed from the anchor (k e^-s)
//   sKb      [KB_ROWS][LDS] B operands of the off-diagonal blocks: for each block a, the rows of every earlier block
//                           decayed to a's anchor, rows [0, 16 a) at kb_offset(a)
// laid out sQx, sKd, sKx, sKb, so that sKx and sKb are one span.
// STAGED (bf16 inputs with bf16 operands, float32 with float): the slice's raw q and k are first copied into sQx and
// sKd in the tiles' own layout, and each thread reads its elements there before it overwrites them with its operands
// (float16 inputs, whose raw rows are narrower than the float tiles, read global memory instead). The raw g rows go
// to the sKx / sKb span with their own row stride LDG: [C][LDG] elements of G_BYTES (float32 g beside bf16 operands
// takes more than sKx alone; the gates are read into registers before any operand is written there).
// Phase B reuses the bytes: L / Tm in fp32 [C][LDL] and the inverse's scratch, Tm diag(beta) [C][LDC], then the w / u
// steps' B operands, copied while the epilogue and the inverse run: k e^G [KP / 64][C][LD64] and two 64-column v
// slices [2][C][LD64].
template <int IN_BYTES, int ELEM_BYTES, int C, int KP, int G_BYTES>
struct PrepareLayout {
  static constexpr int NSUB = C / 16;
  static constexpr int SW = KP < 128 ? KP : 128;  // dimensions per slice
  static constexpr int NKS = KP / SW;             // slices
  static constexpr int PAD = smem_pad(ELEM_BYTES);
  static constexpr int LDS = SW + PAD;
  static constexpr int LDG = SW + smem_pad(G_BYTES);  // staged raw g rows (STAGED), in g's elements
  static constexpr int LD64 = 64 + PAD;
  static constexpr int LDC = C + PAD;
  static constexpr int LDL = C + 8;  // even (float2 fragment loads) and 8 mod 32 banks
  static constexpr int LDY = 12;     // the inverse's per-warp [32][LDY] intermediate: conflict-free B fragments
  static constexpr int KB_ROWS = 8 * NSUB * (NSUB - 1);
  static constexpr bool STAGED = IN_BYTES == ELEM_BYTES;
  static constexpr std::size_t r16(std::size_t b) { return (b + 15) & ~std::size_t(15); }
  static constexpr std::size_t g_offset() { return ELEM_BYTES * std::size_t(2 * C) * LDS; }  // sKx: the raw g rows
  static constexpr std::size_t g_bytes() { return STAGED ? G_BYTES * std::size_t(C) * LDG : 0; }
  static constexpr std::size_t slice_bytes() {
    return r16(ELEM_BYTES * std::size_t(3 * C + KB_ROWS) * LDS > g_offset() + g_bytes()
                   ? ELEM_BYTES * std::size_t(3 * C + KB_ROWS) * LDS
                   : g_offset() + g_bytes());
  }
  static constexpr std::size_t tb_offset() { return r16(4 * C * LDL) + r16(4 * 4 * 32 * LDY); }
  static constexpr std::size_t b64_bytes() { return r16(ELEM_BYTES * std::size_t(C) * LD64); }  // a [C][LD64] slice
  static constexpr std::size_t ks_offset() { return tb_offset() + r16(ELEM_BYTES * std::size_t(C) * LDC); }
  static constexpr std::size_t v_offset() { return ks_offset() + (KP / 64) * b64_bytes(); }
  static constexpr std::size_t phase_b_bytes() { return v_offset() + 2 * b64_bytes(); }
  static constexpr std::size_t union_bytes() {
    return slice_bytes() > phase_b_bytes() ? slice_bytes() : phase_b_bytes();
  }
  static_assert(g_offset() % 16 == 0 && (LDG * G_BYTES) % 16 == 0, "raw g rows copied in 16-byte pieces");
  // The exact path's per-warp [16][17] fp32 scratch sits in the (then unused) diagonal B rows of its block.
  static_assert(ELEM_BYTES * 16 * LDS >= 2 * 16 * 17 * 4, "exact-path scratch fits a block's sKd rows");
  // About 81 KB for bf16 inputs with C = 64, K <= 128: two CTAs per SM.
  static constexpr std::size_t bytes() {
    return union_bytes() + 2 * r16(4 * NSUB * SW) + 3 * r16(4 * C) + r16(4 * 2 * NSUB);
  }
};

// First row of row block a's off-diagonal B operand in sKb (row block a needs rows [0, 16a)).
KDA_HD constexpr int kb_offset(int a) { return 8 * a * (a - 1); }

template <int ELEM_BYTES, int KP, int BV, bool ONE_STAGE = false>
struct RecurrenceLayout {
  static constexpr int PAD = smem_pad(ELEM_BYTES);
  static constexpr int LDK = KP + PAD, LDB = BV + PAD, LDA = 64 + PAD;
  // Two stages (the next chunk's tiles prefetched) where they fit; 128-column tiles (one CTA per head: a single wave
  // where 64-column tiles would need 1-2) fit one.
  // ONE_STAGE: devices with less shared memory per block than Hopper (A100, sm_86/89) drop the prefetch stage.
  static constexpr int STAGES = (!ONE_STAGE && ELEM_BYTES == 2 && KP <= 128 && BV <= 64) ? 2 : 1;
  // Split operands at K = 256 do not fit three [64][KP] tiles: w, qg and kg then take turns in one buffer.
  static constexpr bool ONE_TILE = ELEM_BYTES == 4 && KP > 128;
  static constexpr int TILES = ONE_TILE ? 1 : 3;
  // bf16 operands also take Aqk's lo tile (Aqk v_new on hi + lo; see the prepare kernel's epilogue).
  static constexpr bool SPLIT_A = ELEM_BYTES == 2;
  static constexpr std::size_t stage_bytes() {
    return ELEM_BYTES * std::size_t(TILES * 64 * LDK + 64 * LDB + (SPLIT_A ? 2 : 1) * 64 * LDA) + 4 * KP;
  }
  static constexpr std::size_t stage_stride() { return (stage_bytes() + 15) & ~std::size_t(15); }
  // bf16 operands keep the chunk-start state as hi + lo tiles (two MMAs for w S and qg S): rounded once to bf16,
  // the state's error would dominate outputs that are mostly the initial-state term (T = 1).
  static constexpr bool SPLIT_S = ELEM_BYTES == 2;
  static constexpr std::size_t bytes() {
    return STAGES * stage_stride() + ELEM_BYTES * std::size_t((SPLIT_S ? 2 : 1) * KP * LDB + 64 * LDB) + 64;
  }
};

// recurrence_kernel's warps: warp = (row group w4 in 0..3) + 4 * (column group). Each warp owns 16 chunk rows of v_new
// and o and KP/4 state rows, for its column group of the CTA's BV value columns: 16 columns per warp from BV = 32 on
// (16 warps at BV = 64: the chunk step is a latency chain, and more warps per scheduler hide more of it), 8 at BV = 16.
template <int BV>
struct RecurrenceWarps {
  static constexpr int GROUPS = BV >= 64 ? 4 : 2;
  static constexpr int THREADS = 128 * GROUPS;
  static constexpr int COLS = BV / GROUPS;  // columns per warp
};

// recurrence_vrows_kernel (KP <= 128): eight warps of 16 value rows each at BV = 128, BV / 16 in general.
// WG (warpgroup MMAs): the workspace tiles w, qg, kg and Aqk in the 128-byte-swizzled layout (no row padding).
template <int ELEM_BYTES, int KP, int BV, bool ONE_STAGE = false, bool WG = false>
struct VrowsLayout {
  static_assert(!WG || (ELEM_BYTES == 2 && BV % 64 == 0), "warpgroup MMAs: bf16 operands, whole warpgroups");
  static constexpr int PAD = smem_pad(ELEM_BYTES);
  static constexpr int LDK = WG ? KP : KP + PAD, LDB = BV + PAD, LDA = WG ? 64 : 64 + PAD;
  static constexpr int WARPS = BV / 16, THREADS = 32 * WARPS;
  // Two stages (the next chunk's tiles prefetched) for bf16 operands; ONE_STAGE for devices with less shared memory.
  static constexpr int STAGES = (!ONE_STAGE && ELEM_BYTES == 2) ? 2 : 1;
  // COPIER: a second warpgroup issues the stages' copies, so that the products' warpgroup issues only its own work
  // (warpgroup MMAs with two stages at 64 columns: the one-warpgroup CTAs; at 128 columns the registers do not allow
  // a third warpgroup). LAUNCH_THREADS: the CTA.
  static constexpr bool COPIER = WG && STAGES == 2 && BV == 64;
  static constexpr int LAUNCH_THREADS = THREADS + (COPIER ? 128 : 0);
  static constexpr bool SPLIT_A = ELEM_BYTES == 2;  // Aqk's lo tile (bf16 operands)
  static constexpr std::size_t stage_bytes() {
    return ELEM_BYTES * std::size_t(3 * 64 * LDK + 64 * LDB + (SPLIT_A ? 2 : 1) * 64 * LDA) + 4 * KP;
  }
  // WG: the swizzled tiles (w, qg, kg at 64 * KP, u, Aqk, its lo tile) start at multiples of 1024 bytes from a base
  // aligned in the kernel (hence the 1 KB of slack).
  static constexpr std::size_t ALIGN = WG ? 1024 : 16;
  static_assert(!WG || (64 * LDB * ELEM_BYTES) % 1024 == 0, "u tile keeps the swizzled tiles 1024-byte aligned");
  static constexpr std::size_t stage_stride() { return (stage_bytes() + ALIGN - 1) & ~(ALIGN - 1); }
  // WG: a [64][LDB] bf16 tile after the stages stages the outputs (ForwardArgs::vec_out).
  static constexpr std::size_t bytes() {
    return STAGES * stage_stride() + (WG ? 1024 + 64 * LDB * std::size_t(ELEM_BYTES) : 0);
  }
};

// 128-column tiles (bf16 operands, K <= 128): recurrence_vrows_kernel; narrower tiles: recurrence_kernel, whose warps
// split the keys as well (the value-row kernel's four warps at 64 columns wait on their own instruction chains:
// docs/perf-notes.md). With warpgroup MMAs (WG) the value-row kernel takes 64-column tiles as well (one warpgroup).
template <int KP, int BV, bool WG = false>
constexpr bool kVrows = KP <= 128 && (BV == 128 || (WG && BV == 64));

// Where the warpgroup-MMA variant exists: bf16 operands, K <= 128, whole warpgroups of value rows.
template <int ELEM_BYTES, int KP, int BV>
constexpr bool kHasWgmma = ELEM_BYTES == 2 && KP <= 128 && (BV == 64 || BV == 128);

template <int ELEM_BYTES, int KP, int BV, bool ONE_STAGE = false, bool WG = false>
constexpr std::size_t recurrence_bytes() {
  if constexpr (kVrows<KP, BV, WG>) return VrowsLayout<ELEM_BYTES, KP, BV, ONE_STAGE, WG>::bytes();
  else return RecurrenceLayout<ELEM_BYTES, KP, BV, ONE_STAGE>::bytes();
}

// ONE_STAGE variants exist only where the default layout has two stages.
template <int ELEM_BYTES, int KP, int BV, bool WG = false>
constexpr bool kHasOneStage = kVrows<KP, BV, WG> ? VrowsLayout<ELEM_BYTES, KP, BV>::STAGES == 2
                                                   : RecurrenceLayout<ELEM_BYTES, KP, BV>::STAGES == 2;

// Shared memory per block of the prepare kernel and of the recurrence for a configuration, as launched (the same
// dispatch as launch_forward). ELEM_BYTES: bf16 inputs take bf16 operands (2), float16 and float32 inputs float
// operands (4, split into two or three bf16 parts in the products, TileElem). G_BYTES: g's element size (the prepare
// kernel's raw g rows).
template <int IN_BYTES, int ELEM_BYTES, int G_BYTES>
ForwardSmem forward_smem(const ForwardConfig& cfg) {
  ForwardSmem r;
  with_kp(cfg.KP, [&](auto kp_tag) {
    constexpr int KP = decltype(kp_tag)::value;
    r.prepare = cfg.chunk == 32 ? PrepareLayout<IN_BYTES, ELEM_BYTES, 32, KP, G_BYTES>::bytes()
                                : PrepareLayout<IN_BYTES, ELEM_BYTES, 64, KP, G_BYTES>::bytes();
    with_bv<ELEM_BYTES, KP>(cfg.BV, [&](auto bv_tag) {
      constexpr int BV = decltype(bv_tag)::value;
      r.recurrence = recurrence_bytes<ELEM_BYTES, KP, BV>();
      if constexpr (kHasOneStage<ELEM_BYTES, KP, BV>) {
        if (cfg.one_stage) r.recurrence = recurrence_bytes<ELEM_BYTES, KP, BV, true>();
      }
      if constexpr (kHasWgmma<ELEM_BYTES, KP, BV>) {
        if (cfg.wgmma) {
          r.recurrence = cfg.one_stage ? recurrence_bytes<ELEM_BYTES, KP, BV, true, true>()
                                       : recurrence_bytes<ELEM_BYTES, KP, BV, false, true>();
        }
      }
    });
  });
  return r;
}

}  // namespace kdakit::cuda
