#pragma once
// Backend: what a transport (sim, mpi, nccl) implements — one virtual per
// primitive collective, each receiving a Call that the funnel has already
// validated, numbered and accounted. Backends never validate arguments again
// and never know about autograd (the pattern of c10d's Backend).
//
// The funnel enters a backend through run() (split for new groups), the one
// dispatch from Call::op to the primitive. Cross-cutting layers (checked
// mode, composed reductions, the threaded world's baton) are decorators
// built on dist/backend/forwarding.hpp; dist/backend/layers.hpp stacks them
// over a production transport in one fixed order.
#include <functional>
#include <memory>
#include <string>

#include "diffcomm/distributed/backend/call.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::dist {

class Backend {
 public:
  virtual ~Backend() = default;

  /// "sim", "mpi", "nccl".
  virtual std::string backend_name() const = 0;
  /// This process's group-local rank and the group size.
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// Global (world) rank of a member given its group-local rank.
  virtual int global_rank(int group_rank) const = 0;
  /// Whether tensors on this device can be communicated.
  virtual bool supports(const Device& device) const = 0;
  /// Whether the calling context may use this handle now; throws a
  /// diffcomm::Error saying why not. The funnel calls it first, before a
  /// call is numbered, so a refused call leaves no trace on the group. The
  /// simulated world refuses a handle used by another rank's fiber (it is
  /// per rank) and one whose world run has ended. Default: always usable.
  virtual void check_caller(const Call& call) const { (void)call; }
  /// This rank refuses its own collective `call` (the funnel's local
  /// validation failed with `error`, e.g. input_splits wrong on this rank
  /// alone): a backend whose members agree on every call before moving data
  /// (checked mode, dist::CheckedBackend) takes part in that agreement with
  /// the error instead of the call, so the peers raise CollectiveMismatch
  /// naming this rank and its error at once instead of waiting for their
  /// deadline. Returns whether it did (the funnel then numbers the refused
  /// call, as the peers numbered theirs, so the group's numbering stays
  /// aligned); the caller raises its own InvalidArgument afterwards,
  /// whatever this throws. Default: false (nothing to announce to).
  virtual bool announce_refusal(const Call& call, const std::string& error) {
    (void)call;
    (void)error;
    return false;
  }

  /// Whether all_reduce() accepts a call whose outputs[0] is not its
  /// inputs[0] (dist::all_reduce_into; the two then share no byte). Default
  /// false: the funnel copies the input into the output and sends an
  /// in-place call.
  virtual bool all_reduce_out_of_place() const { return false; }

  /// Whether all_to_all_single() and all_gather_v() honour
  /// Call::own_block_placed (skip the own block's copy). Default false: a
  /// composed reduction then copies as with any transport.
  virtual bool skips_own_block() const { return false; }

  /// Runs `call` on the primitive call.op names (the one dispatch; a
  /// decorator forwards a call with it). Throws InvalidArgument for
  /// OpType::NewGroup, which returns a backend: use split().
  void run(Call& call);

  /// Runs `steps`, the transport steps of one user op composed from several
  /// primitives of this backend (dist/backend/composed.hpp), inside the op
  /// context the transport keeps per user op: NCCL makes its device and
  /// stream current and orders the whole composition with the caller's
  /// current stream once. Default: just steps().
  virtual void run_composed(Call& call, const std::function<void()>& steps) {
    (void)call;
    steps();
  }

  /// Collective over this group, like MPI_Comm_split: members passing the
  /// same color >= 0 form a new group ordered by key; color < 0 gets null.
  /// call.output_splits is the fingerprint every member must agree on.
  virtual std::shared_ptr<Backend> split(Call& call, int color, int key) = 0;

  virtual void barrier(Call& call) = 0;
  virtual void all_reduce(Call& call) = 0;
  virtual void broadcast(Call& call) = 0;
  virtual void reduce(Call& call) = 0;
  virtual void all_gather(Call& call) = 0;
  virtual void all_gather_single(Call& call) = 0;
  virtual void all_gather_v(Call& call) = 0;
  virtual void gather(Call& call) = 0;
  virtual void scatter(Call& call) = 0;
  virtual void reduce_scatter(Call& call) = 0;
  virtual void reduce_scatter_single(Call& call) = 0;
  virtual void reduce_scatter_v(Call& call) = 0;
  virtual void all_to_all(Call& call) = 0;
  virtual void all_to_all_single(Call& call) = 0;
  virtual void send(Call& call) = 0;
  virtual void recv(Call& call) = 0;
};

}  // namespace diffcomm::dist
