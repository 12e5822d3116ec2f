#pragma once
// The production stack: one factory puts the cross-cutting layers over a
// transport (MPI, NCCL, and any later one) in one fixed order, outermost
// first:
//
//   CheckedBackend       (Options::check resolved on)   fingerprints on a control backend
//   ComposedReductions   (unless native_reduction)     deterministic reductions
//   the transport                                       native primitives only
//
// so a user's op is checked once, then composed from transport steps that
// are not checked again.
#include <functional>
#include <memory>

#include "diffcomm/distributed/backend.hpp"
#include "diffcomm/distributed/backend/options.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::dist {

/// `transport` under the layers `options` asks for (above). `make_control`
/// is called only when checking is on: it returns the control backend of
/// CheckedBackend (same members and order as `transport`, a separate
/// communicator, no layers), whose fingerprints live on `control_device`.
/// Throws what make_control throws, and InvalidArgument for a null transport
/// or control backend.
std::shared_ptr<Backend> stack_layers(std::shared_ptr<Backend> transport, const Options& options,
                                      const std::function<std::shared_ptr<Backend>()>& make_control,
                                      Device control_device);

}  // namespace diffcomm::dist
