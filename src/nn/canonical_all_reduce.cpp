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
#include "nn/canonical_tree.hpp"
#include "nn/nn_site.hpp"

namespace diffcomm::nn {
namespace {

constexpr const char* kOp = "canonical_all_reduce";

ErrorSite site(const ProcessGroup& g) { return detail::nn_site(kOp, g); }

Shape trailing(const Shape& s) { return Shape(s.begin() + 1, s.end()); }

// The tree of canonical_sum on a [m, n] tensor (m >= 1): [1, n].
Tensor tree(Tensor level) {  // level is consumed: each level frees the one before
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

// [k, ...]: k copies of g (a chunk's gradient when every chunk gets g).
Tensor repeat_rows(const Tensor& g, int64_t k) {
  Shape one{1};
  one.insert(one.end(), g.shape().begin(), g.shape().end());
  if (k == 0) {
    one[0] = 0;
    return zeros(one, g.dtype(), g.device());
  }
  std::vector<Tensor> copies(static_cast<std::size_t>(k), g.view_as_shape(one));
  return cat(copies);
}

int64_t chunk_count(const ChunkIds& ids, int64_t k, int members) {
  if (ids.empty()) return k * members;
  int64_t C = 0;
  for (const auto& m : ids) C += static_cast<int64_t>(m.size());
  return C;
}

struct CanonicalAllReduceFn : Function<CanonicalAllReduceFn> {
  static constexpr const char* kName = "CanonicalAllReduceBackward";
  dist::Caller caller;  // the user's call site: every call forward and backward makes
  ProcessGroup group;
  ReduceOp op;
  ChunkIds ids;             // empty: the contiguous rule
  int64_t chunks_here = 0;  // k
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    const Tensor& x = in[0];
    const int64_t k = x.size(0), n = x.row_numel();
    chunks_here = k;
    Tensor total = detail::canonical_all_reduce_tree(x.view_as_shape({k, n}), ids, group, caller,
                                                     &forward_call);
    if (op == ReduceOp::Avg)
      total = scale(total, 1.0 / static_cast<double>(chunk_count(ids, k, group.size())));
    return {total.view_as_shape(trailing(x.shape()))};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    const ProcessGroup::BackwardOf tie(group, forward_call);
    Tensor g = empty_like(grads[0]);
    dist::all_reduce_into(group, g, grads[0], ReduceOp::Sum, caller);
    if (op == ReduceOp::Avg)
      g = scale(g, 1.0 / static_cast<double>(chunk_count(ids, chunks_here, group.size())));
    return {repeat_rows(g, chunks_here)};
  }
  dist::CallId forward_call{};  // named by every call backward() makes
};

struct CanonicalReduceScatterFn : Function<CanonicalReduceScatterFn> {
  static constexpr const char* kName = "CanonicalReduceScatterBackward";
  dist::Caller caller;
  ProcessGroup group;
  int64_t chunks_here = 0;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    const Tensor& x = in[0];  // [k, members * R, ...]
    const int members = group.size();
    const int64_t k = x.size(0), n = x.row_numel(), S = n / members;
    chunks_here = k;
    Tensor mine =
        detail::canonical_slice(x.view_as_shape({k, n}), S, {}, group, caller, &forward_call);
    Shape out = trailing(x.shape());
    out[0] /= members;
    return {mine.view_as_shape(out)};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    const ProcessGroup::BackwardOf tie(group, forward_call);
    Shape full = grads[0].shape();
    full[0] *= group.size();
    Tensor g = empty(full, grads[0].dtype(), grads[0].device());
    dist::all_gather_single(group, g, grads[0], caller);
    return {repeat_rows(g, chunks_here)};
  }
  dist::CallId forward_call{};
};

// What is wrong with this rank's arguments, "" when nothing is.
std::string local_problem(const Tensor& chunks, ReduceOp op, bool may_be_empty = false) {
  if (chunks.dim() == 0) return "chunks is 0-d; it needs one row (dim 0) per chunk";
  if (chunks.size(0) == 0 && !may_be_empty)
    return fmt::format("chunks is {}: no chunk on this rank", chunks.str());
  if (op != ReduceOp::Sum && op != ReduceOp::Avg)
    return fmt::format("reduce op {} is not canonical here; use sum or avg",
                       dist::reduce_op_name(op));
  if (op == ReduceOp::Avg && !is_floating(chunks.dtype()))
    return fmt::format("avg is undefined for integer dtype {} (use sum)",
                       dtype_name(chunks.dtype()));
  return "";
}

// FNV-1a over the table (its shape and every id), 62 bits.
int64_t ids_hash(const ChunkIds& ids) {
  uint64_t h = 0xcbf29ce484222325ull;
  auto mixin = [&](uint64_t v) { h = (h ^ v) * 0x100000001b3ull; };
  for (const auto& m : ids) {
    mixin(m.size());
    for (int64_t id : m) mixin(static_cast<uint64_t>(id));
  }
  return static_cast<int64_t>(h & 0x3fffffffffffffffull);
}

// What is wrong with a chunk-id table on this rank, "" when nothing is.
std::string ids_problem(const Tensor& chunks, const ChunkIds& ids, int rank, int members) {
  if (static_cast<int>(ids.size()) != members)
    return fmt::format("chunk_ids has {} rows for {} members", ids.size(), members);
  const auto& mine = ids[static_cast<std::size_t>(rank)];
  if (chunks.dim() > 0 && chunks.size(0) != static_cast<int64_t>(mine.size()))
    return fmt::format("chunks is {} but chunk_ids[{}] lists {} ids", chunks.str(), rank,
                       mine.size());
  std::size_t C = 0;
  for (const auto& m : ids) C += m.size();
  std::vector<char> seen(C, 0);
  for (std::size_t m = 0; m < ids.size(); ++m)
    for (int64_t id : ids[m]) {
      if (id < 0 || static_cast<std::size_t>(id) >= C || seen[static_cast<std::size_t>(id)] != 0)
        return fmt::format(
            "chunk_ids must list 0..{} once each over the members; member {} lists {}{}", C - 1, m,
            id, id >= 0 && static_cast<std::size_t>(id) < C ? " twice" : " (out of range)");
      seen[static_cast<std::size_t>(id)] = 1;
    }
  return "";
}

// One member's arguments as the agreement step exchanges them: whether it
// refused its own, its chunk count, op, dtype and chunk shape (up to
// kShownDims dims shown; every dim in the hash).
constexpr int kShownDims = 4;
constexpr int64_t kWidth = 6 + kShownDims;
std::vector<int64_t> agreement_row(const Tensor& chunks, ReduceOp op, bool refused,
                                   const ChunkIds& ids) {
  std::vector<int64_t> row(kWidth, 0);
  row[0] = refused ? 1 : 0;
  row[1] = chunks.dim() == 0 ? -1 : ids.empty() ? chunks.size(0) : -2 - ids_hash(ids);
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
  const std::string count =
      r[1] >= -1 ? fmt::format("{} chunks", r[1]) : fmt::format("chunk-id table #{:x}", -2 - r[1]);
  return fmt::format("{} of [{}{}] {}, op {}", count, fmt::join(dims, ", "),
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
void agree(const ProcessGroup& g, const Tensor& chunks, ReduceOp op, dist::Caller caller,
           const std::string& problem, const ChunkIds& ids = {}) {
  const std::vector<int64_t> mine = agreement_row(chunks, op, !problem.empty(), ids);
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
        fmt::format("members must hold the same number of chunks (or chunk-id table) of one "
                    "shape and dtype and pass the same op: rank {} (global {}) {}, this rank {}",
                    m, g.global_rank(m), describe_row(r), describe_row(mine.data())));
  }
}

}  // namespace

