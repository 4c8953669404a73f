// Every invalid input raises kdakit::InvalidArgument naming the argument (spec §5.2 and the stricter checks).
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "support/kda_case.h"

namespace kdakit::test {
namespace {

// A valid varlen forward problem with its buffers, to be mutated one field at a time.
struct ForwardFixture {
  KdaCase c;
  HostTensor out, final_state, idx, mask, inter;
  std::vector<unsigned char> ws;
  ForwardParams p;

  explicit ForwardFixture(GateMode gate = GateMode::kLowerBound) {
    CaseConfig cfg;
    cfg.seqlens = {5, 0, 70};
    cfg.H = 2; cfg.HV = 4; cfg.K = 16; cfg.V = 8;
    cfg.gate = gate;
    c = make_case(cfg, 1);
    p.in = c.inputs();
    p.state = c.state_io();
    out = HostTensor(DType::kFloat32, {1, 75, 4, 8});
    final_state = HostTensor(DType::kFloat32, {3, 4, 16, 8});
    p.out = out.view();
    p.state.final_state = final_state.view();
    ws.resize(forward_workspace_size(p));
    p.workspace = ws.data();
    p.workspace_bytes = ws.size();
  }
};

void expect_invalid(const std::function<void()>& call, const std::string& argument, const std::string& phrase) {
  try {
    call();
    ADD_FAILURE() << "no exception; expected one naming '" << argument << "'";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(phrase), std::string::npos) << "message '" << e.what() << "' lacks '" << phrase << "'";
  }
}

void expect_forward_invalid(const std::function<void(ForwardFixture&)>& mutate, const std::string& argument,
                            const std::string& phrase, GateMode gate = GateMode::kLowerBound) {
  ForwardFixture f(gate);
  mutate(f);
  expect_invalid([&] { forward(f.p); }, argument, phrase);
}

TEST(Validate, ValidFixtureRuns) {
  ForwardFixture f;
  EXPECT_NO_THROW(forward(f.p));
  const Problem pr = validate(f.p);
  EXPECT_EQ(pr.N, 3);
  EXPECT_EQ(pr.HV, 4);
  EXPECT_EQ(pr.group, 2);
  EXPECT_EQ(pr.num_chunks, 1 + 0 + 2);
}

TEST(Validate, SpecErrors) {
  // cu_seqlens with batch size != 1
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.q.shape[0] = 2; f.p.in.k.shape[0] = 2; }, "v", "[B,T,HV,V]");
  {
    CaseConfig cfg;
    cfg.B = 2; cfg.T = 8; cfg.K = 4; cfg.V = 4;
    KdaCase c = make_case(cfg, 2);
    HostTensor cu(DType::kInt64, {2});
    cu.set(0, 0); cu.set(1, 8);
    ForwardParams p;
    p.in = c.inputs();
    p.in.cu_seqlens = cu.view();
    HostTensor out(DType::kFloat32, {2, 8, 2, 4});
    p.out = out.view();
    expect_invalid([&] { validate(p); }, "cu_seqlens", "batch size 1");
  }
  // initial_state rows != number of sequences
  expect_forward_invalid([](ForwardFixture& f) { f.p.state.initial_state.shape[0] = 2; }, "initial_state", "[N,HV,K,V]");
  // initial_state dtype
  expect_forward_invalid([](ForwardFixture& f) { f.p.state.initial_state.dtype = DType::kFloat16; }, "initial_state",
                         "float32 or bfloat16");
  // in-kernel softplus gate without A_log
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.gate.A_log = TensorView(); }, "A_log", "required",
                         GateMode::kSoftplus);
  // chunk_size
  expect_forward_invalid([](ForwardFixture& f) { f.p.chunk_size = 16; }, "chunk_size",
                         "`chunk_size` must be either 32 or 64");
  // safe_gate with the in-kernel softplus gate (lower_bound None)
  expect_forward_invalid([](ForwardFixture& f) { f.p.safe_gate = true; }, "lower_bound", "lower_bound=None",
                         GateMode::kSoftplus);
  // lower_bound outside [-5, 0) under safe_gate, and >= 0 always
  expect_forward_invalid([](ForwardFixture& f) { f.p.safe_gate = true; f.p.in.gate.lower_bound = -6.f; }, "lower_bound",
                         "[-5, 0)");
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.gate.lower_bound = 0.f; }, "lower_bound", "negative");
  // allow_neg_eigval without the sigmoid
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.allow_neg_eigval = true; }, "allow_neg_eigval",
                         "use_beta_sigmoid_in_kernel");
  // q.shape != k.shape
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.k.shape[3] = 8; }, "k", "shape of q");
  // K > 256
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.q.shape[3] = 300; f.p.in.k.shape[3] = 300; }, "q", "K = 300");
  // HV % H != 0
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.v.shape[2] = 3; }, "v", "multiple");
  // g and beta shapes
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.g.shape[2] = 2; }, "g", "[B,T,HV,K]");
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.beta.shape[2] = 2; }, "beta", "[B,T,HV]");
}

