// kdakit._C: the Python binding of the C++ API. torch tensors are read through their Python attributes and other
// arrays through DLPack (numpy, cupy, ...), so the module depends on no framework's C++ ABI. The params structs are
// exposed field by field and handed to the C++ entry points unchanged.
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

// A torch tensor read through its Python attributes: several times cheaper than a DLPack export, which matters
// for a decode step (a dozen tensors per call, microseconds of GPU work). torch is looked up in sys.modules, never
// imported: without torch loaded no argument can be a torch tensor, and the binding needs no torch to build or run.
struct TorchTypes {
  PyObject* tensor = nullptr;  // torch.Tensor (borrowed from the loaded module, kept alive by it)
  PyObject* dtypes[8] = {};
  DType kinds[8] = {};
  int count = 0;
  bool looked = false;
  bool lookup() {
    if (looked) return tensor != nullptr;
    PyObject* torch = PyDict_GetItemString(PySys_GetObject("modules"), "torch");  // borrowed, may be null
    if (torch == nullptr) return false;  // not loaded yet: look again next time
    looked = true;
    const std::pair<const char*, DType> names[] = {
        {"float32", DType::kFloat32}, {"bfloat16", DType::kBFloat16}, {"float16", DType::kFloat16},
        {"float64", DType::kFloat64}, {"int32", DType::kInt32},       {"int64", DType::kInt64},
        {"uint8", DType::kUInt8},     {"bool", DType::kBool}};
    for (const auto& [name, kind] : names) {
      PyObject* d = PyObject_GetAttrString(torch, name);
      if (d == nullptr) { PyErr_Clear(); continue; }
      dtypes[count] = d;  // the reference is kept for the module's lifetime
      kinds[count++] = kind;
    }
    tensor = PyObject_GetAttrString(torch, "Tensor");
    if (tensor == nullptr) PyErr_Clear();
    return tensor != nullptr;
  }
};
TorchTypes torch_types;

// Attribute names interned once (the lookups then skip building a string per call).
struct TorchNames {
  PyObject *dtype, *is_cuda, *is_cpu, *shape, *stride, *data_ptr, *get_device, *device;
  TorchNames() {
    auto intern = [](const char* s) { return PyUnicode_InternFromString(s); };
    dtype = intern("dtype"), is_cuda = intern("is_cuda"), is_cpu = intern("is_cpu"), shape = intern("shape");
    stride = intern("stride"), data_ptr = intern("data_ptr"), get_device = intern("get_device"), device = intern("device");
  }
};

nb::object get(nb::handle obj, PyObject* name) {
  PyObject* r = PyObject_GetAttr(obj.ptr(), name);
  if (r == nullptr) throw nb::python_error();
  return nb::steal(r);
}
nb::object call(nb::handle obj, PyObject* name) {
  PyObject* r = PyObject_CallMethodNoArgs(obj.ptr(), name);
  if (r == nullptr) throw nb::python_error();
  return nb::steal(r);
}
int64_t long_of(PyObject* o) {
  const long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw nb::python_error();
  return v;
}

