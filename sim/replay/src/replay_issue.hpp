#pragma once
// Issuing a recorded call (sim/replay.hpp): on the simulated world's groups
// when replaying, and once per distinct description on a dry group (a
// backend that moves nothing) so the funnel's local checks still refuse a
// corrupt description in the agreeing prefix, which the world never issues.
// Internal to sim/replay/src.
#include <cstddef>
#include <memory>
#include <vector>

#include "diffcomm/distributed/backend/fingerprint.hpp"
#include "diffcomm/distributed/flight_recorder.hpp"
#include "diffcomm/distributed/group.hpp"
#include "replay_table.hpp"

namespace diffcomm::sim::detail {

/// The most bytes one recorded call's inputs and outputs may total
/// (16 TiB): replay reserves that much address space, never memory.
inline constexpr double kMaxCallBytes = double(std::size_t{1} << 44);

/// Tensors of the recorded shapes that own no memory: views of one
/// address-space reservation (PROT_NONE, nothing committed) as large as the
/// table's largest call. A verdict needs shapes, not values: the funnel
/// reads shapes and address ranges (its aliasing rule), DryBackend moves
/// nothing and the world replays with WorldOptions::move_payloads off, so no
/// byte is read or written; one that were would fault at once. A call's
/// tensors lie one after another (none overlaps another of the call); every
/// rank's call starts at the same address, since aliasing is a rule within
/// one rank's call.
class ShapeOnlyTensors {
 public:
  /// Throws InvalidArgument ("replay: rank R's OP #S on group 'G' holds ...
  /// refuses calls over 16 TiB", or "... cannot be replayed: ... negative
  /// dim") for a call past kMaxCallBytes or with a negative dim, and
  /// ResourceExhausted when the system refuses the reservation.
  explicit ShapeOnlyTensors(const Table& table);
  /// Issues `r` on `g` with tensors of its recorded shapes.
  void issue(const dist::ProcessGroup& g, const dist::FlightRecord& r) const;

 private:
  std::vector<Tensor> views(const std::vector<Shape>& shapes, DType dtype,
                            std::size_t& offset) const;
  std::shared_ptr<char> region_;
};

/// Issues every distinct description of `table` once on a dry group of its
/// group's size, as its recording rank, and returns the funnel's
/// description of each (indexed like table.calls; call numbers zero), what
/// the world's rendezvous would compare. Throws InvalidArgument ("replay:
/// the recorded calls cannot be replayed: ..." with the funnel's message)
/// for a description the funnel refuses.
std::vector<dist::CallDesc> validate_calls(const Table& table, const ShapeOnlyTensors& tensors);

}  // namespace diffcomm::sim::detail
