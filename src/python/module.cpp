// kdakit._C: the Python binding of the C++ API. Tensors arrive through DLPack (torch, numpy, cupy, ...), so the
// module depends on no framework's C++ ABI. The params structs are exposed field by field and handed to the
// C++ entry points unchanged.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>

#include "kdakit/kdakit.h"

namespace nb = nanobind;
using namespace kdakit;

namespace {

DType dtype_of(const nb::dlpack::dtype& dt) {
  using code = nb::dlpack::dtype_code;
  if (dt.lanes == 1) {
    if (dt.code == static_cast<uint8_t>(code::Float)) {
      if (dt.bits == 32) return DType::kFloat32;
      if (dt.bits == 16) return DType::kFloat16;
      if (dt.bits == 64) return DType::kFloat64;
    } else if (dt.code == static_cast<uint8_t>(code::Bfloat) && dt.bits == 16) {
      return DType::kBFloat16;
    } else if (dt.code == static_cast<uint8_t>(code::Int)) {
      if (dt.bits == 32) return DType::kInt32;
      if (dt.bits == 64) return DType::kInt64;
    } else if (dt.code == static_cast<uint8_t>(code::UInt) && dt.bits == 8) {
      return DType::kUInt8;
    } else if (dt.code == static_cast<uint8_t>(code::Bool) && dt.bits == 8) {
      return DType::kBool;
    }
  }
  throw InvalidArgument("tensor", "unsupported element type (DLPack code " + std::to_string(dt.code) + ", " +
                                      std::to_string(dt.bits) + " bits)");
}

TensorView view_of(nb::ndarray<nb::ro> a) {
  Device device;
  if (a.device_type() == nb::device::cpu::value) {
    device = Device::kCPU;
  } else if (a.device_type() == nb::device::cuda::value) {
    device = Device::kCUDA;
  } else {
    throw InvalidArgument("tensor", "unsupported device type (DLPack device " + std::to_string(a.device_type()) + ")");
  }
  const int ndim = static_cast<int>(a.ndim());
  if (ndim > kMaxDims) {
    throw InvalidArgument("tensor", "at most " + std::to_string(kMaxDims) + " dimensions, got " + std::to_string(ndim));
  }
  int64_t shape[kMaxDims], strides[kMaxDims];
  for (int i = 0; i < ndim; ++i) {
    shape[i] = static_cast<int64_t>(a.shape(i));
    strides[i] = static_cast<int64_t>(a.stride(i));
  }
  return make_view(const_cast<void*>(a.data()), dtype_of(a.dtype()), ndim, shape, strides, device,
                   static_cast<int>(a.device_id()));
}

template <class P>
void set_workspace(P& p, const TensorView& t) {
  if (!t.present()) {
    p.workspace = nullptr;
    p.workspace_bytes = 0;
    return;
  }
  p.workspace = t.data;
  p.workspace_bytes = static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype);
}

