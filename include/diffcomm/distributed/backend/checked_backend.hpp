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

#include "diffcomm/distributed/backend/forwarding.hpp"

namespace diffcomm::dist {

class CheckedBackend final : public ForwardingBackend {
 public:
  /// `inner` moves the data; `control` (same members, same order, separate
  /// communicator) carries fingerprints as int64 tensors on `control_device`.
  /// Throws InvalidArgument for a null backend or a control backend with
  /// other members.
  CheckedBackend(std::shared_ptr<Backend> inner, std::shared_ptr<Backend> control,
                 Device control_device);

  /// Checks the split call, then splits the data and the control backends.
  std::shared_ptr<Backend> split(Call& call, int color, int key) override;
  /// Takes part in the members' fingerprint exchange with a refusal (a
  /// fingerprint no call has) and the error in its description: every peer
  /// raises CollectiveMismatch "rank R (global G) refused its own call ...:
  /// <error>". send/recv: nothing (their checks are pairwise; false).
  bool announce_refusal(const Call& call, const std::string& error) override;

 protected:
  /// Collectives: the fingerprint check, then inner(). send/recv: the
  /// envelope exchange, then inner().
  void forward(Call& call) override;

 private:
  // Raises CollectiveMismatch on every member unless all fingerprints agree.
  void check(const Call& call);
  // The members' agreement on `call` ("" when every fingerprint agrees, else
  // the report); `refused` non-empty: this member refuses the call with it.
  std::string agree(const Call& call, const std::string& refused);
  void check_send(const Call& call);
  void check_recv(const Call& call);
  std::shared_ptr<Backend> control_;
  Device device_;
};

}  // namespace diffcomm::dist
