#pragma once
// Primitive collectives (no autograd). Every function funnels through one
// validated path (collectives.cpp): it checks its arguments locally and
// raises InvalidArgument *before* any communication, numbers the call,
// accounts its bytes in the group's Stats, and hands it to the backend.
//
// Conventions (NCCL / MPI communicators; torch.distributed's where noted):
//  - ranks (src, dst, root, peer) are group-local, as in NCCL and MPI. In
//    torch.distributed `src`/`dst` are GLOBAL ranks (group_src/group_dst are
//    the group-local ones): convert with ProcessGroup::global_rank/group_rank;
//  - tensors are written in place; outputs must be preallocated with the
//    documented shape, the inputs' dtype and device;
//  - "rows" means dim 0; splits count rows, may be zero, and must agree
//    across ranks (input_splits[j] on rank i == output_splits[i] on rank j);
//
// One semantics on every backend (docs/semantics.md, "Semantics"):
//  - reductions: dist::reduce_into over the contributions in group-rank
//    order; bfloat16/float16 accumulate in float32 and round once; Avg is
//    that sum divided once by N; Max/Min propagate NaN; integers wrap.
//    Production backends compose it from data movement (dist/backend/composed.hpp)
//    unless Options::native_reduction, so results are bit-identical to the
//    simulated world;
//  - aliasing: an input overlapping an output of the same call is staged
//    (copied) first, so every call reads its inputs as they were when called
//    (all_reduce, broadcast and reduce are in place by definition);
//  - agreement: members must pass the same op, dtype, shapes, root, reduce
//    op and agreeing splits. The simulated world always checks; MPI and
//    NCCL check in checked mode (Options::check, DIFFCOMM_CHECK; on in Debug
//    builds); otherwise a disagreement is undefined there, as with raw
//    MPI/NCCL.
// Errors: InvalidArgument (local checks, before any communication),
// CollectiveMismatch (on every member), Deadlock / RankFailure (simulated
// world), Timeout (production: a peer never arrived within
// Options::timeout_s), BackendError (transport).
#include <cstdint>
#include <memory>
#include <vector>

#include "diffcomm/distributed/caller.hpp"
#include "diffcomm/distributed/group.hpp"
#include "diffcomm/distributed/reduce_op.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::dist {

using Splits = std::vector<int64_t>;

/// Returns once every member has entered.
void barrier(const ProcessGroup& group, Caller caller = Caller::here());

/// tensor <- reduce over members of tensor (any shape). In place.
void all_reduce(const ProcessGroup& group, const Tensor& tensor, ReduceOp op = ReduceOp::Sum,
                Caller caller = Caller::here());

/// output <- reduce over members of input; input is left unchanged. The
/// result is bit-identical to copying input into output and calling
/// all_reduce(group, output, op), and the call is the same all_reduce to
/// every check (fingerprint, checked mode, flight recorder, stats). Shapes:
/// output has input's shape, dtype and device; output may be input itself
/// (then this is all_reduce). Cost: where the backend reduces out of place
/// (Backend::all_reduce_out_of_place: the composed deterministic reductions,
/// the simulated world) input is read directly; otherwise (native_reduction
/// over MPI/NCCL/torch) input is copied into output first. An output sharing
/// only some bytes with input gets input's values as they were at the call.
/// Throws InvalidArgument naming op, rank and group for a shape, dtype or
/// device mismatch.
void all_reduce_into(const ProcessGroup& group, const Tensor& output, const Tensor& input,
                     ReduceOp op = ReduceOp::Sum, Caller caller = Caller::here());

/// tensor <- tensor of member src. In place; shapes must agree.
void broadcast(const ProcessGroup& group, const Tensor& tensor, int src,
               Caller caller = Caller::here());

/// On dst, tensor <- reduce over members; on other ranks tensor is left
/// unchanged (the differentiable nn::reduce defines it as zeros there).
void reduce(const ProcessGroup& group, const Tensor& tensor, int dst, ReduceOp op = ReduceOp::Sum,
            Caller caller = Caller::here());

/// outputs[s] <- input of member s. outputs.size() == size(), each with
/// input's shape.
void all_gather(const ProcessGroup& group, const std::vector<Tensor>& outputs, const Tensor& input,
                Caller caller = Caller::here());

