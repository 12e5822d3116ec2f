// What-if edits of dumps (replay_edit.hpp).
#include "diffcomm/sim/replay_edit.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::sim {
namespace {
using dist::FlightRecord;
using dist::OpType;

bool is_collective_on(const FlightRecord& r, const std::string& group) {
  return r.group == group && r.op != OpType::Send && r.op != OpType::Recv;
}

template <class T>
bool parse_number(std::string_view s, T& out) {
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return !s.empty() && ec == std::errc{} && p == s.data() + s.size();
}

// Shifts the rank's collectives on `group` numbered >= `from` by `delta`.
void renumber(dist::FlightDump& d, const std::string& group, uint64_t from, int delta) {
  for (FlightRecord& r : d.entries)
    if (is_collective_on(r, group) && r.seq >= from)
      r.seq = static_cast<uint64_t>(static_cast<int64_t>(r.seq) + delta);
}
}  // namespace

ReplayEdit parse_replay_edit(ReplayEdit::Kind kind, const std::string& spec) {
  const auto first = spec.find(':');
  const auto last = spec.rfind(':');
  ReplayEdit e;
  e.kind = kind;
  if (first == std::string::npos || first == last ||
      !parse_number(std::string_view(spec).substr(0, first), e.rank) ||
      !parse_number(std::string_view(spec).substr(last + 1), e.call) || e.rank < 0)
    throw InvalidArgument(fmt::format("'{}': expected RANK:GROUP:CALL (e.g. 3:world:12)", spec));
  e.group = spec.substr(first + 1, last - first - 1);
  return e;
}

void apply_edit(std::vector<dist::FlightDump>& dumps, const ReplayEdit& e) {
  if (e.rank >= static_cast<int>(dumps.size()))
    throw InvalidArgument(fmt::format("edit {}:{}:{}: rank {} outside the world of {}", e.rank,
                                      e.group, e.call, e.rank, dumps.size()));
  dist::FlightDump& d = dumps[static_cast<std::size_t>(e.rank)];
  auto at = std::find_if(d.entries.begin(), d.entries.end(), [&](const FlightRecord& r) {
    return is_collective_on(r, e.group) && r.seq >= e.call;
  });
  if (e.kind == ReplayEdit::Kind::Drop) {
    if (at == d.entries.end() || at->seq != e.call)
      throw InvalidArgument(fmt::format("--drop {}:{}:{}: rank {} recorded no call #{} on '{}'",
                                        e.rank, e.group, e.call, e.rank, e.call, e.group));
    d.entries.erase(at);
    renumber(d, e.group, e.call + 1, -1);
    return;
  }
  const auto g = std::find_if(d.groups.begin(), d.groups.end(),
                              [&](const dist::DumpedGroup& x) { return x.group.name == e.group; });
  if (g == d.groups.end())
    throw InvalidArgument(fmt::format("--insert-barrier {}:{}:{}: rank {} has no group '{}'",
                                      e.rank, e.group, e.call, e.rank, e.group));
  FlightRecord b;
  b.group = e.group;
  b.group_rank = g->group.group_rank;
  b.group_size = static_cast<int>(g->group.members.size());
  b.op = OpType::Barrier;
  b.seq = e.call;
  b.state = FlightRecord::State::Completed;
  renumber(d, e.group, e.call, +1);
  d.entries.insert(at, b);  // `at` stays valid: renumbering moves no entry
}

void apply_edits(std::vector<dist::FlightDump>& dumps, const std::vector<std::string>& drops,
                 const std::vector<std::string>& barriers) {
  std::vector<ReplayEdit> edits;
  for (const auto& d : drops) edits.push_back(parse_replay_edit(ReplayEdit::Kind::Drop, d));
  for (const auto& b : barriers)
    edits.push_back(parse_replay_edit(ReplayEdit::Kind::InsertBarrier, b));
  auto same_drop = [](const ReplayEdit& a, const ReplayEdit& b) {
    return a.kind == ReplayEdit::Kind::Drop && b.kind == ReplayEdit::Kind::Drop &&
           a.rank == b.rank && a.group == b.group && a.call == b.call;
  };
  for (std::size_t i = 0; i < edits.size(); ++i)
    for (std::size_t k = i + 1; k < edits.size(); ++k)
      if (same_drop(edits[i], edits[k]))
        throw InvalidArgument(
            fmt::format("--drop {}:{}:{} given twice (a recorded call is "
                        "dropped once)",
                        edits[i].rank, edits[i].group, edits[i].call));
  // Every edit names the recorded numbering. An edit only renumbers the
  // calls at and after its own, so applying the highest call first leaves
  // the numbers the others name untouched; at one call the drop goes first,
  // so a drop and a barrier there replace the recorded call by the barrier.
  std::stable_sort(edits.begin(), edits.end(), [](const ReplayEdit& a, const ReplayEdit& b) {
    if (a.call != b.call) return a.call > b.call;
    return a.kind == ReplayEdit::Kind::Drop && b.kind != ReplayEdit::Kind::Drop;
  });
  for (const ReplayEdit& e : edits) apply_edit(dumps, e);
}

Recording read_edited(const std::string& dir, const std::vector<std::string>& drops,
                      const std::vector<std::string>& barriers) {
  if (drops.empty() && barriers.empty()) return Recording::read(dir);
  std::vector<dist::FlightDump> dumps = read_dumps(dir);
  apply_edits(dumps, drops, barriers);
  return Recording::of(dumps);
}

}  // namespace diffcomm::sim
