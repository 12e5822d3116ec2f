#pragma once
// PayloadMemory: one rank process's shared payload buffer, a memfd mapped by
// the rank process and by the world that serves it. A call's tensors are
// copied into it by the rank, read and written there by the world, and the
// outputs copied back: payloads cross processes through memory, never
// through the socket. The rank grows it (ftruncate) when a call needs more;
// the world remaps to the size each call names.
#include <cstddef>

namespace diffcomm::sim::detail {

class PayloadMemory {
 public:
  /// Maps nothing yet; `fd` stays owned by the caller.
  explicit PayloadMemory(int fd) : fd_(fd) {}
  ~PayloadMemory();
  PayloadMemory(const PayloadMemory&) = delete;
  PayloadMemory& operator=(const PayloadMemory&) = delete;

  /// Rank side: at least `bytes` mapped, growing the file (to a power of two)
  /// when it is smaller. Throws BackendError naming
  /// the size when the system refuses.
  void reserve(std::size_t bytes);
  /// World side: maps the file's first `bytes` (the size the rank set).
  /// Throws BackendError when the mapping fails.
  void follow(std::size_t bytes);
  char* data() const { return base_; }
  std::size_t size() const { return size_; }

 private:
  void map(std::size_t bytes);
  int fd_;
  char* base_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace diffcomm::sim::detail
