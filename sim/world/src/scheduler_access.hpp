#pragma once
// What the simulated world's scheduler prefetches before resuming a rank's
// fiber (scheduler.hpp, prefetch_ahead()), read from the dist objects'
// private state: a friend of Stats, FlightRecorder and ProcessGroup, so the
// public headers carry no scheduler hooks. Inline, as the members it
// replaces were: the same loads and prefetches.
#include <array>
#include <cstddef>

#include "diffcomm/distributed/flight_recorder.hpp"
#include "diffcomm/distributed/group.hpp"
#include "diffcomm/distributed/stats.hpp"

namespace diffcomm::dist::detail {

struct SchedulerAccess {
  /// Prefetches the entry the next Stats::record() most likely updates (the
  /// last one). Reads only `stats`.
  static void prefetch(const Stats& stats) noexcept {
    __builtin_prefetch(stats.last_.key);
    __builtin_prefetch(stats.last_.stats, 1);
  }

  /// Prefetches the records the next end() and begin() write (the last
  /// call's and the next one's). Reads only `recorder`.
  static void prefetch(const FlightRecorder& recorder) noexcept {
    constexpr std::size_t kCapacity = FlightRecorder::kSimCapacity;
    const char* last = reinterpret_cast<const char*>(
        recorder.ring_.data() + (recorder.next_id_ + kCapacity - 2) % kCapacity);
    const char* next =
        reinterpret_cast<const char*>(recorder.ring_.data() + (recorder.next_id_ - 1) % kCapacity);
    for (std::size_t off = 0; off < sizeof(FlightRecord); off += 64) {
      __builtin_prefetch(last + off, 1);
      __builtin_prefetch(next + off, 1);
    }
    __builtin_prefetch(last + sizeof(FlightRecord) - 1, 1);
    __builtin_prefetch(next + sizeof(FlightRecord) - 1, 1);
  }

  /// Where a call on `group` first reads: the group's shared state and its
  /// backend object. Never null; not to be dereferenced.
  static std::array<const void*, 2> hot_addresses(const ProcessGroup& group) noexcept {
    return {group.state_.get(), &group.backend()};
  }
};

}  // namespace diffcomm::dist::detail