TEST(Validate, DtypeDeviceShapeStride) {
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.q.dtype = DType::kInt32; f.p.in.k.dtype = DType::kInt32; }, "q",
                         "int32");
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.k.dtype = DType::kBFloat16; }, "k", "dtype of q");
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.v.device = Device::kCUDA; }, "v", "cuda:0");
  expect_forward_invalid([](ForwardFixture& f) { f.p.out.shape[3] = 4; }, "out", "[B,T,HV,V]");
  expect_forward_invalid([](ForwardFixture& f) { f.p.out = TensorView(); }, "out", "required");
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.q.strides[3] = 2; }, "q", "stride 1");
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.v.strides[0] = -1; }, "v", "negative strides");
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.v.shape[3] = 257; }, "v", "V = 257");
  expect_forward_invalid([](ForwardFixture& f) { f.p.state.initial_state.strides[2] = 99; }, "initial_state", "dense");
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.gate.A_log.shape[0] = 3; }, "A_log", "4 elements");
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.gate.dt_bias.shape[0] = 3; }, "dt_bias", "64 elements");
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.gate.mode = GateMode::kPreGated; }, "A_log",
                         "use_gate_in_kernel=False");
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.scale = 1.f / 0.f; }, "scale", "finite");
  expect_forward_invalid([](ForwardFixture& f) { f.p.workspace_bytes = 16; }, "workspace", "bytes");
}

TEST(Validate, SequenceBoundaries) {
  expect_forward_invalid([](ForwardFixture& f) { f.c.cu_seqlens.set(2, 3); }, "cu_seqlens", "non-decreasing");
  expect_forward_invalid([](ForwardFixture& f) { f.c.cu_seqlens.set(3, 76); }, "cu_seqlens",
                         "not exceed the number of tokens T = 75");
  expect_forward_invalid([](ForwardFixture& f) { f.c.cu_seqlens.set(0, 1); }, "cu_seqlens", "start at 0");
  expect_forward_invalid([](ForwardFixture& f) { f.p.in.cu_seqlens.dtype = DType::kFloat32; }, "cu_seqlens", "int32 or int64");
  // A padded token tail: the last boundary may end before T (the tokens past it are padding).
  ForwardFixture tail;
  tail.c.cu_seqlens.set(3, 60);
  EXPECT_NO_THROW(forward(tail.p));
}

