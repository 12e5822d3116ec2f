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
  // Members that disagree, whatever the slices would fit, get
  // CollectiveMismatch from the agreement step (found by a new user: [2, 3]
  // against [2, 4] chunks, or sum against avg, gave wrong sums silently).
  auto mismatch_of = [](auto make_x, auto op_of) {
    sim::World world = make_world(2);
    std::vector<std::string> kinds(2), messages(2);
    world.run([&](sim::Rank& rk) {
      const auto r = static_cast<std::size_t>(rk.rank());
      try {
        nn::canonical_all_reduce(make_x(rk), rk.world(), op_of(rk));
      } catch (const CollectiveMismatch& e) {
        kinds[r] = "CollectiveMismatch";
        messages[r] = e.what();
      } catch (const InvalidArgument& e) {
        kinds[r] = "InvalidArgument";
        messages[r] = e.what();
      }
    });
    return std::pair{kinds, messages};
  };
  auto sum_op = [](sim::Rank&) { return ReduceOp(ReduceOp::Sum); };
  {
    auto [kinds, msgs] = mismatch_of(
        [](sim::Rank& rk) {
          return zeros({2, 3 + rk.rank()}, DType::Float64);
        },
        sum_op);
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(kinds[static_cast<std::size_t>(r)], "CollectiveMismatch") << msgs[0];
      EXPECT_NE(msgs[static_cast<std::size_t>(r)].find("agreement step"), std::string::npos);
    }
    EXPECT_NE(msgs[0].find("rank 1 (global 1) 2 chunks of [4] float64, op sum, this rank 2 "
                           "chunks of [3] float64, op sum"),
              std::string::npos)
        << msgs[0];
  }
  {
    auto [kinds, msgs] = mismatch_of(
        [](sim::Rank&) {
          return zeros({2, 3});
        },
        [](sim::Rank& rk) {
          return rk.rank() == 0 ? ReduceOp(ReduceOp::Sum) : ReduceOp(ReduceOp::Avg);
        });
    EXPECT_EQ(kinds, (std::vector<std::string>{"CollectiveMismatch", "CollectiveMismatch"}));
    EXPECT_NE(msgs[0].find("op avg"), std::string::npos) << msgs[0];
  }
  {  // one member without chunks: it refuses, its peer learns at once
    auto [kinds, msgs] = mismatch_of(
        [](sim::Rank& rk) {
          return zeros({rk.rank() == 0 ? 0 : 2, 3});
        },
        sum_op);
    EXPECT_EQ(kinds, (std::vector<std::string>{"InvalidArgument", "CollectiveMismatch"}));
    EXPECT_NE(msgs[0].find("no chunk on this rank"), std::string::npos) << msgs[0];
    EXPECT_NE(msgs[1].find("rank 0 (global 0) refused its own arguments"), std::string::npos)
        << msgs[1];
  }
  {  // members holding different chunk counts
    auto [kinds, msgs] = mismatch_of(
        [](sim::Rank& rk) {
          return zeros({1 + rk.rank(), 4});
        },
        sum_op);
    EXPECT_EQ(kinds, (std::vector<std::string>{"CollectiveMismatch", "CollectiveMismatch"}));
  }
  // Avg of integers has no meaning here, as in all_reduce.
  e = error_of(1, [](sim::Rank& rk) {
    nn::canonical_all_reduce(zeros({2, 3}, DType::Int64), rk.world(), ReduceOp::Avg);
  });
  EXPECT_NE(e.find("avg is undefined for integer dtype int64"), std::string::npos) << e;
  EXPECT_THROW(nn::canonical_sum(zeros({2}, DType::Int32), ReduceOp::Avg), InvalidArgument);
  // canonical_sum with Avg is the single-rank reference of the op's Avg.
  sim::World world = make_world(2);
  std::vector<std::vector<double>> avg(2);
  const Tensor all = from_vector({1e16, 1.0, -1e16, 3.0}, {4}, DType::Float64);
  world.run([&](sim::Rank& rk) {
    avg[static_cast<std::size_t>(rk.rank())] =
        nn::canonical_all_reduce(all.row_view(2 * rk.rank(), 2).copy_data(), rk.world(),
                                 ReduceOp::Avg)
            .to_vector();
  });
  EXPECT_EQ(avg[0], nn::canonical_sum(all, ReduceOp::Avg).to_vector());
  EXPECT_EQ(avg[1], avg[0]);
}

}  // namespace
}  // namespace diffcomm
