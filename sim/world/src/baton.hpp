#pragma once
// Baton: whose turn it is between two threads (a ThreadedWorld rank thread
// and the world's thread), passed with one store and one wake. On Linux the
// word is a futex: one FUTEX_WAKE per pass and one FUTEX_WAIT per wait that
// finds the turn elsewhere. A std::mutex + std::condition_variable costs
// about twice that per hand-over on one CPU (3.7 against 2.0 us per
// rank-call with two hand-overs, measured), and C++20 atomic::wait more (its
// spin and yield phase). Elsewhere atomic::wait/notify_all.
#include <atomic>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace diffcomm::sim::detail {

class Baton {
 public:
  explicit Baton(int holder) : turn_(holder) {}
  /// Gives the turn to `to` and wakes a thread waiting for it. Everything the
  /// caller wrote before is visible to that thread after its wait_for().
  void pass(int to) {
    turn_.store(to);  // sequentially consistent: RankChannel::serve pairs it with a load
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<int*>(&turn_), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
#else
    turn_.notify_all();
#endif
  }
  /// Blocks until the turn is `who`'s.
  void wait_for(int who) {
    for (int seen = turn_.load(std::memory_order_acquire); seen != who;
         seen = turn_.load(std::memory_order_acquire)) {
#if defined(__linux__)
      // Returns at once when the word is no longer `seen` (a pass raced us).
      syscall(SYS_futex, reinterpret_cast<int*>(&turn_), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr,
              0);
#else
      turn_.wait(seen, std::memory_order_acquire);
#endif
    }
  }
  /// The holder now (a snapshot, for reports).
  int holder() const { return turn_.load(std::memory_order_acquire); }

 private:
  static_assert(sizeof(std::atomic<int>) == sizeof(int) && std::atomic<int>::is_always_lock_free,
                "the futex word is the atomic's int");
  std::atomic<int> turn_;
};

}  // namespace diffcomm::sim::detail
