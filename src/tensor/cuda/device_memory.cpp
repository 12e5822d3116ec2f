// DeviceGuard, DeviceMemory and the per-thread current streams (see
// device_memory.hpp), plus the public diffcomm::cuda functions over them.
#include "tensor/cuda/device_memory.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::detail {

// ---------------------------------------------------------------- DeviceGuard
DeviceGuard::DeviceGuard(DeviceApi& api, int device) : api_(api), previous_(api.current_device()) {
  if (previous_ != device) {
    api_.set_device(device);
    switched_ = true;
  }
}

DeviceGuard::DeviceGuard(int device) : DeviceGuard(device_api(), device) {}

DeviceGuard::~DeviceGuard() {
  if (!switched_) return;
  try {
    api_.set_device(previous_);
  } catch (...) {  // a destructor must not throw; the device stays switched
  }
}

// ---------------------------------------------------------------- DeviceMemory
DeviceMemory::DeviceMemory(DeviceApi& api, std::shared_ptr<cuda::Allocator> fallback)
    : api_(api), fallback_(std::move(fallback)) {}

void DeviceMemory::set_allocator(std::shared_ptr<cuda::Allocator> allocator) {
  const std::lock_guard lock(mu_);
  chosen_ = std::move(allocator);
}

std::shared_ptr<cuda::Allocator> DeviceMemory::allocator() const {
  const std::lock_guard lock(mu_);
  return chosen_ ? chosen_ : fallback_;
}

void* DeviceMemory::allocate(std::size_t nbytes, int device, void* stream) {
  std::shared_ptr<cuda::Allocator> alloc = allocator();
  if (!alloc)
    raise(fmt::format("cuda:{}", device),
          "no CUDA allocator (this diffcomm was built without CUDA)");
  const std::size_t n = nbytes == 0 ? 1 : nbytes;
  void* p = nullptr;
  {
    const DeviceGuard guard(api_, device);
    p = alloc->allocate(n, device, stream);
  }
  if (p == nullptr)
    raise<BackendError>(fmt::format("cuda:{}", device),
                        fmt::format("allocator '{}' returned null for {} bytes", alloc->name(), n));
  const std::lock_guard lock(mu_);
  Block& b = blocks_[reinterpret_cast<std::uintptr_t>(p)];
  b.nbytes = n;
  b.device = device;
  b.stream = stream;
  b.other_streams.clear();
  b.allocator = std::move(alloc);
  ++stats_.allocations;
  stats_.bytes_in_use += static_cast<int64_t>(n);
  stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
  return p;
}

void DeviceMemory::record_use(const void* ptr, void* stream, int stream_device) {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  const std::lock_guard lock(mu_);
  auto it = blocks_.upper_bound(addr);
  if (it == blocks_.begin()) return;
  --it;
  Block& b = it->second;
  if (addr >= it->first + b.nbytes || (stream == b.stream && stream_device == b.device)) return;
  const std::pair<void*, int> use{stream, stream_device};
  if (std::find(b.other_streams.begin(), b.other_streams.end(), use) == b.other_streams.end())
    b.other_streams.push_back(use);
}

void DeviceMemory::forget_stream(void* stream, int stream_device) {
  const std::pair<void*, int> use{stream, stream_device};
  const std::lock_guard lock(mu_);
  for (auto& [addr, b] : blocks_) std::erase(b.other_streams, use);
}

void DeviceMemory::deallocate(void* ptr) noexcept {
  Block b;
  {
    const std::lock_guard lock(mu_);
    auto it = blocks_.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == blocks_.end()) return;
    b = std::move(it->second);
    blocks_.erase(it);
    ++stats_.frees;
    if (!b.other_streams.empty()) ++stats_.cross_stream_frees;
    stats_.bytes_in_use -= static_cast<int64_t>(b.nbytes);
  }
  try {
    const DeviceGuard guard(api_, b.device);
    for (const auto& [stream, device] : b.other_streams) {
      void* ev = nullptr;
      try {
        {
          // An event is recorded on a stream of its own device.
          const DeviceGuard on_stream_device(api_, device);
          ev = api_.create_event();
          api_.record_event(ev, stream);
        }
        api_.stream_wait_event(b.stream, ev);
      } catch (...) {
        if (ev != nullptr) api_.destroy_event(ev);
        throw;
      }
      api_.destroy_event(ev);
    }
    b.allocator->deallocate(ptr, b.nbytes, b.device, b.stream);
  } catch (...) {
    // The device could not be made current or an event failed (a dead
    // context, typically at exit): hand the block back without the waits
    // rather than leak it; the allocator is noexcept.
    b.allocator->deallocate(ptr, b.nbytes, b.device, b.stream);
  }
}

cuda::MemoryStats DeviceMemory::stats() const {
  const std::lock_guard lock(mu_);
  cuda::MemoryStats s = stats_;
  const auto& a = chosen_ ? chosen_ : fallback_;
  s.allocator = a ? a->name() : "none (built without CUDA)";
  return s;
}

DeviceMemory& device_memory() {
  // Never destroyed: tensors with static storage duration may free blocks
  // during exit.
  static DeviceMemory* const memory = new DeviceMemory(device_api(), default_allocator());
  return *memory;
}

namespace {
// Current stream per device of this host thread. Per thread like CUDA's own
// current device (and torch's current stream); the simulated world, whose
// ranks share one thread, never uses CUDA tensors through it.
thread_local std::vector<void*> tl_current_streams;
}  // namespace

}  // namespace diffcomm::detail

namespace diffcomm::cuda {

void set_allocator(std::shared_ptr<Allocator> allocator) {
  detail::device_memory().set_allocator(std::move(allocator));
}

std::shared_ptr<Allocator> allocator() {
  std::shared_ptr<Allocator> a = detail::device_memory().allocator();
  if (!a) raise("cuda::allocator", "this diffcomm was built without CUDA");
  return a;
}

void* current_stream(int device) {
  auto& v = detail::tl_current_streams;
  if (device < 0 || static_cast<std::size_t>(device) >= v.size()) return nullptr;
  return v[static_cast<std::size_t>(device)];
}

void set_current_stream(int device, void* stream) {
  if (device < 0) raise("cuda::set_current_stream", fmt::format("device {} < 0", device));
  auto& v = detail::tl_current_streams;
  if (static_cast<std::size_t>(device) >= v.size()) v.resize(static_cast<std::size_t>(device) + 1);
  v[static_cast<std::size_t>(device)] = stream;
}

StreamGuard::StreamGuard(int device, void* stream)
    : device_(device), previous_(current_stream(device)) {
  set_current_stream(device, stream);
}

StreamGuard::~StreamGuard() {
  // device_ >= 0 was checked by the constructor: this cannot throw.
  detail::tl_current_streams[static_cast<std::size_t>(device_)] = previous_;
}

void record_stream(const Tensor& t, void* stream) {
  if (!t.defined() || !t.device().is_cuda()) return;
  detail::device_memory().record_use(t.data_ptr(), stream, t.device().index);
}

MemoryStats memory_stats() { return detail::device_memory().stats(); }

}  // namespace diffcomm::cuda
