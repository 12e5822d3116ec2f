// diffcomm._core: errors, tensors (DLPack in and out), autograd and the
// differentiable local ops.
#include <dlpack/dlpack.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>

#include <array>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bind.hpp"
#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm_python {

// ---------------------------------------------------------------- DLPack
dc::DType dtype_from_dl(const nb::dlpack::dtype& d) {
  using C = nb::dlpack::dtype_code;
  const auto code = static_cast<C>(d.code);
  if (d.lanes == 1) {
    if (code == C::Float && d.bits == 64) return dc::DType::Float64;
    if (code == C::Float && d.bits == 32) return dc::DType::Float32;
    if (code == C::Float && d.bits == 16) return dc::DType::Float16;
    if (code == C::Bfloat && d.bits == 16) return dc::DType::BFloat16;
    if (code == C::Int && d.bits == 64) return dc::DType::Int64;
    if (code == C::Int && d.bits == 32) return dc::DType::Int32;
    if (code == C::UInt && d.bits == 8) return dc::DType::UInt8;
  }
  // The name as torch and numpy spell it (DLPack codes: 0 int, 1 uint, 2
  // float, 4 bfloat, 5 complex, 6 bool).
  static constexpr const char* kKinds[] = {"int",    "uint",    "float", "opaque",
                                           "bfloat", "complex", "bool"};
  const std::string name =
      d.code < std::size(kKinds)
          ? std::string(kKinds[d.code]) + (d.code == 6 ? "" : std::to_string(d.bits))
          : "DLPack code " + std::to_string(d.code) + ", " + std::to_string(d.bits) + " bits";
  dc::raise("diffcomm", std::string("unsupported tensor dtype ") + name +
                            (d.lanes != 1 ? " x" + std::to_string(d.lanes) + " lanes" : "") +
                            "; supported: float64, float32, bfloat16, float16, int64, int32, "
                            "uint8");
}

nb::dlpack::dtype dl_from_dtype(dc::DType t) {
  using C = nb::dlpack::dtype_code;
  auto make = [](C code, int bits) {
    nb::dlpack::dtype d;
    d.code = static_cast<uint8_t>(code);
    d.bits = static_cast<uint8_t>(bits);
    d.lanes = 1;
    return d;
  };
  switch (t) {
    case dc::DType::Float64: return make(C::Float, 64);
    case dc::DType::Float32: return make(C::Float, 32);
    case dc::DType::Float16: return make(C::Float, 16);
    case dc::DType::BFloat16: return make(C::Bfloat, 16);
    case dc::DType::Int64: return make(C::Int, 64);
    case dc::DType::Int32: return make(C::Int, 32);
    case dc::DType::UInt8: return make(C::UInt, 8);
  }
  dc::raise("diffcomm", "unknown dtype");
}

/// Borrows a DLPack tensor (torch, numpy, ...) as a diffcomm Tensor sharing
/// its storage. Refuses non-contiguous layouts: diffcomm tensors are dense
/// row-major and a silent copy would break the zero-copy promise.
// A capsule as DLPack's Python protocol defines it: named "dltensor"; the
// consumer renames it "used_dltensor" and owns the tensor from then on, so
// the destructor frees only a capsule nobody consumed.
nb::object to_dlpack_capsule(const Tensor& t) {
  DLManagedTensor* m = dc::to_dlpack(t);
  PyObject* cap = PyCapsule_New(m, "dltensor", [](PyObject* c) {
    if (!PyCapsule_IsValid(c, "dltensor")) return;
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
    if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
  });
  if (cap == nullptr) {
    m->deleter(m);
    throw nb::python_error();
  }
  return nb::steal(cap);
}