namespace detail {

// The scatter half of every canonical collective: member s's slice
// [s*S, (s+1)*S) of the canonical sum, as [1, S] on member s. x is [k, n]
// (n <= size()*S) with this rank's k chunks; ids[m] lists member m's chunk
// ids in the order it holds them (empty: the contiguous rule, chunks
// [m*k, (m+1)*k)). Returns the call id of its collective in *call.
Tensor canonical_slice(Tensor x, int64_t S, const ChunkIds& ids, const ProcessGroup& group,
                       dist::Caller caller, dist::CallId* call) {
  const int members = group.size();
  const int64_t k = x.size(0), n = x.size(1);
  const int64_t C = chunk_count(ids, k, members);
  dist::Splits in_splits, out_splits;  // empty: even blocks (the contiguous rule)
  if (!ids.empty()) {
    for (const auto& m : ids) out_splits.push_back(static_cast<int64_t>(m.size()));
    in_splits.assign(static_cast<std::size_t>(members), k);
  }
  Tensor recv = empty({C, S}, x.dtype(), x.device());
  {
    // One chunk per rank and n == members * S: x is that layout already.
    const bool as_is = k == 1 && n == members * S && ids.empty();
    Tensor send = as_is ? x.view_as_shape({members, S})
                        : slices_by_member(x.view_as_shape({k * n}), k, n, members, S);
    if (!as_is) x = Tensor{};  // the slices are a copy: x is not needed while this rank waits
    dist::all_to_all_single(group, recv, send, out_splits, in_splits, caller);
    if (call != nullptr) *call = group.last_call();
  }
  x = Tensor{};
  if (C == 0) return zeros({1, S}, recv.dtype(), recv.device());
  if (!ids.empty()) {  // rows arrive member by member: put them in chunk-id order
    Tensor ordered = empty({C, S}, recv.dtype(), recv.device());
    int64_t row = 0;
    for (const auto& m : ids)
      for (int64_t id : m) ordered.row_view(id, 1).copy_(recv.row_view(row++, 1));
    recv = ordered;
  }
  return tree(std::move(recv));
}

Tensor canonical_all_reduce_tree(Tensor x, const ChunkIds& ids, const ProcessGroup& group,
                                 dist::Caller caller, dist::CallId* call, const Addend& addend) {
  const int members = group.size();
  const int64_t n = x.size(1), S = (n + members - 1) / members;
  const DType dtype = x.dtype();
  const Device device = x.device();
  Tensor mine = canonical_slice(std::move(x), S, ids, group, caller, call);
  if (addend) {
    const int64_t begin = std::min<int64_t>(group.rank() * S, n),
                  count = std::min<int64_t>(S, n - begin);
    if (count > 0) {
      Tensor head = add(mine.view_as_shape({S}).row_view(0, count), addend(begin, count));
      mine.view_as_shape({S}).row_view(0, count).copy_(head);
    }
  }
  Tensor gathered = empty({members, S}, dtype, device);
  dist::all_gather_single(group, gathered, mine, caller);
  Tensor flat = gathered.view_as_shape({members * S});
  return n == members * S ? flat : flat.row_view(0, n).copy_data();
}

}  // namespace detail

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
  agree(group, chunks, op, caller, local_problem(chunks, op));
  std::vector<Tensor> outs = CanonicalAllReduceFn{{}, caller, group, op, {}}.apply({chunks});
  if (outs[0].defined()) Cohort::add(group.cohort(), outs[0].grad_fn());
  return outs[0];
}

