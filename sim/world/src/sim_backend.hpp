// SimBackend: the dist::Backend of the simulated world. One handle per
// (rank, group); every primitive goes to World::Impl (rendezvous.cpp).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "diffcomm/distributed/backend.hpp"
#include "diffcomm/sim/world.hpp"
#include "rendezvous.hpp"

namespace diffcomm::sim::detail {

class SimBackend final : public dist::Backend {
 public:
  SimBackend(World::Impl* world, std::shared_ptr<SimGroup> group, int slot,
             std::shared_ptr<const bool> running)
      : world_(world), group_(std::move(group)), slot_(slot), running_(std::move(running)) {}

  std::string backend_name() const override { return "sim"; }
  int rank() const override { return slot_; }
  int size() const override { return static_cast<int>(group_->members.size()); }
  int global_rank(int r) const override { return group_->members[static_cast<std::size_t>(r)]; }
  bool supports(const Device& d) const override { return d.is_cpu(); }
  /// move_all_reduce reads every member's inputs[0] and writes its outputs[0].
  bool all_reduce_out_of_place() const override { return true; }
  /// move_all_to_all_single and move_all_gather_v skip a member's own block
  /// on its Call::own_block_placed.
  bool skips_own_block() const override { return true; }

  // O(1): the run flag, and the rank of the running fiber (its properties)
  // against this handle's owner. Touches nothing of the World unless its run
  // is still going (the World may be gone).
  void check_caller(const dist::Call& call) const override;

  std::shared_ptr<dist::Backend> split(dist::Call& call, int, int) override;
  void barrier(dist::Call& c) override;
  void all_reduce(dist::Call& c) override;
  void broadcast(dist::Call& c) override;
  void reduce(dist::Call& c) override;
  void all_gather(dist::Call& c) override;
  void all_gather_single(dist::Call& c) override;
  void all_gather_v(dist::Call& c) override;
  void gather(dist::Call& c) override;
  void scatter(dist::Call& c) override;
  void reduce_scatter(dist::Call& c) override;
  void reduce_scatter_single(dist::Call& c) override;
  void reduce_scatter_v(dist::Call& c) override;
  void all_to_all(dist::Call& c) override;
  void all_to_all_single(dist::Call& c) override;
  void send(dist::Call& c) override;
  void recv(dist::Call& c) override;

 private:
  World::Impl* world_;
  std::shared_ptr<SimGroup> group_;
  int slot_;
  std::shared_ptr<const bool> running_;  // false once the run that made this handle ended
  std::map<std::tuple<int, int, int>, uint64_t> p2p_counters_;  // (src, dst, tag) -> n
};

}  // namespace diffcomm::sim::detail