Tensor tensor_from_dlpack(nb::ndarray<> a, bool requires_grad) {
  dc::Shape shape(a.ndim());
  for (std::size_t i = 0; i < a.ndim(); ++i) shape[i] = static_cast<int64_t>(a.shape(i));
  const int64_t numel = dc::shape_numel(shape);
  if (numel > 0 && a.stride_ptr() != nullptr) {
    int64_t expected = 1;
    for (std::size_t k = a.ndim(); k-- > 0;) {
      if (shape[k] != 1 && a.stride(k) != expected) {
        std::string strides;
        for (std::size_t i = 0; i < a.ndim(); ++i)
          strides += (i ? ", " : "") + std::to_string(a.stride(i));
        dc::raise(
            "diffcomm",
            std::string("tensor of shape ") + dc::shape_str(shape) + " with strides (" + strides +
                ") is not contiguous; diffcomm borrows storage without copying and needs a dense "
                "row-major tensor: call .contiguous() first");
      }
      expected *= shape[k];
    }
  }
  dc::Device device;
  if (a.device_type() == nb::device::cpu::value) {
    device = dc::Device::cpu();
  } else if (a.device_type() == nb::device::cuda::value) {
    device = dc::Device::cuda(a.device_id());
  } else {
    dc::raise("diffcomm", std::string("only CPU and CUDA tensors are supported (DLPack device ") +
                              std::to_string(a.device_type()) + ")");
  }
  const dc::DType dtype = dtype_from_dl(a.dtype());
  if (numel > 0 && a.data() == nullptr)  // torch's ZeroTensor: a shape and no memory
    dc::raise("diffcomm", std::string("tensor of shape ") + dc::shape_str(shape) +
                              " has no memory (null data pointer, e.g. torch's "
                              "_efficientzerotensor); materialize it first (.clone())");
  auto keep = std::make_shared<nb::ndarray<>>(a);  // releases the producer's buffer last
  Tensor t = dc::from_blob(a.data(), shape, dtype, device, [keep](void*) mutable { keep.reset(); });
  if (requires_grad) t.set_requires_grad(true);
  return t;
}

namespace {

// The Python class of each diffcomm::ErrorKind, indexed by kind: the one
// kind -> class table of the binding. Set once by bind_errors; the module
// holds a reference to each class for the life of the process.
std::array<PyObject*, dc::kErrorKindCount> error_classes{};

// A new exception class m.<name> (module-qualified, as nb::exception names
// them) deriving from `bases` (a class, or a tuple of classes).
PyObject* new_error_class(nb::module_& m, const char* name, PyObject* bases) {
  const std::string qualified = nb::cast<std::string>(m.attr("__name__")) + "." + name;
  PyObject* cls = PyErr_NewException(qualified.c_str(), bases, nullptr);
  if (cls == nullptr) throw nb::python_error();
  m.attr(name) = nb::handle(cls);
  return cls;
}

// The Python builtin a kind also derives from, so that Python's own except
// clauses catch it: InvalidArgument is a ValueError, Timeout a TimeoutError,
// ResourceExhausted a MemoryError; nullptr for the others.
PyObject* builtin_of(dc::ErrorKind k) {
  switch (k) {
    case dc::ErrorKind::InvalidArgument: return PyExc_ValueError;
    case dc::ErrorKind::Timeout: return PyExc_TimeoutError;
    case dc::ErrorKind::ResourceExhausted: return PyExc_MemoryError;
    default: return nullptr;
  }
}

}  // namespace

