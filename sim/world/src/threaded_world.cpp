#include "diffcomm/sim/threaded_world.hpp"

#include <fmt/format.h>

#include <atomic>
#include <mutex>
#include <optional>

#include "cpu_pin.hpp"
#include "diffcomm/distributed/backend/forwarding.hpp"
#include "diffcomm/tensor/error.hpp"
#include "rank_channel.hpp"

namespace diffcomm::sim {

// ---------------------------------------------------------------- backend
namespace {

// The rank thread's view of one simulated group: every primitive is executed
// on the world's thread through the channel, by the world's own backend.
// The group's identity is copied at creation: the world's backend dies with
// World::run, and a handle kept past its rank's end must still answer its
// rank and size and then refuse the call (check_caller), not read freed
// memory.
class BatonBackend final : public dist::ForwardingBackend {
 public:
  BatonBackend(std::shared_ptr<void> keep_alive, std::shared_ptr<detail::RankChannel> channel,
               std::shared_ptr<dist::Backend> real)
      : ForwardingBackend(real),
        keep_alive_(std::move(keep_alive)),
        channel_(std::move(channel)),
        name_(real->backend_name()),
        rank_(real->rank()),
        cpu_(real->supports(Device::cpu())),
        out_of_place_(real->all_reduce_out_of_place()),
        skips_own_block_(real->skips_own_block()) {
    for (int r = 0; r < real->size(); ++r) global_.push_back(real->global_rank(r));
  }

  std::string backend_name() const override { return name_; }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(global_.size()); }
  int global_rank(int group_rank) const override {
    return global_.at(static_cast<std::size_t>(group_rank));
  }
  bool supports(const Device& d) const override { return d.is_cpu() && cpu_; }
  bool all_reduce_out_of_place() const override { return out_of_place_; }
  bool skips_own_block() const override { return skips_own_block_; }

  // The rank thread is not a fiber of the world: the simulated handle's
  // caller check (which fiber runs) applies on the world's thread, where
  // the call is executed. Here: the rank's own thread, before its end.
  void check_caller(const dist::Call&) const override { channel_->check_usable(); }

  std::shared_ptr<dist::Backend> split(dist::Call& call, int color, int key) override {
    std::shared_ptr<dist::Backend> out;
    channel_->call([&] { out = inner().split(call, color, key); });
    if (!out) return nullptr;
    return std::make_shared<BatonBackend>(keep_alive_, channel_, std::move(out));
  }

 protected:
  void forward(dist::Call& c) override {
    channel_->call([&] { inner().run(c); });
  }

 private:
  std::shared_ptr<void> keep_alive_;  // the world's state (not its per-run backends)
  std::shared_ptr<detail::RankChannel> channel_;
  std::string name_;
  int rank_;
  bool cpu_, out_of_place_, skips_own_block_;
  std::vector<int> global_;
};

}  // namespace

// ---------------------------------------------------------------- world
struct ThreadedWorldState {
  explicit ThreadedWorldState(WorldOptions o) : world(std::move(o)) {}
  World world;
  int cpu = -1;  // CpuPlacement::OneCpu: the CPU every thread is pinned to
  std::atomic<bool> ran{false};
  std::vector<std::shared_ptr<detail::RankChannel>> channels;
  // Each rank thread's pinning, touched only by that thread (start, finish).
  std::vector<detail::CpuPin> pins;
  // Filled by each proxy fiber before it hands the baton over.
  std::vector<std::optional<dist::ProcessGroup>> groups;
  std::mutex mutex;
};

ThreadedWorld::ThreadedWorld(WorldOptions options, CpuPlacement placement)
    : state_(std::make_shared<ThreadedWorldState>(std::move(options))) {
  const auto n = static_cast<std::size_t>(state_->world.options().ranks);
  for (std::size_t r = 0; r < n; ++r)
    state_->channels.push_back(std::make_shared<detail::RankChannel>());
  state_->groups.resize(n);
  state_->pins.resize(n);
  if (placement == CpuPlacement::OneCpu) state_->cpu = detail::current_cpu();
}

