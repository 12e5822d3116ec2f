#pragma once
// sim::World: N ranks as Boost.Fiber fibers on one OS thread, running the
// same dist/nn/encoder_parallel code as production behind the dist::Backend
// interface.
//
//  - One seed = one interleaving = one run: a seeded scheduling algorithm
//    picks the next ready fiber.
//  - Every collective is a rendezvous keyed by (group, call number). Before
//    data moves, the members' calls are compared (op, dtype, shapes, root,
//    reduce op, splits, cross-rank split agreement); any difference raises
//    CollectiveMismatch on every member.
//  - When every live rank is blocked, every blocked rank raises Deadlock with
//    a report of what each rank waits in or that it finished. Never hangs.
//  - A rank that fails (an injected fault or any exception) makes the other
//    members of its groups raise RankFailure instead of waiting for it.
//  - Reductions combine in group-rank order: results are bit-reproducible.
//  - Per-rank Stats, and a trace of every call in virtual time from an
//    alpha-beta cost model, written as Chrome trace-event JSON (Perfetto).
//
// Limits: run() must be called from a plain thread, not from inside a rank
// function (InvalidArgument); rank functions must not block on anything but
// diffcomm calls. Lifetimes: a ProcessGroup a rank obtains (Rank::world(),
// new_group, split, meshes) is that rank's handle for that run() only; a call
// through it from another rank's fiber, or after the run returned or the
// World was destroyed, raises InvalidArgument and reaches no member.
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "diffcomm/distributed/group.hpp"
#include "diffcomm/distributed/mesh.hpp"
#include "diffcomm/distributed/stats.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::sim {

/// The first line of every Deadlock report of the simulated world, and of a replay that settles a
/// deadlock without running the world (replay.hpp), so both read the same.
inline constexpr std::string_view kDeadlockLine =
    "deadlock: every live rank is blocked and none can proceed";

enum class Schedule {
  Random,     ///< next fiber drawn from the ready set with a seeded RNG
  RoundRobin  ///< ready fibers in FIFO order (the seed is then irrelevant)
};

/// Virtual time of one collective: alpha_us * steps + bytes / bandwidth,
/// where steps = N-1 (2(N-1) for all_reduce, 1 for send/recv, 0 for N = 1)
/// and bytes = the largest of any member's sent or received payload (Stats).
/// A collective starts when its last member arrives (members' clocks are
/// advanced to its end). Local compute costs nothing unless a rank calls
/// Rank::advance_us.
struct CostModel {
  double alpha_us = 5.0;          ///< latency per step, microseconds
  double bandwidth_gbps = 100.0;  ///< link bandwidth, GB/s (1e9 bytes/s)
};

/// "rank R fails at its K-th collective" (K counts from 1 over every call
/// the rank makes through the dist layer: collectives, send/recv, new_group).
struct Fault {
  int rank = 0;
  int at_call = 1;
};

/// The most ranks a simulated world runs (WorldOptions::ranks).
inline constexpr int kMaxRanks = 16384;

struct WorldOptions {
  int ranks = 1;  ///< 1..kMaxRanks
  uint64_t seed = 0;
  Schedule schedule = Schedule::Random;
  std::size_t stack_size = 256 * 1024;  ///< bytes per fiber stack (guard page added)
  CostModel cost;
  std::optional<Fault> fault;
  bool trace = true;  ///< keep trace events (memory grows with calls)
  /// false: calls meet, are compared, timed and reported as usual, but no
  /// byte of their tensors is read or written (outputs keep what they held).
  /// For runs that need verdicts, not values: sim::replay runs its tensors
  /// without memory this way. Fiber world only (Python's process mode copies
  /// payloads on the rank side regardless).
  bool move_payloads = true;
};

/// One call in the trace.
struct TraceEvent {
  std::string op;
  std::string group;
  uint64_t seq = 0;
  int rank = 0;  ///< global rank
  double start_us = 0;
  double duration_us = 0;
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
};

class World;

/// One failed rank of a World::run.
struct RankError {
  int rank = 0;              ///< global rank
  std::exception_ptr error;  ///< what the rank function raised
  /// Its what(), shared rather than copied: after a deadlock every blocked
  /// rank's message is the same N-line report (a copy per rank was 16384 x
  /// 1.8 MB at 16384 ranks).
  std::shared_ptr<const std::string> what;
  int root_cause = -1;  ///< global rank whose failure made this one fail (-1: none)
  /// The message (what()), or "" when none was recorded.
  const std::string& message() const {
    static const std::string none;
    return what ? *what : none;
  }
};

