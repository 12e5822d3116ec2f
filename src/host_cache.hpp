// The reusing allocator behind CPU Storage above the inline size: freed
// blocks are kept per size class and handed out again, so a loop that
// allocates the same large outputs and scratch every step (an nn op's output,
// a composed reduction's receive buffer, a tensor handed to torch and dropped)
// touches its pages once, not on every call. Public knobs: host_cache_stats()
// and empty_host_cache() in diffcomm/tensor.hpp.
#pragma once

#include <cstddef>

namespace diffcomm::detail {

/// A block of at least `nbytes` bytes, 64-byte aligned, from the cache or
/// the heap; `*capacity` receives the block's size, to be passed back to
/// host_free. Throws std::bad_alloc.
void* host_allocate(std::size_t nbytes, std::size_t* capacity);
/// Returns a block from host_allocate: kept for reuse while the cache is
/// under its limit, else freed.
void host_free(void* p, std::size_t capacity) noexcept;

}  // namespace diffcomm::detail
