#pragma once
// Differentiable collectives, written once above the dist::Backend interface,
// so the same forward and adjoint run on sim, mpi and nccl.
//
// Every op is a linear map for Sum/Avg/PremulSum and its backward is the exact adjoint
// (DESIGN.md table): summed over ranks, <A x, y> = <x, A^T y>.
//
// Rules every caller must follow (as with torch.distributed.nn):
//  - Ranks (src, dst) are group-local.
//  - Every member calls the op, with inputs that agree on requires_grad, so
//    every member records the node and runs the backward collective. A rank
//    with nothing to send passes a zero-row tensor that still carries an
//    edge (cat_or_empty) and still calls backward (with zero gradients if it
//    has no loss term).
//  - Outputs a rank does not own (non-root outputs of reduce and gather) are
//    defined as zeros and carry no gradient.
// Outputs are new tensors (above 64 KiB from the host block cache, see
// tensor.hpp). The in-place forms are the non-differentiable primitives
// themselves: dist::all_reduce and dist::broadcast (diffcomm.torch's
// all_reduce_ / broadcast_), with the same bits as these ops.
// Errors: InvalidArgument for bad arguments (before any communication),
// plus whatever the backend raises (see dist/collectives.hpp).
// Call sites: every op takes a defaulted `caller` (dist/caller.hpp), the
// line that called the op; every collective its forward and backward make
// records it, so reports name the user's line, not this library's.
#include <vector>

#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/distributed/group.hpp"
#include "diffcomm/distributed/reduce_op.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::nn {

using dist::ProcessGroup;
using dist::ReduceOp;
using dist::Splits;

/// Gradient convention of a gather into receivers.
///  - Partial (default): the mathematical adjoint — each receiver holds a
///    partial gradient, backward reduce-scatters (sums) them.
///  - Replicated: receivers are replicas whose gradients are already
///    complete and equal (TP ranks without SP after Megatron's input-grad
///    all-reduce); backward keeps this rank's own slice of its own gradient,
///    no communication. Summing would count the gradient size() times.
enum class GatherGrad { Partial, Replicated };

/// y = reduce over members of x (any shape), on every rank.
/// Sum: dx = all_reduce(g, Sum). Avg: dx = all_reduce(g, Avg).
/// premul_sum(f): dx = all_reduce(g, premul_sum(f)) = f * sum_s g_s.
/// Max/Min: the summed output gradient goes to the rank(s) holding the
/// extremum, split evenly among ties (k ranks tied -> each gets G/k), per
/// element. A NaN result (Max/Min propagate NaN) is held by every rank whose
/// element is NaN: G is split evenly among those ranks, the others get 0.
/// Product: dx_r = (sum_s g_s) * prod_{s != r} x_s, exact when some
/// x_s are zero. Max/Min/Product backward runs on CPU tensors.
Tensor all_reduce(const Tensor& x, const ProcessGroup& group, ReduceOp op = ReduceOp::Sum,
                  dist::Caller caller = dist::Caller::here());

/// y = x of src on every rank. dx = sum of g over members on src, zeros
/// elsewhere (a reduce to src).
Tensor broadcast(const Tensor& x, int src, const ProcessGroup& group,
                 dist::Caller caller = dist::Caller::here());

/// y = reduce of x on dst; zeros (x's shape) on other ranks.
/// Sum: dx = g of dst on every rank (a broadcast); Avg: that over size();
/// premul_sum(f): f times that. Max/Min/Product (NaN rule included): as
/// all_reduce, with G = g of dst.
Tensor reduce(const Tensor& x, int dst, const ProcessGroup& group, ReduceOp op = ReduceOp::Sum,
              dist::Caller caller = dist::Caller::here());

/// y[s] = x of member s (size() tensors of x's shape).
/// Partial: dx = reduce_scatter(g, Sum) — one collective. Replicated: dx = g[rank].
std::vector<Tensor> all_gather(const Tensor& x, const ProcessGroup& group,
                               GatherGrad grad = GatherGrad::Partial,
                               dist::Caller caller = dist::Caller::here());

/// y [size()*R, ...] = rows of every member concatenated (x is [R, ...]).
/// Partial: dx = reduce_scatter_single(g). Replicated: dx = g rows of this rank.
Tensor all_gather_single(const Tensor& x, const ProcessGroup& group,
                         GatherGrad grad = GatherGrad::Partial,
                         dist::Caller caller = dist::Caller::here());

