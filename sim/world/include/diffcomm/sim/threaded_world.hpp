#pragma once
// ThreadedWorld: a sim::World whose ranks run on OS threads (one per rank,
// e.g. Python threads), with exactly one rank running at a time.
//
// Fibers cannot switch under CPython frames, so each rank's code runs on its
// own OS thread, while the simulated world itself runs unchanged: every rank
// has a small proxy fiber in a sim::World. A proxy fiber hands a baton to its
// rank's thread and blocks the world's thread until that thread either
// issues a dist call (which the fiber then executes on the real simulated
// backend: rendezvous, fingerprint comparison, data move, stats, faults,
// deadlock detection — all the world's own code) or finishes. So:
//  - exactly one thread runs at a time (the world's or one rank's);
//  - the interleaving is the world's seeded fiber schedule: same seed, same
//    interleaving, same trace_hash();
//  - mismatches, deadlocks and rank failures surface as the world raises
//    them, on every affected rank, never as a hang — unless a rank blocks on
//    something other than diffcomm (a lock, a queue, an endless loop).
// Cost: each dist call crosses threads twice (rank thread -> world thread ->
// rank thread), plus one hand-over per rank that the world schedules.
// Since only one of these threads ever runs, by default they all share one
// CPU (CpuPlacement::OneCpu): a hand-over is then a context switch on that
// CPU (about 1 us through a futex word) instead of a wake-up on another core (a cross-CPU
// interrupt and often a core leaving its idle state: 10-30 us per hand-over
// measured on a 2-core machine, 4-7x the per-collective cost at world 8).
#include <memory>
#include <string>
#include <vector>

#include "diffcomm/distributed/group.hpp"
#include "diffcomm/sim/world.hpp"

namespace diffcomm::sim {

struct ThreadedWorldState;

/// Where the threads of a ThreadedWorld run.
enum class CpuPlacement {
  /// The world's thread and every rank thread are pinned to one CPU (the one
  /// the constructing thread ran on) between start()/run() and finish()/the
  /// end of run(); each thread's previous CPU set is restored then. Nothing
  /// runs in parallel anyway (one baton), so nothing is lost but the
  /// cross-CPU wake-ups. When the OS refuses the pinning (e.g. a cpuset that
  /// changed), the threads stay where the OS puts them (cpu() says -1).
  OneCpu,
  /// Threads go where the OS puts them.
  Os,
};

/// A simulated world of `options.ranks` thread-ranks. Usage:
///   ThreadedWorld w(options);
///   // thread r:  auto g = w.start(r); ... diffcomm calls on g ...; w.finish(r, "");
///   w.run();     // on one more thread: returns when every rank finished
class ThreadedWorld {
 public:
  /// Throws InvalidArgument for options sim::World rejects.
  explicit ThreadedWorld(WorldOptions options, CpuPlacement placement = CpuPlacement::OneCpu);
  ~ThreadedWorld();

  /// Rank thread: waits for the baton, returns this rank's world group
  /// (sub-groups and meshes made from it work as in sim::World). The group
  /// is usable from this thread only, until finish(); otherwise its calls
  /// throw InvalidArgument. Throws Error when the world ended before this
  /// rank ran, or when the rank already started.
  dist::ProcessGroup start(int rank);
  /// Rank thread: the rank function finished (failure: its message, or ""):
  /// the world then ends this rank as sim::World ends a rank whose function
  /// returned (or threw Error(failure)). Also allowed without start() (the
  /// thread could not run the rank): the world counts the rank as finished.
  void finish(int rank, std::string failure);
  /// Runs the world (blocks), once: a second call throws InvalidArgument.
  /// Returns normally even when ranks failed; see
  /// error_messages(). Any rank thread still waiting afterwards is released.
  /// Throws what sim::World::run throws when the world cannot run at all
  /// (BackendError: no fiber stacks; InvalidArgument), after releasing the
  /// rank threads.
  void run();
  /// Releases every rank thread still waiting in start() (it raises Error
  /// with `why`): for a caller that cannot start every rank thread.
  void cancel(const std::string& why);

  /// The rank whose thread holds the baton now, or -1 (the world's thread
  /// runs, or the world ended): for an interrupt that must reach the one
  /// rank running its own code (Python's Ctrl-C in diffcomm.sim.run).
  int running_rank() const;
  /// The CPU the world's threads share (CpuPlacement::OneCpu), or -1.
  int cpu() const;
  int size() const;
  const World& world() const;
  std::vector<std::string> error_messages() const;

 private:
  std::shared_ptr<ThreadedWorldState> state_;
};

}  // namespace diffcomm::sim
