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
#include <fmt/ranges.h>

#include <algorithm>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/tensor/error.hpp"
#include "nn/nn_site.hpp"

namespace diffcomm::nn {
namespace {

constexpr const char* kOp = "canonical_all_reduce";

ErrorSite site(const ProcessGroup& g) { return detail::nn_site(kOp, g); }

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
    dist::all_to_all_single(group, recv, send, {}, {}, caller);  // row q*k + j: chunk q*k + j
    forward_call = group.last_call();
    Tensor mine = tree(recv);
    Tensor gathered = empty({members, S}, x.dtype(), x.device());
    dist::all_gather_single(group, gathered, mine, caller);
    Tensor flat = gathered.view_as_shape({members * S});
    Tensor total = n == members * S ? flat : flat.row_view(0, n).copy_data();
    if (op == ReduceOp::Avg) total = scale(total, 1.0 / static_cast<double>(C));
    return {total.view_as_shape(trailing(x.shape()))};
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

// What is wrong with this rank's arguments, "" when nothing is.
std::string local_problem(const Tensor& chunks, ReduceOp op) {
  if (chunks.dim() == 0) return "chunks is 0-d; it needs one row (dim 0) per chunk";
  if (chunks.size(0) == 0) return fmt::format("chunks is {}: no chunk on this rank", chunks.str());
  if (op != ReduceOp::Sum && op != ReduceOp::Avg)
    return fmt::format("reduce op {} is not canonical here; use sum or avg",
                       dist::reduce_op_name(op));
  if (op == ReduceOp::Avg && !is_floating(chunks.dtype()))
    return fmt::format("avg is undefined for integer dtype {} (use sum)",
                       dtype_name(chunks.dtype()));
  return "";
}

// One member's arguments as the agreement step exchanges them: whether it
// refused its own, its chunk count, op, dtype and chunk shape (up to
// kShownDims dims shown; every dim in the hash).
constexpr int kShownDims = 4;
constexpr int64_t kWidth = 6 + kShownDims;
std::vector<int64_t> agreement_row(const Tensor& chunks, ReduceOp op, bool refused) {
  std::vector<int64_t> row(kWidth, 0);
  row[0] = refused ? 1 : 0;
  row[1] = chunks.dim() == 0 ? -1 : chunks.size(0);
  row[2] = op == ReduceOp::Sum ? 0 : op == ReduceOp::Avg ? 1 : 2;
  row[3] = static_cast<int64_t>(chunks.dtype());
  row[4] = chunks.dim() - 1;
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over the trailing dims
  for (int64_t d = 1; d < chunks.dim(); ++d) {
    h = (h ^ static_cast<uint64_t>(chunks.size(d))) * 0x100000001b3ull;
    if (d <= kShownDims) row[static_cast<std::size_t>(5 + d)] = chunks.size(d);
  }
  row[5] = static_cast<int64_t>(h & 0x7fffffffffffffffull);
  return row;
}

std::string describe_row(const int64_t* r) {
  if (r[0] != 0) return "refused its own arguments";
  std::vector<int64_t> dims(r + 6, r + 6 + std::min<int64_t>(r[4], kShownDims));
  return fmt::format("{} chunks of [{}{}] {}, op {}", r[1], fmt::join(dims, ", "),
                     r[4] > kShownDims ? ", ..." : "", dtype_name(static_cast<DType>(r[3])),
                     r[2] == 0   ? "sum"
                     : r[2] == 1 ? "avg"
                                 : "other");
}

// The agreement step: members exchange their arguments (one small
// all_gather_single) before any data moves. Without it, members whose
// chunk shapes or ops differ could still fit the slices the collectives
// move (they only see ceil(n / size()) elements per slice) and get wrong
// sums without an error; a member that refuses its own arguments would
// leave its peers waiting. Every member raises: InvalidArgument for its
// own arguments, CollectiveMismatch naming the first member that differs.
void agree(const ProcessGroup& g, const Tensor& chunks, ReduceOp op, dist::Caller caller) {
  const std::string problem = local_problem(chunks, op);
  const std::vector<int64_t> mine = agreement_row(chunks, op, !problem.empty());
  Tensor row = empty({1, kWidth}, DType::Int64);
  std::copy(mine.begin(), mine.end(), row.data<int64_t>());
  Tensor all = empty({g.size(), kWidth}, DType::Int64, chunks.device());
  dist::all_gather_single(g, all, row.to(chunks.device()), caller);
  if (!problem.empty()) raise(site(g), problem);
  const Tensor host = all.to(Device::cpu());
  const int64_t* rows = host.data<int64_t>();
  for (int m = 0; m < g.size(); ++m) {
    const int64_t* r = rows + m * kWidth;
    if (std::equal(r, r + kWidth, mine.data())) continue;
    ErrorSite s = site(g);
    s.step = "agreement";
    raise<CollectiveMismatch>(
        std::move(s),
        fmt::format("members must hold the same number of chunks of one shape and dtype and "
                    "pass the same op: rank {} (global {}) {}, this rank {}",
                    m, g.global_rank(m), describe_row(r), describe_row(mine.data())));
  }
}

}  // namespace

Tensor canonical_sum(const Tensor& chunks, ReduceOp op) {
  if (!chunks.defined()) raise("canonical_sum", "chunks is undefined");
  if (const std::string problem = local_problem(chunks, op); !problem.empty())
    raise("canonical_sum", problem);
  const int64_t k = chunks.size(0), n = chunks.row_numel();
  Tensor total = tree(chunks.detach().copy_data().view_as_shape({k, n}));
  if (op == ReduceOp::Avg) total = scale(total, 1.0 / static_cast<double>(k));
  return total.view_as_shape(trailing(chunks.shape()));
}

Tensor canonical_all_reduce(const Tensor& chunks, const ProcessGroup& group, ReduceOp op,
                            dist::Caller caller) {
  if (!chunks.defined()) raise(site(group), "chunks is undefined");
  agree(group, chunks, op, caller);
  std::vector<Tensor> outs = CanonicalAllReduceFn{{}, caller, group, op}.apply({chunks});
  if (outs[0].defined()) Cohort::add(group.cohort(), outs[0].grad_fn());
  return outs[0];
}

}  // namespace diffcomm::nn
