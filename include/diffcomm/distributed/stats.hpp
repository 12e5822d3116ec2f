#pragma once
// Per-rank accounting of collective traffic, kept by the funnel for every
// backend: calls and payload bytes per (group, op).
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>

namespace diffcomm::dist {

namespace detail {
// The simulated world's scheduler (sim/world/src/scheduler_access.hpp): prefetches
// a rank's hot data before resuming it. Not an API.
struct SchedulerAccess;
}  // namespace detail

/// Payload bytes this rank sends to / receives from *other* ranks under a
/// direct algorithm (no relaying). all_reduce counts as reduce_scatter +
/// all_gather: 2(N-1)/N of the buffer each way, the nccl-tests "bus" bytes.
struct OpStats {
  uint64_t calls = 0;
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
};

class Stats {
 public:
  using Key = std::pair<std::string, std::string>;  ///< (group, op)
  /// Orders keys and lets lookups use string views (no allocation per call).
  struct KeyLess {
    using is_transparent = void;
    using View = std::pair<std::string_view, std::string_view>;
    static View view(const Key& k) { return {k.first, k.second}; }
    static View view(const View& k) { return k; }
    template <class A, class B>
    bool operator()(const A& a, const B& b) const {
      return view(a) < view(b);
    }
  };
  void record(std::string_view group, std::string_view op, uint64_t sent, uint64_t received);
  /// Counters of one (group, op); zeros when never called.
  OpStats get(std::string_view group, std::string_view op) const;
  /// Sum over groups of one op.
  OpStats total(std::string_view op) const;
  /// Sum over everything.
  OpStats total() const;
  const std::map<Key, OpStats, KeyLess>& entries() const { return entries_; }
  void clear() {
    entries_.clear();
    last_ = {};
  }

 private:
  friend struct detail::SchedulerAccess;
  std::map<Key, OpStats, KeyLess> entries_;
  // The entry record() touched last: a program calls the same op on the same
  // group many times in a row, and a map lookup comparing two strings per
  // node was a visible part of a small collective's fixed cost. Map nodes
  // are stable; a copy of Stats starts with an empty cache (it would point
  // into the other map).
  struct Last {
    const Key* key = nullptr;
    OpStats* stats = nullptr;
    Last() = default;
    Last(const Last&) {}
    Last& operator=(const Last&) {
      key = nullptr;
      stats = nullptr;
      return *this;
    }
  };
  Last last_;
};

}  // namespace diffcomm::dist
