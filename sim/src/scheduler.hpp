#pragma once
// The seeded Boost.Fiber scheduling algorithm of the simulated world: one
// seed, one interleaving.
#include <boost/fiber/algo/algorithm.hpp>
#include <boost/fiber/context.hpp>
#include <boost/fiber/scheduler.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <random>
#include <thread>

namespace diffcomm::sim::detail {

class SeededAlgorithm final : public boost::fibers::algo::algorithm {
 public:
  SeededAlgorithm(uint64_t seed, bool random) : rng_(seed), random_(random) {}

  void awakened(boost::fibers::context* ctx) noexcept override { ready_.push_back(ctx); }

  boost::fibers::context* pick_next() noexcept override {
    if (ready_.empty()) return nullptr;
    std::size_t i = 0;
    if (random_ && ready_.size() > 1) i = static_cast<std::size_t>(rng_() % ready_.size());
    boost::fibers::context* ctx = ready_[i];
    ready_.erase(ready_.begin() + static_cast<std::ptrdiff_t>(i));
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

 private:
  std::deque<boost::fibers::context*> ready_;
  std::mt19937_64 rng_;
  bool random_;
};

}  // namespace diffcomm::sim::detail
