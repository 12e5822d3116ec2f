// sim::World and sim::Rank: N ranks as Boost.Fiber fibers on one thread,
// scheduled by the seeded algorithm (scheduler.hpp). The parts, by concern:
//   rendezvous.cpp     groups, joining a call, waiting, deadlocks, failures
//   reference_ops.cpp  the data move of each primitive
//   trace.cpp          trace records, hash, write_trace, cost model
//   sim_backend.cpp    the dist::Backend of a rank in a group
//   stacks.hpp         the fiber stacks
// This file: World's options and results, and run().
#include "diffcomm/sim/world.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <boost/fiber/all.hpp>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <numeric>

#include "diffcomm/distributed/flight_recorder.hpp"
#include "diffcomm/tensor/error.hpp"
#include "scheduler.hpp"
#include "sim_backend.hpp"
#include "stacks.hpp"
#include "world_impl.hpp"

namespace diffcomm::sim {

using detail::RankState;
using detail::SharedDeadlock;

// ---------------------------------------------------------------- Rank
int Rank::world_size() const { return world_->impl_->options.ranks; }

dist::DeviceMesh Rank::mesh(dist::DeviceMesh::Dims dims) const {
  return dist::DeviceMesh(world_group_, std::move(dims));
}

double Rank::now_us() const {
  return world_->impl_->ranks[static_cast<std::size_t>(rank_)].clock_us;
}

void Rank::advance_us(double us) {
  if (us < 0) raise("advance_us", fmt::format("negative time {}", us));
  world_->impl_->ranks[static_cast<std::size_t>(rank_)].clock_us += us;
}

// ---------------------------------------------------------------- World
World::World(WorldOptions options) : impl_(std::make_unique<Impl>()) {
  if (options.ranks < 1 || options.ranks > kMaxRanks)
    raise("sim::World", fmt::format("ranks = {}, expected 1..{}", options.ranks, kMaxRanks));
  if (options.stack_size < 16 * 1024)
    raise("sim::World",
          fmt::format("stack_size = {} bytes, expected >= 16384", options.stack_size));
  if (options.fault && (options.fault->rank < 0 || options.fault->rank >= options.ranks ||
                        options.fault->at_call < 1))
    raise("sim::World",
          fmt::format("fault rank {} at call {} is invalid (rank in [0, {}), call >= 1)",
                      options.fault->rank, options.fault->at_call, options.ranks));
  if (options.cost.bandwidth_gbps <= 0 || options.cost.alpha_us < 0)
    raise("sim::World", "cost model needs alpha_us >= 0 and bandwidth_gbps > 0");
  impl_->options = options;
}

World::~World() {
  if (impl_) *impl_->running = false;  // handles still around refuse calls
}

const WorldOptions& World::options() const { return impl_->options; }
const std::vector<std::exception_ptr>& World::errors() const { return impl_->errors; }
const dist::Stats& World::stats(int rank) const {
  if (rank < 0 || rank >= static_cast<int>(impl_->ranks.size()))
    raise("World::stats", fmt::format("rank {} out of range (run() first?)", rank));
  return *impl_->ranks[static_cast<std::size_t>(rank)].stats;
}
const std::vector<TraceEvent>& World::trace() const { return impl_->expanded_trace(); }
uint64_t World::trace_hash() const { return impl_->trace_hash; }

double World::sim_time_us() const {
  double t = 0;
  for (const auto& r : impl_->ranks) t = std::max(t, r.clock_us);
  return t;
}

double World::rank_time_us(int rank) const {
  if (rank < 0 || rank >= static_cast<int>(impl_->ranks.size()))
    raise("World::rank_time_us", fmt::format("rank {} outside [0, {})", rank, impl_->ranks.size()));
  return impl_->ranks[static_cast<std::size_t>(rank)].clock_us;
}

const std::string& World::injected_fault() const { return impl_->injected_fault; }

std::vector<std::string> World::error_messages() const {
  std::vector<std::string> out;
  for (const auto& r : impl_->ranks) out.push_back(message_of(r));
  return out;
}

// ---------------------------------------------------------------- run
namespace {

// Refuses a run() from inside a fiber or while another thread is inside
// run(); on return this thread holds `in_run`.
void claim_run(std::atomic<bool>& in_run) {
  // Inside a fiber (a rank function of this or another World) Boost.Fiber
  // would abort on the nested scheduler switch: refuse before touching it.
  if (!boost::fibers::context::active()->is_context(boost::fibers::type::main_context))
    raise("sim::World::run",
          "called from inside a fiber (a rank function of a running World); "
          "run() must be called from a plain thread, and one World runs one run() at a time");
  // Claimed before anything of the World is read: a second thread gets here
  // only while the first is inside run().
  if (in_run.exchange(true))
    raise("sim::World::run",
          "this World is already running on another thread; one World runs one "
          "run() at a time (give each thread its own World)");
}

// Per-rank generator seed: a SplitMix64 step over (seed, rank).
uint64_t rank_seed(uint64_t seed, int r) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(r + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return z;
}

// How a rank function left: its exception (null on success) and message.
struct RankExit {
  std::exception_ptr error;
  std::shared_ptr<const std::string> message;
};

RankExit call_rank_function(const std::function<void(Rank&)>& fn, Rank& rank) {
  RankExit exit;
  try {
    fn(rank);
  } catch (const SharedDeadlock& e) {
    exit.error = std::current_exception();
    exit.message = e.report();  // shared with every other blocked rank
  } catch (const std::exception& e) {
    // Never block or yield inside a catch handler (Boost 1.74 loses
    // the exception state across a fiber switch): record and leave.
    exit.error = std::current_exception();
    exit.message = std::make_shared<const std::string>(e.what());
  } catch (...) {
    exit.error = std::current_exception();
    exit.message = std::make_shared<const std::string>("unknown exception");
  }
  // The rank's pending differentiable collectives (a failed or forward-only
  // rank) can never run now: forget them. Each holds its group, whose state
  // holds the cohort, so kept they would form a cycle and leak.
  rank.world().cohort()->discard();
  return exit;
}

// Allocated before any rank runs: the message of a rank whose setup failed
// for lack of memory cannot count on allocating its own.
const auto kSetupOutOfMemory = std::make_shared<const std::string>(
    "out of memory setting up the rank (its backend, flight recorder and world group) before "
    "its function ran");

// "could not set up the rank ...: <what>" (the report prefixes the rank),
// or the preallocated message when even that cannot be allocated. Never
// throws.
std::shared_ptr<const std::string> setup_failure_message(const std::exception_ptr& error) noexcept {
  try {
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      return std::make_shared<const std::string>(
          fmt::format("could not set up the rank before its function ran (its backend, flight "
                      "recorder and world group): {}",
                      e.what()));
    }
  } catch (...) {
  }
  return kSetupOutOfMemory;
}

// What World::run throws: the class of the first failure's kind with the
// run's failures added, so `catch (const Deadlock&)` (or any kind's class)
// and `catch (const RunFailures&)` both match it. The kind is chosen at run
// time through the one kind -> class mapping (visit_error_class).
template <class Kind>
class RunError final : public Kind, public RunFailures {
 public:
  RunError(ErrorSite site, std::string_view detail,
           std::shared_ptr<const std::vector<RankError>> failures)
      : Kind(std::move(site), detail), RunFailures(std::move(failures)) {}
};

// A failure's kind, site and detail: a diffcomm Error's own; the standard
// library's std::bad_alloc (the rank's own vectors, strings, maps) is
// ResourceExhausted; any other exception is a plain Error whose detail is
// its message.
struct Typed {
  ErrorKind kind = ErrorKind::Error;
  ErrorSite site;
  std::string detail;
};

Typed typed(const RankError& f) {
  try {
    std::rethrow_exception(f.error);
  } catch (const Error& e) {
    return {e.kind(), e.site(), std::string(e.detail())};
  } catch (const std::bad_alloc&) {
    return {ErrorKind::ResourceExhausted, {}, bad_alloc_detail(f.message())};
  } catch (...) {
    return {ErrorKind::Error, {}, f.message()};
  }
}

// Raises the run's failures as the first failure's kind, its message naming
// that rank (unless its site names it already) and then one line per other
// failed rank (a rank whose message is the first's shared report, e.g. a
// deadlock, is listed without repeating it).
[[noreturn]] void rethrow_named(std::shared_ptr<const std::vector<RankError>> failures,
                                const std::vector<const std::string*>& texts) {
  const RankError& first = failures->front();
  Typed lead = typed(first);
  if (!lead.site.global_rank) lead.site.global_rank = first.rank;
  if (failures->size() > 1) {
    lead.detail += fmt::format("\n{} ranks failed in this run (RunFailures::failures() has each):",
                               failures->size());
    for (std::size_t i = 0; i < failures->size(); ++i) {
      const RankError& f = (*failures)[i];
      if (i > 0 && texts[i] == texts[0]) {
        lead.detail += fmt::format("\n  rank {}: the same report", f.rank);
        continue;
      }
      const std::string& m = f.message();
      lead.detail += fmt::format("\n  rank {}: {}", f.rank, m.substr(0, m.find('\n')));
    }
  }
  visit_error_class(lead.kind, [&]<class Kind>(std::type_identity<Kind>) {
    throw RunError<Kind>(std::move(lead.site), lead.detail, std::move(failures));
  });
  std::abort();  // unreachable: the visit throws
}

}  // namespace