// diffcomm.Error derives from RuntimeError, as torch.distributed's errors do
// (DistError is a RuntimeError): `except RuntimeError` catches every
// diffcomm error, and torch's own `except torch.distributed.DistError` does
// not, since deriving from it would make `import diffcomm` import torch
// (docs/python.md).
void bind_errors(nb::module_& m) {
  auto kind = [](dc::ErrorKind k) { return static_cast<std::size_t>(k); };
  PyObject* base =
      new_error_class(m, dc::error_kind_name(dc::ErrorKind::Error), PyExc_RuntimeError);
  error_classes[kind(dc::ErrorKind::Error)] = base;
  for (dc::ErrorKind k :
       {dc::ErrorKind::InvalidArgument, dc::ErrorKind::CollectiveMismatch, dc::ErrorKind::Deadlock,
        dc::ErrorKind::RankFailure, dc::ErrorKind::Timeout, dc::ErrorKind::BackendError,
        dc::ErrorKind::ResourceExhausted}) {
    PyObject* bases = base;
    nb::object pair;
    if (PyObject* builtin = builtin_of(k)) {
      pair = nb::steal(PyTuple_Pack(2, base, builtin));
      if (!pair.is_valid()) throw nb::python_error();
      bases = pair.ptr();
    }
    error_classes[kind(k)] = new_error_class(m, dc::error_kind_name(k), bases);
  }
  // One translator: the class of the error's kind, its message unchanged.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const dc::Error& e) {
      PyErr_SetString(error_classes[static_cast<std::size_t>(e.kind())], e.what());
    }
  });
}

