#pragma once
// The seeded Boost.Fiber scheduling algorithm of the simulated world: one
// seed, one interleaving.
//
// Under AddressSanitizer it also tells ASan about every fiber switch
// (__sanitizer_start/finish_switch_fiber). Debian's Boost.Context is not
// built with those annotations, and without them an exception thrown on a
// fiber stack leaves stale poison behind (ASan cannot unpoison a stack it
// does not know), which later shows up as false stack-use-after-scope
// reports. Every switch *into* a fiber of the simulated world goes through
// pick_next() on the outgoing stack (Boost's own dispatcher included), so that
// is where a switch starts; it finishes at the few places a fiber resumes in
// our code (see on_resumed()).
#include <boost/fiber/algo/algorithm.hpp>
#include <boost/fiber/context.hpp>
#include <boost/fiber/properties.hpp>
#include <boost/fiber/scheduler.hpp>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <random>
#include <thread>

// GCC defines __SANITIZE_ADDRESS__ under -fsanitize=address; clang only
// answers __has_feature(address_sanitizer).
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DIFFCOMM_SIM_HAS_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(DIFFCOMM_SIM_HAS_ASAN)
#define DIFFCOMM_SIM_ASAN 1
#include <pthread.h>
#include <sanitizer/common_interface_defs.h>
#else
#define DIFFCOMM_SIM_ASAN 0
#endif

namespace diffcomm::sim::detail {

/// Per-fiber state the algorithm keeps: the fiber's stack (for ASan),
/// whether it is ending, and the global rank it runs (-1: not a rank).
class FiberProps : public boost::fibers::fiber_properties {
 public:
  using fiber_properties::fiber_properties;
  const void* stack_bottom = nullptr;
  std::size_t stack_size = 0;
  bool terminating = false;
  bool pending_finish = false;
  void* fake_stack = nullptr;
  int rank = -1;
};

class SeededAlgorithm final : public boost::fibers::algo::algorithm_with_properties<FiberProps> {
 public:
  SeededAlgorithm(uint64_t seed, bool random) : rng_(seed), random_(random) {
#if DIFFCOMM_SIM_ASAN
    pthread_attr_t attr;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
      void* addr = nullptr;
      std::size_t size = 0;
      pthread_attr_getstack(&attr, &addr, &size);
      main_bottom_ = addr;
      main_size_ = size;
      pthread_attr_destroy(&attr);
    }
#endif
  }

  void awakened(boost::fibers::context* ctx, FiberProps&) noexcept override {
    ready_.push_back(ctx);
  }

  boost::fibers::context* pick_next() noexcept override {
    if (ready_.empty()) return nullptr;
    boost::fibers::context* ctx = nullptr;
    if (random_ && ready_.size() > 1) {
      // O(1): the drawn fiber's slot takes the last one (swap-remove). The
      // ready set's order is then not FIFO, which is fine for a random draw
      // and keeps one seed = one interleaving; erasing from the middle was
      // O(N) per switch, O(N^2) per collective at 16384 ranks.
      const auto i = static_cast<std::size_t>(draw() % ready_.size());
      drawn_ = false;
      ctx = ready_[i];
      ready_[i] = ready_.back();
      ready_.pop_back();
    } else {
      ctx = ready_.front();
      ready_.pop_front();
    }
    prefetch_next();
#if DIFFCOMM_SIM_ASAN
    start_switch(ctx);
#endif
    return ctx;
  }

  bool has_ready_fibers() const noexcept override { return !ready_.empty(); }

  void suspend_until(std::chrono::steady_clock::time_point const& tp) noexcept override {
    if (tp == (std::chrono::steady_clock::time_point::max)()) {
      // Nothing can run and nothing will wake us: the world's deadlock
      // detection should have fired first. Refuse to hang.
      std::fputs(
          "diffcomm sim: every fiber is blocked outside a diffcomm call (e.g. on a foreign "
          "mutex); aborting instead of hanging\n",
          stderr);
      std::abort();
    }
    std::this_thread::sleep_until(tp);
  }

  void notify() noexcept override {}

