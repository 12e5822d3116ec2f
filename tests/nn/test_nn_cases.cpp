// The six small cases of CASES.md on which public libraries of differentiable
// collectives gave wrong answers, crashed or hung — each with the values
// worked out by hand there. Every rank records what it saw; the checks run
// after World::run returns.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm {
namespace {

using dist::ReduceOp;
using Values = std::vector<double>;

sim::World make_world(int ranks, uint64_t seed = 1) {
  sim::WorldOptions opt;
  opt.ranks = ranks;
  opt.seed = seed;
  return sim::World(opt);
}

Tensor leaf(const Values& v, const Shape& shape) {
  Tensor t = from_vector(v, shape, DType::Float64);
  t.set_requires_grad(true);
  return t;
}

// Case 1: world 4, group = global ranks {2, 3}; x = [1.0] on both members;
// each member's loss = sum(all_gather(x)). dx = 2 on both; ranks 0 and 1 are
// not members and do nothing.
TEST(NnCases, Case1SubGroupAllGather) {
  for (std::vector<int> members : {std::vector<int>{2, 3}, std::vector<int>{3, 2}}) {
    SCOPED_TRACE(testing::Message() << "group {" << members[0] << "," << members[1] << "}");
    for (uint64_t seed : {1, 2, 3}) {
      sim::World world = make_world(4, seed);
      std::vector<Values> dx(4);
      std::vector<int> group_rank(4, -1);
      world.run([&](sim::Rank& rk) {
        auto g = rk.world().new_group(members);
        if (!g) return;
        group_rank[static_cast<std::size_t>(rk.rank())] = g->rank();
        Tensor x = leaf({1.0}, {1});
        std::vector<Tensor> ys = nn::all_gather(x, *g);
        Tensor loss = add(sum(ys[0]), sum(ys[1]));
        dx[static_cast<std::size_t>(rk.rank())] = grad({loss}, {x})[0].to_vector();
      });
      EXPECT_EQ(group_rank[0], -1);
      EXPECT_EQ(group_rank[1], -1);
      EXPECT_EQ(group_rank[static_cast<std::size_t>(members[0])], 0);
      EXPECT_EQ(group_rank[static_cast<std::size_t>(members[1])], 1);
      EXPECT_EQ(dx[2], Values{2.0});
      EXPECT_EQ(dx[3], Values{2.0});
      EXPECT_TRUE(dx[0].empty());
      EXPECT_TRUE(dx[1].empty());
    }
  }
}

// Case 2a: world 3, group = all, src = 1; cotangents 1, 2, 4 on ranks 0, 1, 2.
// dx = 0, 7, 0.
TEST(NnCases, Case2BroadcastSourceInGroup) {
  sim::World world = make_world(3);
  const Values cot = {1.0, 2.0, 4.0};
  std::vector<Values> y(3), dx(3);
  world.run([&](sim::Rank& rk) {
    const auto r = static_cast<std::size_t>(rk.rank());
    Tensor x = leaf({10.0 + static_cast<double>(r)}, {1});
    Tensor out = nn::broadcast(x, 1, rk.world());
    y[r] = out.to_vector();
    dx[r] = grad({out}, {x}, {from_vector({cot[r]}, {1}, DType::Float64)})[0].to_vector();
  });
  for (std::size_t r = 0; r < 3; ++r) EXPECT_EQ(y[r], Values{11.0}) << "rank " << r;
  EXPECT_EQ(dx[0], Values{0.0});
  EXPECT_EQ(dx[1], Values{7.0});
  EXPECT_EQ(dx[2], Values{0.0});
}

// Case 2b: world 2, group = {global rank 1} alone, src = its local rank 0,
// loss = sum(y), x = [1, 1]. dx = [1, 1] (comparing the global src with the
// local rank gives [0, 0]).
TEST(NnCases, Case2BroadcastSingletonSubGroup) {
  sim::World world = make_world(2);
  std::vector<Values> y(2), dx(2);
  world.run([&](sim::Rank& rk) {
    auto g = rk.world().new_group({1});
    if (!g) return;
    const auto r = static_cast<std::size_t>(rk.rank());
    Tensor x = leaf({1.0, 1.0}, {2});
    Tensor out = nn::broadcast(x, 0, *g);
    y[r] = out.to_vector();
    dx[r] = grad({sum(out)}, {x})[0].to_vector();
  });
  EXPECT_EQ(y[1], (Values{1.0, 1.0}));
  EXPECT_EQ(dx[1], (Values{1.0, 1.0}));
  EXPECT_TRUE(dx[0].empty());
}

// Case 3: world 2, all_reduce Avg, x = 2 and 4 (y = 3); cotangents 1 and 3.
// dx = 2 on both ranks.
TEST(NnCases, Case3AllReduceAvg) {
  sim::World world = make_world(2);
  const Values x_in = {2.0, 4.0}, cot = {1.0, 3.0};
  std::vector<Values> y(2), dx(2);
  world.run([&](sim::Rank& rk) {
    const auto r = static_cast<std::size_t>(rk.rank());
    Tensor x = leaf({x_in[r]}, {1});
    Tensor out = nn::all_reduce(x, rk.world(), ReduceOp::Avg);
    y[r] = out.to_vector();
    dx[r] = grad({out}, {x}, {from_vector({cot[r]}, {1}, DType::Float64)})[0].to_vector();
  });
  for (std::size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(y[r], Values{3.0}) << "rank " << r;
    EXPECT_EQ(dx[r], Values{2.0}) << "rank " << r;
  }
}

// Case 4: world 2, all_gather of x with shape (1, 0, 2) on each rank: two
// (1, 0, 2) outputs, a (1, 0, 2) gradient, no crash, and every rank takes
// part in both directions.
TEST(NnCases, Case4ZeroElementAllGather) {
  sim::World world = make_world(2);
  std::vector<std::vector<Shape>> out_shapes(2);
  std::vector<Shape> dx_shape(2);
  world.run([&](sim::Rank& rk) {
    const auto r = static_cast<std::size_t>(rk.rank());
    Tensor x = zeros({1, 0, 2}, DType::Float32);
    x.set_requires_grad(true);
    std::vector<Tensor> ys = nn::all_gather(x, rk.world());
    for (const auto& t : ys) out_shapes[r].push_back(t.shape());
    std::vector<Tensor> cots = {zeros({1, 0, 2}, DType::Float32), zeros({1, 0, 2}, DType::Float32)};
    dx_shape[r] = grad(ys, {x}, cots)[0].shape();
  });
  for (int r = 0; r < 2; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    EXPECT_EQ(out_shapes[ur], (std::vector<Shape>{{1, 0, 2}, {1, 0, 2}})) << "rank " << r;
    EXPECT_EQ(dx_shape[ur], (Shape{1, 0, 2})) << "rank " << r;
    EXPECT_EQ(world.stats(r).get("world", "all_gather").calls, 1u) << "rank " << r;
    EXPECT_EQ(world.stats(r).get("world", "reduce_scatter").calls, 1u) << "rank " << r;
  }
}

// Case 5: world 2, all_to_all_single. Rank 0: x = [a], input splits [1, 0],
// output splits [1, 1]; rank 1: x = [b], input splits [1, 0], output splits
// [0, 0]. Rank 0 receives [a, b], rank 1 nothing. Rank 0's loss = 2 y0 +
// 3 y1; rank 1 has no loss term. dx = [2] on rank 0, [3] on rank 1, and rank
// 1 still runs the backward all-to-all (it is the one that gets a row back).
TEST(NnCases, Case5RankThatReceivesNothing) {
  sim::World world = make_world(2);
  const double a = 5.0, b = 7.0;
  std::vector<Values> y(2), dx(2);
  world.run([&](sim::Rank& rk) {
    const auto r = static_cast<std::size_t>(rk.rank());
    Tensor x = leaf({r == 0 ? a : b}, {1});
    const dist::Splits out_splits = r == 0 ? dist::Splits{1, 1} : dist::Splits{0, 0};
    Tensor out = nn::all_to_all_single(x, out_splits, {1, 0}, rk.world());
    y[r] = out.to_vector();
    if (r == 0) {
      Tensor loss = dot(out, from_vector({2.0, 3.0}, {2}, DType::Float64));
      dx[r] = grad({loss}, {x})[0].to_vector();
    } else {
      // No loss term: still enters the backward collective, zero cotangent.
      dx[r] = grad({out}, {x}, {zeros_like(out)})[0].to_vector();
    }
  });
  EXPECT_EQ(y[0], (Values{a, b}));
  EXPECT_TRUE(y[1].empty());
  EXPECT_EQ(dx[0], Values{2.0});
  EXPECT_EQ(dx[1], Values{3.0});
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(world.stats(r).get("world", "all_to_all_single").calls, 2u) << "rank " << r;
}

// Case 5, the hang: if rank 1 skips its backward, rank 0 waits in the
// backward all-to-all; the world reports a Deadlock instead of hanging.
TEST(NnCases, Case5SkippedBackwardIsADeadlock) {
  sim::World world = make_world(2);
  EXPECT_THROW(world.run([&](sim::Rank& rk) {
    const auto r = static_cast<std::size_t>(rk.rank());
    Tensor x = leaf({r == 0 ? 5.0 : 7.0}, {1});
    const dist::Splits out_splits = r == 0 ? dist::Splits{1, 1} : dist::Splits{0, 0};
    Tensor out = nn::all_to_all_single(x, out_splits, {1, 0}, rk.world());
    if (r == 0) grad({dot(out, from_vector({2.0, 3.0}, {2}, DType::Float64))}, {x});
  }),
               Deadlock);
}

// Case 6: world 2, G = all_gather(x) of scalars = [x0, x1]; rank 0's loss =
// 1 G0 + 2 G1, rank 1's loss = 3 G0 + 4 G1. dx0 = 4, dx1 = 6 (not (1, 4), not
// (5, 5)).
TEST(NnCases, Case6AsymmetricCotangents) {
  sim::World world = make_world(2);
  const std::vector<Values> weights = {{1.0, 2.0}, {3.0, 4.0}};
  std::vector<Values> gathered(2), dx(2);
  world.run([&](sim::Rank& rk) {
    const auto r = static_cast<std::size_t>(rk.rank());
    Tensor x = leaf({r == 0 ? 10.0 : 20.0}, {});  // 0-d scalars
    std::vector<Tensor> g = nn::all_gather(x, rk.world());
    gathered[r] = {g[0].item(), g[1].item()};
    Tensor loss = add(scale(g[0], weights[r][0]), scale(g[1], weights[r][1]));
    dx[r] = grad({loss}, {x})[0].to_vector();
  });
  for (std::size_t r = 0; r < 2; ++r) EXPECT_EQ(gathered[r], (Values{10.0, 20.0})) << "rank " << r;
  EXPECT_EQ(dx[0], Values{4.0});
  EXPECT_EQ(dx[1], Values{6.0});
}

}  // namespace
}  // namespace diffcomm
