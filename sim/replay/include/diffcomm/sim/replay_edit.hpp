#pragma once
// What-if edits of flight recorder dumps before a replay (replay.hpp): test
// a fix without redeploying. `--drop RANK:GROUP:CALL` removes a rank's
// recorded collective; `--insert-barrier RANK:GROUP:CALL` makes the rank
// call a barrier on GROUP as call CALL, before what it recorded there. The
// rank's later collectives on that group are renumbered as the edited
// program would number them (one less after a drop, one more after an
// insertion).
#include <cstdint>
#include <string>
#include <vector>

#include "diffcomm/distributed/flight_dump.hpp"
#include "diffcomm/sim/replay.hpp"

namespace diffcomm::sim {

struct ReplayEdit {
  enum class Kind { Drop, InsertBarrier };
  Kind kind = Kind::Drop;
  int rank = 0;       ///< global rank
  std::string group;  ///< group name
  uint64_t call = 0;  ///< per-group collective number
};

/// Parses "RANK:GROUP:CALL" (the group is everything between the first and
/// the last colon). Throws InvalidArgument naming `spec` when malformed.
ReplayEdit parse_replay_edit(ReplayEdit::Kind kind, const std::string& spec);

/// Applies `edit` to `dumps` (one per global rank). Throws InvalidArgument
/// when the rank is outside the world, or (drop) the rank recorded no
/// collective CALL on GROUP, or (insert) no group GROUP is in its dump.
void apply_edit(std::vector<dist::FlightDump>& dumps, const ReplayEdit& edit);

/// Applies every edit of `drops` and `barriers` ("RANK:GROUP:CALL" each),
/// each CALL in the *recorded* numbering: `--drop 3:world:12 --drop
/// 3:world:13` drops the two recorded calls, whatever order they are given
/// in (edits apply from the highest call down; at one call the drop first,
/// so a drop and a barrier there replace that call by a barrier). Throws
/// InvalidArgument as parse_replay_edit and apply_edit do, and for a drop
/// given twice.
void apply_edits(std::vector<dist::FlightDump>& dumps, const std::vector<std::string>& drops,
                 const std::vector<std::string>& barriers);

/// DIR's dumps with `drops` and `barriers` (apply_edits) ("RANK:GROUP:CALL" each)
/// applied, as `diffcomm-sim replay` and diffcomm.sim.replay read them:
/// Recording::read(dir) when there are no edits, else read_dumps,
/// apply_edits, Recording::of. Errors as those.
Recording read_edited(const std::string& dir, const std::vector<std::string>& drops,
                      const std::vector<std::string>& barriers);

}  // namespace diffcomm::sim
