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
#include <array>
#include <boost/circular_buffer.hpp>
#include <boost/fiber/algo/algorithm.hpp>
#include <boost/fiber/context.hpp>
#include <boost/fiber/properties.hpp>
#include <boost/fiber/scheduler.hpp>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

#include "diffcomm/distributed/flight_recorder.hpp"
#include "diffcomm/distributed/stats.hpp"
#include "scheduler_access.hpp"

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

/// Where the next two picks land in a ready set of n fibers if none wakes up
/// in between, as indices into the set as it is now (`second` is meaningful
/// only for n >= 2), given the next two draws. The pick rule: Random draws
/// `draw % size` when more than one fiber is ready and swap-removes it (the
/// last entry takes its slot); otherwise (RoundRobin, or one ready fiber)
/// the front is taken without a draw.
struct NextPicks {
  std::size_t first = 0;
  std::size_t second = 1;
};
inline std::size_t first_pick(std::size_t n, bool random, uint64_t d0) noexcept {
  return random && n > 1 ? static_cast<std::size_t>(d0 % n) : 0;
}
inline std::size_t second_pick(std::size_t n, bool random, std::size_t first,
                               uint64_t d1) noexcept {
  if (!random) return 1;
  if (n == 2) return 1 - first;  // one left: taken without a draw
  const auto i = static_cast<std::size_t>(d1 % (n - 1));
  return i == first ? n - 1 : i;  // the last entry moved into first's slot
}
inline NextPicks next_picks(std::size_t n, bool random, uint64_t d0, uint64_t d1) noexcept {
  NextPicks p;
  p.first = first_pick(n, random, d0);
  if (n >= 2) p.second = second_pick(n, random, p.first, d1);
  return p;
}

/// The memory a rank's fiber touches first when it resumes inside a
/// collective, registered by the world while the rank's objects live, so the
/// scheduler can prefetch it before switching there (see prefetch_ahead()).
struct RankHints {
  std::array<const void*, 3> objects{};            ///< two lines each (null: unused)
  const dist::FlightRecorder* recorder = nullptr;  ///< itself, then its next records
  const dist::Stats* stats = nullptr;              ///< itself, then its last entry
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

  void awakened(boost::fibers::context* ctx, FiberProps& props) noexcept override {
    // Room for every rank and the caller was made by set_ranks(): waking
    // allocates nothing (this is noexcept; a bad_alloc here was std::terminate).
    if (ready_.full()) ready_.set_capacity(2 * ready_.capacity() + 2);
    // The rank is read only when hints are kept: its properties are one
    // more (cold) line per waiter woken.
    ready_.push_back(Ready{ctx, hints_.empty() ? -1 : props.rank});
  }

  /// Registers (or, with `{}`, withdraws) what rank `rank` touches first when
  /// resumed. The objects must stay alive until withdrawn: prefetch_ahead()
  /// reads the recorder and the stats object.
  void set_hints(int rank, const RankHints& hints) {
    if (rank >= 0 && static_cast<std::size_t>(rank) < hints_.size())
      hints_[static_cast<std::size_t>(rank)] = hints;
  }
  /// Makes room for the hints of ranks 0..n-1 (none registered). Below
  /// kHintedRanks ranks every rank's working set stays in cache and the
  /// hinted prefetches would only add instructions (about 12 ns per arrival
  /// at 8 ranks, +0.1x a bare barrier), so no hints are kept and set_hints()
  /// ignores them.
  /// Also makes room in the ready set for all n ranks and the caller's
  /// context (may throw std::bad_alloc; waking then never allocates).
  void set_ranks(int n) {
    hints_.assign(n >= kHintedRanks ? static_cast<std::size_t>(n) : 0, RankHints{});
    if (ready_.capacity() < static_cast<std::size_t>(n) + 2)
      ready_.set_capacity(static_cast<std::size_t>(n) + 2);
  }
  static constexpr int kHintedRanks = 512;