void World::Impl::reset_for_run(int n) {
  try {
    ranks.assign(static_cast<std::size_t>(n), RankState{});
    for (auto& rs : ranks) rs.stats = std::make_shared<dist::Stats>();  // one per rank, not shared
  } catch (const std::bad_alloc&) {
    std::vector<RankState>().swap(ranks);  // what was taken: the report needs some memory
    throw;
  }
  groups.clear();
  next_group_id = 0;  // group ids enter trace_hash(): same seed, same hash on every run
  pending.clear();
  trace_calls.clear();
  trace_members.clear();
  trace_names.clear();
  trace_expanded.clear();
  trace_stale = false;
  trace_hash = detail::kTraceHashSeed;
  live = n;
  blocked = 0;
  failures = 0;
  injected_fault.clear();
  errors.assign(static_cast<std::size_t>(n), nullptr);
}

void World::Impl::install_scheduler(int n) {
  algo = new detail::SeededAlgorithm(options.seed, options.schedule == Schedule::Random);
  boost::fibers::context::active()->get_scheduler()->set_algo(algo);  // takes ownership
  algo->set_ranks(n);
  // The caller's context takes its properties now, where running out of
  // memory is a report (set_up in run()); Boost would allocate them when a
  // rank first wakes it, on a noexcept path (std::terminate).
  boost::fibers::context* self = boost::fibers::context::active();
  if (self->get_properties() == nullptr) self->set_properties(new detail::FiberProps(self));
}

