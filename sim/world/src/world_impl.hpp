// World::Impl, the state of a simulated world, shared by the files of its
// concerns: rendezvous.cpp (groups, joining, waiting, deadlocks, failures,
// completion), trace.cpp (trace records, hash, cost model), world.cpp (run).
// The data move of each primitive is in reference_ops.cpp.
#pragma once

#include <algorithm>
#include <atomic>
#include <boost/fiber/fiber.hpp>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "diffcomm/distributed/backend.hpp"
#include "diffcomm/sim/world.hpp"
#include "rendezvous.hpp"
#include "scheduler.hpp"
#include "trace.hpp"

namespace diffcomm::sim {

namespace detail {
class Stacks;
}

struct World::Impl {
  using Call = dist::Call;
  using Rendezvous = detail::Rendezvous;
  using SimGroup = detail::SimGroup;
  using RankState = detail::RankState;
  using TraceCall = detail::TraceCall;
  using TraceMember = detail::TraceMember;

  WorldOptions options;
  std::vector<RankState> ranks;
  std::list<std::shared_ptr<SimGroup>> groups;
  // Every rendezvous someone waits in, unordered (Rendezvous::pending_at is
  // its index: O(1) insert and swap-remove, no node allocation per waiting
  // rank as std::set had). The rare paths that walk it sort a copy by
  // address, the order the std::set gave, so wake order is unchanged.
  std::vector<Rendezvous*> pending;
  // The rendezvous ranks wait in, in an order that depends on the program
  // and the seed only: (group id, op and call number of the first arrival,
  // members). Sorting by address made the order in which a deadlock or a
  // failure wakes the waiting ranks (and so the rest of the interleaving and
  // which failure leads the report) depend on the heap layout of the build.
  std::vector<Rendezvous*> pending_sorted() const {
    std::vector<Rendezvous*> all(pending);
    auto key = [](const Rendezvous* rv) {
      const dist::Call* first =
          rv->arrival_order.empty()
              ? nullptr
              : rv->calls[static_cast<std::size_t>(rv->arrival_order.front())];
      return std::tuple<uint64_t, int, uint64_t, const std::vector<int>&>(
          rv->group != nullptr ? rv->group->id : UINT64_MAX,
          first != nullptr ? static_cast<int>(first->op) : -1, first != nullptr ? first->seq : 0,
          rv->globals);
    };
    std::sort(all.begin(), all.end(),
              [&](const Rendezvous* a, const Rendezvous* b) { return key(a) < key(b); });
    return all;
  }
  uint64_t next_group_id = 0;
  int live = 0;
  int blocked = 0;
  uint64_t failures = 0;
  std::string injected_fault;  // the injected fault's message, once it fired
  // The trace as recorded (see trace.hpp).
  std::vector<TraceCall> trace_calls;
  std::vector<TraceMember> trace_members;
  std::vector<std::string> trace_names;
  mutable std::vector<TraceEvent> trace_expanded;
  mutable bool trace_stale = false;
  uint64_t trace_hash = detail::kTraceHashSeed;
  std::vector<std::exception_ptr> errors;
  detail::SeededAlgorithm* algo = nullptr;  // installed on this thread by run()
  // True while run() runs; each run makes a new flag, every handle of that
  // run shares it, and it outlives the World (handles check it first).
  std::shared_ptr<bool> running = std::make_shared<bool>(false);
  // Held by the thread inside run(): a second thread's run() is refused
  // (`running` is no lock: two threads would both see it false).
  std::atomic<bool> in_run{false};

  // ---------------------------------------------------------- trace.cpp
  // Calls a TraceEvent-shaped f(call, member) for every recorded event.
  template <class F>
  void for_each_trace_event(F&& f) const;
  void hash(uint64_t v);
  void hash(const char* s);
  // The completed call `rv` into trace_hash: group, call number, op, and
  // the order its members arrived in.
  void hash_completion(const Rendezvous& rv);
  // One trace record for `rv` (one per end of a send/recv pair).
  void record_trace(const Rendezvous& rv);
  uint32_t intern_trace_name(SimGroup& g, std::string_view name);
  const std::vector<TraceEvent>& expanded_trace() const;
  // Virtual duration of `rv` under options.cost (alpha-beta).
  double cost_us(const Rendezvous& rv) const;

  // ---------------------------------------------------------- rendezvous.cpp
  std::shared_ptr<SimGroup> make_group(std::vector<int> members);
  void wake(Rendezvous& rv);
  void check_deadlock();
  // Blocks the calling rank until rv is done (or fails).
  void wait(Rendezvous& rv, int global, const Call& call);
  void on_rank_exit(int global, std::exception_ptr error,
                    std::shared_ptr<const std::string> message);
  std::string failure_text(int global) const;
  [[noreturn]] void raise(const Rendezvous& rv, const Call& call);
  // Entry of every call: fault injection and failed members.
  void enter(SimGroup& g, int global, const Call& call);
  // Returns "" when the members agree, else the mismatch report.
  static std::string compare(Rendezvous& rv);
  // Called by the last member to arrive: check, move, time, trace, wake.
  void complete(Rendezvous& rv);
  // The arrival of `call` at the pending rendezvous `entry` (created by
  // `make` for the first arrival): the last of n arrivals runs `last`, the
  // others wait.
  template <class Make, class Last>
  std::shared_ptr<Rendezvous> join(std::shared_ptr<Rendezvous>& entry, Make&& make, int slot, int n,
                                   int global, Call& call, Last&& last);

  // The body of every primitive on the simulated backend.
  void collective(const std::shared_ptr<SimGroup>& g, int slot, Call& call);
  void point_to_point(const std::shared_ptr<SimGroup>& g, int slot, Call& call,
                      std::map<std::tuple<int, int, int>, uint64_t>& counters);
  std::shared_ptr<dist::Backend> split(const std::shared_ptr<SimGroup>& g, int slot, Call& call);
  // The groups of split() call `rv`, one backend per member (null: no group).
  void split_groups(Rendezvous& rv, const SimGroup& g);

  // ---------------------------------------------------------- world.cpp
  // The steps of World::run, in order.
  // State of a fresh run of n ranks (the world group not made yet).
  void reset_for_run(int n);
  // The seeded scheduler, on this thread, for n ranks.
  void install_scheduler(int n);
  // One fiber per rank on its own stack, each running run_rank.
  std::vector<boost::fibers::fiber> start_ranks(World* world, detail::Stacks& stacks,
                                                const std::function<void(Rank&)>& fn,
                                                const std::shared_ptr<SimGroup>& world_group);
  // A rank's fiber: its world handle, then `fn`, then its exit.
  void run_rank(World* world, const std::function<void(Rank&)>& fn,
                const std::shared_ptr<SimGroup>& world_group, int r);
  // Waits for every fiber and releases them before run() returns.
  void join_ranks(std::vector<boost::fibers::fiber>& fibers);
  // Raises the run's failures (RunError), if any.
  void rethrow_failures() const;
};

}  // namespace diffcomm::sim
