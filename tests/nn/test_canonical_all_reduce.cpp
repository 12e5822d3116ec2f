// canonical_all_reduce and canonical_sum: the tree's order on small cases
// worked out by hand, the bits across group sizes against an ordinary
// all_reduce whose bits change, the gradient, and the errors. (The property
// over random groups, shapes and dtypes is property_tests/test_canonical.cpp.)
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/nn/canonical_all_reduce.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm {
namespace {

using dist::ReduceOp;

sim::World make_world(int ranks, uint64_t seed = 1) {
  sim::WorldOptions opt;
  opt.ranks = ranks;
  opt.seed = seed;
  return sim::World(opt);
}

// Values whose float64 sum depends on the order: 1e16 absorbs a 1 added to
// it alone, but not 1 + 1 added first.
const std::vector<double> kChunks = {1e16, 1.0, -1e16, 1.0, 3.0, 1.0, 0.5, 1.0};

TEST(CanonicalSum, FollowsTheTreeOfTheHeader) {
  // C = 8: ((x0+x4) + (x2+x6)) + ((x1+x5) + (x3+x7))
  //      = ((1e16+3) + (-1e16+0.5)) + ((1+1) + (1+1)).
  const double a = 1e16 + 3.0, b = -1e16 + 0.5, c = 1.0 + 1.0, d = 1.0 + 1.0;
  const double expected = (a + b) + (c + d);
  Tensor x = from_vector(kChunks, {8}, DType::Float64);
  EXPECT_EQ(nn::canonical_sum(x).to_vector(), std::vector<double>{expected});
  // C = 3: (x0 + x1) + x2.
  Tensor y = from_vector({1e16, 1.0, 1.0}, {3}, DType::Float64);
  EXPECT_EQ(nn::canonical_sum(y).item(), (1e16 + 1.0) + 1.0);
  // C = 5: ((x0 + x2) + (x1 + x3)) + x4.
  Tensor z = from_vector({1.0, 2.0, 1e16, 3.0, -1e16}, {5}, DType::Float64);
  EXPECT_EQ(nn::canonical_sum(z).item(), ((1.0 + 1e16) + (2.0 + 3.0)) + -1e16);
}

// The bits of every member's result, for the 8 chunks held by `ranks` ranks.
std::vector<std::vector<double>> results(int ranks, bool canonical) {
  sim::World world = make_world(ranks);
  std::vector<std::vector<double>> got(static_cast<std::size_t>(ranks));
  world.run([&](sim::Rank& rk) {
    const int64_t k = 8 / ranks;
    Tensor all = from_vector(kChunks, {8, 1}, DType::Float64);
    Tensor mine = all.row_view(rk.rank() * k, k).copy_data();
    Tensor y = canonical ? nn::canonical_all_reduce(mine, rk.world())
                         : nn::all_reduce(reshape(nn::canonical_sum(mine), {1}), rk.world());
    got[static_cast<std::size_t>(rk.rank())] = y.to_vector();
  });
  return got;
}

TEST(CanonicalAllReduce, SameBitsOnEveryGroupSizeWhereAnAllReduceDiffers) {
  const std::vector<double> one =
      nn::canonical_sum(from_vector(kChunks, {8, 1}, DType::Float64)).to_vector();
  std::vector<std::vector<double>> plain;
  for (int ranks : {1, 2, 4, 8}) {
    SCOPED_TRACE(testing::Message() << ranks << " ranks");
    for (const auto& r : results(ranks, true)) EXPECT_EQ(r, one);
    plain.push_back(results(ranks, false)[0]);
  }
  // The ordinary form (each rank sums its own chunks, then all_reduce over
  // ranks) changes with the number of ranks on these values: the problem.
  EXPECT_NE(plain[1], plain[3]);
}

TEST(CanonicalAllReduce, OneDimensionalChunksGiveAScalarAndAvgDividesByTheChunkCount) {
  sim::World world = make_world(2);
  std::vector<Shape> shapes(2);
  std::vector<double> avg(2);
  world.run([&](sim::Rank& rk) {
    Tensor mine = from_vector({1.0 + rk.rank(), 3.0 + rk.rank()}, {2}, DType::Float64);
    Tensor y = nn::canonical_all_reduce(mine, rk.world(), ReduceOp::Avg);
    shapes[static_cast<std::size_t>(rk.rank())] = y.shape();
    avg[static_cast<std::size_t>(rk.rank())] = y.item();
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(shapes[static_cast<std::size_t>(r)], Shape{});
    EXPECT_EQ(avg[static_cast<std::size_t>(r)], (1.0 + 3.0 + 2.0 + 4.0) / 4);
  }
}

TEST(CanonicalAllReduce, EveryLocalChunkGetsTheSummedGradient) {
  sim::World world = make_world(3);
  std::vector<std::vector<double>> dx(3), dx_avg(3);
  world.run([&](sim::Rank& rk) {
    const double r = rk.rank();
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
      Tensor x = zeros({2, 2}, DType::Float64);
      x.set_requires_grad(true);
      Tensor y = nn::canonical_all_reduce(x, rk.world(), op);
      Tensor g = from_vector({r + 1, 10 * (r + 1)}, {2}, DType::Float64);
      auto& out = op == ReduceOp::Sum ? dx : dx_avg;
      out[static_cast<std::size_t>(rk.rank())] = grad({y}, {x}, {g})[0].to_vector();
    }
  });
  // sum over ranks of g: [6, 60]; Avg over C = 6 chunks: [1, 10].
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(dx[static_cast<std::size_t>(r)], (std::vector<double>{6, 60, 6, 60}));
    EXPECT_EQ(dx_avg[static_cast<std::size_t>(r)], (std::vector<double>{1, 10, 1, 10}));
  }
}

// The message of what `fn` throws on rank 0 of a world of `ranks`.
template <class F>
std::string error_of(int ranks, F fn) {
  sim::World world = make_world(ranks);
  std::string message;
  try {
    world.run([&](sim::Rank& rk) { fn(rk); });
  } catch (const std::exception& e) {
    message = e.what();
  }
  return message;
}

TEST(CanonicalAllReduce, BadArgumentsAreRefusedNamingTheOpRankAndGroup) {
  auto on_every_rank = [](auto make) {
    return [make](sim::Rank& rk) { nn::canonical_all_reduce(make(rk), rk.world()); };
  };
  std::string e = error_of(2, on_every_rank([](sim::Rank&) { return zeros({}); }));
  EXPECT_NE(e.find("nn::canonical_all_reduce"), std::string::npos) << e;
  EXPECT_NE(e.find("0-d"), std::string::npos) << e;
  EXPECT_NE(e.find("rank 0 of 2"), std::string::npos) << e;
  e = error_of(2, on_every_rank([](sim::Rank&) { return zeros({0, 3}); }));
  EXPECT_NE(e.find("no chunk on this rank"), std::string::npos) << e;
  e = error_of(
      1, [](sim::Rank& rk) { nn::canonical_all_reduce(zeros({2}), rk.world(), ReduceOp::Max); });
  EXPECT_NE(e.find("reduce op max is not canonical"), std::string::npos) << e;
  EXPECT_THROW(nn::canonical_sum(Tensor{}), InvalidArgument);
  // Members disagreeing on the number of chunks: a mismatch in the op's own
  // terms, not a hang.
  e = error_of(2, on_every_rank([](sim::Rank& rk) { return zeros({1 + rk.rank(), 4}); }));
  EXPECT_NE(e.find("nn::canonical_all_reduce"), std::string::npos) << e;
  EXPECT_NE(e.find("all_to_all_single step"), std::string::npos) << e;
  EXPECT_NE(e.find("members hold different numbers or shapes of chunks"), std::string::npos) << e;
}

}  // namespace
}  // namespace diffcomm