/// output [size()*R, ...] <- inputs [R, ...] of every member concatenated in
/// rank order (torch all_gather_into_tensor).
void all_gather_single(const ProcessGroup& group, const Tensor& output, const Tensor& input,
                       Caller caller = Caller::here());

/// output [sum(output_splits), ...] <- concatenation of the inputs; member s
/// contributes output_splits[s] rows (so input rows == output_splits[rank]).
/// output_splits must be equal on every rank.
void all_gather_v(const ProcessGroup& group, const Tensor& output, const Tensor& input,
                  const Splits& output_splits, Caller caller = Caller::here());

/// On dst: outputs[s] <- input of member s (outputs.size() == size(), each with
/// input's shape). Other ranks pass an empty outputs list.
void gather(const ProcessGroup& group, const std::vector<Tensor>& outputs, const Tensor& input,
            int dst, Caller caller = Caller::here());

/// output <- inputs[rank] of src. On src inputs.size() == size(), each with
/// output's shape; other ranks pass an empty inputs list.
void scatter(const ProcessGroup& group, const Tensor& output, const std::vector<Tensor>& inputs,
             int src, Caller caller = Caller::here());

/// output <- reduce over members s of inputs[rank] of s. inputs.size() ==
/// size(), each with output's shape.
void reduce_scatter(const ProcessGroup& group, const Tensor& output,
                    const std::vector<Tensor>& inputs, ReduceOp op = ReduceOp::Sum,
                    Caller caller = Caller::here());

/// input [size()*R, ...], output [R, ...]: output <- reduce over members of
/// their rows [rank*R, (rank+1)*R) (torch reduce_scatter_tensor).
void reduce_scatter_single(const ProcessGroup& group, const Tensor& output, const Tensor& input,
                           ReduceOp op = ReduceOp::Sum, Caller caller = Caller::here());

/// input [sum(input_splits), ...] cut into size() row blocks by input_splits;
/// output [input_splits[rank], ...] <- reduce over members of block `rank`.
/// input_splits must be equal on every rank.
void reduce_scatter_v(const ProcessGroup& group, const Tensor& output, const Tensor& input,
                      const Splits& input_splits, ReduceOp op = ReduceOp::Sum,
                      Caller caller = Caller::here());

/// outputs[s] <- inputs[rank] of member s. Both lists have size() entries;
/// outputs[s] on r must have the shape of inputs[r] on s.
void all_to_all(const ProcessGroup& group, const std::vector<Tensor>& outputs,
                const std::vector<Tensor>& inputs, Caller caller = Caller::here());

/// Rows routed by splits (torch all_to_all_single): input is cut into blocks
/// of input_splits[j] rows, block j going to member j; output is the
/// concatenation of the blocks received, output_splits[s] rows from member s.
/// Empty splits mean even blocks (rows divisible by size()). Requires
/// input_splits[j] on rank i == output_splits[i] on rank j.
void all_to_all_single(const ProcessGroup& group, const Tensor& output, const Tensor& input,
                       const Splits& output_splits = {}, const Splits& input_splits = {},
                       Caller caller = Caller::here());

/// Sends tensor to member dst (blocks until matched by a recv). dst != rank.
void send(const ProcessGroup& group, const Tensor& tensor, int dst, int tag = 0,
          Caller caller = Caller::here());
/// Receives into tensor from member src (same shape and dtype as sent).
void recv(const ProcessGroup& group, const Tensor& tensor, int src, int tag = 0,
          Caller caller = Caller::here());

namespace detail {
/// The funnel's entry for ProcessGroup::split/new_group (users call those).
/// members_are_ranks: `fingerprint` is new_group's rank list (for reports).
std::shared_ptr<Backend> split_backend(const ProcessGroup& group, int color, int key,
                                       const std::vector<int64_t>& fingerprint,
                                       bool members_are_ranks = false,
                                       Caller caller = Caller::here());
}  // namespace detail

/// Even split of `rows` into `parts` blocks; throws InvalidArgument (naming
/// `op`) when rows is not divisible.
Splits even_splits(int64_t rows, int parts, const char* op);

}  // namespace diffcomm::dist
