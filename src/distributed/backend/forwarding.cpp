// ForwardingBackend (see forwarding.hpp).
#include "diffcomm/distributed/backend/forwarding.hpp"

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::dist {

ForwardingBackend::ForwardingBackend(std::shared_ptr<Backend> inner) : inner_(std::move(inner)) {
  if (!inner_) raise("ForwardingBackend", "null inner backend");
}

Backend& ForwardingBackend::transport() const { return transport_of(*inner_); }

std::shared_ptr<Backend> ForwardingBackend::split(Call& call, int color, int key) {
  std::shared_ptr<Backend> inner = inner_->split(call, color, key);
  return inner ? rewrap(std::move(inner)) : nullptr;
}

std::shared_ptr<Backend> ForwardingBackend::rewrap(std::shared_ptr<Backend> /*inner_split*/) {
  raise<Error>("ForwardingBackend", "a decorator must override rewrap() or split()");
}

Backend& transport_of(Backend& backend) {
  Backend* b = &backend;
  while (auto* f = dynamic_cast<ForwardingBackend*>(b)) b = &f->inner();
  return *b;
}

}  // namespace diffcomm::dist
