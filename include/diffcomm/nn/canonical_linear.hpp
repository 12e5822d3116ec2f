#pragma once
// Megatron's column-parallel linear with a canonical input gradient: dx has the
// same bits for every tensor-parallel size (docs/semantics.md, "Canonical
// reductions").
//
// A column-parallel linear splits the weight's columns over the TP group, so
// the input gradient dx = dy A^T is a sum over columns that every member holds
// a part of. Megatron adds the members' partial sums (copy_to_tp_region's
// all-reduce, or sequence parallelism's reduce-scatter): the rounding then
// depends on the TP size. Here the columns are cut into fixed blocks, each
// block's product is one matmul, and the blocks are combined by the canonical
// tree over the block index (canonical_all_reduce.hpp).
#include <functional>

#include "diffcomm/distributed/group.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::nn {

using dist::ProcessGroup;

/// y = x_full A_cols on every member of the TP group.
///  - weight: [in, cols], this member's columns [rank*cols, (rank+1)*cols)
///    of the full weight A [in, size()*cols];
///  - sequence_parallel == false: x [R, in] is the replica every member
///    holds (what copy_to_tp_region gives); y is [R, cols];
///  - sequence_parallel == true: x [R, in] is this member's rows; they are
///    all-gathered first (all_gather_single, members' rows in rank order), so
///    y is [size()*R, cols].
/// Forward bits: matmul's, row by row (each y element is one rank's sum over
/// `in`), whatever size() is.
/// dx: the sum over the size()*cols columns c of dy[:, c] A[:, c]^T, taken as
/// blocks of block_cols columns (one matmul each, the block's columns in
/// order) combined by canonical_sum's tree over the C = size()*cols/block_cols
/// blocks: canonical_all_reduce without SP (every replica gets the whole dx),
/// canonical_reduce_scatter with SP (this member's rows). So dx has the bits
/// of the single-rank computation for every size() that divides C.
/// dx_addend (optional): a term added to dx after the canonical sum, as
/// dx_addend(begin, count) -> the elements [begin, begin + count) of the
/// flattened dx (this member's rows with SP) as a 1-d tensor of x's dtype;
/// without SP each member asks only for the elements it reduces, so a term
/// every replica needs (the gradient of another use of the replicated x) is
/// computed once overall instead of once per member. dx = tree + addend,
/// added in x's dtype.
/// dweight (when weight requires grad) = x_full^T dy, no communication.
/// Memory: backward holds cols/block_cols partials of dx's shape (with SP:
/// of the gathered rows).
/// Throws InvalidArgument (naming the op, rank and group) for undefined or
/// non-2-d tensors, x and weight of other dtypes or inner sizes, or
/// block_cols < 1 not dividing cols. Members must agree on the shapes (a
/// disagreement surfaces as its collectives' CollectiveMismatch).
Tensor canonical_column_parallel_linear(const Tensor& x, const Tensor& weight,
                                        const ProcessGroup& group, bool sequence_parallel,
                                        int64_t block_cols = 1,
                                        std::function<Tensor(int64_t, int64_t)> dx_addend = nullptr,
                                        dist::Caller caller = dist::Caller::here());

}  // namespace diffcomm::nn