  /// Call where a fiber of the world resumes in our code (the start of a
  /// rank function, after a condition-variable wait, after join on the main
  /// context): completes an ASan fiber switch begun in pick_next().
  void on_resumed() noexcept {
#if DIFFCOMM_SIM_ASAN
    boost::fibers::context* cur = boost::fibers::context::active();
    if (cur->is_context(boost::fibers::type::main_context)) {
      if (main_pending_) {
        main_pending_ = false;
        __sanitizer_finish_switch_fiber(main_fake_, nullptr, nullptr);
      }
      return;
    }
    auto* props = static_cast<FiberProps*>(cur->get_properties());
    if (props && props->pending_finish) {
      props->pending_finish = false;
      __sanitizer_finish_switch_fiber(props->fake_stack, nullptr, nullptr);
    }
#endif
  }

 private:
#if DIFFCOMM_SIM_ASAN
  void start_switch(boost::fibers::context* next) noexcept {
    boost::fibers::context* cur = boost::fibers::context::active();
    if (next == cur) return;
    // Where the incoming fiber's stack is, and where it will record the end
    // of the switch.
    const void* bottom = nullptr;
    std::size_t size = 0;
    bool* pending = nullptr;
    if (next->is_context(boost::fibers::type::main_context)) {
      bottom = main_bottom_;
      size = main_size_;
      pending = &main_pending_;
    } else {
      auto* np = static_cast<FiberProps*>(next->get_properties());
      if (np == nullptr || np->stack_size == 0) return;  // not one of ours: leave ASan alone
      bottom = np->stack_bottom;
      size = np->stack_size;
      pending = &np->pending_finish;
    }
    void** save = nullptr;  // null: the outgoing fiber is ending (ASan frees its fake stack)
    if (cur->is_context(boost::fibers::type::main_context)) {
      save = &main_fake_;
    } else if (cur->is_context(boost::fibers::type::dispatcher_context)) {
      // Boost switches into its dispatcher without asking the algorithm, so
      // ASan never learnt that stack; leaving it only needs the target's.
      save = &dispatcher_fake_;
    } else {
      auto* cp = static_cast<FiberProps*>(cur->get_properties());
      if (cp == nullptr) return;
      if (!cp->terminating) save = &cp->fake_stack;
    }
    __sanitizer_start_switch_fiber(save, bottom, size);
    *pending = true;
  }
  const void* main_bottom_ = nullptr;
  std::size_t main_size_ = 0;
  bool main_pending_ = false;
  void* main_fake_ = nullptr;
  void* dispatcher_fake_ = nullptr;
#endif

  /// The next random draw, taken from the generator once and kept until a
  /// pick consumes it: drawing ahead (for prefetch_next) leaves the sequence
  /// of draws, hence every interleaving, exactly as drawing on demand.
  uint64_t draw() noexcept {
    if (!drawn_) {
      draw_ = rng_();
      drawn_ = true;
    }
    return draw_;
  }

  /// Prefetches the context of the fiber the next pick will choose if no
  /// fiber wakes up before it (the common case: a rendezvous releases every
  /// member, then they run one after another). Why: with thousands of
  /// fibers, a switch to a fiber chosen at random lands on cold memory (its
  /// context object at the top of its stack), a cache and TLB miss that a
  /// round-robin walk hides from the hardware prefetcher; prefetching it one
  /// switch ahead overlaps the miss with the current fiber's work. A wrong
  /// guess costs one wasted prefetch, never a different choice.
  void prefetch_next() noexcept {
    if (ready_.empty()) return;
    const boost::fibers::context* next =
        (random_ && ready_.size() > 1) ? ready_[static_cast<std::size_t>(draw() % ready_.size())]
                                       : ready_.front();
    const char* p = reinterpret_cast<const char*>(next);
    for (std::size_t off = 0; off < sizeof(boost::fibers::context); off += 64)
      __builtin_prefetch(p + off);
    __builtin_prefetch(p + sizeof(boost::fibers::context) - 1);
  }

  std::deque<boost::fibers::context*> ready_;
  std::mt19937_64 rng_;
  bool random_;
  uint64_t draw_ = 0;
  bool drawn_ = false;
};

}  // namespace diffcomm::sim::detail
