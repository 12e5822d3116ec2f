#include "diffcomm/sim/adjoint.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::sim {
namespace {

double inner(const Tensor& a, const Tensor& b) {
  const auto va = a.to_vector(), vb = b.to_vector();
  double s = 0;
  for (std::size_t i = 0; i < va.size(); ++i) s += va[i] * vb[i];
  return s;
}

}  // namespace

AdjointCase draw_adjoint_case(int ranks, uint64_t seed) {
  Generator g(seed);
  auto pick = [&](int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(g.next_u64() % static_cast<uint64_t>(hi - lo + 1));
  };
  AdjointCase c;
  std::vector<int> perm(static_cast<std::size_t>(ranks));
  std::iota(perm.begin(), perm.end(), 0);
  for (std::size_t i = perm.size(); i > 1; --i) std::swap(perm[i - 1], perm[g.next_u64() % i]);
  const auto k = static_cast<std::size_t>(pick(1, ranks));
  c.members.assign(perm.begin(), perm.begin() + static_cast<std::ptrdiff_t>(k));
  if (ranks > 1 && c.members[0] == 0) {
    // The group must not start at global rank 0 (that hides local/global mix-ups).
    if (k > 1)
      std::rotate(c.members.begin(), c.members.begin() + 1, c.members.end());
    else
      c.members[0] = perm[1];
  }
  const auto n = c.members.size();
  c.root = static_cast<int>(pick(0, static_cast<int64_t>(n) - 1));
  c.width = pick(1, 3);
  // rows[0] sizes the uniform ops' tensors: at least one row, so both sides
  // of the identity are non-trivial; the other entries (splits) may be zero.
  for (std::size_t i = 0; i < n; ++i) c.rows.push_back(pick(i == 0 ? 1 : 0, 3));
  c.m.assign(n, std::vector<int64_t>(n, 0));
  for (auto& row : c.m)
    for (auto& v : row) v = pick(0, 3);
  return c;
}

const std::vector<std::string>& differentiable_ops() {
  static const std::vector<std::string> ops{"all_reduce",
                                            "broadcast",
                                            "reduce",
                                            "all_gather",
                                            "all_gather_single",
                                            "all_gather_v",
                                            "gather",
                                            "scatter",
                                            "reduce_scatter",
                                            "reduce_scatter_single",
                                            "reduce_scatter_v",
                                            "all_to_all",
                                            "all_to_all_single",
                                            "all_reduce_premul_sum",
                                            "reduce_scatter_premul_sum"};
  return ops;
}

