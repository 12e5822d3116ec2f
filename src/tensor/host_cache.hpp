// The reusing allocator behind CPU Storage above the inline size: freed
// blocks are kept per size class and handed out again, so a loop that
// allocates the same large outputs and scratch every step (an nn op's output,
// a composed reduction's receive buffer, a tensor handed to torch and dropped)
// touches its pages once, not on every call. Public knobs: host_cache_stats()
// and empty_host_cache() in diffcomm/tensor/tensor.hpp.
#pragma once

#include <bit>
#include <cstddef>

namespace diffcomm::detail {

/// n > 1 KiB rounded up to its size class: with 2^(b-1) < n <= 2^b, steps
/// of 2^(b-3), four classes per power of two, < 25 % rounding. Shared by
/// this cache and the per-thread small-block cache in tensor.cpp.
inline std::size_t class_bytes(std::size_t n) {
  const int shift = static_cast<int>(std::bit_width(n - 1)) - 3;
  const std::size_t step = std::size_t{1} << shift;
  return (n + step - 1) >> shift << shift;
}

/// A block of at least `nbytes` bytes, 64-byte aligned, from the cache or
/// the heap; `*capacity` receives the block's size, to be passed back to
/// host_free. Throws std::bad_alloc.
void* host_allocate(std::size_t nbytes, std::size_t* capacity);
/// Returns a block from host_allocate: kept for reuse while the cache is
/// under its limit, else freed.
void host_free(void* p, std::size_t capacity) noexcept;

}  // namespace diffcomm::detail
