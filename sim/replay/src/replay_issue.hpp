#pragma once
// Issuing a recorded call (sim/replay.hpp): on the simulated world's groups
// when replaying, and once per distinct description on a dry group (a
// backend that moves nothing) so the funnel's local checks still refuse a
// corrupt description in the agreeing prefix, which the world never issues.
// Internal to sim/replay/src.
#include <vector>

#include "diffcomm/distributed/backend/fingerprint.hpp"
#include "diffcomm/distributed/flight_recorder.hpp"
#include "diffcomm/distributed/group.hpp"
#include "replay_table.hpp"

namespace diffcomm::sim::detail {

/// Issues `r` on `g` with zero tensors of its recorded shapes.
void issue(const dist::ProcessGroup& g, const dist::FlightRecord& r);

/// Issues every distinct description of `table` once on a dry group of its
/// group's size, as its recording rank, and returns the funnel's
/// description of each (indexed like table.calls; call numbers zero), what
/// the world's rendezvous would compare. Throws InvalidArgument ("replay:
/// the recorded calls cannot be replayed: ..." with the funnel's message)
/// for a description the funnel refuses.
std::vector<dist::CallDesc> validate_calls(const Table& table);

}  // namespace diffcomm::sim::detail