std::pair<double, double> adjoint_terms(const std::string& op, const dist::ProcessGroup& world,
                                        const AdjointCase& c, DType dtype, Generator& gen,
                                        Device device) {
  auto group = world.new_group(c.members);
  if (!group) return {0.0, 0.0};
  const int r = group->rank();
  const auto n = static_cast<std::size_t>(group->size());
  const int64_t w = c.width;
  // Small integers keep every dtype exact in the data itself.
  auto data = [&](int64_t rows) {
    Tensor t = rand_uniform({rows, w}, gen, -4.0, 4.0, DType::Float64);
    std::vector<double> v = t.to_vector();
    for (double& x : v) x = std::round(x);
    return from_vector(v, {rows, w}, dtype).to(device);
  };
  const auto me = static_cast<std::size_t>(r);
  std::vector<Tensor> xs, outs;
  if (op == "all_reduce" || op == "all_reduce_avg" || op == "all_reduce_premul_sum") {
    xs = {data(c.rows[0])};
    dist::ReduceOp rop = dist::ReduceOp::premul_sum(-0.375);
    if (op == "all_reduce") rop = dist::ReduceOp::Sum;
    if (op == "all_reduce_avg") rop = dist::ReduceOp::Avg;
    outs = {nn::all_reduce(xs[0].set_requires_grad(), *group, rop)};
  } else if (op == "broadcast") {
    xs = {data(c.rows[0])};
    outs = {nn::broadcast(xs[0].set_requires_grad(), c.root, *group)};
  } else if (op == "reduce") {
    xs = {data(c.rows[0])};
    outs = {nn::reduce(xs[0].set_requires_grad(), c.root, *group)};
  } else if (op == "all_gather") {
    xs = {data(c.rows[0])};
    outs = nn::all_gather(xs[0].set_requires_grad(), *group);
  } else if (op == "all_gather_single") {
    xs = {data(c.rows[0])};
    outs = {nn::all_gather_single(xs[0].set_requires_grad(), *group)};
  } else if (op == "all_gather_v") {
    xs = {data(c.rows[me])};
    outs = {nn::all_gather_v(
        xs[0].set_requires_grad(),
        std::vector<int64_t>(c.rows.begin(), c.rows.begin() + static_cast<std::ptrdiff_t>(n)),
        *group)};
  } else if (op == "gather") {
    xs = {data(c.rows[0])};
    outs = nn::gather(xs[0].set_requires_grad(), c.root, *group);
  } else if (op == "scatter") {
    for (std::size_t i = 0; i < n; ++i) xs.push_back(data(c.rows[0]).set_requires_grad());
    outs = {nn::scatter(xs, c.root, *group)};
  } else if (op == "reduce_scatter" || op == "reduce_scatter_premul_sum") {
    for (std::size_t i = 0; i < n; ++i) xs.push_back(data(c.rows[0]).set_requires_grad());
    outs = {nn::reduce_scatter(xs, *group,
                               op == "reduce_scatter" ? dist::ReduceOp(dist::ReduceOp::Sum)
                                                      : dist::ReduceOp::premul_sum(-0.375))};
  } else if (op == "reduce_scatter_single") {
    xs = {data(c.rows[0] * static_cast<int64_t>(n))};
    outs = {nn::reduce_scatter_single(xs[0].set_requires_grad(), *group)};
  } else if (op == "reduce_scatter_v") {
    const std::vector<int64_t> splits(c.rows.begin(),
                                      c.rows.begin() + static_cast<std::ptrdiff_t>(n));
    xs = {data(std::accumulate(splits.begin(), splits.end(), int64_t{0}))};
    outs = {nn::reduce_scatter_v(xs[0].set_requires_grad(), splits, *group)};
  } else if (op == "all_to_all") {
    std::vector<Shape> out_shapes;
    for (std::size_t j = 0; j < n; ++j) {
      xs.push_back(data(c.m[me][j]).set_requires_grad());
      out_shapes.push_back({c.m[j][me], w});
    }
    outs = nn::all_to_all(xs, *group, out_shapes);
  } else {  // all_to_all_single
    std::vector<int64_t> in_splits, out_splits;
    for (std::size_t j = 0; j < n; ++j) {
      in_splits.push_back(c.m[me][j]);
      out_splits.push_back(c.m[j][me]);
    }
    xs = {data(std::accumulate(in_splits.begin(), in_splits.end(), int64_t{0}))};
    outs = {nn::all_to_all_single(xs[0].set_requires_grad(), out_splits, in_splits, *group)};
  }
  std::vector<Tensor> cots;
  double l = 0;
  for (const auto& o : outs) {
    Tensor y = data(o.size(0)).view_as_shape(o.shape());
    cots.push_back(y);
    l += inner(o, y);
  }
  const std::vector<Tensor> grads = grad(outs, xs, cots);
  double rr = 0;
  for (std::size_t i = 0; i < xs.size(); ++i) rr += inner(xs[i], grads[i]);
  return {l, rr};
}

AdjointReport check_adjoint(const std::string& op, int ranks, uint64_t seed, DType dtype) {
  const auto& ops = differentiable_ops();
  if (std::find(ops.begin(), ops.end(), op) == ops.end())
    raise("check_adjoint",
          fmt::format("unknown op '{}' (expected one of {})", op, fmt::join(ops, ", ")));
  if (ranks < 1 || ranks > 4096)
    raise("check_adjoint", fmt::format("ranks {} outside 1..4096", ranks));
  if (!is_floating(dtype))
    raise("check_adjoint", fmt::format("dtype {} is not floating point", dtype_name(dtype)));
  const AdjointCase c = draw_adjoint_case(ranks, seed);
  AdjointReport rep;
  rep.op = op;
  rep.ranks = ranks;
  rep.seed = seed;
  rep.dtype = dtype;
  rep.group = c.members;
  std::vector<double> lhs(static_cast<std::size_t>(ranks), 0.0),
      rhs(static_cast<std::size_t>(ranks), 0.0);

  WorldOptions options;
  options.ranks = ranks;
  options.seed = seed;
  World world(options);
  world.run([&](Rank& rank) {
    const auto [l, r] = adjoint_terms(op, rank.world(), c, dtype, rank.generator());
    lhs[static_cast<std::size_t>(rank.rank())] = l;
    rhs[static_cast<std::size_t>(rank.rank())] = r;
  });
  // Sum over ranks here, outside the world (not with diffcomm's all_reduce).
  rep.lhs = std::accumulate(lhs.begin(), lhs.end(), 0.0);
  rep.rhs = std::accumulate(rhs.begin(), rhs.end(), 0.0);
  rep.rel_err =
      std::abs(rep.lhs - rep.rhs) / std::max({std::abs(rep.lhs), std::abs(rep.rhs), 1e-300});
  rep.tolerance = dtype == DType::Float64 ? 1e-12 : dtype == DType::Float32 ? 1e-5 : 2e-2;
  rep.passed = rep.rel_err <= rep.tolerance;
  return rep;
}

}  // namespace diffcomm::sim
