// The decode's launch planner (src/cuda/decode/plan.cpp) as a pure function: which form a call takes (one-token
// entry, one-token instance of the general kernel, whole-tile, masked general), its CTA tile and staging, the L2
// prefetch, the alignment facts, and the errors for what the kernels do not take; device facts given here (no GPU, no
// environment overrides).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/plan.h"
#include "cuda/decode/plan.h"
#include "cuda/decode/tile_size.h"
#include "cuda/device.h"
#include "cuda/tuning.h"
#include "device_views.h"

namespace kdakit::test {
namespace {

using cuda::DecodeLaunch;
using cuda::DeviceInfo;
using cuda::Tuning;

// The engines' decode step: N sequences of T tokens (batch form), a v-first pool of `slots` slots read and written in
// place through int32 slot ids, bf16 inputs.
struct DecodeCase {
  DeviceInputs x;
  DecodeParams p;
  DecodeCase(int64_t N, int64_t T, int64_t H, int64_t HV, DType pool = DType::kFloat32, int64_t K = 128,
             int64_t V = 128)
      : x(N, T, H, HV, K, V) {
    p.in = x.in;
    const TensorView s = device_view(pool, {N * T, HV, V, K});
    p.state.layout = StateLayout::kVK;
    p.state.initial_state = s;
    p.state.final_state = s;
    p.state.state_indices = device_view(DType::kInt32, {N});
    p.out = device_view(DType::kBFloat16, {N, T, HV, V});
  }
  DecodeLaunch plan(const DeviceInfo& dev = kH200, const Tuning& tune = Tuning()) const {
    return cuda::plan_decode_launch(p, detail::plan_decode(p), dev, tune);
  }
};

TEST(DecodePlan, OneTokenBatchTakesTheOneTokenEntry) {
  const DecodeLaunch d = DecodeCase(1, 1, 16, 16).plan();
  EXPECT_TRUE(d.cfg.one);
  EXPECT_FALSE(d.cfg.one_multi);  // fixed T = 1: every sequence has one token
  EXPECT_EQ(d.cfg.warps, 4);
  EXPECT_EQ(d.cfg.passes, 1);  // one CTA per SM at most: the shortest chain
  EXPECT_EQ(d.cfg.smem, 0u);   // the state goes straight to registers
  EXPECT_EQ(d.vtiles, 4);
  EXPECT_TRUE(d.initial_vec && d.final_vec && d.q_vec && d.k_vec && d.g_vec);
}

TEST(DecodePlan, OneTokenKvPoolsStageTheStateAtOnePass) {
  DecodeCase c(1, 1, 16, 16);
  c.p.state.layout = StateLayout::kKV;  // [slots, HV, K, V]: K = V, the same views
  const DecodeLaunch d = c.plan();
  EXPECT_TRUE(d.cfg.one);
  EXPECT_EQ(d.cfg.passes, 1);
  EXPECT_TRUE(d.cfg.one_staged);  // by rows and ldmatrix, not one 4-byte load per key
  EXPECT_EQ(d.cfg.smem, cuda::decode_staged_bytes(128, 4, 128, 1));
  EXPECT_FALSE(DecodeCase(1, 1, 16, 16).plan().cfg.one_staged);  // v-first: straight to registers
  Tuning direct;
  direct.decode_one_staged = 0;
  const DecodeLaunch r = c.plan(kH200, direct);
  EXPECT_FALSE(r.cfg.one_staged);
  EXPECT_EQ(r.cfg.smem, 0u);
  EXPECT_TRUE(DecodeCase(256, 1, 16, 16).plan(kH200, direct).cfg.one_staged);  // passes > 1 always stage
}

TEST(DecodePlan, LargeBatchesStageTheStateAndPrefetchOnHopper) {
  const DecodeLaunch bf = DecodeCase(256, 1, 16, 16, DType::kBFloat16).plan();
  EXPECT_TRUE(bf.cfg.one);
  EXPECT_FALSE(bf.cfg.one_multi);
  EXPECT_TRUE(bf.stage_state);
  EXPECT_EQ(bf.cfg.passes, 4);  // 4 x 32 bf16 columns of K = 128: a 32 KB tile
  EXPECT_EQ(bf.cfg.smem, cuda::decode_staged_bytes(128, 2, 128, 4));
  EXPECT_EQ(bf.cfg.smem, 32768u + 4 * cuda::kDecodeKvRowPad);  // the state, plus the [K,V] row layout's padding
  EXPECT_TRUE(bf.cfg.one_staged);
  EXPECT_EQ(bf.prefetch_ahead, 132);  // one CTA per SM ahead
  const DecodeLaunch fp = DecodeCase(256, 1, 16, 16, DType::kFloat32).plan();
  EXPECT_EQ(fp.cfg.passes, 2);  // 2 x 32 fp32 columns: 32 KB
  EXPECT_EQ(DecodeCase(256, 1, 16, 16, DType::kBFloat16).plan(kA100).prefetch_ahead, 0);
  Tuning off;
  off.decode_prefetch = 0.f;
  EXPECT_EQ(DecodeCase(256, 1, 16, 16, DType::kBFloat16).plan(kH200, off).prefetch_ahead, 0);
}

TEST(DecodePlan, VarlenWithDeviceLengthsTakesTheOneTokenInstance) {
  DecodeCase c(1, 8, 16, 16);  // vLLM's form: [1, T] tokens, device cu_seqlens, lengths unknown to the host
  c.p.in.cu_seqlens = device_view(DType::kInt32, {9});
  c.p.state.state_indices = device_view(DType::kInt32, {8});
  const DecodeLaunch d = c.plan();
  EXPECT_TRUE(d.cfg.one);        // at most N tokens: every sequence may have one
  EXPECT_TRUE(d.cfg.one_multi);  // but a longer one runs token by token in the same kernel
  EXPECT_EQ(d.cfg.smem, 0u);     // v-first at one pass: the state straight to registers, no token staging
  EXPECT_TRUE(d.tail_cta);       // device cu_seqlens: a CTA row zeroes a padded token tail, if any
  c.p.state.layout = StateLayout::kKV;
  const DecodeLaunch kv = c.plan();
  EXPECT_TRUE(kv.cfg.one_multi);
  EXPECT_EQ(kv.cfg.smem, cuda::decode_staged_bytes(128, 4, 128, 1));  // [K,V]: the staged tile alone
}

TEST(DecodePlan, VerifyWithTwoDimensionalIndicesTakesTheWholeTileForm) {
  DecodeCase c(32, 4, 16, 16);
  c.p.state.state_indices = device_view(DType::kInt32, {32, 4});
  c.p.num_accepted_tokens = device_view(DType::kInt32, {32});
  const DecodeLaunch d = c.plan();
  EXPECT_FALSE(d.cfg.one);
  EXPECT_TRUE(d.cfg.full);
  EXPECT_EQ(d.tb, 4);
  EXPECT_LE(d.cfg.smem, cuda::kDecodeSmemLimit);
  EXPECT_EQ(d.prefetch_ahead, 132);  // whole staged tiles prefetch the later CTA's tile too
  EXPECT_EQ(c.plan(kA100).prefetch_ahead, 0);
}

// Verify of 1024 sequences with [N, 4] slot ids and accepted counts on a bf16 [K,V] pool, K = V = 128.
DecodeCase bf16_kv_verify() {
  DecodeCase c(1024, 4, 32, 32, DType::kBFloat16);
  c.p.state.layout = StateLayout::kKV;
  const TensorView pool = device_view(DType::kBFloat16, {1024 * 4, 32, 128, 128});
  c.p.state.initial_state = c.p.state.final_state = pool;
  c.p.state.state_indices = device_view(DType::kInt32, {1024, 4});
  c.p.num_accepted_tokens = device_view(DType::kInt32, {1024});
  return c;
}

TEST(DecodePlan, Bf16KvVerifyTakesWideTiles) {
  const DecodeCase c = bf16_kv_verify();
  const DecodeLaunch w = c.plan();
  EXPECT_TRUE(w.cfg.full);
  EXPECT_EQ(w.cfg.wide_kv, 8);
  EXPECT_FALSE(w.kv_regs);
  EXPECT_EQ(w.cfg.warps, 4);
  EXPECT_EQ(w.cfg.passes, 4);  // one CTA tile of 128 columns
  EXPECT_EQ(w.vtiles, 1);
  EXPECT_EQ(w.cfg.smem, cuda::DecodeSmem(128, 4, 128, 0).total);  // the token rows only: the state is not staged
  EXPECT_EQ(w.prefetch_ahead, 132);
  Tuning t;
  t.decode_passes = 4;  // the pass override at the wide tile's own count keeps it
  EXPECT_EQ(c.plan(kH200, t).cfg.wide_kv, 8);
  t.decode_passes = 2;
  EXPECT_EQ(c.plan(kH200, t).cfg.wide_kv, 0);
  t.decode_passes = 0;
  t.decode_wide_kv = 4;  // 4 columns per thread: 64 per CTA
  const DecodeLaunch w4 = c.plan(kH200, t);
  EXPECT_EQ(w4.cfg.wide_kv, 4);
  EXPECT_EQ(w4.cfg.passes, 2);
  EXPECT_EQ(w4.vtiles, 2);
  EXPECT_EQ(w4.cfg.smem, cuda::DecodeSmem(128, 4, 64, 0).total);
  // V = 96: not whole 128-column tiles.
  DecodeCase odd(64, 4, 16, 16, DType::kBFloat16, 128, 96);
  odd.p.state.layout = StateLayout::kKV;
  odd.p.state.initial_state = odd.p.state.final_state = device_view(DType::kBFloat16, {64, 16, 128, 96});
  EXPECT_EQ(odd.plan().cfg.wide_kv, 0);
}

TEST(DecodePlan, Bf16KvVerifyHoldsBothPassesInRegisters) {
  const DecodeCase c = bf16_kv_verify();
  Tuning staged;
  staged.decode_wide_kv = 0;
  const DecodeLaunch d = c.plan(kH200, staged);
  EXPECT_TRUE(d.cfg.full);
  EXPECT_EQ(d.cfg.wide_kv, 0);
  EXPECT_EQ(d.cfg.passes, 2);  // four passes in registers would not fit; pass by pass they were slower
  EXPECT_TRUE(d.kv_regs);
  EXPECT_EQ(d.prefetch_ahead, 0);  // no L2 prefetch for these three-CTA launches (slower with it)
  const std::size_t tile = cuda::decode_staged_bytes(128, 2, 128, 2);
  EXPECT_EQ(d.cfg.smem, cuda::DecodeSmem(128, 4, 64, 2 * tile).total);  // the tile and the second staging buffer
  EXPECT_EQ(d.vtiles, 2);
  EXPECT_EQ(d.vt_shift, 1);  // the two V tiles of a state block next to each other in launch order
  Tuning t;
  t.decode_wide_kv = 0;
  t.decode_kv_regs = false;
  t.decode_vt_inner = 0;
  const DecodeLaunch o = c.plan(kH200, t);
  EXPECT_FALSE(o.kv_regs);
  EXPECT_EQ(o.prefetch_ahead, 132);  // the whole tile pass by pass prefetches
  EXPECT_EQ(o.cfg.smem, cuda::DecodeSmem(128, 4, 64, tile).total);
  EXPECT_EQ(o.vt_shift, 0);
  // fp32 pools keep the whole tile in shared memory (no registers across tokens), v-first pools their own order.
  EXPECT_FALSE(DecodeCase(64, 4, 16, 16).plan().kv_regs);
}

TEST(DecodePlan, FormsThatLeaveTheOneTokenForm) {
  {
    DecodeCase c(8, 1, 16, 16);
    c.p.state.state_indices = device_view(DType::kInt64, {8});  // int64 slot ids stay in the one-token form
    EXPECT_TRUE(c.plan().cfg.one);
  }
  {
    DecodeCase c(8, 1, 16, 16);
    c.p.in.g.dtype = c.p.in.beta.dtype = DType::kFloat32;  // the engines' fp32 gate beside bf16 inputs: stays
    EXPECT_TRUE(c.plan().cfg.one);
    c.p.in.beta.dtype = DType::kBFloat16;  // g and beta of different dtypes: the general form
    EXPECT_FALSE(c.plan().cfg.one);
  }
  {
    DecodeCase c(8, 1, 16, 16);
    c.p.token_states = device_view(DType::kFloat32, {8, 16, 128, 128});  // per-token states
    EXPECT_FALSE(c.plan().cfg.one);
  }
  {
    DecodeCase c(8, 1, 16, 16);
    c.p.in.beta.dtype = DType::kFloat32;  // beta of another dtype than q
    EXPECT_FALSE(c.plan().cfg.one);
  }
  {
    DecodeCase c(8, 1, 16, 16, DType::kFloat32, 128, 128);
    c.p.in.q = device_view(DType::kBFloat16, {8, 1, 16, 128}, 2);  // rows not 16-byte aligned
    EXPECT_FALSE(c.plan().cfg.one);
    EXPECT_FALSE(c.plan().q_vec);
  }
  Tuning general;
  general.decode_general = true;
  const DecodeLaunch g = DecodeCase(8, 1, 16, 16).plan(kH200, general);
  EXPECT_FALSE(g.cfg.one);
  EXPECT_FALSE(g.cfg.full);
}

TEST(DecodePlan, StatesOfAnotherDtypeOrAlignmentTakeTheMaskedForm) {
  DecodeCase c(64, 4, 16, 16, DType::kBFloat16);
  c.p.state.final_state = device_view(DType::kFloat32, {256, 16, 128, 128});  // not the pool's dtype
  c.p.state.state_indices = device_view(DType::kInt32, {64});
  const DecodeLaunch d = c.plan();
  EXPECT_FALSE(d.cfg.full);
  EXPECT_TRUE(d.stage_state);  // the initial state is still staged
  EXPECT_EQ(d.prefetch_ahead, 0);  // masked tiles: no prefetch
  DecodeCase u(64, 1, 16, 16, DType::kFloat32);
  u.p.state.initial_state = u.p.state.final_state = device_view(DType::kFloat32, {64, 16, 128, 128}, 8);
  const DecodeLaunch e = u.plan();
  EXPECT_FALSE(e.initial_vec);
  EXPECT_FALSE(e.stage_state);
  EXPECT_FALSE(e.cfg.one);
  EXPECT_FALSE(e.cfg.full);
}

TEST(DecodePlan, LaunchShapeOverridesAndSmallHeads) {
  Tuning t;
  t.decode_warps = 2;
  t.decode_passes = 2;
  const DecodeLaunch d = DecodeCase(256, 1, 16, 16).plan(kH200, t);
  EXPECT_EQ(d.cfg.warps, 2);
  EXPECT_EQ(d.cfg.passes, 2);
  EXPECT_EQ(d.vtiles, 128 / (2 * 8 * 2));
  // V = 16: one warp-column group of 8 per warp, two warps.
  const DecodeLaunch s = DecodeCase(4, 1, 2, 2, DType::kFloat32, 64, 16).plan();
  EXPECT_EQ(s.cfg.warps, 2);
  EXPECT_EQ(s.cfg.KP, 64);
  // K = 256 with float32 pools and 8 staged tokens does not stage the state (over 48 KB).
  const DecodeLaunch k = DecodeCase(8, 8, 2, 2, DType::kFloat32, 256, 128).plan();
  EXPECT_EQ(k.cfg.KP, 256);
  EXPECT_LE(k.cfg.smem, cuda::kDecodeSmemLimit);
}

TEST(DecodePlan, ErrorsNameTheArgument) {
  auto expect_invalid = [](DecodeCase& c, const std::string& arg, const std::string& phrase) {
    try {
      c.plan();
      ADD_FAILURE() << "expected InvalidArgument naming " << arg;
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.argument(), arg) << e.what();
      EXPECT_NE(std::string(e.what()).find(phrase), std::string::npos) << e.what();
    }
  };
  DecodeCase f64(4, 1, 2, 2, DType::kFloat64);
  expect_invalid(f64, "initial_state", "float64 runs on the CPU");
  DecodeCase heads(1, 1, 1, 65536, DType::kFloat32, 64, 8);
  expect_invalid(heads, "v", "at most 65535 value heads");
  DecodeCase mixed(4, 1, 2, 2);
  mixed.p.in.v.dtype = DType::kFloat16;
  expect_invalid(mixed, "v", "q, k and v of one dtype");
}

}  // namespace
}  // namespace kdakit::test
