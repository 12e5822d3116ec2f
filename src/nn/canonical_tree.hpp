#pragma once
// The two halves every canonical collective is made of (canonical_all_reduce.cpp),
// shared with the canonical column-parallel linear (canonical_linear.cpp). No
// agreement step, no autograd: callers check their arguments first.
#include <cstdint>

#include "diffcomm/distributed/group.hpp"
#include "diffcomm/nn/canonical_all_reduce.hpp"

namespace diffcomm::nn::detail {

/// Member m's slice [m*S, (m+1)*S) of the canonical sum, as [1, S] on member
/// m. x is [k, n] (n <= size()*S), this member's k chunks; ids[m] lists member
/// m's chunk ids in the order it holds them (empty: the contiguous rule,
/// chunks [m*k, (m+1)*k)). One all_to_all_single; its call id goes to *call
/// when call is not null.
Tensor canonical_slice(const Tensor& x, int64_t S, const ChunkIds& ids, const ProcessGroup& group,
                       dist::Caller caller, dist::CallId* call);

/// The canonical sum of every member's chunks on every member: x [k, n] ->
/// [n] (canonical_slice, then one all_gather_single).
Tensor canonical_all_reduce_tree(const Tensor& x, const ChunkIds& ids, const ProcessGroup& group,
                                 dist::Caller caller, dist::CallId* call);

}  // namespace diffcomm::nn::detail