/// y [sum(output_splits), ...] = concatenation of the members' x; member s
/// has output_splits[s] rows (equal on every rank).
/// Partial: dx = reduce_scatter_v(g, output_splits). Replicated: own rows of g.
/// Throws InvalidArgument (naming the op and the size) before allocating when
/// output_splits are negative, overflow, or ask for more than kMaxTensorBytes.
Tensor all_gather_v(const Tensor& x, const Splits& output_splits, const ProcessGroup& group,
                    GatherGrad grad = GatherGrad::Partial,
                    dist::Caller caller = dist::Caller::here());

/// On dst y[s] = x of member s; on other ranks size() zero tensors.
/// dx = g[rank] of dst (a scatter from dst).
std::vector<Tensor> gather(const Tensor& x, int dst, const ProcessGroup& group,
                           dist::Caller caller = dist::Caller::here());

/// y = xs[rank] of src. Every rank passes size() tensors of the output shape;
/// on ranks other than src their values are ignored and get zero gradients.
/// dxs on src = the members' g (a gather to src); zeros elsewhere.
Tensor scatter(const std::vector<Tensor>& xs, int src, const ProcessGroup& group,
               dist::Caller caller = dist::Caller::here());

/// y = reduce over members s of xs[rank] of s (xs: size() tensors of y's shape).
/// Sum: dxs[j] = g of member j (an all_gather). Avg: that over size();
/// premul_sum(f): f times that. Max/Min/Product: InvalidArgument.
Tensor reduce_scatter(const std::vector<Tensor>& xs, const ProcessGroup& group,
                      ReduceOp op = ReduceOp::Sum, dist::Caller caller = dist::Caller::here());

/// x [size()*R, ...] -> y [R, ...]. Backward: all_gather_single (over size() for Avg,
/// times f for premul_sum(f)).
Tensor reduce_scatter_single(const Tensor& x, const ProcessGroup& group,
                             ReduceOp op = ReduceOp::Sum,
                             dist::Caller caller = dist::Caller::here());

/// x [sum(input_splits), ...] -> y [input_splits[rank], ...].
/// Backward: all_gather_v(g, input_splits) (over size() for Avg, times f for
/// premul_sum(f)).
Tensor reduce_scatter_v(const Tensor& x, const Splits& input_splits, const ProcessGroup& group,
                        ReduceOp op = ReduceOp::Sum, dist::Caller caller = dist::Caller::here());

/// y[s] = xs[rank] of member s. output_shapes[s] is the shape of y[s] (the
/// shape of xs[rank] on member s); empty means "same as xs[s] here".
/// Backward: all_to_all of the gradients.
std::vector<Tensor> all_to_all(const std::vector<Tensor>& xs, const ProcessGroup& group,
                               const std::vector<Shape>& output_shapes = {},
                               dist::Caller caller = dist::Caller::here());

/// Rows routed by splits (torch.distributed.nn.all_to_all_single): x's blocks
/// of input_splits[j] rows go to member j; y has output_splits[s] rows from
/// member s. Empty splits mean even. Backward: all_to_all_single of g with the
/// splits swapped; dx has x's shape even when row totals differ.
/// Output sizes from splits are checked as in all_gather_v before allocating.
Tensor all_to_all_single(const Tensor& x, const Splits& output_splits, const Splits& input_splits,
                         const ProcessGroup& group, dist::Caller caller = dist::Caller::here());

/// Megatron's "copy to tensor-model-parallel region" (f in the Megatron-LM
/// paper): y = x (identity; x is a replica held equally by every member), and
/// dx = all_reduce(g, Sum) over group, so after backward every replica holds
/// the complete, equal gradient. This is what makes the receivers of an
/// exchange "replicas" in the sense of GatherGrad::Replicated /
/// ReceiverGrad::ReplicatedOverTp.
Tensor copy_to_tp_region(const Tensor& x, const ProcessGroup& group,
                         dist::Caller caller = dist::Caller::here());

/// cat(rows) when rows is non-empty; otherwise a [0, width] tensor of
/// anchor's dtype and device that keeps an autograd edge to anchor (its
/// backward gives anchor a zero gradient). Lets a rank with nothing to send
/// still record — and so still run — the backward collective.
/// Throws InvalidArgument on an undefined anchor or a negative width.
Tensor cat_or_empty(const std::vector<Tensor>& rows, const Tensor& anchor, int64_t width);

}  // namespace diffcomm::nn
