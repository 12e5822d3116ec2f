// The fiber stacks of a sim::World run (used by World::run in world.cpp).
#pragma once

#include <fmt/format.h>

#include <boost/context/stack_context.hpp>
#include <boost/fiber/protected_fixedsize_stack.hpp>
#include <cstddef>
#include <new>
#include <vector>

#include "diffcomm/tensor/error.hpp"
#include "scheduler.hpp"  // DIFFCOMM_SIM_ASAN

#if DIFFCOMM_SIM_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace diffcomm::sim::detail {

// Every rank's fiber stack, allocated before any fiber exists: running out
// of memory (or of mappings) then raises ResourceExhausted from run() with
// nothing to unwind, where failing inside the fiber loop destroyed joinable
// fibers (std::terminate). A stack handed to a fiber is the fiber's; the
// rest are freed here.
class Stacks {
 public:
  Stacks(int ranks, std::size_t size)
      : alloc_(size), stacks_(static_cast<std::size_t>(ranks)), taken_(stacks_.size(), true) {
    for (std::size_t r = 0; r < stacks_.size(); ++r) {
      try {
        stacks_[r] = alloc_.allocate();
      } catch (const std::bad_alloc&) {
        release_unused();
        raise<ResourceExhausted>(
            "sim::World::run",
            fmt::format("cannot allocate the fiber stack of rank {} of {} ({} bytes each, "
                        "{:.1f} MiB for the world): out of memory or of memory mappings; use fewer "
                        "ranks or a smaller WorldOptions::stack_size (>= 16 KiB)",
                        r, ranks, size, static_cast<double>(size) * ranks / (1 << 20)));
      }
      taken_[r] = false;
    }
  }
  ~Stacks() { release_unused(); }
  Stacks(const Stacks&) = delete;
  Stacks& operator=(const Stacks&) = delete;

  // The stack allocator of rank r's fiber: it takes r's stack.
  struct Handout {
    Stacks* stacks;
    std::size_t rank;
    boost::context::stack_context allocate() {
      stacks->taken_[rank] = true;
      const boost::context::stack_context s = stacks->stacks_[rank];
#if DIFFCOMM_SIM_ASAN
      // Memory of an earlier fiber's stack may come back from mmap with that
      // fiber's last frames still poisoned in ASan's shadow (a fiber's bottom
      // frames never return): start every stack clean.
      __asan_unpoison_memory_region(static_cast<char*>(s.sp) - s.size, s.size);
#endif
      return s;
    }
    void deallocate(boost::context::stack_context& s) noexcept { stacks->alloc_.deallocate(s); }
  };
  Handout handout(int rank) { return {this, static_cast<std::size_t>(rank)}; }
  const boost::context::stack_context& operator[](int rank) const {
    return stacks_[static_cast<std::size_t>(rank)];
  }

 private:
  void release_unused() {
    for (std::size_t r = 0; r < stacks_.size(); ++r)
      if (!taken_[r]) {
        alloc_.deallocate(stacks_[r]);
        taken_[r] = true;
      }
  }
  boost::fibers::protected_fixedsize_stack alloc_;
  std::vector<boost::context::stack_context> stacks_;
  std::vector<bool> taken_;  // true: handed to a fiber, or never allocated
};

}  // namespace diffcomm::sim::detail