// Fills `out` from a torch tensor on the CPU or a CUDA device; false for other objects and element types (the
// DLPack path decides).
bool torch_view(nb::handle obj, TensorView& out) {
  if (!torch_types.lookup() || !PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(torch_types.tensor))) {
    return false;
  }
  static const TorchNames names;
  const nb::object dt = get(obj, names.dtype);
  int kind = -1;
  for (int i = 0; i < torch_types.count; ++i) {
    if (dt.ptr() == torch_types.dtypes[i]) { kind = i; break; }
  }
  if (kind < 0) return false;  // complex, float8, ...: DLPack names the type in its error
  Device device;
  if (get(obj, names.is_cuda).ptr() == Py_True) {
    device = Device::kCUDA;
  } else if (get(obj, names.is_cpu).ptr() == Py_True) {
    device = Device::kCPU;
  } else {
    throw InvalidArgument("tensor", "expected a CPU or CUDA tensor, got one on device " +
                                        std::string(nb::steal<nb::str>(PyObject_Str(get(obj, names.device).ptr())).c_str()));
  }
  const nb::object shape = get(obj, names.shape), strides = call(obj, names.stride);
  const Py_ssize_t ndim = PyTuple_Size(shape.ptr());  // torch.Size and the strides are tuples
  if (ndim < 0 || PyTuple_Size(strides.ptr()) != ndim) throw nb::python_error();
  if (ndim > kMaxDims) {
    throw InvalidArgument("tensor", "at most " + std::to_string(kMaxDims) + " dimensions, got " + std::to_string(ndim));
  }
  int64_t sh[kMaxDims], st[kMaxDims];
  for (Py_ssize_t i = 0; i < ndim; ++i) {
    sh[i] = long_of(PyTuple_GET_ITEM(shape.ptr(), i));
    st[i] = long_of(PyTuple_GET_ITEM(strides.ptr(), i));
  }
  const nb::object ptr = call(obj, names.data_ptr);
  void* data = PyLong_AsVoidPtr(ptr.ptr());
  if (data == nullptr && PyErr_Occurred()) throw nb::python_error();
  const int index = device == Device::kCUDA ? static_cast<int>(long_of(call(obj, names.get_device).ptr())) : 0;
  out = make_view(data, torch_types.kinds[kind], static_cast<int>(ndim), sh, st, device, index);
  return true;
}