/// Every failure of one World::run, reachable from the exception it throws
/// (which derives from both this and the first failure's Error class).
class RunFailures {
 public:
  /// Takes the failures of one run (shared, never copied per exception).
  explicit RunFailures(std::shared_ptr<const std::vector<RankError>> failures)
      : failures_(std::move(failures)) {}
  virtual ~RunFailures() = default;
  /// Each failed rank's error, in the order the ranks failed (the first is
  /// the one the exception's type and message lead with).
  const std::vector<RankError>& failures() const { return *failures_; }

 private:
  std::shared_ptr<const std::vector<RankError>> failures_;
};

/// The failures carried by an exception World::run threw; null for any
/// other exception.
inline const RunFailures* run_failures(const std::exception& e) {
  return dynamic_cast<const RunFailures*>(&e);
}

/// What a rank function receives. Everything per-rank lives here (no
/// thread_local: all ranks share one OS thread).
class Rank {
 public:
  int rank() const { return rank_; }
  int world_size() const;
  /// The group of all ranks ("world").
  const dist::ProcessGroup& world() const { return world_group_; }
  /// Generator seeded from (world seed, rank): reproducible per rank.
  Generator& generator() { return generator_; }
  /// A mesh over the world (collective: every rank calls it with the same dims).
  dist::DeviceMesh mesh(dist::DeviceMesh::Dims dims) const;
  /// This rank's virtual clock.
  double now_us() const;
  /// Models local compute: advances this rank's clock.
  void advance_us(double us);
  dist::Stats& stats() const { return world_group_.stats(); }

 private:
  friend class World;
  Rank(World* world, int rank, dist::ProcessGroup group, uint64_t seed)
      : world_(world), rank_(rank), world_group_(std::move(group)), generator_(seed) {}
  World* world_;
  int rank_;
  dist::ProcessGroup world_group_;
  Generator generator_;
};

class World {
 public:
  /// Throws InvalidArgument for ranks outside 1..16384, a fault naming a rank
  /// outside the world or K < 1, or a stack smaller than 16 KiB.
  explicit World(WorldOptions options);
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  /// Runs fn on every rank as a fiber and returns when all have finished.
  /// If any rank raised, throws the class of the first failure's kind (in
  /// virtual-scheduler order; a non-diffcomm exception: Error), also a
  /// RunFailures: kind() and site() are that failure's, the site naming its
  /// global rank; what() is its message led by "rank R: ", then one line per
  /// other failed rank. RunFailures::failures() (run_failures(e), and
  /// errors()) hold each rank's exception.
  /// Stats and trace are reset per run. Throws InvalidArgument when called
  /// from inside a fiber (e.g. a rank function of a running World) or while
  /// another thread is inside run() of this World, and BackendError (naming
  /// the rank count and the stack size) when the fiber stacks cannot be
  /// allocated; in those cases nothing has run.
  void run(const std::function<void(Rank&)>& fn);

  const WorldOptions& options() const;
  /// Per-rank exception of the last run (null where the rank succeeded).
  const std::vector<std::exception_ptr>& errors() const;
  /// Per-rank message of errors() ("" where the rank succeeded).
  std::vector<std::string> error_messages() const;
  /// The injected fault's (WorldOptions::fault) message when it fired in the
  /// last run, else "".
  const std::string& injected_fault() const;
  /// Traffic counters of one rank in the last run.
  const dist::Stats& stats(int rank) const;
  /// Every completed call of the last run, in completion order.
  const std::vector<TraceEvent>& trace() const;
  /// A hash of the interleaving: the calls in completion order with the
  /// order their members arrived in. Same seed => same hash.
  uint64_t trace_hash() const;
  /// Writes trace() as Chrome trace-event JSON (one track per rank).
  /// Throws InvalidArgument when the file cannot be opened or written.
  void write_trace(const std::string& path) const;
  /// Largest rank clock at the end of the last run, microseconds.
  double sim_time_us() const;
  /// Rank `rank`'s clock now (during a run: where its fiber stands),
  /// microseconds. Throws InvalidArgument for a rank outside the world.
  double rank_time_us(int rank) const;

  struct Impl;

 private:
  friend class Rank;
  std::unique_ptr<Impl> impl_;
};

}  // namespace diffcomm::sim
