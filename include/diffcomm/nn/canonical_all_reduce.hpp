#pragma once
// The canonical all-reduce: a sum whose bits do not depend on the number of
// ranks (docs/semantics.md, "Canonical reductions").
//
// An ordinary all_reduce adds one partial per rank, so its rounding depends on
// how many ranks there are: a data-parallel gradient averaged over 4 ranks and
// over 8 differs in the last bits. Here the partials belong to a fixed number
// C of logical chunks (samples, micro-batches, blocks of a matmul's inner
// dimension), not to ranks, and every element is summed over the chunks in
// one fixed tree over the chunk index. Any world size that divides C gives the
// same bits, and a group of one rank is the single-rank reference.
#include "diffcomm/distributed/group.hpp"
#include "diffcomm/distributed/reduce_op.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::nn {

using dist::ProcessGroup;
using dist::ReduceOp;

/// chunk_ids[m]: the ids of the chunks member m holds, in the order of its
/// chunks' rows (canonical_all_reduce_v).
using ChunkIds = std::vector<std::vector<int64_t>>;

/// The canonical tree over dim 0: chunks [C, ...] -> [...], every element
/// summed over the C chunks as follows. With m rows left (m = C first), the
/// first floor(m/2) rows are replaced by row i + row i + floor(m/2), the odd
/// row out (m odd) is kept after them, until one row is left:
///   C = 4: (x0 + x2) + (x1 + x3);  C = 3: (x0 + x1) + x2.
/// Additions in chunks' dtype (bfloat16/float16 round each addition, as
/// add() does). Avg: the sum times 1/C, as scale() computes it (in the dtype;
/// float32 for bfloat16/float16, rounded once). Any device add() supports.
/// Not differentiable (the tree of canonical_all_reduce's forward: the
/// single-rank reference of its result, op included).
/// Throws InvalidArgument for an undefined or 0-d tensor, C == 0, an op
/// other than Sum/Avg, or Avg on an integer dtype.
Tensor canonical_sum(const Tensor& chunks, ReduceOp op = ReduceOp::Sum);

/// y [...] = canonical_sum of the chunks of every member, on every member.
///
/// chunks [k, ...] holds this rank's partials for the chunks
/// [rank*k, (rank+1)*k) of C = k * size() (group-local ranks, so a rank's
/// chunks are contiguous); k and the trailing shape must agree on every
/// member. The result's bits are those of canonical_sum over all C chunks on
/// one rank, for every group size that divides C (float formats included:
/// each element sees the same additions in the same order). Avg is the sum
/// times 1/C (not 1/size()), exactly canonical_sum(all chunks, Avg). Only Sum
/// and Avg (Avg on floating dtypes only).
///
/// Agreement: before any data moves, members exchange k, the chunk shape,
/// the dtype and the op (one all_gather_single of a few int64), so members
/// that differ get CollectiveMismatch naming the first that differs, and a
/// member whose own arguments are refused raises InvalidArgument while its
/// peers get CollectiveMismatch at once (no wait for a deadline).
///
/// Cost: the agreement's small all_gather_single, one all_to_all_single (this rank receives k *
/// size() slices of ceil(N / size()) elements, N = elements per chunk: about k*N) and one
/// all_gather_single (about N): k*N + N received, against ~2N for a ring
/// all_reduce; for k = 1 it is the same traffic as reduce-scatter +
/// all-gather.
///
/// Backward: dchunks[j] = all_reduce(g, Sum) for every local chunk j (over C
/// for Avg): the exact adjoint of y = sum of all chunks on every member.
/// Those bits do depend on size() (a sum over ranks' gradients), which is
/// why the canonical form is the forward: it is what reduces gradients.
///
/// caller: recorded by every collective it makes (functional.hpp).
/// Throws InvalidArgument (naming the op, rank and group) for an undefined
/// or 0-d tensor, k == 0, an op other than Sum/Avg or Avg on integers;
/// CollectiveMismatch when members disagree (above).
Tensor canonical_all_reduce(const Tensor& chunks, const ProcessGroup& group,
                            ReduceOp op = ReduceOp::Sum,
                            dist::Caller caller = dist::Caller::here());

/// canonical_all_reduce for chunks owned unevenly: member m holds the chunks
/// chunk_ids[m] (any ids, in any order; 0 to C-1 listed exactly once over all
/// members), so its chunks are [chunk_ids[m].size(), ...] (zero rows allowed:
/// a member holding no chunk still calls). chunk_ids is replicated metadata,
/// equal on every member (like all_gather_v's output_splits). The result is
/// canonical_sum of the C chunks in id order on every member, so any
/// assignment of the chunks to any number of members gives the same bits.
/// C == 0 gives zeros of the chunk shape (Sum). Same agreement step (the
/// table's hash in place of k), cost (this member receives C slices of
/// ceil(N / size()) elements) and backward (dchunks[j] = all_reduce(g)) as
/// canonical_all_reduce.
/// Throws InvalidArgument for a table that does not have size() rows, does
/// not list 0..C-1 once each, or lists another number of ids for this
/// member than chunks has rows, plus canonical_all_reduce's errors;
/// CollectiveMismatch when members' tables, shapes, dtypes or ops differ.
Tensor canonical_all_reduce_v(const Tensor& chunks, const ChunkIds& chunk_ids,
                              const ProcessGroup& group, ReduceOp op = ReduceOp::Sum,
                              dist::Caller caller = dist::Caller::here());

/// y [R, ...] = this member's rows of the canonical sum (Sum) of every
/// member's chunks: chunks [k, size()*R, ...] holds the chunks [rank*k,
/// (rank+1)*k) as in canonical_all_reduce, and member m gets rows [m*R,
/// (m+1)*R) of canonical_sum over all C = k*size() chunks — the bits of one
/// rank's canonical_sum, row for row, for every size() that divides C. The
/// canonical form of reduce_scatter_single (Megatron's sequence-parallel
/// input gradient). Cost: one all_to_all_single (k*size()*R rows received)
/// after the agreement step. Backward: dchunks[j] = all_gather_single(g) for
/// every local chunk j (the adjoint).
/// Throws InvalidArgument when chunks is not [k >= 1, R*size(), ...] plus
/// canonical_all_reduce's errors; CollectiveMismatch when members differ.
Tensor canonical_reduce_scatter(const Tensor& chunks, const ProcessGroup& group,
                                dist::Caller caller = dist::Caller::here());

}  // namespace diffcomm::nn
