// The canonical all-reduce: every element summed over a fixed number of
// logical chunks in one fixed tree, whatever the number of ranks holding them
// (header: include/diffcomm/nn/canonical_all_reduce.hpp).
//
// Why this order of work: the tree is elementwise, so cutting the elements
// into one slice per rank changes nothing about any element's additions. Each
// rank receives every chunk's copy of its slice (all_to_all_single), runs the
// tree on it, and the slices are gathered back (all_gather_single). That is a
// reduce-scatter whose reduction order is fixed by the chunks, then the usual
// all-gather.
#include "diffcomm/nn/canonical_all_reduce.hpp"

#include <fmt/format.h>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::nn {
namespace {

constexpr const char* kOp = "canonical_all_reduce";

ErrorSite site(const ProcessGroup& g) {
  return {.op = fmt::format("nn::{}", kOp),
          .group = g.name(),
          .rank = g.rank(),
          .group_size = g.size()};
}

Shape trailing(const Shape& s) { return Shape(s.begin() + 1, s.end()); }

// The tree of canonical_sum on a [m, n] tensor (m >= 1): [1, n].
Tensor tree(Tensor level) {
  while (level.size(0) > 1) {
    const int64_t m = level.size(0), h = m / 2;
    Tensor sums = add(level.row_view(0, h), level.row_view(h, h));
    level = m % 2 == 0 ? sums : cat({sums, level.row_view(2 * h, 1)});
  }
  return level;
}

// [size*k, S]: row s*k + j holds chunk j's elements [s*S, (s+1)*S) (zeros past
// the chunk's n elements): the block all_to_all_single sends to member s.
Tensor slices_by_member(const Tensor& flat, int64_t k, int64_t n, int members, int64_t S) {
  Tensor out = zeros({members * k, S}, flat.dtype(), flat.device());
  Tensor out_flat = out.view_as_shape({members * k * S});
  for (int s = 0; s < members; ++s)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t begin = s * S, len = std::min(S, n - begin);
      if (len <= 0) continue;
      out_flat.row_view((s * k + j) * S, len).copy_(flat.row_view(j * n + begin, len));
    }
  return out;
}

struct CanonicalAllReduceFn : Function<CanonicalAllReduceFn> {
  static constexpr const char* kName = "CanonicalAllReduceBackward";
  dist::Caller caller;  // the user's call site: every call forward and backward makes
  ProcessGroup group;
  ReduceOp op;
  int64_t chunks_here = 0;  // k
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    const Tensor& x = in[0];
    const int members = group.size();
    const int64_t k = x.size(0), n = x.row_numel(), C = k * members;
    chunks_here = k;
    // One slice of ceil(n / members) elements per member (a group of one runs
    // the same path: its calls are recorded like any group's).
    const int64_t S = (n + members - 1) / members;
    // One chunk per rank and n divisible by members: x is that layout already.
    const bool as_is = k == 1 && n == members * S;
    Tensor send = as_is ? x.view_as_shape({members, S})
                        : slices_by_member(x.view_as_shape({k * n}), k, n, members, S);
    Tensor recv = empty({C, S}, x.dtype(), x.device());
    exchange_slices(recv, send, k, n);  // row q*k + j: global chunk q*k + j
    forward_call = group.last_call();
    Tensor mine = tree(recv);
    Tensor gathered = empty({members, S}, x.dtype(), x.device());
    dist::all_gather_single(group, gathered, mine, caller);
    Tensor flat = gathered.view_as_shape({members * S});
    Tensor total = n == members * S ? flat : flat.row_view(0, n).copy_data();
    if (op == ReduceOp::Avg) total = scale(total, 1.0 / static_cast<double>(C));
    return {total.view_as_shape(trailing(x.shape()))};
  }
  // The all_to_all_single of the forward. Its splits and row size come from
  // k and the chunk size alone, so a mismatch in it means members disagree
  // on those: reported in this op's terms (the step named as detail).
  void exchange_slices(const Tensor& recv, const Tensor& send, int64_t k, int64_t n) {
    try {
      dist::all_to_all_single(group, recv, send, {}, {}, caller);
    } catch (const CollectiveMismatch& e) {
      ErrorSite s = e.site();
      s.op = fmt::format("nn::{}", kOp);
      s.step = "all_to_all_single";
      raise<CollectiveMismatch>(
          std::move(s), fmt::format("members hold different numbers or shapes of chunks (each "
                                    "holds C / size() chunks of one shape; this rank: {} of {} "
                                    "elements): {}",
                                    k, n, e.detail()));
    }
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    const ProcessGroup::BackwardOf tie(group, forward_call);
    Tensor g = empty_like(grads[0]);
    dist::all_reduce_into(group, g, grads[0], ReduceOp::Sum, caller);
    if (op == ReduceOp::Avg) g = scale(g, 1.0 / static_cast<double>(chunks_here * group.size()));
    std::vector<Tensor> copies(static_cast<std::size_t>(chunks_here),
                               g.view_as_shape(with_row(g.shape())));
    return {cat(copies)};
  }
  static Shape with_row(const Shape& s) {
    Shape out{1};
    out.insert(out.end(), s.begin(), s.end());
    return out;
  }
  dist::CallId forward_call{};  // named by every call backward() makes
};

void check_chunks(const ProcessGroup* g, const Tensor& chunks, const char* name) {
  const auto fail = [&](const std::string& why) {
    if (g) raise(site(*g), why);
    raise(name, why);
  };
  if (!chunks.defined()) fail("chunks is undefined");
  if (chunks.dim() == 0) fail("chunks is 0-d; it needs one row (dim 0) per chunk");
  if (chunks.size(0) == 0) fail(fmt::format("chunks is {}: no chunk on this rank", chunks.str()));
}

}  // namespace

Tensor canonical_sum(const Tensor& chunks) {
  check_chunks(nullptr, chunks, "canonical_sum");
  const int64_t k = chunks.size(0), n = chunks.row_numel();
  return tree(chunks.detach().copy_data().view_as_shape({k, n}))
      .view_as_shape(trailing(chunks.shape()));
}

Tensor canonical_all_reduce(const Tensor& chunks, const ProcessGroup& group, ReduceOp op,
                            dist::Caller caller) {
  check_chunks(&group, chunks, kOp);
  if (op != ReduceOp::Sum && op != ReduceOp::Avg)
    raise(site(group), fmt::format("reduce op {} is not canonical here; use sum or avg",
                                   dist::reduce_op_name(op)));
  std::vector<Tensor> outs = CanonicalAllReduceFn{{}, caller, group, op}.apply({chunks});
  if (outs[0].defined()) Cohort::add(group.cohort(), outs[0].grad_fn());
  return outs[0];
}

}  // namespace diffcomm::nn
