#pragma once
// Per-rank accounting of collective traffic, kept by the funnel for every
// backend: calls and payload bytes per (group, op).
#include <cstdint>
#include <map>
#include <string>
#include <utility>

namespace diffcomm::dist {

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
  void record(const std::string& group, const std::string& op, uint64_t sent, uint64_t received);
  /// Counters of one (group, op); zeros when never called.
  OpStats get(const std::string& group, const std::string& op) const;
  /// Sum over groups of one op.
  OpStats total(const std::string& op) const;
  /// Sum over everything.
  OpStats total() const;
  const std::map<std::pair<std::string, std::string>, OpStats>& entries() const { return entries_; }
  void clear() { entries_.clear(); }

 private:
  std::map<std::pair<std::string, std::string>, OpStats> entries_;
};

}  // namespace diffcomm::dist
