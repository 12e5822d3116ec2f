// The data move of each primitive on the simulated world: the reference
// semantics of the collectives, over the members' Calls in group order
// (send/recv: 0 = sender, 1 = receiver). Called by the last member to
// arrive, after the fingerprints were compared; a differential test can call
// them as the oracle.
//
// Aliasing: the funnel has already staged every input that overlaps an
// output of the same call (dist/collectives.cpp), the one rule of every
// backend, so the data move never reads what it has written.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "diffcomm/distributed/backend/call.hpp"
#include "rendezvous.hpp"

namespace diffcomm::sim::detail {

using Calls = std::vector<dist::Call*>;

// Moves the data of one call (every op but AllToAll, see move_all_to_all).
void move_data(Calls& c);

void move_all_reduce(const Calls& c);
void move_broadcast(const Calls& c);
void move_reduce(const Calls& c);
void move_all_gather(const Calls& c);
void move_all_gather_single(const Calls& c);
void move_all_gather_v(const Calls& c);
void move_gather(const Calls& c);
void move_scatter(const Calls& c);
void move_reduce_scatter(const Calls& c);
void move_reduce_scatter_single(const Calls& c);
void move_reduce_scatter_v(const Calls& c);
void move_all_to_all_single(const Calls& c);
void move_send_recv(const Calls& c);

// all_to_all (list form): member `slot`'s row of rv.a2a, read from its own
// lists on arrival, and the N^2 blocks moved from those tables.
void fill_all_to_all_row(Rendezvous& rv, std::size_t slot, const dist::Call& call);
void move_all_to_all(Rendezvous& rv);

}  // namespace diffcomm::sim::detail
