#pragma once
// Deterministic reductions composed from data movement, for the production
// backends (MPI, NCCL). The transport only moves bytes; every element is
// reduced by dist::reduce_into over the members' contributions in group-rank
// order (16-bit types accumulate in float32 and round once; Avg divides the
// sum by N once), exactly as the simulated world reduces — so results are
// bit-identical to the simulated world whatever the transport's algorithm.
//
//  reduce_scatter*: all_to_all_single of the blocks, then a local
//                   rank-ordered accumulation of the N received blocks.
//                   Bytes sent per rank: (N-1)/N of the input, as a ring.
//  all_reduce:      the above on even blocks of the flat tensor, then
//                   all_gather_v of the reduced blocks: 2(N-1)/N of the
//                   tensor, as a ring all-reduce.
//  reduce:          the above, then each reduced block goes to dst only.
//
// Each function takes the funnel-validated Call of the user's op and issues
// the steps through the same backend's all_to_all_single / all_gather_v
// (steps carry Call::part_of for messages). ComposedReductions is the
// decorator that routes a transport's five reductions here, so a transport
// implements its native reductions only.
//
// Over a transport whose skips_own_block() is true (MPI, the simulated
// world), the steps carry Call::own_block_placed: a member's own block is
// reduced from where it lies in the input (one memcpy of 1/N of the input
// less), and all_reduce writes its reduced block straight into its place in
// the output and gathers from there (one more memcpy and the 1/N scratch
// block less). Same operands, same order: the same bits either way.
#include "diffcomm/distributed/backend/forwarding.hpp"

namespace diffcomm::dist {

/// Decorator: all_reduce, reduce, reduce_scatter, reduce_scatter_single and
/// reduce_scatter_v become the compositions below over inner()'s
/// all_to_all_single / all_gather_v, inside inner().run_composed(); every
/// other primitive goes to inner() unchanged. dist::stack_layers puts it
/// over MPI and NCCL unless Options::native_reduction.
class ComposedReductions final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  /// The composition reads inputs[0] and writes outputs[0].
  bool all_reduce_out_of_place() const override { return true; }

 protected:
  void forward(Call& call) override;
  std::shared_ptr<Backend> rewrap(std::shared_ptr<Backend> inner_split) override;
};

void composed_all_reduce(Backend& backend, Call& call);
void composed_reduce(Backend& backend, Call& call);
void composed_reduce_scatter(Backend& backend, Call& call);
void composed_reduce_scatter_single(Backend& backend, Call& call);
void composed_reduce_scatter_v(Backend& backend, Call& call);

/// alpha x t as a new tensor with no autograd history (diffcomm::scale of
/// t.detach(), on the current stream for CUDA tensors): the backends' Avg
/// emulation (Sum, then 1/N) and PremulSum input, without the autograd layer.
Tensor scaled(const Tensor& t, double alpha);

}  // namespace diffcomm::dist