ThreadedWorld::~ThreadedWorld() = default;

int ThreadedWorld::running_rank() const {
  for (std::size_t r = 0; r < state_->channels.size(); ++r)
    if (state_->channels[r]->running()) return static_cast<int>(r);
  return -1;
}

int ThreadedWorld::cpu() const { return state_->cpu; }
int ThreadedWorld::size() const { return state_->world.options().ranks; }
const World& ThreadedWorld::world() const { return state_->world; }
std::vector<std::string> ThreadedWorld::error_messages() const {
  return state_->world.error_messages();
}

dist::ProcessGroup ThreadedWorld::start(int rank) {
  if (rank < 0 || rank >= size())
    raise("ThreadedWorld::start", fmt::format("rank {} outside [0, {})", rank, size()));
  const auto slot = static_cast<std::size_t>(rank);
  auto& pin = state_->pins[slot];
  pin.pin(state_->cpu);
  try {
    state_->channels[slot]->wait_start();
  } catch (...) {
    pin.restore();  // the world never ran this rank: finish() will not be called
    throw;
  }
  std::lock_guard lock(state_->mutex);
  return *state_->groups[static_cast<std::size_t>(rank)];
}

void ThreadedWorld::finish(int rank, std::string failure) {
  if (rank < 0 || rank >= size())
    raise("ThreadedWorld::finish", fmt::format("rank {} outside [0, {})", rank, size()));
  {
    // As sim::World does when a rank function returns: its pending
    // differentiable collectives can never run (kept, they would hold their
    // group, whose state holds the cohort: a cycle).
    std::lock_guard lock(state_->mutex);
    auto& group = state_->groups[static_cast<std::size_t>(rank)];
    if (group) group->cohort()->discard();
  }
  state_->pins[static_cast<std::size_t>(rank)].restore();
  state_->channels[static_cast<std::size_t>(rank)]->finish(std::move(failure));
}

void ThreadedWorld::run() {
  auto state = state_;
  if (state->ran.exchange(true))
    raise("ThreadedWorld::run", "this world already ran (run() is called once)");
  const detail::ScopedCpuPin pin(state->cpu);  // the world's thread shares the ranks' CPU
  // A rank's group holds its baton backend, which holds the state, which
  // holds the group: once the world ended, the state lets go of the groups
  // (handles the rank threads still hold keep what they need alive).
  auto release_groups = [&] {
    std::lock_guard lock(state->mutex);
    for (auto& g : state->groups) g.reset();
  };
  try {
    state->world.run([state](Rank& r) {
      const auto slot = static_cast<std::size_t>(r.rank());
      const dist::ProcessGroup& world_group = r.world();
      // Non-owning handles into the world, kept valid by `state`.
      std::shared_ptr<dist::Backend> real(state, &world_group.backend());
      std::shared_ptr<dist::Stats> stats(state, &world_group.stats());
      // The rank's simulated-world recorder (small, its simulated clock),
      // not a production one (DIFFCOMM_FR_SIZE entries per rank).
      std::shared_ptr<dist::FlightRecorder> recorder(state, &world_group.flight_recorder());
      {
        std::lock_guard lock(state->mutex);
        state->groups[slot] = dist::ProcessGroup(
            std::make_shared<BatonBackend>(state, state->channels[slot], std::move(real)),
            world_group.name(), std::move(stats), std::move(recorder));
      }
      state->channels[slot]->serve();
    });
  } catch (const RunFailures&) {
    // Every rank's error is in error_messages(); the rank threads saw theirs.
  } catch (const Error& e) {
    // The world itself could not run (no rank ran: e.g. its fiber stacks
    // could not be allocated): release the rank threads, then raise.
    release_groups();
    cancel(fmt::format("diffcomm.sim: the world could not run: {}", e.what()));
    throw;
  }
  release_groups();
  cancel("diffcomm.sim: the world ended before this rank ran");
}

void ThreadedWorld::cancel(const std::string& why) {
  for (auto& ch : state_->channels) ch->abort(why);
}

}  // namespace diffcomm::sim