Tensor canonical_all_reduce_v(const Tensor& chunks, const ChunkIds& chunk_ids,
                              const ProcessGroup& group, ReduceOp op, dist::Caller caller) {
  if (!chunks.defined()) raise(site(group), "chunks is undefined");
  std::string problem = local_problem(chunks, op, /*may_be_empty=*/true);
  if (problem.empty()) problem = ids_problem(chunks, chunk_ids, group.rank(), group.size());
  if (problem.empty() && chunk_count(chunk_ids, 0, group.size()) == 0 && op == ReduceOp::Avg)
    problem = "avg over no chunks (chunk_ids is empty)";
  agree(group, chunks, op, caller, problem, chunk_ids.empty() ? ChunkIds{{}} : chunk_ids);
  std::vector<Tensor> outs = CanonicalAllReduceFn{{}, caller, group, op, chunk_ids}.apply({chunks});
  if (outs[0].defined()) Cohort::add(group.cohort(), outs[0].grad_fn());
  return outs[0];
}

Tensor canonical_reduce_scatter(const Tensor& chunks, const ProcessGroup& group,
                                dist::Caller caller) {
  if (!chunks.defined()) raise(site(group), "chunks is undefined");
  std::string problem = local_problem(chunks, ReduceOp::Sum);
  if (problem.empty() && (chunks.dim() < 2 || chunks.size(1) % group.size() != 0))
    problem = fmt::format("chunks is {}: needs [k, R, ...] with R divisible by the {} members",
                          chunks.str(), group.size());
  agree(group, chunks, ReduceOp::Sum, caller, problem);
  std::vector<Tensor> outs = CanonicalReduceScatterFn{{}, caller, group}.apply({chunks});
  if (outs[0].defined()) Cohort::add(group.cohort(), outs[0].grad_fn());
  return outs[0];
}

}  // namespace diffcomm::nn