void* stream_ptr(uintptr_t s) { return reinterpret_cast<void*>(s); }

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "kdakit C++ core (KDA kernels); use the kdakit package, not this module, in applications";

  // InvalidArgumentError derives from both ValueError and AssertionError, so code written against FLA's
  // exceptions (a mix of the two) keeps working.
  static nb::object invalid_argument = nb::steal(PyErr_NewExceptionWithDoc(
      "kdakit._C.InvalidArgumentError", "An argument of a kdakit call is invalid; the message names it.",
      nb::make_tuple(nb::handle(PyExc_ValueError), nb::handle(PyExc_AssertionError)).ptr(), nullptr));
  m.attr("InvalidArgumentError") = invalid_argument;
  static nb::exception<NotBuilt> not_built(m, "NotBuiltError", PyExc_RuntimeError);
  static nb::exception<CudaError> cuda_error(m, "CudaError", PyExc_RuntimeError);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(invalid_argument.ptr(), e.what());
    }
  });

  nb::enum_<StateLayout>(m, "StateLayout", nb::is_arithmetic()).value("KV", StateLayout::kKV).value("VK", StateLayout::kVK);
  nb::enum_<GateMode>(m, "GateMode", nb::is_arithmetic())
      .value("PRE_GATED", GateMode::kPreGated)
      .value("SOFTPLUS", GateMode::kSoftplus)
      .value("LOWER_BOUND", GateMode::kLowerBound);

  nb::class_<TensorView>(m, "TensorView")
      .def(nb::init<>())
      .def_prop_ro("present", &TensorView::present)
      .def_prop_ro("shape", [](const TensorView& t) {
        return std::vector<int64_t>(t.shape, t.shape + std::max(t.ndim, 0));
      })
      .def_prop_ro("strides", [](const TensorView& t) {
        return std::vector<int64_t>(t.strides, t.strides + std::max(t.ndim, 0));
      })
      .def_prop_ro("dtype", [](const TensorView& t) { return std::string(dtype_name(t.dtype)); })
      .def_prop_ro("data_ptr", [](const TensorView& t) { return reinterpret_cast<uintptr_t>(t.data); })
      .def("__repr__", [](const TensorView& t) {
        return "TensorView(" + std::string(dtype_name(t.dtype)) + ", shape=" + t.shape_str() + ", strides=" + t.strides_str() + ")";
      });
  m.def("view", &view_of, nb::arg("array"),
        "A view of any DLPack-capable array (torch tensor without grad, numpy array, ...). The caller keeps "
        "the array alive while the view is used.");

  nb::class_<GateParams>(m, "GateParams")
      .def(nb::init<>())
      .def_rw("mode", &GateParams::mode)
      .def_rw("A_log", &GateParams::A_log)
      .def_rw("dt_bias", &GateParams::dt_bias)
      .def_rw("lower_bound", &GateParams::lower_bound);

  nb::class_<KdaInputs>(m, "KdaInputs")
      .def(nb::init<>())
      .def_rw("q", &KdaInputs::q)
      .def_rw("k", &KdaInputs::k)
      .def_rw("v", &KdaInputs::v)
      .def_rw("g", &KdaInputs::g)
      .def_rw("beta", &KdaInputs::beta)
      .def_rw("scale", &KdaInputs::scale)
      .def_rw("gate", &KdaInputs::gate, nb::rv_policy::reference_internal)
      .def_rw("qk_l2norm", &KdaInputs::qk_l2norm)
      .def_rw("beta_sigmoid", &KdaInputs::beta_sigmoid)
      .def_rw("allow_neg_eigval", &KdaInputs::allow_neg_eigval)
      .def_rw("cu_seqlens", &KdaInputs::cu_seqlens)
      .def_rw("cu_seqlens_host", &KdaInputs::cu_seqlens_host);

  nb::class_<StateIO>(m, "StateIO")
      .def(nb::init<>())
      .def_rw("layout", &StateIO::layout)
      .def_rw("initial_state", &StateIO::initial_state)
      .def_rw("final_state", &StateIO::final_state)
      .def_rw("state_indices", &StateIO::state_indices)
      .def_rw("has_initial_state", &StateIO::has_initial_state);

  nb::class_<ForwardParams>(m, "ForwardParams")
      .def(nb::init<>())
      .def_rw("inputs", &ForwardParams::in, nb::rv_policy::reference_internal)
      .def_rw("state", &ForwardParams::state, nb::rv_policy::reference_internal)
      .def_rw("chunk_size", &ForwardParams::chunk_size)
      .def_rw("safe_gate", &ForwardParams::safe_gate)
      .def_rw("out", &ForwardParams::out)
      .def_rw("intermediate_states", &ForwardParams::intermediate_states)
      .def("set_workspace", &set_workspace<ForwardParams>, nb::arg("workspace"));

  nb::class_<BackwardParams>(m, "BackwardParams")
      .def(nb::init<>())
      .def_rw("inputs", &BackwardParams::in, nb::rv_policy::reference_internal)
      .def_rw("layout", &BackwardParams::layout)
      .def_rw("initial_state", &BackwardParams::initial_state)
      .def_rw("chunk_size", &BackwardParams::chunk_size)
      .def_rw("safe_gate", &BackwardParams::safe_gate)
      .def_rw("d_out", &BackwardParams::d_out)
      .def_rw("d_final_state", &BackwardParams::d_final_state)
      .def_rw("dq", &BackwardParams::dq)
      .def_rw("dk", &BackwardParams::dk)
      .def_rw("dv", &BackwardParams::dv)
      .def_rw("dg", &BackwardParams::dg)
      .def_rw("dbeta", &BackwardParams::dbeta)
      .def_rw("dA_log", &BackwardParams::dA_log)
      .def_rw("ddt_bias", &BackwardParams::ddt_bias)
      .def_rw("d_initial_state", &BackwardParams::d_initial_state)
      .def("set_workspace", &set_workspace<BackwardParams>, nb::arg("workspace"));

  nb::class_<DecodeParams>(m, "DecodeParams")
      .def(nb::init<>())
      .def_rw("inputs", &DecodeParams::in, nb::rv_policy::reference_internal)
      .def_rw("state", &DecodeParams::state, nb::rv_policy::reference_internal)
      .def_rw("num_accepted_tokens", &DecodeParams::num_accepted_tokens)
      .def_rw("out", &DecodeParams::out)
      .def_rw("token_states", &DecodeParams::token_states);

  nb::class_<Problem>(m, "Problem")
      .def_ro("B", &Problem::B).def_ro("T", &Problem::T).def_ro("H", &Problem::H).def_ro("HV", &Problem::HV)
      .def_ro("K", &Problem::K).def_ro("V", &Problem::V).def_ro("N", &Problem::N).def_ro("group", &Problem::group)
      .def_ro("T_max", &Problem::T_max).def_ro("num_chunks", &Problem::num_chunks).def_ro("varlen", &Problem::varlen);

  m.def("validate_forward", [](const ForwardParams& p) { return validate(p); });
  m.def("validate_backward", [](const BackwardParams& p) { return validate(p); });
  m.def("validate_decode", [](const DecodeParams& p) { return validate(p); });
  m.def("forward_workspace_size", [](const ForwardParams& p) { return forward_workspace_size(p); });
  m.def("backward_workspace_size", [](const BackwardParams& p) { return backward_workspace_size(p); });
  m.def("forward", [](const ForwardParams& p, uintptr_t stream) { forward(p, stream_ptr(stream)); }, nb::arg("params"),
        nb::arg("stream") = 0, nb::call_guard<nb::gil_scoped_release>());
  m.def("backward", [](const BackwardParams& p, uintptr_t stream) { backward(p, stream_ptr(stream)); },
        nb::arg("params"), nb::arg("stream") = 0, nb::call_guard<nb::gil_scoped_release>());
  m.def("decode", [](const DecodeParams& p, uintptr_t stream) { decode(p, stream_ptr(stream)); }, nb::arg("params"),
        nb::arg("stream") = 0, nb::call_guard<nb::gil_scoped_release>());
  m.def("reference_forward", [](const ForwardParams& p) { reference_forward(p); }, nb::arg("params"),
        nb::call_guard<nb::gil_scoped_release>());
  m.def("count_chunks", &count_chunks, nb::arg("cu_seqlens"), nb::arg("chunk_size"));
  m.def("cuda_available", &cuda_available);
  m.def("version", &version);
  m.def("set_cpu_threads", &set_cpu_threads, nb::arg("n"));
  m.def("cpu_threads", &cpu_threads);
}