std::vector<boost::fibers::fiber> World::Impl::start_ranks(
    World* world, detail::Stacks& stacks, const std::function<void(Rank&)>& fn,
    const std::shared_ptr<SimGroup>& world_group) {
  const int n = options.ranks;
  std::vector<boost::fibers::fiber> fibers;
  fibers.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    fibers.emplace_back(std::allocator_arg, stacks.handout(r), [this, world, &fn, world_group, r] {
      run_rank(world, fn, world_group, r);
    });
    auto& props = fibers.back().properties<detail::FiberProps>();
    props.stack_bottom = static_cast<char*>(stacks[r].sp) - stacks[r].size;
    props.stack_size = stacks[r].size;
    props.rank = r;
  }
  return fibers;
}

void World::Impl::run_rank(World* world, const std::function<void(Rank&)>& fn,
                           const std::shared_ptr<SimGroup>& world_group, int r) {
  algo->on_resumed();
  RankState& state = ranks[static_cast<std::size_t>(r)];
  const dist::FlightRecorder* recorder_ptr = nullptr;
  std::unique_ptr<Rank> rank;  // (Rank's constructor is World's: no optional::emplace)
  RankExit exit;
  try {
    auto backend = std::make_shared<detail::SimBackend>(this, world_group, r, running);
    // The flight recorder reads the rank's simulated clock, not the
    // wall clock: deterministic, and free.
    auto recorder = std::make_shared<dist::FlightRecorder>(
        [](const void* s) { return static_cast<const RankState*>(s)->clock_us * 1e-6; }, &state);
    recorder_ptr = recorder.get();
    rank.reset(new Rank(world, r,
                        dist::ProcessGroup(backend, "world", state.stats, std::move(recorder)),
                        rank_seed(options.seed, r)));
  } catch (...) {
    // The rank's setup failed before its function ran (out of memory under
    // a limit): an exception must not leave the fiber (std::terminate), so
    // it is the rank's error like any of its function's. Nothing in a
    // handler may yield (Boost 1.74).
    exit.error = std::current_exception();
  }
  // What this rank touches first when resumed in a world-group call,
  // for the scheduler to prefetch. The fiber never returns to the
  // ready set once these objects die (it ends without yielding), so
  // no stale hint is read; withdrawing them anyway keeps that true
  // if the exit path ever yields.
  struct WithdrawHints {
    detail::SeededAlgorithm* algo;
    int rank;
    ~WithdrawHints() { algo->set_hints(rank, {}); }
  } withdraw_hints{algo, r};
  if (rank) {
    const auto group_hot = dist::detail::SchedulerAccess::hot_addresses(rank->world());
    algo->set_hints(r, {{group_hot[0], group_hot[1], &state}, recorder_ptr, state.stats.get()});
    exit = call_rank_function(fn, *rank);
  } else {
    exit.message = setup_failure_message(exit.error);
  }
  errors[static_cast<std::size_t>(r)] = exit.error;
  on_rank_exit(r, exit.error, std::move(exit.message));
  static_cast<detail::FiberProps*>(boost::fibers::context::active()->get_properties())
      ->terminating = true;
}

