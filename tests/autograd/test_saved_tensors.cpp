// Saved tensors are versioned (issue [4/8], item 2): an in-place write to a
// tensor a node saved for backward, after the forward used it, raises at
// backward (torch's rule) instead of computing the gradient from the new
// values; a write before the forward use stays allowed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm {
namespace {

using dist::ReduceOp;
using testing::HasSubstr;

sim::World world_of(int ranks) {
  sim::WorldOptions o;
  o.ranks = ranks;
  return sim::World(o);
}

Tensor leaf(double v) {
  Tensor x = full({1}, v, DType::Float64);
  x.set_requires_grad(true);
  return x;
}

// Runs fn on a world of 2 and returns each rank's error message ("" when
// it finished).
template <class F>
std::vector<std::string> errors_of(F fn) {
  sim::World world = world_of(2);
  try {
    world.run(fn);
  } catch (const Error&) {
  }
  return world.error_messages();
}

// The DDP buffer-sync pattern: x = [2] / [3], buf = [5] / [7]; loss =
// sum(x * buf); then broadcast(buf, 0) in place; backward. Rank 1's dx must
// be 7 (the value the forward used); it was 5. Now: the documented error.
TEST(SavedTensors, ABufferBroadcastAfterItsForwardUseRaises) {
  const auto errors = errors_of([](sim::Rank& rk) {
    Tensor x = leaf(rk.rank() == 0 ? 2.0 : 3.0);
    Tensor buf = full({1}, rk.rank() == 0 ? 5.0 : 7.0, DType::Float64);
    Tensor loss = sum(mul(x, buf));
    dist::broadcast(rk.world(), buf, 0);
    backward({loss});
  });
  for (const std::string& e : errors) {
    EXPECT_THAT(e, HasSubstr("modified by an inplace operation: [MulBackward] saved tensor 1"));
    EXPECT_THAT(e, testing::ContainsRegex("is at version [0-9]+; expected version [0-9]+ instead"));
  }
}

// The same write before the forward use is fine: dx = buf after the
// broadcast, 5 on both ranks.
TEST(SavedTensors, AWriteBeforeTheForwardUseIsAllowed) {
  sim::World world = world_of(2);
  std::vector<double> dx(2);
  world.run([&](sim::Rank& rk) {
    Tensor x = leaf(rk.rank() == 0 ? 2.0 : 3.0);
    Tensor buf = full({1}, rk.rank() == 0 ? 5.0 : 7.0, DType::Float64);
    dist::broadcast(rk.world(), buf, 0);
    backward({sum(mul(x, buf))});
    dx[static_cast<std::size_t>(rk.rank())] = x.grad().item();
  });
  EXPECT_EQ(dx, (std::vector<double>{5.0, 5.0}));
}

// A Product (or Max) all_reduce whose input is then all-reduced in place:
// the gradient needs the forward's x (Product: 6 / 4, Max: 0 / 2 for x =
// 2 / 3); it gave 10/10 and 1/1. Now the documented error, raised before
// any backward collective.
TEST(SavedTensors, AReductionInputRewrittenInPlaceRaises) {
  for (ReduceOp op : {ReduceOp::Product, ReduceOp::Max}) {
    const auto errors = errors_of([op](sim::Rank& rk) {
      Tensor x = leaf(rk.rank() == 0 ? 2.0 : 3.0);
      Tensor y = nn::all_reduce(x, rk.world(), op);
      dist::all_reduce(rk.world(), x);  // in place, after the forward used x
      backward({sum(y)});
    });
    for (const std::string& e : errors)
      EXPECT_THAT(e, HasSubstr("[AllReduceBackward] saved tensor 0")) << dist::reduce_op_name(op);
  }
}

// Untouched, the same programs give the right gradients.
TEST(SavedTensors, UntouchedReductionsGiveTheirGradients) {
  for (ReduceOp op : {ReduceOp::Product, ReduceOp::Max}) {
    sim::World world = world_of(2);
    std::vector<double> dx(2);
    world.run([&](sim::Rank& rk) {
      Tensor x = leaf(rk.rank() == 0 ? 2.0 : 3.0);
      backward({sum(nn::all_reduce(x, rk.world(), op))});
      dx[static_cast<std::size_t>(rk.rank())] = x.grad().item();
    });
    // Product: d(sum over 2 ranks of x0 x1)/dx_r = 2 x_other; Max: 2 to rank 1.
    const std::vector<double> want =
        op == ReduceOp::Product ? std::vector<double>{6.0, 4.0} : std::vector<double>{0.0, 2.0};
    EXPECT_EQ(dx, want) << dist::reduce_op_name(op);
  }
}

TEST(SavedTensors, FillAndCopyBumpTheVersionOfEveryView) {
  Tensor t = zeros({4}, DType::Float32);
  Tensor row = t.row_view(1, 2);
  const uint64_t v0 = t.version();
  row.fill_(1.0);
  EXPECT_EQ(t.version(), v0 + 1);
  t.copy_(full({4}, 2.0));
  EXPECT_EQ(row.version(), v0 + 2);
}

}  // namespace
}  // namespace diffcomm
