#pragma once
// The one wait loop of the production backends: a backend issues its call
// (non-blocking MPI request, NCCL kernel on a stream), then waits here with a
// deadline, polling `done()`. On expiry it raises Timeout naming the call;
// the funnel appends the rank's flight recorder. Polls (yielding the core
// between polls) for the first 50 ms, then sleeps in short steps, so a rank
// waiting long for a late peer does not hold a core.
#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <thread>

#include "diffcomm/distributed/backend/call.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::dist {

/// Polls done() until it returns true, or until timeout_s seconds have
/// passed: then throws Timeout(expired(timeout_s)). timeout_s <= 0 waits
/// forever (Options refuses such deadlines; only internal callers pass it).
template <class Done, class Expired>
void wait_with_deadline(double timeout_s, Done&& done, Expired&& expired) {
  // Polling is what drives an MPI transport's progress, so the first phase
  // polls without sleeping (as MPI_Wait would), yielding the core between
  // polls so oversubscribed ranks (more ranks than cores) still run; only a
  // call that takes longer than kSpin backs off to short sleeps.
  for (int i = 0; i < 1000; ++i)
    if (done()) return;
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  constexpr auto kSpin = std::chrono::milliseconds(50);
  auto pause = std::chrono::microseconds(10);
  for (uint64_t polls = 1; !done(); ++polls) {
    const auto waited = clock::now() - start;
    if (timeout_s > 0 && std::chrono::duration<double>(waited).count() > timeout_s)
      throw Timeout(expired(timeout_s));
    if (waited < kSpin) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
      if (pause < std::chrono::microseconds(500)) pause *= 2;
    }
  }
}

/// wait_with_deadline for a call. Throws Timeout: "timed out after 5 s
/// waiting in all_reduce #3 on group 'world' (rank 1 of 4):
/// all_reduce(float32, in=[4], op=sum); a member returned early, failed or
/// skipped this call". `on_expiry` (if given) runs first, e.g. to note that
/// the group now has calls in flight.
template <class Done>
void wait_until_done(const Call& call, double timeout_s, Done&& done,
                     void (*on_expiry)(const Call&) = nullptr) {
  wait_with_deadline(timeout_s, done, [&](double t) {
    if (on_expiry != nullptr) on_expiry(call);
    return fmt::format(
        "timed out after {} s waiting in {}: {}; a member returned early, failed or skipped "
        "this call (the group is unusable now)",
        t, call.where(), call.signature());
  });
}

}  // namespace diffcomm::dist