void World::Impl::join_ranks(std::vector<boost::fibers::fiber>& fibers) {
  for (auto& f : fibers) {
    f.join();
    algo->on_resumed();
  }
  // An ended fiber waits in Boost's terminated queue, with its stack and
  // properties, until Boost's dispatcher runs; the seeded algorithm always
  // has a ready fiber to hand over, so the dispatcher never ran and every run
  // kept all of its fibers (N stacks per run; the leak fuzz_plan_exchange
  // found). A zero sleep hands the main context to the dispatcher once,
  // which releases them before run() returns.
  fibers.clear();
  boost::this_fiber::sleep_for(std::chrono::seconds(0));
  algo->on_resumed();
}

// Reports every failure on the caller, the first (in failure order) leading.
void World::Impl::rethrow_failures() const {
  const int n = options.ranks;
  std::vector<int> failed;
  for (int r = 0; r < n; ++r)
    if (ranks[static_cast<std::size_t>(r)].error) failed.push_back(r);
  if (failed.empty()) return;
  std::sort(failed.begin(), failed.end(), [&](int a, int b) {
    return ranks[static_cast<std::size_t>(a)].failure_order <
           ranks[static_cast<std::size_t>(b)].failure_order;
  });
  auto failures = std::make_shared<std::vector<RankError>>();
  std::vector<const std::string*> texts;
  failures->reserve(failed.size());
  for (int r : failed) {
    const RankState& rs = ranks[static_cast<std::size_t>(r)];
    failures->push_back({r, rs.error, rs.error_message, rs.cause});
    texts.push_back(rs.error_message.get());
  }
  rethrow_named(std::move(failures), texts);
}

namespace {

// One step of a run's setup, before any rank runs: running out of memory
// there raises ResourceExhausted naming the step and the world's size (a
// report, as for the fiber stacks), not a bare std::bad_alloc.
template <class F>
void set_up(int n, const char* what, F&& step) {
  try {
    step();
  } catch (const std::bad_alloc&) {
    raise<ResourceExhausted>(
        "sim::World::run",
        fmt::format("cannot allocate {} of {} ranks: out of memory; use fewer ranks", what, n));
  }
}

}  // namespace

void World::run(const std::function<void(Rank&)>& fn) {
  Impl& w = *impl_;
  claim_run(w.in_run);
  struct LeaveRun {
    std::atomic<bool>& flag;
    ~LeaveRun() { flag = false; }
  } leave_run{w.in_run};
  const int n = w.options.ranks;
  detail::Stacks stacks(n, w.options.stack_size);  // before any state changes: may throw
  set_up(n, "the per-rank state", [&] { w.reset_for_run(n); });
  // A new flag per run: handles of an earlier run keep the old, false one.
  *w.running = false;
  w.running = std::make_shared<bool>(true);
  struct EndRun {  // the run is over however run() leaves
    bool& flag;
    ~EndRun() { flag = false; }
  } end_run{*w.running};
  set_up(n, "the scheduler", [&] { w.install_scheduler(n); });

  std::shared_ptr<detail::SimGroup> world_group;
  set_up(n, "the world group", [&] {
    std::vector<int> all(static_cast<std::size_t>(n));
    std::iota(all.begin(), all.end(), 0);
    world_group = w.make_group(all);
  });
  std::vector<boost::fibers::fiber> fibers = w.start_ranks(this, stacks, fn, world_group);
  w.join_ranks(fibers);
  w.rethrow_failures();
}

}  // namespace diffcomm::sim