  boost::fibers::context* pick_next() noexcept override {
    if (ready_.empty()) return nullptr;
    boost::fibers::context* ctx = nullptr;
    if (random_ && ready_.size() > 1) {
      // O(1): the drawn fiber's slot takes the last one (swap-remove). The
      // ready set's order is then not FIFO, which is fine for a random draw
      // and keeps one seed = one interleaving; erasing from the middle was
      // O(N) per switch, O(N^2) per collective at 16384 ranks.
      // prefetch_ahead() drew this index already unless a fiber woke since
      // (wakes only add to the set; same size = same set and draw).
      const std::size_t n = ready_.size();
      const std::size_t i = n == guessed_size_ ? guessed_first_ : first_pick(n, true, draw(0));
      consume_draw();
      ctx = ready_[i].ctx;
      ready_[i] = ready_.back();
      ready_.pop_back();
    } else {
      ctx = ready_.front().ctx;
      ready_.pop_front();
    }
    prefetch_ahead();
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

  /// The k-th next random draw (k = 0, 1), taken from the generator once and
  /// kept until a pick consumes it: drawing ahead (for prefetch_ahead) leaves
  /// the sequence of draws, hence every interleaving, exactly as drawing on
  /// demand.
  uint64_t draw(int k) noexcept {
    while (drawn_ <= k) draws_[drawn_++] = rng_();
    return draws_[k];
  }
  void consume_draw() noexcept {
    draws_[0] = draws_[1];
    --drawn_;
  }

  /// Prefetches what the next two picks will resume, if no fiber wakes up
  /// before them (the common case: a rendezvous releases every member, then
  /// they run one after another). Why: with thousands of fibers, a switch to
  /// a fiber chosen at random lands on cold memory (its context at the top
  /// of its stack, its group's state and backend, its flight recorder and
  /// stats), a chain of dependent cache and TLB misses that a round-robin
  /// walk partly hides from the hardware prefetcher. Two stages, because
  /// some addresses are only known from objects that are themselves cold:
  /// two picks ahead, the rank's objects; one pick ahead, its context and
  /// (the objects now cached) the records and entry the rank writes next.
  /// A wrong guess costs a few wasted prefetches, never a different choice.
  void prefetch_ahead() noexcept {
    const std::size_t n = ready_.size();
    guessed_size_ = n;
    if (n == 0) return;
    guessed_first_ = first_pick(n, random_, random_ && n > 1 ? draw(0) : 0);
    const Ready& first = ready_[guessed_first_];
    const char* c = reinterpret_cast<const char*>(first.ctx);
    for (std::size_t off = 0; off < sizeof(boost::fibers::context); off += 64)
      __builtin_prefetch(c + off);
    __builtin_prefetch(c + sizeof(boost::fibers::context) - 1);
    if (const RankHints* h = hints(first.rank)) {
      prefetch_objects(*h);
      if (h->recorder != nullptr) dist::detail::SchedulerAccess::prefetch(*h->recorder);
      if (h->stats != nullptr) dist::detail::SchedulerAccess::prefetch(*h->stats);
    }
    if (n == 1 || hints_.empty()) return;
    const std::size_t second =
        second_pick(n, random_, guessed_first_, random_ && n > 2 ? draw(1) : 0);
    if (const RankHints* h = hints(ready_[second].rank)) prefetch_objects(*h);
  }

  const RankHints* hints(int rank) const noexcept {
    return rank >= 0 && static_cast<std::size_t>(rank) < hints_.size()
               ? &hints_[static_cast<std::size_t>(rank)]
               : nullptr;
  }
  static void prefetch_objects(const RankHints& h) noexcept {
    const std::array<const void*, 5> all = {h.objects[0], h.objects[1], h.objects[2], h.recorder,
                                            h.stats};
    for (const void* o : all) {
      if (o == nullptr) continue;
      __builtin_prefetch(o);
      __builtin_prefetch(static_cast<const char*>(o) + 64);
    }
  }

  struct Ready {
    boost::fibers::context* ctx;
    int rank;  // -1: not a rank's fiber
  };
  boost::circular_buffer<Ready> ready_;  // a ring with the room set_ranks() made
  std::vector<RankHints> hints_;         // by global rank
  std::mt19937_64 rng_;
  bool random_;
  uint64_t draws_[2] = {0, 0};
  int drawn_ = 0;
  std::size_t guessed_size_ = 0;   // ready_.size() when prefetch_ahead() guessed
  std::size_t guessed_first_ = 0;  // and the index the next pick takes then
};

}  // namespace diffcomm::sim::detail
