#pragma once
// What a replay holds (sim/replay.hpp's Recording): every rank's recorded
// calls as small steps into one table of distinct call descriptions, the
// groups with each member's watermarks, and the window each group replays
// from. Internal to sim/replay/src (replay_table.cpp builds it, replay_prefix.cpp
// and replay.cpp read it).
#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "diffcomm/distributed/backend/fingerprint.hpp"
#include "diffcomm/distributed/flight_dump.hpp"

namespace diffcomm::sim::detail {

struct TableGroup {
  std::string name;
  std::vector<int> members;         // global ranks in group order
  std::vector<uint64_t> watermark;  // per member; 0 where its dump lacks the group
  std::vector<uint64_t> p2p_watermark;
  // Set by Table::finish(): the first collective and send/recv numbers every
  // member still holds, and the members whose ring lost calls others hold.
  uint64_t start = 0;
  uint64_t p2p_start = 0;
  std::vector<int> lost;
};

// A distinct call description: the record (seq, id, times and backward_of's
// call zero) and its group.
struct TableCall {
  dist::FlightRecord proto;
  uint32_t group = 0;
  bool p2p = false;
};

// One recorded call of one rank (16 bytes: 32 million fit in 0.5 GiB).
struct Step {
  uint32_t call = 0;            // into Table::calls
  uint32_t backward_plus1 = 0;  // backward_of's call + 1, 0 for none
  uint64_t seq = 0;
};

struct Table {
  int world_size = 0;
  std::vector<TableGroup> groups;
  std::unordered_map<std::string, uint32_t> group_index;
  std::vector<TableCall> calls;
  std::unordered_map<std::string, uint32_t> call_index;
  std::vector<std::vector<Step>> steps;                           // per global rank
  std::vector<std::vector<std::pair<uint32_t, int>>> group_rank;  // per rank: (group, group rank)
  std::vector<std::string> unknown;                               // what the dumps do not record
  // Set by finish(): per call, the first call number its group replays
  // (UINT64_MAX for group creation, which is never replayed).
  std::vector<uint64_t> call_start;

  explicit Table(int world) : world_size(world), steps(world), group_rank(world) {}
  /// Adds rank d.rank's dump; `file` names it in errors. Not thread-safe.
  void add(const dist::CompactFlightDump& d, const std::vector<std::string>& unknown,
           const std::string& file) {
    fill(d, intern(d, unknown, file), file);
  }
  /// add()'s two halves: interning d's groups and descriptions (returns its
  /// descriptions' indices into calls; not thread-safe), and rank d.rank's
  /// steps from its rows (safe beside other ranks' fill).
  std::vector<uint32_t> intern(const dist::CompactFlightDump& d,
                               const std::vector<std::string>& unknown, const std::string& file);
  void fill(const dist::CompactFlightDump& d, const std::vector<uint32_t>& global,
            const std::string& file);
  /// Computes every group's window (after the last add).
  void finish();
  /// Whether step `s` lies inside its group's replay window.
  bool in_window(const Step& s) const { return s.seq >= call_start[s.call]; }
  /// `rank`'s group-local rank in `group`.
  int rank_in(int rank, uint32_t group) const;
  /// The record of rank `rank`'s step `s` (its proto with the step's numbers).
  dist::FlightRecord record(const Step& s) const;
};

/// The checks read_dumps makes of each file: it records rank `r` and rank
/// 0's world size, and its groups' members lie inside the world.
/// InvalidArgument naming the file.
void check_dump_header(int r, int rank, int world_size, int world0,
                       const std::vector<dist::DumpedGroup>& groups, const std::string& file);
/// A group's members as the first file that recorded it (rank `seen_rank`) has them.
struct SeenGroup {
  int seen_rank = 0;
  std::vector<int> members;
};
/// Where group `g` (in rank `r`'s `file`) is first seen, checks that its
/// members are distinct, records them in `first_seen` and returns nullptr;
/// otherwise returns the earlier record, which the caller must compare with
/// check_same_members (now, or outside a lock). Both readers use it, so they
/// refuse a bad directory with the same line.
const SeenGroup* see_group(std::map<std::string, SeenGroup>& first_seen, const dist::DumpedGroup& g,
                           int r, const std::string& file);
/// `g`'s members must be `seen`'s (InvalidArgument naming both files).
void check_same_members(const dist::DumpedGroup& g, const SeenGroup& seen, const std::string& file);

/// "DIR/rank-R.json".
std::string rank_file(const std::string& dir, int rank);

}  // namespace diffcomm::sim::detail