TEST(Validate, StatePoolAndIndices) {
  // Slot out of range for the pool, slot < -1, 2-D indices in the chunked forward.
  auto with_pool = [](ForwardFixture& f, std::vector<double> slots, std::vector<int64_t> shape) {
    f.idx = HostTensor(DType::kInt32, shape);
    for (std::size_t i = 0; i < slots.size(); ++i) f.idx.set(static_cast<int64_t>(i), slots[i]);
    f.p.state.state_indices = f.idx.view();
  };
  expect_forward_invalid([&](ForwardFixture& f) { with_pool(f, {0, 1, 3}, {3}); }, "ssm_state_indices", "out of range");
  expect_forward_invalid([&](ForwardFixture& f) { with_pool(f, {0, -2, 1}, {3}); }, "ssm_state_indices",
                         "padding is -1 or pad_slot_id");
  expect_forward_invalid([&](ForwardFixture& f) { with_pool(f, {0, 1, 2, 0, 1, 2}, {3, 2}); }, "ssm_state_indices", "1-D");
  expect_forward_invalid([&](ForwardFixture& f) { with_pool(f, {0, 1}, {2}); }, "ssm_state_indices", "one row per sequence");
  // pad_slot_id: -1 or a slot id, and only with indices.
  expect_forward_invalid([&](ForwardFixture& f) { with_pool(f, {0, 1, 2}, {3}); f.p.state.pad_slot_id = -2; },
                         "pad_slot_id", "got -2");
  {
    // Without indices nothing is padding: a pad id changes nothing (engines pass their constant in every call).
    ForwardFixture with_pad, without;
    with_pad.p.state.pad_slot_id = 0;
    forward(with_pad.p);
    forward(without.p);
    EXPECT_EQ(with_pad.out.values(), without.out.values());
    EXPECT_EQ(with_pad.final_state.values(), without.final_state.values());
  }
  {
    // Rows past N are ignored (whatever they hold); a slot equal to pad_slot_id is padding even past the pool.
    ForwardFixture f;
    with_pool(f, {2, 9, 0, -5, 100}, {5});
    f.p.state.pad_slot_id = 9;
    EXPECT_NO_THROW(forward(f.p));
    f.mask = HostTensor(DType::kBool, {4});
    f.p.state.has_initial_state = f.mask.view();
    EXPECT_NO_THROW(forward(f.p));
    f.mask = HostTensor(DType::kBool, {2});
    f.p.state.has_initial_state = f.mask.view();
    expect_invalid([&] { forward(f.p); }, "has_initial_state", "expected 3 entries");
    f.p.state.has_initial_state = TensorView();
    f.p.state.pad_slot_id = 0;
    expect_invalid([&] { forward(f.p); }, "ssm_state_indices", "slot 9 of sequence 1 is out of range");
  }
  expect_forward_invalid([](ForwardFixture& f) { f.p.state.final_state.shape[3] = 4; }, "final_state", "[N,HV,K,V]");
  expect_forward_invalid(
      [](ForwardFixture& f) {
        f.p.state.final_state = f.p.state.initial_state;
        f.p.state.final_state.dtype = DType::kBFloat16;
      },
      "final_state", "in place");
  expect_forward_invalid(
      [](ForwardFixture& f) {
        f.mask = HostTensor(DType::kBool, {3});
        f.p.state.has_initial_state = f.mask.view();
        f.p.state.initial_state = TensorView();
      },
      "has_initial_state", "no initial_state");
  expect_forward_invalid(
      [](ForwardFixture& f) {
        f.inter = HostTensor(DType::kFloat32, {1, 2, 4, 16, 8});  // 3 chunks in total
        f.p.intermediate_states = f.inter.view();
      },
      "intermediate_states", "[B,NT,HV,K,V]");
}

TEST(Validate, DecodeSpecific) {
  CaseConfig cfg;
  cfg.B = 3; cfg.T = 2; cfg.H = 1; cfg.HV = 2; cfg.K = 8; cfg.V = 8;
  cfg.initial_state = false;
  KdaCase c = make_case(cfg, 3);
  HostTensor pool(DType::kFloat32, {10, 2, 8, 8}), out(DType::kFloat32, {3, 2, 2, 8});
  HostTensor idx1(DType::kInt64, {3}), idx2(DType::kInt64, {3, 2}), acc(DType::kInt32, {3});
  for (int i = 0; i < 3; ++i) { idx1.set(i, i); acc.set(i, 2); }
  for (int i = 0; i < 6; ++i) idx2.set(i, i);
  auto base = [&] {
    DecodeParams p;
    p.in = c.inputs();
    p.state.initial_state = pool.view();
    p.state.final_state = pool.view();
    p.state.state_indices = idx1.view();
    p.out = out.view();
    return p;
  };
  EXPECT_NO_THROW(decode(base()));
  expect_invalid([&] { DecodeParams p = base(); p.num_accepted_tokens = acc.view(); decode(p); }, "num_accepted_tokens",
                 "2-D");
  acc.set(1, 3);
  expect_invalid(
      [&] {
        DecodeParams p = base();
        p.state.state_indices = idx2.view();
        p.num_accepted_tokens = acc.view();
        decode(p);
      },
      "num_accepted_tokens", "expected 1..2");
  HostTensor idx_narrow(DType::kInt64, {3, 1});
  expect_invalid(
      [&] {
        DecodeParams p = base();
        p.state.state_indices = idx_narrow.view();
        decode(p);
      },
      "ssm_state_indices", "longest sequence");
  expect_invalid(
      [&] {
        DecodeParams p = base();
        p.state.initial_state = TensorView();
        p.state.final_state = TensorView();
        decode(p);
      },
      "ssm_state_indices", "no state pool");
  {
    // 2-D indices and num_accepted_tokens with rows past N (ignored: their values are not checked).
    HostTensor idx_wide(DType::kInt64, {5, 2}), acc_wide(DType::kInt32, {5});
    for (int i = 0; i < 10; ++i) idx_wide.set(i, i < 6 ? i : -9);
    for (int i = 0; i < 5; ++i) acc_wide.set(i, i < 3 ? 1 + i % 2 : 0);
    DecodeParams p = base();
    p.state.state_indices = idx_wide.view();
    p.num_accepted_tokens = acc_wide.view();
    EXPECT_NO_THROW(decode(p));
    HostTensor acc_short(DType::kInt32, {2});
    acc_short.set(0, 1); acc_short.set(1, 1);
    p.num_accepted_tokens = acc_short.view();
    expect_invalid([&] { decode(p); }, "num_accepted_tokens", "expected 3 entries");
  }
  HostTensor bad_beta(DType::kFloat32, {3, 2, 2, 7});
  expect_invalid([&] { DecodeParams p = base(); p.in.beta = bad_beta.view(); decode(p); }, "beta", "[B,T,HV,V]");
}

