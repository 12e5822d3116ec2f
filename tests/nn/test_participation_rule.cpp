// Backward collectives tied to their forward call, and the participation
// rule (issue [4/8], item 1): every rank runs the backward of every
// differentiable collective it took part in, whatever its own loss reaches,
// and a backward call names its forward call, so ranks that cannot pair
// raise CollectiveMismatch in the user's terms instead of mispairing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"
#include "gradient_program.hpp"

namespace diffcomm {
namespace {

using testing::HasSubstr;

sim::World world_of(int ranks, uint64_t seed) {
  sim::WorldOptions o;
  o.ranks = ranks;
  o.seed = seed;
  return sim::World(o);
}

Tensor one_leaf() {
  Tensor x = full({1}, 1.0, DType::Float64);
  x.set_requires_grad(true);
  return x;
}

// The program: world 2, x = 1 on both ranks;
//   y1 = all_reduce(x), y2 = all_reduce(2x); loss_r = sum(r == 0 ? y1 : y2).
// Total loss (x0 + x1) + 2 (x0 + x1): dx = 3 on both ranks (it was 2 and 4:
// rank 0's backward of y1 paired with rank 1's backward of y2).
TEST(Participation, EachRanksLossReachesADifferentCollective) {
  for (uint64_t seed : {1, 2, 3, 4}) {
    sim::World world = world_of(2, seed);
    std::vector<double> dx(2);
    world.run([&](sim::Rank& rk) {
      Tensor x = one_leaf();
      Tensor y1 = nn::all_reduce(x, rk.world());
      Tensor y2 = nn::all_reduce(scale(x, 2.0), rk.world());
      backward({sum(rk.rank() == 0 ? y1 : y2)});
      dx[static_cast<std::size_t>(rk.rank())] = x.grad().item();
    });
    EXPECT_EQ(dx, (std::vector<double>{3.0, 3.0})) << "seed " << seed;
  }
}

// One rank's loss ignores an output entirely (y2 unused on rank 1): no
// deadlock, and the gradients of the summed loss: loss_0 = y1 + y2,
// loss_1 = y1: d/dx_r = 2 (from y1) + 2 (from y2 = 2 x0 + 2 x1, rank 0's).
TEST(Participation, ARankWhoseLossIgnoresAnOutputStillRunsItsBackward) {
  sim::World world = world_of(2, 7);
  std::vector<double> dx(2);
  world.run([&](sim::Rank& rk) {
    Tensor x = one_leaf();
    Tensor y1 = nn::all_reduce(x, rk.world());
    Tensor y2 = nn::all_reduce(scale(x, 2.0), rk.world());
    backward({rk.rank() == 0 ? add(sum(y1), sum(y2)) : sum(y1)});
    dx[static_cast<std::size_t>(rk.rank())] = x.grad().item();
  });
  EXPECT_EQ(dx, (std::vector<double>{4.0, 4.0}));
}

// A rank that drops an output before its backward still runs that output's
// backward (the cohort owns it): loss_0 = y1, loss_1 = y1, y2 dropped on
// rank 1 only: dx = 2 on both (y2 contributes nothing, but both ranks
// still run its backward collective).
TEST(Participation, ADroppedOutputStillRunsItsBackward) {
  sim::World world = world_of(2, 13);
  std::vector<double> dx(2);
  world.run([&](sim::Rank& rk) {
    Tensor x = one_leaf();
    Tensor y1 = nn::all_reduce(x, rk.world());
    Tensor y2 = nn::all_reduce(scale(x, 2.0), rk.world());
    if (rk.rank() == 1) y2 = Tensor{};
    backward({sum(y1)});
    dx[static_cast<std::size_t>(rk.rank())] = x.grad().item();
  });
  EXPECT_EQ(dx, (std::vector<double>{2.0, 2.0}));
  EXPECT_EQ(world.stats(1).get("world", "all_reduce").calls, 4u);
}

// A rank with no loss at all joins through its cohort (CASES 5's rank 1).
TEST(Participation, ARankWithNoLossJoinsWithBackwardPending) {
  sim::World world = world_of(2, 3);
  std::vector<double> dx(2);
  world.run([&](sim::Rank& rk) {
    const auto r = static_cast<std::size_t>(rk.rank());
    Tensor x = full({1}, r == 0 ? 5.0 : 7.0, DType::Float64);
    x.set_requires_grad(true);
    const dist::Splits out_splits = r == 0 ? dist::Splits{1, 1} : dist::Splits{0, 0};
    Tensor out = nn::all_to_all_single(x, out_splits, {1, 0}, rk.world());
    if (r == 0)
      backward({dot(out, from_vector({2.0, 3.0}, {2}, DType::Float64))});
    else
      rk.world().cohort()->backward_pending();
    dx[r] = x.grad().item();
  });
  EXPECT_EQ(dx, (std::vector<double>{2.0, 3.0}));
}

// grad() on one output runs every pending collective too, and a later
// backward() does not run them again (released), on every rank alike.
TEST(Participation, GradThenBackwardRunEachCollectiveOnce) {
  sim::World world = world_of(2, 5);
  std::vector<double> g1(2);
  world.run([&](sim::Rank& rk) {
    Tensor x = one_leaf();
    Tensor y1 = nn::all_reduce(x, rk.world());
    Tensor y2 = nn::all_reduce(scale(x, 3.0), rk.world());
    g1[static_cast<std::size_t>(rk.rank())] = grad({sum(y1)}, {x})[0].item();
    EXPECT_THROW(backward({sum(y2)}), InvalidArgument);  // its node already ran
  });
  EXPECT_EQ(g1, (std::vector<double>{2.0, 2.0}));
  EXPECT_EQ(world.stats(0).get("world", "all_reduce").calls, 4u);  // 2 forward + 2 backward
}

// retain_graph: two backward passes run every collective twice on every
// rank, and the gradients accumulate (2 x 3 = 6).
TEST(Participation, RetainGraphRunsEveryCollectiveAgain) {
  sim::World world = world_of(2, 9);
  std::vector<double> dx(2);
  world.run([&](sim::Rank& rk) {
    Tensor x = one_leaf();
    Tensor y1 = nn::all_reduce(x, rk.world());
    Tensor y2 = nn::all_reduce(scale(x, 2.0), rk.world());
    Tensor loss = sum(rk.rank() == 0 ? y1 : y2);
    backward({loss}, {}, /*retain_graph=*/true);
    backward({loss});
    dx[static_cast<std::size_t>(rk.rank())] = x.grad().item();
  });
  EXPECT_EQ(dx, (std::vector<double>{6.0, 6.0}));
}

// Where the rule cannot apply (rank 0 discards its pending collectives, so
// only its loss's own collective runs), the backward calls name their
// forward calls: a CollectiveMismatch on both ranks, "forward call differs".
TEST(Participation, RanksThatCannotPairGetAMismatchNamingForwardCalls) {
  sim::World world = world_of(2, 11);
  try {
    world.run([&](sim::Rank& rk) {
      Tensor x = one_leaf();
      Tensor y1 = nn::all_reduce(x, rk.world());
      Tensor y2 = nn::all_reduce(scale(x, 2.0), rk.world());
      if (rk.rank() == 0) rk.world().cohort()->discard();  // on rank 0 only: misuse
      backward({sum(y1)});
    });
    FAIL() << "the mispaired backward was not reported";
  } catch (const CollectiveMismatch& e) {
    EXPECT_THAT(e.what(), HasSubstr("(backward of all_reduce #0)"));
    EXPECT_THAT(e.what(), HasSubstr("(backward of all_reduce #1)"));
    EXPECT_THAT(e.what(), HasSubstr("forward call differs"));
  }
}

// hand_off (the Python bridge's call): the graph behind the outputs leaves
// the cohort, so a later backward of another output no longer runs it, and
// the tensors its nodes saved come back (Max all_reduce: its input and
// output; Sum: none).
TEST(Participation, HandOffTakesTheGraphOutOfTheCohortAndNamesSavedTensors) {
  sim::World world = world_of(2, 17);
  world.run([&](sim::Rank& rk) {
    Tensor x = one_leaf();
    Tensor y_max = nn::all_reduce(x, rk.world(), dist::ReduceOp::Max);
    Tensor y_sum = nn::all_reduce(x, rk.world());
    const HandOff max_graph = hand_off({y_max});
    EXPECT_EQ(max_graph.collectives, 1);
    ASSERT_EQ(max_graph.saved.size(), 2u);
    EXPECT_EQ(max_graph.saved[1].data_ptr(), y_max.data_ptr());
    const HandOff sum_graph = hand_off({y_sum});
    EXPECT_EQ(sum_graph.collectives, 1);
    EXPECT_TRUE(sum_graph.saved.empty());
    EXPECT_EQ(hand_off({y_sum}).collectives, 0);  // already handed off
    EXPECT_TRUE(rk.world().cohort()->pending().empty());
    backward({sum(y_sum)});  // runs y_sum's backward only
    EXPECT_EQ(x.grad().item(), 2.0);
  });
  // 2 forward calls + 1 backward call per rank: y_max's backward never ran.
  EXPECT_EQ(world.stats(0).get("world", "all_reduce").calls, 3u);
}

}  // namespace
}  // namespace diffcomm

