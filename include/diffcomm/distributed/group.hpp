#pragma once
// ProcessGroup: a handle to a communicator. Ranks in every call (roots,
// src, dst, peers) are group-local, as in MPI and NCCL communicators. Note
// for PyTorch users: torch.distributed's `src`/`dst` are GLOBAL ranks (newer
// torch adds `group_src`/`group_dst` for group-local ones); convert with
// global_rank() and group_rank(). Copies share state (the call sequence
// number), so pass it by value freely.
#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/distributed/backend.hpp"
#include "diffcomm/distributed/caller.hpp"
#include "diffcomm/distributed/flight_recorder.hpp"
#include "diffcomm/distributed/stats.hpp"

namespace diffcomm::dist {

class ProcessGroup {
  struct State;  // shared by copies of one handle (defined in group.cpp)

 public:
  /// Wraps a backend. Backends' factories (sim::Rank::world(),
  /// mpi::world(), ...) call this; users rarely do.
  /// `stats` and `recorder` are shared by every group of one rank (null:
  /// fresh ones).
  /// `cohort` (null: a fresh one) is the rank's cohort of differentiable
  /// collectives, shared by every group of one rank like `stats`.
  ProcessGroup(std::shared_ptr<Backend> backend, std::string name, std::shared_ptr<Stats> stats,
               std::shared_ptr<FlightRecorder> recorder = nullptr,
               std::shared_ptr<Cohort> cohort = nullptr);

  /// This process's group-local rank, in [0, size()).
  int rank() const;
  int size() const;
  /// Global rank of the member with group-local rank `group_rank`.
  /// Throws InvalidArgument when out of range.
  int global_rank(int group_rank) const;
  /// Group-local rank of the member whose global rank is `global_rank` (the
  /// inverse of global_rank(); torch.distributed.get_group_rank). Throws
  /// InvalidArgument when that rank is not a member of this group.
  int group_rank(int global_rank) const;
  /// Global ranks of all members, in group order.
  std::vector<int> members() const;
  const std::string& name() const;
  Backend& backend() const;
  /// Traffic counters of this rank (shared by all groups made from one world).
  Stats& stats() const;
  /// The last calls of this rank (shared by all groups of the rank).
  FlightRecorder& flight_recorder() const;
  /// This rank's differentiable collectives (shared by all groups of the
  /// rank): nn:: ops join their autograd nodes to it, so a backward pass
  /// runs the backward of every one of them (the participation rule; see
  /// Cohort in autograd.hpp).
  const std::shared_ptr<Cohort>& cohort() const;
  /// The funnel holds one while a call runs on this group: it claims the
  /// group for the calling thread, and throws InvalidArgument (naming the
  /// group, both threads and the call in flight) when another thread is
  /// inside a call on it. The threading rule of NCCL communicators and c10d
  /// process groups: one thread issues a group's calls; two threads
  /// interleaving calls on one communicator mix their messages (wrong sums,
  /// silently). A nested claim by the same thread is allowed. It also sets
  /// call.thread_index (Call): the group's number for the calling thread, in
  /// order of first use, which members agree on. Cost: one compare-and-swap
  /// and a few stores per call (a hash lookup when the thread changed).
  class CallSlot {
   public:
    CallSlot(const ProcessGroup& group, Call& call);
    ~CallSlot();
    CallSlot(const CallSlot&) = delete;
    CallSlot& operator=(const CallSlot&) = delete;

   private:
    State* state_;
    bool claimed_ = false;
  };

  /// The collective this rank last issued on this group (op and call
  /// number; send/recv not counted). A differentiable collective reads it
  /// right after its forward call, to name that call in its backward.
  /// Throws InvalidArgument when no collective was issued yet.
  CallId last_call() const;

  /// While one lives, every call this rank makes on this group is marked as
  /// the backward of `forward` (Call::backward_of): members must agree on
  /// it, so ranks running the backward of different forward calls get
  /// CollectiveMismatch ("forward call differs") instead of a silent
  /// mispairing. nn:: ops hold one around their backward's calls.
  class BackwardOf {
   public:
    BackwardOf(const ProcessGroup& group, CallId forward);
    ~BackwardOf();
    BackwardOf(const BackwardOf&) = delete;
    BackwardOf& operator=(const BackwardOf&) = delete;

   private:
    State* state_;
    std::optional<CallId> previous_;
  };

  /// Next per-group call number (the funnel numbers every call).
  uint64_t next_seq() const;
  /// Next point-to-point call number. Kept apart from next_seq(), because a
  /// send/recv involves two members only and must not shift the numbering of
  /// the group's collectives.
  uint64_t next_p2p_seq() const;
  /// Numbers this rank's next collective on this group `seq` (`p2p`: its
  /// next send/recv): how a replay (sim/replay.hpp) issues each recorded
  /// call under its recorded number. Members must agree, as on any call
  /// number (the simulated world pairs collectives by number).
  void resume_numbering(uint64_t seq, bool p2p = false) const;
  /// What the funnel marks this rank's next call with (see BackwardOf).
  const std::optional<CallId>& backward_of() const;
  /// The funnel records each numbered collective (see last_call()).
  void set_last_call(CallId call) const;

  /// Creates the sub-group of the members with group-local ranks `ranks`, in
  /// that order (new rank i = ranks[i]). Collective over this group: every
  /// member calls it with the same list (checked by the simulated world;
  /// CollectiveMismatch otherwise). Returns nullopt on non-members.
  /// Throws InvalidArgument on duplicates or out-of-range ranks.
  /// Follows torch.distributed.new_group.
  /// caller: the call site its flight-recorder entry and reports name.
  std::optional<ProcessGroup> new_group(const std::vector<int>& ranks, std::string name = "",
                                        Caller caller = Caller::here()) const;

  /// Collective over this group (MPI_Comm_split semantics): members with the
  /// same color >= 0 form a group ordered by (key, rank). `fingerprint` must
  /// be equal on every member; `name` names this rank's new group.
  std::optional<ProcessGroup> split(int color, int key, const std::vector<int64_t>& fingerprint,
                                    std::string name, Caller caller = Caller::here()) const;

 private:
  friend struct detail::SchedulerAccess;  // reads state_'s address (stats.hpp)
  std::shared_ptr<State> state_;
};

}  // namespace diffcomm::dist