// None -> an absent view; a torch tensor by its attributes; anything else through DLPack.
TensorView view_of_object(nb::handle obj) {
  if (obj.is_none()) return TensorView();
  TensorView v;
  if (torch_view(obj, v)) return v;
  nb::ndarray<nb::ro> array;
  if (!nb::try_cast(obj, array)) {
    throw nb::type_error(("view(): expected a torch tensor, a DLPack-capable array or None, got " +
                          std::string(nb::type_name(obj.type()).c_str()))
                             .c_str());
  }
  return view_of(array);
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

template <class Params>
void bind_call(nb::module_& m, const char* name) {
  nb::class_<PlannedCall<Params>>(m, name)
      .def(nb::init<const Params&>(), nb::arg("params"))
      .def_prop_ro("workspace_size", &PlannedCall<Params>::workspace_size)
      .def(
          "run",
          [](const PlannedCall<Params>& c, const TensorView& ws, uintptr_t stream) {
            c.run(ws.data, ws.present() ? static_cast<std::size_t>(ws.numel()) * dtype_size(ws.dtype) : 0,
                  stream_ptr(stream));
          },
          nb::arg("workspace"), nb::arg("stream") = 0, nb::call_guard<nb::gil_scoped_release>());
}

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
  nb::enum_<CpPhase>(m, "CpPhase", nb::is_arithmetic())
      .value("NONE", CpPhase::kNone)
      .value("SUMMARY", CpPhase::kSummary)
      .value("FINISH", CpPhase::kFinish);
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
  m.def("view", &view_of_object, nb::arg("array").none(),
        "A view of a torch tensor (CPU or CUDA, read through its attributes) or of any DLPack-capable array "
        "(numpy, ...); None gives an absent view. The caller keeps the array alive while the view is used.");

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
      .def_rw("has_initial_state", &StateIO::has_initial_state)
      .def_rw("pad_slot_id", &StateIO::pad_slot_id);

  // Whole-struct setters: one call from Python instead of a field assignment per tensor (host time per decode step).
  m.def(
      "set_inputs",
      [](KdaInputs& in, nb::handle q, nb::handle k, nb::handle v, nb::handle g, nb::handle beta, nb::handle A_log,
         nb::handle dt_bias, nb::handle cu_seqlens, nb::handle cu_seqlens_host, float scale, int gate,
         float lower_bound, bool qk_l2norm, bool beta_sigmoid, bool allow_neg_eigval) {
        if (gate < 0 || gate > static_cast<int>(GateMode::kLowerBound)) {
          throw InvalidArgument("gate", "expected a GateMode value 0..2, got " + std::to_string(gate));
        }
        in.q = view_of_object(q);
        in.k = view_of_object(k);
        in.v = view_of_object(v);
        in.g = view_of_object(g);
        in.beta = view_of_object(beta);
        in.scale = scale;
        in.gate.mode = static_cast<GateMode>(gate);
        in.gate.A_log = view_of_object(A_log);
        in.gate.dt_bias = view_of_object(dt_bias);
        in.gate.lower_bound = lower_bound;
        in.qk_l2norm = qk_l2norm;
        in.beta_sigmoid = beta_sigmoid;
        in.allow_neg_eigval = allow_neg_eigval;
        in.cu_seqlens = view_of_object(cu_seqlens);
        in.cu_seqlens_host = view_of_object(cu_seqlens_host);
      },
      nb::arg("inputs"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"),
      nb::arg("A_log").none(), nb::arg("dt_bias").none(), nb::arg("cu_seqlens").none(),
      nb::arg("cu_seqlens_host").none(), nb::arg("scale"), nb::arg("gate"), nb::arg("lower_bound"),
      nb::arg("qk_l2norm"), nb::arg("beta_sigmoid"), nb::arg("allow_neg_eigval"));
  m.def(
      "set_state",
      [](StateIO& st, bool v_first, nb::handle initial, nb::handle final_state, nb::handle indices,
         nb::handle has_initial, int64_t pad_slot_id) {
        st.layout = v_first ? StateLayout::kVK : StateLayout::kKV;
        st.initial_state = view_of_object(initial);
        st.final_state = view_of_object(final_state);
        st.state_indices = view_of_object(indices);
        st.has_initial_state = view_of_object(has_initial);
        st.pad_slot_id = pad_slot_id;
      },
      nb::arg("state"), nb::arg("v_first"), nb::arg("initial_state").none(), nb::arg("final_state").none(),
      nb::arg("state_indices").none(), nb::arg("has_initial_state").none(), nb::arg("pad_slot_id") = -1);

  nb::class_<ForwardParams>(m, "ForwardParams")
      .def(nb::init<>())
      .def_rw("inputs", &ForwardParams::in, nb::rv_policy::reference_internal)
      .def_rw("state", &ForwardParams::state, nb::rv_policy::reference_internal)
      .def_rw("chunk_size", &ForwardParams::chunk_size)
      .def_rw("safe_gate", &ForwardParams::safe_gate)
      .def_rw("out", &ForwardParams::out)
      .def_rw("intermediate_states", &ForwardParams::intermediate_states)
      .def_rw("cp_phase", &ForwardParams::cp_phase)
      .def_rw("cp_summary", &ForwardParams::cp_summary)
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
      .def_rw("chunk_states", &BackwardParams::chunk_states)
      .def_rw("dq", &BackwardParams::dq)
      .def_rw("dk", &BackwardParams::dk)
      .def_rw("dv", &BackwardParams::dv)
      .def_rw("dg", &BackwardParams::dg)
      .def_rw("dbeta", &BackwardParams::dbeta)
      .def_rw("dA_log", &BackwardParams::dA_log)
      .def_rw("ddt_bias", &BackwardParams::ddt_bias)
      .def_rw("d_initial_state", &BackwardParams::d_initial_state)
      .def_rw("d_initial_state_only", &BackwardParams::d_initial_state_only)
      .def_rw("cp_phase", &BackwardParams::cp_phase)
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
  // A validated, planned call: its workspace size, then run (validation and planning once per call).
  bind_call<ForwardParams>(m, "ForwardCall");
  bind_call<BackwardParams>(m, "BackwardCall");
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
  m.def("reload_overrides", &reload_overrides,
        "Reads the KDAKIT_* developer overrides of the CUDA launch choices from the environment again.");
  m.def("set_cpu_threads", &set_cpu_threads, nb::arg("n"));
  m.def("cpu_threads", &cpu_threads);
}
