#pragma once
// ForwardingBackend: the base of every decorator over a dist::Backend
// (checked mode, composed reductions, the threaded world's baton). It
// forwards the handle's identity (name, ranks, devices, caller check) to the
// backend it wraps and sends every primitive through one virtual, forward(),
// so a decorator states its rule once instead of in sixteen overrides (the
// shape of c10d's ProcessGroupWrapper).
#include <memory>
#include <string>

#include "diffcomm/distributed/backend.hpp"

namespace diffcomm::dist {

class ForwardingBackend : public Backend {
 public:
  /// Throws InvalidArgument for a null `inner`.
  explicit ForwardingBackend(std::shared_ptr<Backend> inner);

  std::string backend_name() const override { return inner_->backend_name(); }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  int global_rank(int group_rank) const override { return inner_->global_rank(group_rank); }
  bool supports(const Device& device) const override { return inner_->supports(device); }
  void check_caller(const Call& call) const override { inner_->check_caller(call); }
  bool announce_refusal(const Call& call, const std::string& error) override {
    return inner_->announce_refusal(call, error);
  }
  bool all_reduce_out_of_place() const override { return inner_->all_reduce_out_of_place(); }
  bool skips_own_block() const override { return inner_->skips_own_block(); }
  void run_composed(Call& call, const std::function<void()>& steps) override {
    inner_->run_composed(call, steps);
  }

  /// The backend this one wraps.
  Backend& inner() const { return *inner_; }
  /// The innermost backend: the transport under every decorator.
  Backend& transport() const;

  /// The inner backend's split, wrapped again by rewrap() (null stays null:
  /// this member is in no new group). A decorator whose split needs more
  /// (CheckedBackend splits its control backend too) overrides split instead.
  std::shared_ptr<Backend> split(Call& call, int color, int key) override;

  void barrier(Call& c) final { forward(c); }
  void all_reduce(Call& c) final { forward(c); }
  void broadcast(Call& c) final { forward(c); }
  void reduce(Call& c) final { forward(c); }
  void all_gather(Call& c) final { forward(c); }
  void all_gather_single(Call& c) final { forward(c); }
  void all_gather_v(Call& c) final { forward(c); }
  void gather(Call& c) final { forward(c); }
  void scatter(Call& c) final { forward(c); }
  void reduce_scatter(Call& c) final { forward(c); }
  void reduce_scatter_single(Call& c) final { forward(c); }
  void reduce_scatter_v(Call& c) final { forward(c); }
  void all_to_all(Call& c) final { forward(c); }
  void all_to_all_single(Call& c) final { forward(c); }
  void send(Call& c) final { forward(c); }
  void recv(Call& c) final { forward(c); }

 protected:
  /// The decorator's rule for every primitive (call.op says which). Default:
  /// inner().run(call).
  virtual void forward(Call& call) { inner_->run(call); }
  /// This decorator around `inner_split`, a group split from inner(). The
  /// default throws Error: a decorator overrides rewrap() or split().
  virtual std::shared_ptr<Backend> rewrap(std::shared_ptr<Backend> inner_split);

 private:
  std::shared_ptr<Backend> inner_;
};

/// The transport under `backend`'s decorators (`backend` itself when it is
/// not a ForwardingBackend).
Backend& transport_of(Backend& backend);

}  // namespace diffcomm::dist
