#pragma once
// The collectives the MPI backend builds itself from per-peer
// MPI_Isend/MPI_Irecv instead of calling MPI's own: the ring all-reduce and
// the exchange of blocks behind the gathers, scatters and all-to-alls. Apart
// from mpi_backend.cpp, which maps each primitive to its MPI call, because
// these are algorithms of diffcomm's own, chosen where they beat Open MPI's
// non-blocking collectives (bench/RESULTS.md, "MPI at raw speed").
#include <mpi.h>

#include <boost/container/small_vector.hpp>
#include <cstdint>

#include "diffcomm/distributed/backend.hpp"
#include "mpi_util.hpp"

namespace diffcomm::mpi::detail {

// One message of an exchange: `nbytes` at `data`, to or from member `peer`.
struct Block {
  int peer;
  const char* data;
  int64_t nbytes;
};
// The messages of one exchange, one per peer (inline up to kInlinePeers).
using Blocks = boost::container::small_vector<Block, kInlinePeers>;

// The per-peer algorithms of one group: its rank and size, on `comm` (the
// backend's duplicate of the group's communicator, which no user message can
// match), each message completed with the group's deadline.
class Peers {
 public:
  Peers() = default;
  Peers(MPI_Comm comm, int rank, int size, double timeout_s)
      : comm_(comm), rank_(rank), size_(size), timeout_s_(timeout_s) {}

  // The peers in pairwise order: step i sends to rank+i and receives from
  // rank-i, so the members do not all send to member 0 first.
  template <class F>
  void each_peer(F&& f) const {
    for (int i = 1; i < size_; ++i) f((rank_ + i) % size_, (rank_ - i + size_) % size_);
  }

  // Per-peer non-blocking messages in chunks of at most max_count bytes,
  // completed within the deadline. `while_in_flight` runs between posting
  // and waiting: the caller's own-block copy, which then overlaps the
  // transfers (as Open MPI's blocking calls do).
  void exchange(const dist::Call& c, const Blocks& sends, const Blocks& recvs) const {
    exchange(c, sends, recvs, [] {});
  }
  template <class F>
  void exchange(const dist::Call& c, const Blocks& sends, const Blocks& recvs,
                F&& while_in_flight) const {
    Requests reqs = post(c, sends, recvs);
    while_in_flight();
    complete(c, reqs);
  }

  // Every member's `in` into its block of `out`, by per-peer messages.
  void gather_fixed(const dist::Call& c, const Tensor& in, const Tensor& out) const;

  // Whether all_reduce of `t` takes ring_all_reduce rather than MPI_Iallreduce.
  bool use_ring(const Tensor& t) const;
  void ring_all_reduce(const dist::Call& c, const Tensor& t) const;

 private:
  Requests post(const dist::Call& c, const Blocks& sends, const Blocks& recvs) const;
  void complete(const dist::Call& c, Requests& reqs) const;

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  double timeout_s_ = 0;
};

}  // namespace diffcomm::mpi::detail
