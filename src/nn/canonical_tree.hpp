#pragma once
// The two halves every canonical collective is made of (canonical_all_reduce.cpp),
// shared with the canonical column-parallel linear (canonical_linear.cpp). No
// agreement step, no autograd: callers check their arguments first.
#include <cstdint>
#include <functional>

#include "diffcomm/distributed/group.hpp"
#include "diffcomm/nn/canonical_all_reduce.hpp"

namespace diffcomm::nn::detail {

/// Member m's slice [m*S, (m+1)*S) of the canonical sum, as [1, S] on member
/// m. x is [k, n] (n <= size()*S), this member's k chunks, taken by value: it
/// is released once sent, so pass it moved when nothing else needs it (a
/// simulated rank holds what it keeps while it waits for the others). ids[m]
/// lists member m's chunk ids in the order it holds them (empty: the
/// contiguous rule, chunks [m*k, (m+1)*k)). One all_to_all_single; its call
/// id goes to *call when call is not null.
Tensor canonical_slice(Tensor x, int64_t S, const ChunkIds& ids, const ProcessGroup& group,
                       dist::Caller caller, dist::CallId* call);

/// Elements [begin, begin + count) of a term added to a canonical sum after
/// the tree, as a 1-d tensor of count elements (canonical_all_reduce_tree).
using Addend = std::function<Tensor(int64_t begin, int64_t count)>;

/// The canonical sum of every member's chunks on every member: x [k, n] ->
/// [n] (canonical_slice, then one all_gather_single). With an addend, each
/// member adds its slice's elements of it before the gather, so the result is
/// the sum plus the addend with the addend computed once overall.
Tensor canonical_all_reduce_tree(Tensor x, const ChunkIds& ids, const ProcessGroup& group,
                                 dist::Caller caller, dist::CallId* call,
                                 const Addend& addend = nullptr);

}  // namespace diffcomm::nn::detail
