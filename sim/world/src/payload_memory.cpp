#include "payload_memory.hpp"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::sim::detail {

PayloadMemory::~PayloadMemory() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

void PayloadMemory::map(std::size_t bytes) {
  if (base_ != nullptr) ::munmap(base_, size_);
  base_ = nullptr;
  size_ = 0;
  if (bytes == 0) return;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED)
    raise<BackendError>(
        "diffcomm.sim rank process",
        fmt::format("cannot map {} bytes of payload memory: {}", bytes, std::strerror(errno)));
  base_ = static_cast<char*>(p);
  size_ = bytes;
}

void PayloadMemory::reserve(std::size_t bytes) {
  if (bytes <= size_) return;
  const std::size_t want = std::bit_ceil(std::max<std::size_t>(bytes, 1 << 16));
  if (::ftruncate(fd_, static_cast<off_t>(want)) != 0)
    raise<BackendError>(
        "diffcomm.sim rank process",
        fmt::format("cannot grow the payload memory to {} bytes: {}", want, std::strerror(errno)));
  map(want);
}

void PayloadMemory::follow(std::size_t bytes) {
  if (bytes != size_) map(bytes);
}

}  // namespace diffcomm::sim::detail