void bind_tensor(nb::module_& m) {
  nb::class_<Tensor>(m, "Tensor",
                     "A diffcomm tensor: a handle to shared, dense, row-major storage with "
                     "diffcomm's own autograd state. Copies share data (like torch.Tensor).")
      .def_prop_ro(
          "shape",
          [](const Tensor& t) { return std::vector<int64_t>(t.shape().begin(), t.shape().end()); })
      .def_prop_ro("dtype", [](const Tensor& t) { return dc::dtype_name(t.dtype()); })
      .def_prop_ro("device", [](const Tensor& t) { return t.device().str(); })
      .def_prop_ro("requires_grad", &Tensor::requires_grad)
      .def_prop_ro("is_leaf", &Tensor::is_leaf)
      .def_prop_ro("data_ptr",
                   [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()); })
      .def("numel", &Tensor::numel)
      .def(
          "set_requires_grad",
          [](Tensor& t, bool v) {
            t.set_requires_grad(v);
            return t;
          },
          "value"_a = true)
      .def_prop_ro("grad",
                   [](const Tensor& t) -> std::optional<Tensor> {
                     Tensor g = t.grad();
                     if (!g.defined()) return std::nullopt;
                     return g;
                   })
      .def("detach", &Tensor::detach)
      .def("tolist", &Tensor::to_vector, "Values as a flat list of floats (row-major).")
      // Pickled as its values (a CPU tensor's bytes, shape, dtype and
      // requires_grad), not its graph or grad, as torch pickles a leaf: what
      // a rank process's fn returns to diffcomm.sim.run's caller.
      .def("__getstate__",
           [](const Tensor& t) {
             if (!t.device().is_cpu())
               throw dc::InvalidArgument("pickling a diffcomm.Tensor on " + t.device().str() +
                                         ": only CPU tensors pickle");
             return nb::make_tuple(nb::bytes(static_cast<const char*>(t.data_ptr()), t.nbytes()),
                                   std::vector<int64_t>(t.shape().begin(), t.shape().end()),
                                   dc::dtype_name(t.dtype()), t.requires_grad());
           })
      .def("__setstate__",
           [](Tensor& t, const std::tuple<nb::bytes, std::vector<int64_t>, std::string, bool>& s) {
             const auto& [bytes, shape, dtype, requires_grad] = s;
             Tensor made = dc::empty(dc::Shape(shape.begin(), shape.end()), dc::parse_dtype(dtype));
             if (bytes.size() != made.nbytes())
               throw dc::InvalidArgument(
                   "unpickling a diffcomm.Tensor: " + std::to_string(bytes.size()) + " bytes for " +
                   std::to_string(made.nbytes()));
             if (made.nbytes() > 0) std::memcpy(made.data_ptr(), bytes.c_str(), made.nbytes());
             if (requires_grad) made.set_requires_grad(true);
             new (&t) Tensor(std::move(made));
           })
      .def("__repr__", [](const Tensor& t) { return "diffcomm.Tensor(" + t.str() + ")"; });

  m.def("from_dlpack", &tensor_from_dlpack, "array"_a, "requires_grad"_a = false,
        "Borrows a DLPack-capable array (torch.Tensor, numpy.ndarray, ...) as a diffcomm "
        "Tensor sharing its storage (no copy). Raises InvalidArgument for non-contiguous "
        "arrays.");
  m.def("to_dlpack", &to_dlpack_capsule, "tensor"_a,
        "A DLPack capsule (\"dltensor\") sharing the tensor's storage, for "
        "torch.utils.dlpack.from_dlpack: the fast way to torch (to_torch goes through "
        "nanobind's ndarray, about 1 us more per call).");
  m.def("to_torch", &tensor_to_ndarray<nb::pytorch>, "tensor"_a,
        "A torch.Tensor sharing the diffcomm tensor's storage (no copy, no autograd).");
  m.def(
      "host_cache_stats",
      [] {
        const dc::HostCacheStats s = dc::host_cache_stats();
        nb::dict d;
        d["cached_bytes"] = s.cached_bytes;
        d["hits"] = s.hits;
        d["misses"] = s.misses;
        d["released"] = s.released;
        d["limit_bytes"] = s.limit_bytes;
        return d;
      },
      "The host block cache (diffcomm::HostCacheStats, diffcomm/tensor/tensor.hpp): CPU storages "
      "above "
      "64 KiB, outputs handed to torch included, are reused after free, up to "
      "DIFFCOMM_HOST_CACHE_MB (default 1024); above 32 MiB cached, a miss releases the blocks "
      "freed longest ago. A dict: cached_bytes, hits, misses, released, limit_bytes.");
  m.def("empty_host_cache", &dc::empty_host_cache,
        "Frees every cached host block (torch.cuda.empty_cache's counterpart).");
  m.def("to_numpy", &tensor_to_ndarray<nb::numpy>, "tensor"_a,
        "A numpy array sharing the diffcomm tensor's storage (no copy).");
  m.def(
      "from_list",
      [](const std::vector<double>& v, const std::vector<int64_t>& shape, const std::string& d) {
        return dc::from_vector(v, shape, dc::parse_dtype(d));
      },
      "values"_a, "shape"_a, "dtype"_a = "float64");
  m.def(
      "zeros",
      [](const std::vector<int64_t>& shape, const std::string& d) {
        return dc::zeros(shape, dc::parse_dtype(d));
      },
      "shape"_a, "dtype"_a = "float64");

  // Autograd and the few differentiable ops (for code written on diffcomm tensors).
  m.def(
      "grad",
      [](const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
         const std::vector<Tensor>& grad_outputs,
         bool retain_graph) { return dc::grad(outputs, inputs, grad_outputs, retain_graph, true); },
      "outputs"_a, "inputs"_a, "grad_outputs"_a, "retain_graph"_a = false, release(),
      "diffcomm::grad: gradients of outputs w.r.t. inputs contracted with grad_outputs; runs "
      "the backward collectives of the recorded graph. Unused inputs get zeros.");
  m.def(
      "hand_off",
      [](const std::vector<Tensor>& outputs) {
        dc::HandOff h = dc::hand_off(outputs);
        return nb::make_tuple(h.saved, h.collectives);
      },
      "outputs"_a,
      "diffcomm::hand_off: the graph behind outputs leaves its cohorts (torch's engine orders "
      "its backward now); returns (saved tensors, number of collectives).");
  m.def(
      "backward",
      [](const std::vector<Tensor>& roots, const std::vector<Tensor>& grads) {
        dc::backward(roots, grads);
      },
      "roots"_a, "grad_roots"_a = std::vector<Tensor>{}, release());
  m.def("add", &dc::add, release());
  m.def("mul", &dc::mul, release());
  m.def("scale", &dc::scale, release());
  m.def("sum", &dc::sum, release());
  m.def("dot", &dc::dot, release());
  m.def("matmul", &dc::matmul, release());
  m.def("cat", &dc::cat, release());
  m.def("narrow", &dc::narrow, release());
}

}  // namespace diffcomm_python
