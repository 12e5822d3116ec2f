#pragma once
// The agreeing prefix of a recording (replay.hpp), settled without the
// simulated world: each rank runs its recorded collectives as a blocking
// program would, a collective completing when every member has arrived at
// it and their descriptions agree under dist::compare (checked once per
// distinct combination of descriptions). Where that stops is a cut every
// rank reached in the world too; the world replays only what follows it.
// Internal to sim/replay/src.
#include <cstddef>
#include <optional>
#include <vector>

#include "replay_table.hpp"

namespace diffcomm::sim::detail {

struct Cut {
  enum class At {
    Finished,  // ran out of recorded calls
    Waiting,   // in a collective some member never arrived at
    Stopped,   // in a collective whose members disagree (or that it recorded twice)
    P2p,       // at a send/recv: left to the world, whose matching depends on the schedule
  };
  std::vector<std::size_t> pc;  // per rank: index into its steps
  std::vector<At> at;
  // The first collective whose members arrived and disagree: its group,
  // number and each member's description (indices into Table::calls).
  struct Disagreement {
    uint32_t group = 0;
    uint64_t seq = 0;
    std::vector<uint32_t> calls;
  };
  std::optional<Disagreement> first_disagreement;
  bool all_finished() const;
  bool any_p2p() const;
  bool any_stopped() const;
};

/// `descs[c]`: the funnel's description of table.calls[c] (validate_calls).
Cut settle_prefix(const Table& table, const std::vector<dist::CallDesc>& descs);

/// The cut at every rank's first step, as if at a send/recv (so the world
/// runs every recorded call).
Cut no_prefix(const Table& table);

}  // namespace diffcomm::sim::detail
