// A process-wide cache of large host blocks (see host_cache.hpp).
//
// Why: glibc serves a block above its mmap threshold (128 KiB to 32 MiB,
// adaptive) with a fresh mmap and returns it to the kernel on free, so every
// call that allocated a 16 MiB output paid 4096 first-touch page faults
// (zero-filled by the kernel) before writing a byte: issue 27 measured
// diffcomm.torch's all_reduce at 16 MiB at 3-5x mpi4py on the same tensors.
// torch's CUDA caching allocator is the model: blocks keep their pages and
// go back to a free list per size class. One lock for the process: a block
// freed on one thread (torch dropping a tensor) is reused on another, and
// these blocks are large, so the lock is a small share of the call.
//
// Under AddressSanitizer a cached block is poisoned, so a use after free
// is still reported (as use-after-poison).
#include "host_cache.hpp"

#include <fmt/format.h>

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <vector>

#include "diffcomm/error.hpp"
#include "diffcomm/tensor.hpp"

#if defined(__has_include)
#if __has_include(<sanitizer/asan_interface.h>)
#include <sanitizer/asan_interface.h>
#endif
#endif
#ifndef ASAN_POISON_MEMORY_REGION
#define ASAN_POISON_MEMORY_REGION(addr, size) ((void)(addr), (void)(size))
#define ASAN_UNPOISON_MEMORY_REGION(addr, size) ((void)(addr), (void)(size))
#endif

namespace diffcomm {
namespace {

constexpr std::size_t kAlign = 64;
constexpr std::size_t kMaxCacheMb = std::size_t{1} << 24;  // 16 TiB

// DIFFCOMM_HOST_CACHE_MB (default 1024; 0 turns the cache off), read once.
std::size_t limit_from_env() {
  const char* v = std::getenv("DIFFCOMM_HOST_CACHE_MB");
  if (v == nullptr || *v == '\0') return std::size_t{1} << 30;
  std::size_t mb = 0;
  const char* end = v + std::strlen(v);
  const auto [ptr, ec] = std::from_chars(v, end, mb);
  if (ec != std::errc{} || ptr != end || mb > kMaxCacheMb)
    throw InvalidArgument(fmt::format(
        "DIFFCOMM_HOST_CACHE_MB='{}': expected a whole number of MiB in 0..{} (0: no cache)", v,
        kMaxCacheMb));
  return mb << 20;
}

struct Cache {
  std::mutex lock;
  std::map<std::size_t, std::vector<void*>> free;  // class bytes -> blocks
  std::size_t limit = limit_from_env();
  HostCacheStats stats;
};

Cache& cache() {
  static Cache* c = new Cache;  // never destroyed: storages may be freed at exit
  return *c;
}

}  // namespace

namespace detail {

void* host_allocate(std::size_t nbytes, std::size_t* capacity) {
  // Only storages above 64 KiB come here: their classes are whole steps of
  // 8 KiB or more, multiples of kAlign as aligned_alloc needs.
  const std::size_t bytes = class_bytes(nbytes);
  *capacity = bytes;
  Cache& c = cache();
  {
    const std::lock_guard<std::mutex> hold(c.lock);
    const auto it = c.free.find(bytes);
    if (it != c.free.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      c.stats.cached_bytes -= bytes;
      ++c.stats.hits;
      ASAN_UNPOISON_MEMORY_REGION(p, bytes);
      return p;
    }
    ++c.stats.misses;
  }
  void* p = std::aligned_alloc(kAlign, bytes);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

void host_free(void* p, std::size_t capacity) noexcept {
  Cache& c = cache();
  {
    const std::lock_guard<std::mutex> hold(c.lock);
    if (c.stats.cached_bytes + capacity <= c.limit) {
      try {
        c.free[capacity].push_back(p);
      } catch (...) {  // no memory for the list: free the block instead
        std::free(p);
        return;
      }
      c.stats.cached_bytes += capacity;
      ASAN_POISON_MEMORY_REGION(p, capacity);
      return;
    }
  }
  std::free(p);
}

}  // namespace detail

HostCacheStats host_cache_stats() {
  Cache& c = cache();
  const std::lock_guard<std::mutex> hold(c.lock);
  HostCacheStats s = c.stats;
  s.limit_bytes = c.limit;
  return s;
}

void empty_host_cache() {
  Cache& c = cache();
  std::map<std::size_t, std::vector<void*>> blocks;
  {
    const std::lock_guard<std::mutex> hold(c.lock);
    blocks.swap(c.free);
    c.stats.cached_bytes = 0;
  }
  for (auto& [bytes, list] : blocks)
    for (void* p : list) {
      ASAN_UNPOISON_MEMORY_REGION(p, bytes);
      std::free(p);
    }
}

}  // namespace diffcomm