TEST(Validate, BackwardGradientsFollowInputs) {
  CaseConfig cfg;
  cfg.B = 1; cfg.T = 4; cfg.H = 1; cfg.HV = 1; cfg.K = 4; cfg.V = 4;
  cfg.gate = GateMode::kSoftplus;
  KdaCase c = make_case(cfg, 4);
  HostTensor dO(DType::kFloat32, {1, 4, 1, 4}), dq(DType::kFloat32, {1, 4, 1, 4}), dk(DType::kFloat32, {1, 4, 1, 4}),
      dv(DType::kFloat32, {1, 4, 1, 4}), dg(DType::kFloat32, {1, 4, 1, 4}), db(DType::kFloat32, {1, 4, 1}),
      dA(DType::kFloat32, {1}), dbias(DType::kFloat32, {4}), dh0(DType::kFloat32, {1, 1, 4, 4});
  auto base = [&] {
    BackwardParams p;
    p.in = c.inputs();
    p.initial_state = c.h0.view();
    p.d_out = dO.view();
    p.dq = dq.view(); p.dk = dk.view(); p.dv = dv.view(); p.dg = dg.view(); p.dbeta = db.view();
    p.dA_log = dA.view(); p.ddt_bias = dbias.view(); p.d_initial_state = dh0.view();
    return p;
  };
  EXPECT_NO_THROW(validate(base()));
  expect_invalid([&] { BackwardParams p = base(); p.dA_log = TensorView(); validate(p); }, "dA_log", "required");
  expect_invalid([&] { BackwardParams p = base(); p.d_initial_state = TensorView(); validate(p); }, "d_initial_state",
                 "required");
  expect_invalid([&] { BackwardParams p = base(); p.initial_state = TensorView(); validate(p); }, "d_initial_state",
                 "absent");
  expect_invalid([&] { BackwardParams p = base(); p.in.gate.dt_bias = TensorView(); validate(p); }, "ddt_bias", "absent");
  expect_invalid([&] { BackwardParams p = base(); p.dq.shape[2] = 2; validate(p); }, "dq", "[B,T,H,K]");
  expect_invalid([&] { BackwardParams p = base(); p.d_out = TensorView(); validate(p); }, "d_out", "required");
  expect_invalid(
      [&] {
        BackwardParams p = base();
        validate(p);
        p.workspace_bytes = 8;
        p.workspace = dq.view().data;
        backward(p);
      },
      "workspace", "bytes");
  // d_initial_state_only: d_initial_state alone, the token and parameter gradients absent, initial_state optional.
  auto only = [&] {
    BackwardParams p = base();
    p.d_initial_state_only = true;
    p.dq = p.dk = p.dv = p.dg = p.dbeta = p.dA_log = p.ddt_bias = TensorView();
    return p;
  };
  EXPECT_NO_THROW(validate(only()));
  EXPECT_NO_THROW([&] { BackwardParams p = only(); p.initial_state = TensorView(); validate(p); }());
  expect_invalid([&] { BackwardParams p = only(); p.dv = dv.view(); validate(p); }, "dv", "d_initial_state_only");
  expect_invalid([&] { BackwardParams p = only(); p.dA_log = dA.view(); validate(p); }, "dA_log",
                 "d_initial_state_only");
  expect_invalid([&] { BackwardParams p = only(); p.d_initial_state = TensorView(); validate(p); }, "d_initial_state",
                 "required with d_initial_state_only");
  expect_invalid([&] { BackwardParams p = only(); p.d_initial_state.shape[1] = 2; validate(p); }, "d_initial_state",
                 "");
}

}  // namespace
}  // namespace kdakit::test
