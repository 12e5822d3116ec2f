// The production stack (see layers.hpp).
#include "diffcomm/distributed/backend/layers.hpp"

#include "diffcomm/distributed/backend/checked_backend.hpp"
#include "diffcomm/distributed/backend/composed.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::dist {

std::shared_ptr<Backend> stack_layers(std::shared_ptr<Backend> transport, const Options& options,
                                      const std::function<std::shared_ptr<Backend>()>& make_control,
                                      Device control_device) {
  if (!transport) raise("stack_layers", "null transport");
  std::shared_ptr<Backend> b = std::move(transport);
  if (!options.native_reduction) b = std::make_shared<ComposedReductions>(std::move(b));
  if (options.resolved_check())
    b = std::make_shared<CheckedBackend>(std::move(b), make_control(), control_device);
  return b;
}

}  // namespace diffcomm::dist