namespace diffcomm {
namespace {

// The kind, not the inputs (issue [4/8], item 4): 300 random programs of
// 2-6 differentiable collectives on random sub-groups of 2-6 ranks, each
// rank's loss a random subset of its outputs (none, sometimes): every rank's
// gradient equals the independent reference of the summed loss. The same
// programs run under mpirun -np 3 and 4 (tests/differential/mpi_main.cpp).
TEST(Participation, RandomProgramsMatchTheSingleRankReference) {
  int checked = 0;
  for (uint64_t seed = 1; seed <= 300; ++seed) {
    const int world_size = 2 + static_cast<int>(seed % 5);
    const differential::GradProgram p = differential::make_grad_program(world_size, seed);
    const auto want = differential::reference_gradients(p);
    sim::World world = world_of(world_size, seed);
    std::vector<std::vector<double>> got(static_cast<std::size_t>(world_size));
    try {
      world.run([&](sim::Rank& rk) {
        got[static_cast<std::size_t>(rk.rank())] = differential::run_grad_program(p, rk.world());
      });
    } catch (const Error& e) {
      FAIL() << e.what() << "\nin the program of\n" << differential::describe(p);
    }
    for (int r = 0; r < world_size; ++r)
      for (std::size_t e = 0; e < want[static_cast<std::size_t>(r)].size(); ++e)
        ASSERT_NEAR(got[static_cast<std::size_t>(r)][e], want[static_cast<std::size_t>(r)][e], 1e-9)
            << "rank " << r << " element " << e << " of\n"
            << differential::describe(p);
    ++checked;
  }
  EXPECT_EQ(checked, 300);
}

}  // namespace
}  // namespace diffcomm
