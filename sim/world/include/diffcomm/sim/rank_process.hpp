#pragma once
// Ranks as processes: the two ends of diffcomm.sim.run(isolation="process").
//
// Each rank's code runs in its own OS process (forked by the caller, so
// module globals, RNG state, hooks and c10d state are per rank, as under a
// launcher), while the simulated world stays one ThreadedWorld in the caller.
// A rank process's groups have a backend that sends every primitive call
// (the dist::Call the funnel built, after validation) to the world over a
// socket, with its tensors copied into a shared memfd; on the world side the
// rank's thread (the one that called ThreadedWorld::start) runs that Call on
// the rank's real group backend and sends back its outcome. So the world
// sees exactly the Calls a thread rank would issue: same seed, same
// interleaving and trace hash, same Deadlock / CollectiveMismatch /
// RankFailure text. Only the rank process holding the baton runs: the
// world's thread for that rank waits for the process's next call.
// docs/simulated-world.md says why the world stays in the caller.
#include <string>

#include "diffcomm/distributed/group.hpp"
#include "diffcomm/sim/threaded_world.hpp"

namespace diffcomm::sim {

/// How a rank process ended, as serve_rank_process saw it.
struct RankProcessEnd {
  /// The process reported its end: `failure` is its rank function's failure
  /// ("" when it returned) and `payload` the bytes it sent (the caller's
  /// encoding of the return value). False: the process closed its socket
  /// without reporting (it died: a signal, os._exit, out of memory).
  bool reported = false;
  std::string failure;
  std::string payload;
};

/// World side, on rank `rank`'s thread right after `group =
/// world.start(rank)`: sends the rank process its world group's identity,
/// then runs each call the process sends on `group`'s backend (and splits
/// of it) until the process reports its end or closes `socket_fd`. Errors
/// a call raises go back to the process, which rethrows them. The caller
/// then calls world.finish(rank, ...). `memory_fd` is the rank's payload
/// memfd. Throws nothing the process caused; BackendError only when the
/// payload memory cannot be mapped.
RankProcessEnd serve_rank_process(const ThreadedWorld& world, int rank,
                                  const dist::ProcessGroup& group, int socket_fd, int memory_fd);

/// Rank process side: waits until the world starts this rank, then returns
/// its world group, whose calls (and those of groups split from it) run in
/// the world. Throws BackendError when the world has gone before the start.
/// On Linux the process is set to be killed when its parent dies, so no rank
/// process outlives the run's caller.
dist::ProcessGroup connect_rank_process(int socket_fd, int memory_fd);

/// Rank process side: reports the rank function's end (failure "" when it
/// returned) with `payload`. Returns false when the world has gone.
bool finish_rank_process(int socket_fd, const std::string& failure, const std::string& payload);

}  // namespace diffcomm::sim
