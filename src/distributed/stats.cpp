// Per-group, per-op byte counters (stats.hpp).
#include "diffcomm/distributed/stats.hpp"

namespace diffcomm::dist {

void Stats::record(std::string_view group, std::string_view op, uint64_t sent, uint64_t received) {
  if (last_.key == nullptr || last_.key->second != op || last_.key->first != group) {
    auto it = entries_.find(KeyLess::View{group, op});
    if (it == entries_.end()) it = entries_.emplace(Key{group, op}, OpStats{}).first;
    last_.key = &it->first;
    last_.stats = &it->second;
  }
  OpStats& s = *last_.stats;
  ++s.calls;
  s.bytes_sent += sent;
  s.bytes_received += received;
}

OpStats Stats::get(std::string_view group, std::string_view op) const {
  auto it = entries_.find(KeyLess::View{group, op});
  return it == entries_.end() ? OpStats{} : it->second;
}

OpStats Stats::total(std::string_view op) const {
  OpStats t;
  for (const auto& [key, s] : entries_)
    if (key.second == op) {
      t.calls += s.calls;
      t.bytes_sent += s.bytes_sent;
      t.bytes_received += s.bytes_received;
    }
  return t;
}

OpStats Stats::total() const {
  OpStats t;
  for (const auto& [key, s] : entries_) {
    t.calls += s.calls;
    t.bytes_sent += s.bytes_sent;
    t.bytes_received += s.bytes_received;
  }
  return t;
}

}  // namespace diffcomm::dist
