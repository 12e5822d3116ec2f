// What the binding's files (one per layer: bind_tensor, bind_dist, bind_nn,
// bind_encoder_parallel, bind_sim) share: nanobind, the aliases, the
// conversions more than one layer uses, and each layer's bind function.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/operators.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "diffcomm/distributed/caller.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/distributed/stats.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::encoder_parallel {}

namespace diffcomm_python {

namespace nb = nanobind;
using namespace nb::literals;
namespace dc = diffcomm;
namespace ep = diffcomm::encoder_parallel;
using dc::Tensor;
using dc::dist::ProcessGroup;

/// The first Python frame outside the skipped packages (diffcomm's and
/// torch's, set_caller_skip), as a dist::Caller; none when every frame is
/// skipped. Needs the GIL. Defined in caller.cpp.
dc::dist::Caller python_caller();

/// Every call that may communicate records its Python caller for the
/// collectives it makes (flight recorder, Deadlock reports; caller.hpp),
/// then releases the GIL (see module.cpp). Members run in this order and
/// end in reverse: the GIL is back before the caller is cleared.
struct CallerThenRelease {
  dc::dist::ScopedCaller caller{python_caller()};
  nb::gil_scoped_release unlock;
};
using release = nb::call_guard<CallerThenRelease>;

/// Binds _core._set_caller_skip(prefixes) (caller.cpp).
void bind_caller(nb::module_& m);

/// DLPack in: borrows the caller's storage (non-contiguous refused).
Tensor tensor_from_dlpack(nb::ndarray<> a, bool requires_grad);
/// DLPack dtype of a diffcomm dtype.
nb::dlpack::dtype dl_from_dtype(dc::DType t);

/// DLPack out: lends diffcomm's storage to the framework (zero-copy).
template <class Framework>
nb::ndarray<Framework> tensor_to_ndarray(const Tensor& t) {
  if (!t.defined()) dc::raise("diffcomm", "cannot export an undefined tensor");
  auto* keep = new Tensor(t.detach());
  nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  std::vector<size_t> shape(t.shape().begin(), t.shape().end());
  const int device_type = t.device().is_cuda() ? nb::device::cuda::value : nb::device::cpu::value;
  return nb::ndarray<Framework>(t.data_ptr(), shape.size(), shape.data(), owner, nullptr,
                                dl_from_dtype(t.dtype()), device_type, t.device().index);
}

/// Stats as {'total': {...}, 'entries': [...]}.
nb::dict stats_dict(const dc::dist::Stats& stats);

void bind_errors(nb::module_& m);
void bind_tensor(nb::module_& m);
void bind_dist(nb::module_& m);
void bind_backends(nb::module_& m);
void bind_nn(nb::module_& m);
void bind_encoder_parallel(nb::module_& m);
void bind_sim(nb::module_& m);
void bind_equivalence(nb::module_& m);
void bind_replay(nb::module_& m);
void bind_torch_transport(nb::module_& m);

}  // namespace diffcomm_python
