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
// A miss means the sizes in use changed: while more than
// kHostCacheKeepOnMiss bytes are cached, a miss first releases the blocks
// freed longest ago, as many bytes as it asks for, so a program whose sizes
// keep changing (a simulated world's thousands of ranks, each with its own
// shard sizes) does not hold the limit's worth of pages it never reuses.
// Blocks are mapped with mmap, not taken from malloc, so a released block's
// pages go back to the kernel at once; through glibc they stayed in its heap
// (a 1024-rank step peaked at 921 MB with the cache off, against a 570 MB
// live set).
//
// Under AddressSanitizer blocks come from aligned_alloc (its red zones catch
// an overflow past a storage), and a cached block is poisoned, so a use
// after free is still reported (as use-after-poison).
#include "host_cache.hpp"

#include <fmt/format.h>
#include <sys/mman.h>

#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <new>
#include <vector>

#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

#if defined(__has_include)
#if __has_include(<sanitizer/asan_interface.h>)
#include <sanitizer/asan_interface.h>
#endif
#endif
#ifndef ASAN_POISON_MEMORY_REGION
#define ASAN_POISON_MEMORY_REGION(addr, size) ((void)(addr), (void)(size))
#define ASAN_UNPOISON_MEMORY_REGION(addr, size) ((void)(addr), (void)(size))
#endif
#if defined(__SANITIZE_ADDRESS__)
#define DIFFCOMM_HOST_BLOCKS_FROM_MALLOC 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DIFFCOMM_HOST_BLOCKS_FROM_MALLOC 1
#endif
#endif

namespace diffcomm {
namespace {

constexpr std::size_t kAlign = 64;
constexpr std::size_t kMaxCacheMb = std::size_t{1} << 24;  // 16 TiB
// Blocks taken out of the cache, unmapped by the caller outside the lock.
using Released = std::vector<std::pair<void*, std::size_t>>;

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

// A block's pages: mmap'd (released at once by munmap), or malloc'd under
// AddressSanitizer. Class sizes above 64 KiB are whole pages.
void* map_block(std::size_t bytes) {
#ifdef DIFFCOMM_HOST_BLOCKS_FROM_MALLOC
  void* p = std::aligned_alloc(kAlign, bytes);
  if (p == nullptr) throw std::bad_alloc();
#else
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
#endif
  return p;
}

void unmap_block(void* p, std::size_t bytes) noexcept {
#ifdef DIFFCOMM_HOST_BLOCKS_FROM_MALLOC
  (void)bytes;
  std::free(p);
#else
  munmap(p, bytes);
#endif
}

void unmap_blocks(const Released& blocks) noexcept {
  for (const auto& [p, size] : blocks) {
    ASAN_UNPOISON_MEMORY_REGION(p, size);
    unmap_block(p, size);
  }
}

struct Cached {
  void* p;
  uint64_t freed_at;  // the cache's count of frees when it came back
};

struct Cache {
  std::mutex lock;
  // class bytes -> its blocks, oldest first (a hit takes the newest, the
  // warmest in the CPU's caches; a miss releases the oldest of all).
  std::map<std::size_t, std::deque<Cached>> free;
  uint64_t frees = 0;
  std::size_t limit = limit_from_env();
  HostCacheStats stats;

  // Under the lock: takes blocks freed longest ago out of the cache until
  // `bytes` are taken or at most `keep` bytes remain; the caller unmaps them
  // outside the lock.
  void take_oldest(std::size_t bytes, std::size_t keep, Released& out) {
    std::size_t taken = 0;
    while (taken < bytes && stats.cached_bytes > keep) {
      auto oldest = free.begin();
      for (auto it = free.begin(); it != free.end(); ++it)
        if (it->second.front().freed_at < oldest->second.front().freed_at) oldest = it;
      const std::size_t size = oldest->first;
      out.emplace_back(oldest->second.front().p, size);
      oldest->second.pop_front();
      if (oldest->second.empty()) free.erase(oldest);
      stats.cached_bytes -= size;
      ++stats.released;
      taken += size;
    }
  }
};

Cache& cache() {
  static Cache* c = new Cache;  // never destroyed: storages may be freed at exit
  return *c;
}

}  // namespace

namespace detail {

void* host_allocate(std::size_t nbytes, std::size_t* capacity) {
  // Only storages above 64 KiB come here: their classes are whole steps of
  // 8 KiB or more: whole pages, multiples of kAlign as aligned_alloc needs.
  const std::size_t bytes = class_bytes(nbytes);
  *capacity = bytes;
  Cache& c = cache();
  Released released;
  {
    const std::lock_guard<std::mutex> hold(c.lock);
    const auto it = c.free.find(bytes);
    if (it != c.free.end()) {
      void* p = it->second.back().p;
      it->second.pop_back();
      if (it->second.empty()) c.free.erase(it);
      c.stats.cached_bytes -= bytes;
      ++c.stats.hits;
      ASAN_UNPOISON_MEMORY_REGION(p, bytes);
      return p;
    }
    ++c.stats.misses;
    c.take_oldest(bytes, kHostCacheKeepOnMiss, released);
  }
  unmap_blocks(released);
  return map_block(bytes);
}

void host_free(void* p, std::size_t capacity) noexcept {
  Cache& c = cache();
  {
    const std::lock_guard<std::mutex> hold(c.lock);
    if (c.stats.cached_bytes + capacity <= c.limit) {
      try {
        c.free[capacity].push_back({p, ++c.frees});
      } catch (...) {  // no memory for the list: release the block instead
        unmap_block(p, capacity);
        return;
      }
      c.stats.cached_bytes += capacity;
      ASAN_POISON_MEMORY_REGION(p, capacity);
      return;
    }
  }
  unmap_block(p, capacity);
}

}  // namespace detail

HostCacheStats host_cache_stats() {
  Cache& c = cache();
  const std::lock_guard<std::mutex> hold(c.lock);
  HostCacheStats s = c.stats;
  s.limit_bytes = c.limit;
  return s;
}

void trim_host_cache(uint64_t keep_bytes) {
  Cache& c = cache();
  Released released;
  {
    const std::lock_guard<std::mutex> hold(c.lock);
    c.take_oldest(SIZE_MAX, keep_bytes, released);
  }
  unmap_blocks(released);
}

void empty_host_cache() { trim_host_cache(0); }

}  // namespace diffcomm
