// diffcomm._core: the Python binding of diffcomm (nanobind).
//
// Tensors cross the boundary through DLPack with nanobind's ndarray (no
// hand-written capsule code): from_dlpack() borrows the caller's storage
// (zero-copy; non-contiguous input is refused), to_torch() lends diffcomm's
// storage to torch (zero-copy). Every call that may communicate releases the
// GIL, so ranks of diffcomm.sim.run (one OS thread each) and torch threads
// never wait on it.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/operators.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "diffcomm/autograd.hpp"
#include "diffcomm/config.hpp"
#include "diffcomm/dist/collectives.hpp"
#include "diffcomm/dist/mesh.hpp"
#include "diffcomm/encoder_parallel/batch.hpp"
#include "diffcomm/encoder_parallel/exchange.hpp"
#include "diffcomm/encoder_parallel/merge.hpp"
#include "diffcomm/encoder_parallel/planner.hpp"
#include "diffcomm/encoder_parallel/qwen2vl.hpp"
#include "diffcomm/encoder_parallel/training_step.hpp"
#include "diffcomm/error.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/ops.hpp"
#include "diffcomm/sim/adjoint.hpp"
#include "diffcomm/sim/report.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor.hpp"
#include "threaded_world.hpp"

#if DIFFCOMM_HAVE_MPI
#include <mpi.h>

#include "diffcomm/backends/mpi.hpp"
#endif
#if DIFFCOMM_HAVE_NCCL
#include "diffcomm/backends/nccl.hpp"
#endif

namespace nb = nanobind;
using namespace nb::literals;
namespace dc = diffcomm;
namespace ep = diffcomm::encoder_parallel;
using dc::Tensor;
using dc::dist::ProcessGroup;

namespace {

using release = nb::call_guard<nb::gil_scoped_release>;

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
  throw dc::InvalidArgument(
      "diffcomm: unsupported tensor dtype (DLPack code " + std::to_string(d.code) + ", " +
      std::to_string(d.bits) +
      " bits); supported: float64, float32, bfloat16, float16, int64, int32, uint8");
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
  throw dc::InvalidArgument("diffcomm: unknown dtype");
}

/// Borrows a DLPack tensor (torch, numpy, ...) as a diffcomm Tensor sharing
/// its storage. Refuses non-contiguous layouts: diffcomm tensors are dense
/// row-major and a silent copy would break the zero-copy promise.
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
        throw dc::InvalidArgument(
            "diffcomm: tensor of shape " + dc::shape_str(shape) + " with strides (" + strides +
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
    throw dc::InvalidArgument("diffcomm: only CPU and CUDA tensors are supported (DLPack device " +
                              std::to_string(a.device_type()) + ")");
  }
  const dc::DType dtype = dtype_from_dl(a.dtype());
  auto keep = std::make_shared<nb::ndarray<>>(a);  // releases the producer's buffer last
  Tensor t = dc::from_blob(a.data(), shape, dtype, device, [keep](void*) mutable { keep.reset(); });
  if (requires_grad) t.set_requires_grad(true);
  return t;
}

template <class Framework>
nb::ndarray<Framework> tensor_to_ndarray(const Tensor& t) {
  if (!t.defined()) throw dc::InvalidArgument("diffcomm: cannot export an undefined tensor");
  auto* keep = new Tensor(t.detach());
  nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  std::vector<size_t> shape(t.shape().begin(), t.shape().end());
  const int device_type = t.device().is_cuda() ? nb::device::cuda::value : nb::device::cpu::value;
  return nb::ndarray<Framework>(t.data_ptr(), shape.size(), shape.data(), owner, nullptr,
                                dl_from_dtype(t.dtype()), device_type, t.device().index);
}

// ---------------------------------------------------------------- misc
dc::dist::ReduceOp parse_reduce_op(const std::string& s) {
  using R = dc::dist::ReduceOp;
  if (s == "sum") return R::Sum;
  if (s == "avg") return R::Avg;
  if (s == "product") return R::Product;
  if (s == "min") return R::Min;
  if (s == "max") return R::Max;
  // "premul_sum:<factor>" (diffcomm.torch.premul_sum(f) builds it).
  constexpr std::string_view kPremul = "premul_sum:";
  if (s.rfind(kPremul, 0) == 0) {
    const std::string factor = s.substr(kPremul.size());
    char* end = nullptr;
    const double f = std::strtod(factor.c_str(), &end);
    if (!factor.empty() && end != nullptr && *end == '\0') return R::premul_sum(f);
  }
  throw dc::InvalidArgument("diffcomm: unknown reduce op '" + s +
                            "' (sum, avg, product, min, max, premul_sum:<factor>)");
}

dc::nn::GatherGrad parse_gather_grad(const std::string& s) {
  if (s == "partial") return dc::nn::GatherGrad::Partial;
  if (s == "replicated") return dc::nn::GatherGrad::Replicated;
  throw dc::InvalidArgument("diffcomm: unknown gather grad convention '" + s +
                            "' (partial, replicated)");
}

