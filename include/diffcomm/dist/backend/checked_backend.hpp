#pragma once
// CheckedBackend: a decorator over any production backend that checks, before
// every call, that all members issue the same collective with agreeing
// arguments (the idea of c10d's ProcessGroupWrapper). It exchanges a
// fixed-size dist::Fingerprint per member on its own control backend (a
// duplicate communicator, so user traffic and checks never interleave); all
// members see the same fingerprints, so all reach the same verdict: either
// every member proceeds, or every member raises CollectiveMismatch with the
// report of dist::compare (the simulated world's words). send/recv exchange
// an envelope (dtype and shape) and an acknowledgement first; a disagreement
// raises CollectiveMismatch on both ends and moves no payload.
//
// Cost: one small all_gather (kFingerprintWords int64 per member) per call on
// the control backend, plus two small messages per send/recv; see
// bench/RESULTS.md. Enabled by dist::Options::check / DIFFCOMM_CHECK.
#include <memory>

#include "diffcomm/dist/backend.hpp"

namespace diffcomm::dist {

class CheckedBackend final : public Backend {
 public:
  /// `inner` moves the data; `control` (same members, same order, separate
  /// communicator) carries fingerprints as int64 tensors on `control_device`.
  CheckedBackend(std::shared_ptr<Backend> inner, std::shared_ptr<Backend> control,
                 Device control_device);

  std::string backend_name() const override { return inner_->backend_name(); }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  int global_rank(int group_rank) const override { return inner_->global_rank(group_rank); }
  bool supports(const Device& device) const override { return inner_->supports(device); }
  void check_caller(const Call& call) const override { inner_->check_caller(call); }
  /// The wrapped backend (what moves the data).
  Backend& inner() const { return *inner_; }

  std::shared_ptr<Backend> split(Call& call, int color, int key) override;
  void barrier(Call& call) override;
  void all_reduce(Call& call) override;
  void broadcast(Call& call) override;
  void reduce(Call& call) override;
  void all_gather(Call& call) override;
  void all_gather_single(Call& call) override;
  void all_gather_v(Call& call) override;
  void gather(Call& call) override;
  void scatter(Call& call) override;
  void reduce_scatter(Call& call) override;
  void reduce_scatter_single(Call& call) override;
  void reduce_scatter_v(Call& call) override;
  void all_to_all(Call& call) override;
  void all_to_all_single(Call& call) override;
  void send(Call& call) override;
  void recv(Call& call) override;

 private:
  // Raises CollectiveMismatch on every member unless all fingerprints agree.
  void check(const Call& call);
  std::shared_ptr<Backend> inner_;
  std::shared_ptr<Backend> control_;
  Device device_;
};

}  // namespace diffcomm::dist