nb::dict op_stats_dict(const dc::dist::OpStats& s) {
  nb::dict d;
  d["calls"] = s.calls;
  d["bytes_sent"] = s.bytes_sent;
  d["bytes_received"] = s.bytes_received;
  return d;
}

nb::dict stats_dict(const dc::dist::Stats& stats) {
  nb::dict out;
  out["total"] = op_stats_dict(stats.total());
  nb::list entries;
  for (const auto& [key, s] : stats.entries()) {
    nb::dict e = op_stats_dict(s);
    e["group"] = key.first;
    e["op"] = key.second;
    entries.append(e);
  }
  out["entries"] = entries;
  return out;
}

#if DIFFCOMM_HAVE_MPI
std::unique_ptr<dc::mpi::Environment> g_mpi_env;
#endif

void bind_errors(nb::module_& m) {
  static nb::exception<dc::Error> error(m, "Error");
  static nb::exception<dc::InvalidArgument> invalid(m, "InvalidArgument", error);
  static nb::exception<dc::CollectiveMismatch> mismatch(m, "CollectiveMismatch", error);
  static nb::exception<dc::Deadlock> deadlock(m, "Deadlock", error);
  static nb::exception<dc::RankFailure> failure(m, "RankFailure", error);
  static nb::exception<dc::Timeout> timeout(m, "Timeout", error);
  static nb::exception<dc::BackendError> backend(m, "BackendError", error);
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
      .def("__repr__", [](const Tensor& t) { return "diffcomm.Tensor(" + t.str() + ")"; });

  m.def("from_dlpack", &tensor_from_dlpack, "array"_a, "requires_grad"_a = false,
        "Borrows a DLPack-capable array (torch.Tensor, numpy.ndarray, ...) as a diffcomm "
        "Tensor sharing its storage (no copy). Raises InvalidArgument for non-contiguous "
        "arrays.");
  m.def("to_torch", &tensor_to_ndarray<nb::pytorch>, "tensor"_a,
        "A torch.Tensor sharing the diffcomm tensor's storage (no copy, no autograd).");
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

void bind_dist(nb::module_& m) {
  nb::class_<ProcessGroup>(m, "ProcessGroup",
                           "A diffcomm process group (ranks in every call are group-local).")
      .def("rank", &ProcessGroup::rank, "This process's (thread's) rank in the group.")
      .def("size", &ProcessGroup::size)
      .def("global_rank", &ProcessGroup::global_rank, "group_rank"_a,
           "Global rank of the member with group-local rank group_rank.")
      .def("members", &ProcessGroup::members, "Global ranks of all members, in group order.")
      .def(
          "group_rank",
          [](const ProcessGroup& g, int global) {
            const auto m = g.members();
            for (std::size_t i = 0; i < m.size(); ++i)
              if (m[i] == global) return static_cast<int>(i);
            throw dc::InvalidArgument("diffcomm: global rank " + std::to_string(global) +
                                      " is not a member of group '" + g.name() + "'");
          },
          "global_rank"_a, "Group-local rank of a member given its global rank.")
      .def_prop_ro("name", &ProcessGroup::name)
      .def_prop_ro("backend_name", [](const ProcessGroup& g) { return g.backend().backend_name(); })
      .def(
          "stats", [](const ProcessGroup& g) { return stats_dict(g.stats()); },
          "Traffic counters of this rank: {'total': {...}, 'entries': [...]}.")
      .def("new_group", &ProcessGroup::new_group, "ranks"_a, "name"_a = "", release(),
           "Collective: the sub-group of the given group-local ranks (None on non-members).")
      .def("split", &ProcessGroup::split, "color"_a, "key"_a, "fingerprint"_a, "name"_a, release(),
           "Collective, MPI_Comm_split semantics.")
      .def(
          "barrier", [](const ProcessGroup& g) { dc::dist::barrier(g); }, release())
      .def(
          "backward_pending", [](const ProcessGroup& g) { g.cohort()->backward_pending(); },
          release(),
          "Runs, with zero cotangents, the backward of every differentiable collective of this "
          "rank that has not run yet (the participation of a rank whose loss reaches none of "
          "them; diffcomm.grad/backward do it for the collectives they meet).")
      .def_prop_ro(
          "_cohort_id",
          [](const ProcessGroup& g) { return reinterpret_cast<std::uintptr_t>(g.cohort().get()); },
          "Identifies this rank's cohort (shared by all its groups): diffcomm.torch keys its "
          "pending bridges by it.")
      .def("__repr__", [](const ProcessGroup& g) {
        return "diffcomm.ProcessGroup(name='" + g.name() + "', rank=" + std::to_string(g.rank()) +
               ", size=" + std::to_string(g.size()) + ", backend='" + g.backend().backend_name() +
               "')";
      });

  nb::class_<dc::dist::DeviceMesh>(m, "DeviceMesh",
                                   "Ranks laid out on named dims, row-major, last dim fastest.")
      .def(nb::init<ProcessGroup, dc::dist::DeviceMesh::Dims>(), "world"_a, "dims"_a, release())
      .def("size", &dc::dist::DeviceMesh::size, "dim"_a)
      .def("coordinate", &dc::dist::DeviceMesh::coordinate, "dim"_a)
      .def(
          "group",
          [](dc::dist::DeviceMesh& mesh, const nb::object& dims) -> ProcessGroup {
            if (nb::isinstance<nb::str>(dims)) return mesh.group(nb::cast<std::string>(dims));
            auto names = nb::cast<std::vector<std::string>>(dims);
            nb::gil_scoped_release unlock;
            return mesh.group(names);
          },
          "dims"_a,
          "The group along one dim (a str) or several dims (a list, created on first use: "
          "collective).")
      .def("rank_of", &dc::dist::DeviceMesh::rank_of, "coords"_a)
      .def_prop_ro("dims", &dc::dist::DeviceMesh::dims)
      .def_prop_ro("world", &dc::dist::DeviceMesh::world);
}

void bind_nn(nb::module_& m) {
  using namespace dc::nn;
  auto nn = m.def_submodule("nn", "Differentiable collectives on diffcomm tensors.");
  nn.def(
      "all_reduce",
      [](const Tensor& x, const ProcessGroup& g, const std::string& op) {
        return all_reduce(x, g, parse_reduce_op(op));
      },
      "x"_a, "group"_a, "op"_a = "sum", release());
  nn.def("broadcast", &broadcast, "x"_a, "src"_a, "group"_a, release());
  nn.def(
      "reduce",
      [](const Tensor& x, int dst, const ProcessGroup& g, const std::string& op) {
        return reduce(x, dst, g, parse_reduce_op(op));
      },
      "x"_a, "dst"_a, "group"_a, "op"_a = "sum", release());
  nn.def(
      "all_gather",
      [](const Tensor& x, const ProcessGroup& g, const std::string& grad) {
        return all_gather(x, g, parse_gather_grad(grad));
      },
      "x"_a, "group"_a, "grad"_a = "partial", release());
  nn.def(
      "all_gather_single",
      [](const Tensor& x, const ProcessGroup& g, const std::string& grad) {
        return all_gather_single(x, g, parse_gather_grad(grad));
      },
      "x"_a, "group"_a, "grad"_a = "partial", release());
  nn.def(
      "all_gather_v",
      [](const Tensor& x, const std::vector<int64_t>& splits, const ProcessGroup& g,
         const std::string& grad) { return all_gather_v(x, splits, g, parse_gather_grad(grad)); },
      "x"_a, "output_splits"_a, "group"_a, "grad"_a = "partial", release());
  nn.def("gather", &gather, "x"_a, "dst"_a, "group"_a, release());
  nn.def("scatter", &scatter, "xs"_a, "src"_a, "group"_a, release());
  nn.def(
      "reduce_scatter",
      [](const std::vector<Tensor>& xs, const ProcessGroup& g, const std::string& op) {
        return reduce_scatter(xs, g, parse_reduce_op(op));
      },
      "xs"_a, "group"_a, "op"_a = "sum", release());
  nn.def(
      "reduce_scatter_single",
      [](const Tensor& x, const ProcessGroup& g, const std::string& op) {
        return reduce_scatter_single(x, g, parse_reduce_op(op));
      },
      "x"_a, "group"_a, "op"_a = "sum", release());
  nn.def(
      "reduce_scatter_v",
      [](const Tensor& x, const std::vector<int64_t>& splits, const ProcessGroup& g,
         const std::string& op) { return reduce_scatter_v(x, splits, g, parse_reduce_op(op)); },
      "x"_a, "input_splits"_a, "group"_a, "op"_a = "sum", release());
  nn.def("all_to_all", &all_to_all, "xs"_a, "group"_a, "output_shapes"_a = std::vector<dc::Shape>{},
         release());
  nn.def("all_to_all_single", &all_to_all_single, "x"_a, "output_splits"_a, "input_splits"_a,
         "group"_a, release());
  nn.def("copy_to_tp_region", &copy_to_tp_region, "x"_a, "group"_a, release());
  nn.def("cat_or_empty", &cat_or_empty, "rows"_a, "anchor"_a, "width"_a, release());
}

void bind_encoder_parallel(nb::module_& m) {
  auto e = m.def_submodule("encoder_parallel", "The encoder-parallel feature exchange.");
  nb::enum_<ep::FeatureExchangeMode>(e, "FeatureExchangeMode")
      .value("Local", ep::FeatureExchangeMode::Local)
      .value("TpVariableAllGather", ep::FeatureExchangeMode::TpVariableAllGather)
      .value("TpVariableA2A", ep::FeatureExchangeMode::TpVariableA2A)
      .value("ParentVariableA2A", ep::FeatureExchangeMode::ParentVariableA2A);
  nb::enum_<ep::ReceiverGrad>(e, "ReceiverGrad")
      .value("Partial", ep::ReceiverGrad::Partial)
      .value("ReplicatedOverTp", ep::ReceiverGrad::ReplicatedOverTp);
  nb::enum_<ep::CpLayout>(e, "CpLayout")
      .value("Contiguous", ep::CpLayout::Contiguous)
      .value("Zigzag", ep::CpLayout::Zigzag);

  nb::class_<ep::EncoderWorkItem>(e, "EncoderWorkItem")
      .def(nb::init<>())
      .def_rw("item_id", &ep::EncoderWorkItem::item_id)
      .def_rw("batch_index", &ep::EncoderWorkItem::batch_index)
      .def_rw("decoder_token_start", &ep::EncoderWorkItem::decoder_token_start)
      .def_rw("input_rows", &ep::EncoderWorkItem::input_rows)
      .def_rw("output_rows", &ep::EncoderWorkItem::output_rows)
      .def(nb::self == nb::self)
      .def("__repr__", [](const ep::EncoderWorkItem& w) {
        return "EncoderWorkItem(item_id=" + std::to_string(w.item_id) +
               ", batch_index=" + std::to_string(w.batch_index) +
               ", decoder_token_start=" + std::to_string(w.decoder_token_start) +
               ", input_rows=" + std::to_string(w.input_rows) +
               ", output_rows=" + std::to_string(w.output_rows) + ")";
      });
  nb::class_<ep::EncoderFeature>(e, "EncoderFeature")
      .def(nb::init<>())
      .def(
          "__init__",
          [](ep::EncoderFeature* f, ep::EncoderWorkItem item, Tensor rows) {
            new (f) ep::EncoderFeature{item, std::move(rows)};
          },
          "item"_a, "rows"_a)
      .def_rw("item", &ep::EncoderFeature::item)
      .def_rw("rows", &ep::EncoderFeature::rows);
  nb::class_<ep::MeshContext>(e, "MeshContext")
      .def(nb::init<>())
      .def(
          "__init__",
          [](ep::MeshContext* c, int cp, int tp, bool sp, int cp_rank, int tp_rank) {
            new (c) ep::MeshContext{cp, tp, sp, cp_rank, tp_rank};
          },
          "cp_size"_a = 1, "tp_size"_a = 1, "sequence_parallel"_a = false, "cp_rank"_a = 0,
          "tp_rank"_a = 0)
      .def_rw("cp_size", &ep::MeshContext::cp_size)
      .def_rw("tp_size", &ep::MeshContext::tp_size)
      .def_rw("sequence_parallel", &ep::MeshContext::sequence_parallel)
      .def_rw("cp_rank", &ep::MeshContext::cp_rank)
      .def_rw("tp_rank", &ep::MeshContext::tp_rank)
      .def("parent_rank", &ep::MeshContext::parent_rank);
  nb::class_<ep::ImageSpan>(e, "ImageSpan")
      .def(nb::init<>())
      .def(
          "__init__",
          [](ep::ImageSpan* s, int64_t start, int64_t tokens, int64_t patches, int64_t id) {
            new (s) ep::ImageSpan{start, tokens, patches < 0 ? 4 * tokens : patches, id};
          },
          "token_start"_a, "tokens"_a, "patches"_a = -1, "source_id"_a = -1)
      .def_rw("token_start", &ep::ImageSpan::token_start)
      .def_rw("tokens", &ep::ImageSpan::tokens)
      .def_rw("patches", &ep::ImageSpan::patches)
      .def_rw("source_id", &ep::ImageSpan::source_id);
  nb::class_<ep::Sample>(e, "Sample")
      .def(nb::init<>())
      .def(
          "__init__",
          [](ep::Sample* s, int64_t seq_len, std::vector<ep::ImageSpan> images) {
            new (s) ep::Sample{seq_len, std::move(images)};
          },
          "seq_len"_a, "images"_a = std::vector<ep::ImageSpan>{})
      .def_rw("seq_len", &ep::Sample::seq_len)
      .def_rw("images", &ep::Sample::images);
  nb::class_<ep::Batch>(e, "Batch")
      .def(nb::init<>())
      .def(
          "__init__",
          [](ep::Batch* b, std::vector<ep::Sample> samples) {
            new (b) ep::Batch{std::move(samples)};
          },
          "samples"_a)
      .def_rw("samples", &ep::Batch::samples);
  nb::class_<ep::DecoderMesh>(e, "DecoderMesh")
      .def(nb::init<>())
      .def(
          "__init__",
          [](ep::DecoderMesh* d, int cp, int tp, bool sp, ep::CpLayout layout) {
            new (d) ep::DecoderMesh{cp, tp, sp, layout};
          },
          "cp"_a = 1, "tp"_a = 1, "sp"_a = false, "layout"_a = ep::CpLayout::Contiguous)
      .def_rw("cp", &ep::DecoderMesh::cp)
      .def_rw("tp", &ep::DecoderMesh::tp)
      .def_rw("sp", &ep::DecoderMesh::sp)
      .def_rw("layout", &ep::DecoderMesh::layout)
      .def("context", &ep::DecoderMesh::context, "cp_rank"_a, "tp_rank"_a);
  nb::class_<ep::EncoderLayout>(e, "EncoderLayout")
      .def(nb::init<>())
      .def(
          "__init__",
          [](ep::EncoderLayout* l, int buckets, int ecp) {
            new (l) ep::EncoderLayout{buckets, ecp};
          },
          "buckets"_a = 1, "encoder_cp"_a = 1)
      .def_rw("buckets", &ep::EncoderLayout::buckets)
      .def_rw("encoder_cp", &ep::EncoderLayout::encoder_cp);
  nb::class_<ep::PairTraffic>(e, "PairTraffic")
      .def_ro("src", &ep::PairTraffic::src)
      .def_ro("dst", &ep::PairTraffic::dst)
      .def_ro("rows", &ep::PairTraffic::rows)
      .def_ro("bytes", &ep::PairTraffic::bytes);
  nb::class_<ep::PlanStats>(e, "PlanStats")
      .def_ro("pairs", &ep::PlanStats::pairs)
      .def_ro("total_bytes", &ep::PlanStats::total_bytes)
      .def_ro("padded_all_gather_bytes", &ep::PlanStats::padded_all_gather_bytes)
      .def_ro("encoder_imbalance", &ep::PlanStats::encoder_imbalance)
      .def_ro("bucket_patches", &ep::PlanStats::bucket_patches)
      .def_ro("rows_sent", &ep::PlanStats::rows_sent)
      .def_ro("rows_received", &ep::PlanStats::rows_received);
  nb::class_<ep::ExchangePlan>(e, "ExchangePlan",
                               "The exchange plan of one micro-batch, identical on every rank.")
      .def_ro("mode", &ep::ExchangePlan::mode)
      .def_ro("decoder", &ep::ExchangePlan::decoder)
      .def_ro("encoder", &ep::ExchangePlan::encoder)
      .def_ro("exchange_size", &ep::ExchangePlan::exchange_size)
      .def_ro("seq_lens", &ep::ExchangePlan::seq_lens)
      .def_ro("items", &ep::ExchangePlan::items)
      .def_ro("buckets", &ep::ExchangePlan::buckets)
      .def_ro("bucket_of", &ep::ExchangePlan::bucket_of)
      .def_ro("destinations", &ep::ExchangePlan::destinations)
      .def("producer", &ep::ExchangePlan::producer, "bucket"_a)
      .def("coordinates", &ep::ExchangePlan::coordinates, "exchange_rank"_a)
      .def("owned", &ep::ExchangePlan::owned, "batch_index"_a, "exchange_rank"_a)
      .def(
          "stats",
          [](const ep::ExchangePlan& p, int64_t hidden, const std::string& d) {
            return p.stats(hidden, dc::parse_dtype(d));
          },
          "hidden"_a, "dtype"_a = "float32")
      .def("fingerprint", &ep::ExchangePlan::fingerprint);
  nb::class_<ep::ShardLayout>(e, "ShardLayout")
      .def(nb::init<const ep::ExchangePlan&, int>(), "plan"_a, "exchange_rank"_a)
      .def("rows", &ep::ShardLayout::rows)
      .def("row_of", &ep::ShardLayout::row_of, "batch_index"_a, "token"_a)
      .def("tokens", &ep::ShardLayout::tokens);
  nb::class_<ep::RoutedFeatures>(e, "RoutedFeatures")
      .def_ro("rows", &ep::RoutedFeatures::rows)
      .def_ro("items", &ep::RoutedFeatures::items);
  nb::class_<ep::ImageSize>(e, "ImageSize")
      .def(nb::init<>())
      .def(
          "__init__",
          [](ep::ImageSize* s, int64_t id, int64_t w, int64_t h) {
            new (s) ep::ImageSize{id, w, h};
          },
          "image_id"_a, "width"_a, "height"_a)
      .def_rw("image_id", &ep::ImageSize::image_id)
      .def_rw("width", &ep::ImageSize::width)
      .def_rw("height", &ep::ImageSize::height);
  nb::class_<ep::BatchOptions>(e, "BatchOptions")
      .def(nb::init<>())
      .def_rw("samples", &ep::BatchOptions::samples)
      .def_rw("images_per_sample", &ep::BatchOptions::images_per_sample)
      .def_rw("text_min", &ep::BatchOptions::text_min)
      .def_rw("text_max", &ep::BatchOptions::text_max)
      .def_rw("seq_multiple", &ep::BatchOptions::seq_multiple)
      .def_rw("seed", &ep::BatchOptions::seed);

  e.def("select_feature_exchange", &ep::select_feature_exchange, "mesh"_a);
  e.def("mode_name", &ep::mode_name, "mode"_a);
  e.def("receiver_grad_for", &ep::receiver_grad_for, "mesh"_a);
  e.def("owned_ranges", &ep::owned_ranges, "seq_len"_a, "mesh"_a, "cp_rank"_a, "tp_rank"_a);
  e.def("plan_exchange", &ep::plan_exchange, "batch"_a, "decoder"_a, "encoder"_a);
  e.def("required_seq_multiple", &ep::required_seq_multiple, "mesh"_a);
  e.def("load_image_sizes", &ep::load_image_sizes, "path"_a);
  e.def("default_image_sizes_path", &ep::default_image_sizes_path);
  e.def("build_batches", &ep::build_batches, "images"_a, "dp"_a, "options"_a);
  e.def(
      "smart_resize",
      [](int64_t h, int64_t w, int64_t min_pixels, int64_t max_pixels) {
        const auto r = ep::qwen2vl::smart_resize(h, w, min_pixels, max_pixels);
        return std::make_pair(r.height, r.width);
      },
      "height"_a, "width"_a, "min_pixels"_a = ep::qwen2vl::kMinPixels,
      "max_pixels"_a = ep::qwen2vl::kMaxPixels);
  e.def("image_tokens", &ep::qwen2vl::image_tokens, "height"_a, "width"_a);
  e.def("image_patches", &ep::qwen2vl::image_patches, "height"_a, "width"_a);
  e.def("route_features", &ep::route_features, "mode"_a, "producer_records"_a, "prototype"_a,
        "exchange_rank"_a, "plan"_a, "group"_a, "grad"_a, release());
  e.def("unpack_records", &ep::unpack_records, "rows"_a, "received_items"_a, release());
  e.def("merge_into_decoder", &ep::merge_into_decoder, "base"_a, "records"_a, "layout"_a,
        "anchor"_a = Tensor{}, release());
}

// ---------------------------------------------------------------- sim
ep::StepConfig make_step_config(int dp, int cp, int tp, bool sp, const std::string& layout,
                                int buckets, int encoder_cp, int64_t hidden, int64_t ffn,
                                const std::string& dtype, uint64_t seed,
                                const std::string& receiver_grad) {
  ep::StepConfig cfg;
  cfg.dp = dp;
  if (layout != "contiguous" && layout != "zigzag")
    throw dc::InvalidArgument("cp_layout '" + layout + "': expected contiguous or zigzag");
  cfg.decoder = {cp, tp, sp, layout == "zigzag" ? ep::CpLayout::Zigzag : ep::CpLayout::Contiguous};
  cfg.encoder = {buckets, encoder_cp};
  cfg.hidden = hidden;
  cfg.in_features = 16;  // as diffcomm-sim
  cfg.ffn = ffn;
  cfg.dtype = dc::parse_dtype(dtype);
  cfg.seed = seed;
  if (receiver_grad == "partial")
    cfg.receiver_grad = ep::ReceiverGrad::Partial;
  else if (receiver_grad == "replicated-over-tp")
    cfg.receiver_grad = ep::ReceiverGrad::ReplicatedOverTp;
  else if (receiver_grad != "auto")
    throw dc::InvalidArgument("receiver_grad '" + receiver_grad +
                              "': expected auto, partial or replicated-over-tp");
  return cfg;
}

void bind_sim(nb::module_& m) {
  auto s = m.def_submodule("sim", "The simulated world.");
  s.def("differentiable_ops", &dc::sim::differentiable_ops);
  s.def(
      "check",
      [](const std::string& op, int ranks, uint64_t seed, const std::string& dtype) {
        const auto rep = dc::sim::check_adjoint(op, ranks, seed, dc::parse_dtype(dtype));
        return std::make_pair(dc::sim::to_json(rep), dc::sim::to_text(rep));
      },
      "op"_a, "ranks"_a, "seed"_a, "dtype"_a, release(), "(json, text) of `diffcomm-sim check`.");
  s.def(
      "step",
      [](int dp, int cp, int tp, bool sp, const std::string& layout, int buckets, int ecp,
         int samples, int images_per_sample, int64_t hidden, int64_t ffn, const std::string& dtype,
         uint64_t seed, const std::string& images, const std::string& receiver_grad,
         std::optional<std::pair<int, int>> fault, const std::string& trace) {
        const auto cfg = make_step_config(dp, cp, tp, sp, layout, buckets, ecp, hidden, ffn, dtype,
                                          seed, receiver_grad);
        const auto per_dp =
            dc::sim::step_batches(cfg, ep::load_image_sizes(images), samples, images_per_sample);
        dc::sim::StepRunOptions o;
        if (fault) o.fault = dc::sim::Fault{fault->first, fault->second};
        o.trace_path = trace;
        const auto rep = dc::sim::run_step_report(cfg, per_dp, o);
        return std::make_tuple(dc::sim::to_json(rep), dc::sim::to_text(rep), rep.exit_code());
      },
      "dp"_a, "cp"_a, "tp"_a, "sp"_a, "cp_layout"_a, "buckets"_a, "encoder_cp"_a, "samples"_a,
      "images_per_sample"_a, "hidden"_a, "ffn"_a, "dtype"_a, "seed"_a, "images"_a,
      "receiver_grad"_a, "fault"_a, "trace"_a, release(),
      "(json, text, exit code) of `diffcomm-sim step` (defaults resolved by the caller).");
  s.def(
      "sweep",
      [](int dp, int cp, int tp, bool sp, const std::string& layout, int buckets, int ecp,
         int samples, int images_per_sample, int64_t hidden, int64_t ffn, const std::string& dtype,
         uint64_t first, uint64_t last, const std::string& images,
         const std::string& receiver_grad) {
        const auto cfg = make_step_config(dp, cp, tp, sp, layout, buckets, ecp, hidden, ffn, dtype,
                                          first, receiver_grad);
        const auto rep = dc::sim::run_sweep(cfg, ep::load_image_sizes(images), samples,
                                            images_per_sample, first, last);
        return dc::sim::to_json(rep);
      },
      "dp"_a, "cp"_a, "tp"_a, "sp"_a, "cp_layout"_a, "buckets"_a, "encoder_cp"_a, "samples"_a,
      "images_per_sample"_a, "hidden"_a, "ffn"_a, "dtype"_a, "first"_a, "last"_a, "images"_a,
      "receiver_grad"_a, release());

  nb::class_<dc::threaded::ThreadedWorld>(
      s, "ThreadedWorld",
      "A sim::World whose ranks are OS threads handing a baton (see diffcomm.sim.run).")
      .def(
          "__init__",
          [](dc::threaded::ThreadedWorld* w, int ranks, uint64_t seed, const std::string& schedule,
             std::optional<std::pair<int, int>> fault, bool trace) {
            dc::sim::WorldOptions o;
            o.ranks = ranks;
            o.seed = seed;
            if (schedule == "random")
              o.schedule = dc::sim::Schedule::Random;
            else if (schedule == "round_robin")
              o.schedule = dc::sim::Schedule::RoundRobin;
            else
              throw dc::InvalidArgument("schedule '" + schedule +
                                        "': expected random or round_robin");
            if (fault) o.fault = dc::sim::Fault{fault->first, fault->second};
            o.trace = trace;
            o.stack_size = 64 * 1024;  // proxy fibers only forward calls
            new (w) dc::threaded::ThreadedWorld(o);
          },
          "ranks"_a, "seed"_a = 0, "schedule"_a = "random", "fault"_a = nb::none(),
          "trace"_a = true)
      .def("start", &dc::threaded::ThreadedWorld::start, "rank"_a, release())
      .def("finish", &dc::threaded::ThreadedWorld::finish, "rank"_a, "failure"_a, release())
      .def("run", &dc::threaded::ThreadedWorld::run, release())
      .def("cancel", &dc::threaded::ThreadedWorld::cancel, "why"_a, release())
      .def("size", &dc::threaded::ThreadedWorld::size)
      .def("error_messages", &dc::threaded::ThreadedWorld::error_messages)
      .def("trace_hash",
           [](const dc::threaded::ThreadedWorld& w) { return w.world().trace_hash(); })
      .def("sim_time_us",
           [](const dc::threaded::ThreadedWorld& w) { return w.world().sim_time_us(); })
      .def(
          "stats",
          [](const dc::threaded::ThreadedWorld& w, int r) {
            return stats_dict(w.world().stats(r));
          },
          "rank"_a)
      .def(
          "write_trace",
          [](const dc::threaded::ThreadedWorld& w, const std::string& p) {
            w.world().write_trace(p);
          },
          "path"_a)
      .def("trace_len",
           [](const dc::threaded::ThreadedWorld& w) { return w.world().trace().size(); });
}

void bind_backends(nb::module_& m) {
  m.attr("HAVE_MPI") = bool(DIFFCOMM_HAVE_MPI);
  m.attr("HAVE_NCCL") = bool(DIFFCOMM_HAVE_NCCL);
  m.attr("HAVE_CUDA") = bool(DIFFCOMM_HAVE_CUDA);
  m.attr("__version__") = DIFFCOMM_VERSION;
#if DIFFCOMM_HAVE_MPI
  auto mpi = m.def_submodule("mpi", "The Open MPI backend.");
  mpi.def(
      "init",
      [] {
        int initialized = 0;
        MPI_Initialized(&initialized);
        if (!initialized && !g_mpi_env)
          g_mpi_env = std::make_unique<dc::mpi::Environment>(nullptr, nullptr);
      },
      "MPI_Init_thread unless MPI is already initialised (e.g. by mpi4py).");
  mpi.def(
      "finalize", [] { g_mpi_env.reset(); },
      "MPI_Finalize if diffcomm initialised MPI (not when mpi4py did). After a Timeout it ends "
      "the job with MPI_Abort instead (see abort_if_timed_out).");
  mpi.def(
      "abort", [](int code) { dc::mpi::abort(code); }, "code"_a = 1,
      "MPI_Abort(MPI_COMM_WORLD, code): ends every process of the job; never returns.");
  mpi.def("timed_out", &dc::mpi::timed_out,
          "Whether a call of this process (any group, group creation included) raised Timeout.");
  mpi.def("abort_if_timed_out", &dc::mpi::abort_if_timed_out,
          "After a Timeout: prints which call timed out and ends the job with MPI_Abort (code "
          "124), since MPI_Finalize could wait for the calls in flight forever; else returns. "
          "diffcomm.torch registers it to run at interpreter exit.");
  // dist::Options as keyword arguments: check (None: DIFFCOMM_CHECK, else on
  // in Debug builds), native_reduction, timeout_s (None: DIFFCOMM_TIMEOUT,
  // else 600 s).
  auto options = [](std::optional<bool> check, bool native_reduction,
                    std::optional<double> timeout_s) {
    dc::dist::Options o;
    o.check = check;
    o.native_reduction = native_reduction;
    o.timeout_s = timeout_s;
    return o;
  };
  mpi.def(
      "world",
      [options](std::optional<bool> check, bool native_reduction, std::optional<double> timeout_s) {
        return dc::mpi::world(options(check, native_reduction, timeout_s));
      },
      "check"_a = nb::none(), "native_reduction"_a = false, "timeout_s"_a = nb::none(),
      "The group of MPI_COMM_WORLD (borrowed). check: cross-rank fingerprint checks (None: "
      "DIFFCOMM_CHECK, else on in Debug builds); native_reduction: MPI's own reductions (faster, "
      "not bit-identical to the simulated world); timeout_s: deadline of every wait (None: "
      "DIFFCOMM_TIMEOUT, else 600).");
  mpi.def(
      "from_comm_address",
      [options](uintptr_t address, const std::string& name, std::optional<bool> check,
                bool native_reduction, std::optional<double> timeout_s) {
        return dc::mpi::from_comm(*reinterpret_cast<MPI_Comm*>(address), name,
                                  options(check, native_reduction, timeout_s));
      },
      "address"_a, "name"_a = "mpi", "check"_a = nb::none(), "native_reduction"_a = false,
      "timeout_s"_a = nb::none(),
      "A group over a caller's communicator given the address of its MPI_Comm handle "
      "(mpi4py: MPI._addressof(comm)); borrowed, never freed by diffcomm.");
#endif
#if DIFFCOMM_HAVE_NCCL
  auto nccl = m.def_submodule("nccl", "The NCCL backend (CUDA tensors).");
  nccl.def("device_count", &dc::nccl::device_count);
  nccl.def("unique_id", [] {
    const ncclUniqueId id = dc::nccl::unique_id();
    return nb::bytes(id.internal, sizeof(id.internal));
  });
  nccl.def(
      "init_rank",
      [](nb::bytes id_bytes, int nranks, int rank, int device, uintptr_t stream) {
        ncclUniqueId id;
        if (id_bytes.size() != sizeof(id.internal))
          throw dc::InvalidArgument("nccl.init_rank: the unique id must have 128 bytes");
        std::memcpy(id.internal, id_bytes.c_str(), sizeof(id.internal));
        dc::nccl::Options o;
        o.stream = reinterpret_cast<cudaStream_t>(stream);
        nb::gil_scoped_release unlock;
        return dc::nccl::init_rank(id, nranks, rank, device, o);
      },
      "unique_id"_a, "nranks"_a, "rank"_a, "device"_a, "stream"_a = 0);
  nccl.def("set_stream", [](const ProcessGroup& g, uintptr_t stream) {
    dc::nccl::set_stream(g, reinterpret_cast<cudaStream_t>(stream));
  });
  nccl.def("abort", &dc::nccl::abort, "group"_a, release(),
           "ncclCommAbort on the group's (owned) communicator: every later call on it raises "
           "BackendError. InvalidArgument for a borrowed communicator.");
#endif
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "diffcomm: differentiable collectives and the encoder-parallel exchange (C++ core).";
  bind_errors(m);
  bind_tensor(m);
  bind_dist(m);
  bind_nn(m);
  bind_encoder_parallel(m);
  bind_sim(m);
  bind_backends(m);
}
