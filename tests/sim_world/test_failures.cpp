// The simulated world itself: deadlock reports, collective mismatches and injected faults.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/nn/canonical_all_reduce.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"
#include "fixtures.hpp"

namespace diffcomm {
namespace {

using namespace sim_testing;  // NOLINT(google-build-using-namespace)

// ============================================================ deadlocks

// Checks a deadlocked run: run() throws Deadlock, every rank in `blocked` has
// a Deadlock error naming every line of `report`, and the ranks in `finished`
// have no error.
void expect_deadlock(World& w, const std::function<void(Rank&)>& fn,
                     const std::vector<int>& blocked, const std::vector<int>& finished,
                     const std::vector<std::string>& report) {
  std::exception_ptr e = run_catching(w, fn);
  ASSERT_TRUE(holds<Deadlock>(e)) << "run() raised: " << what_of(e);
  for (const std::string& line : report) EXPECT_CONTAINS(what_of(e), line);
  for (int r : blocked) {
    const auto& err = w.errors()[static_cast<std::size_t>(r)];
    EXPECT_TRUE(holds<Deadlock>(err)) << "rank " << r << ": " << what_of(err);
    for (const std::string& line : report) EXPECT_CONTAINS(what_of(err), line);
    EXPECT_EQ(w.error_messages()[static_cast<std::size_t>(r)], what_of(err));
  }
  for (int r : finished)
    EXPECT_EQ(w.errors()[static_cast<std::size_t>(r)], nullptr) << "rank " << r;
}

TEST(SimDeadlock, RankSkipsACollective) {
  // Rank 2 skips the world all_reduce and waits for rank 0 in a pair group,
  // while rank 0 waits for rank 2 in the world.
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    World w(options(3, seed));
    expect_deadlock(w,
                    [](Rank& r) {
                      auto pair = r.world().new_group({0, 2}, "pair");  // world call #0
                      dist::barrier(r.world());                         // world call #1
                      Tensor t = f32({1, 2});
                      if (r.rank() == 2) {
                        dist::all_reduce(*pair, t);
                      } else {
                        dist::all_reduce(r.world(), t);  // world call #2
                        if (r.rank() == 0) dist::all_reduce(*pair, t);
                      }
                    },
                    {0, 1, 2}, {},
                    {"rank 0: waiting in all_reduce #2 on group 'world' (rank 0 of 3)",
                     "rank 1: waiting in all_reduce #2 on group 'world' (rank 1 of 3)",
                     "rank 2: waiting in all_reduce #0 on group 'pair' (rank 1 of 2)"});
  }
}

TEST(SimDeadlock, TwoGroupsEnteredInOppositeOrders) {
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    World w(options(4, seed));
    expect_deadlock(
        w,
        [](Rank& r) {
          auto a = r.world().new_group({1, 2}, "A");
          auto b = r.world().new_group({2, 1}, "B");
          if (r.rank() == 1 || r.rank() == 2) {
            Tensor t = f32({1});
            if (r.rank() == 1) {
              dist::all_reduce(*a, t);
              dist::all_reduce(*b, t);
            } else {
              dist::all_reduce(*b, t);
              dist::all_reduce(*a, t);
            }
          }
        },
        {1, 2}, {0, 3},
        {"rank 0: finished", "rank 1: waiting in all_reduce #0 on group 'A' (rank 0 of 2)",
         "rank 2: waiting in all_reduce #0 on group 'B' (rank 0 of 2)", "rank 3: finished"});
  }
}

TEST(SimDeadlock, RankReturnsEarly) {
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    World w(options(3, seed));
    expect_deadlock(
        w,
        [](Rank& r) {
          dist::barrier(r.world());
          if (r.rank() == 2) return;
          Tensor t = f32({1, 2, 3});
          dist::all_reduce(r.world(), t, ReduceOp::Max);
        },
        {0, 1}, {2},
        {"rank 0: waiting in all_reduce #1 on group 'world' (rank 0 of 3): "
         "all_reduce(float32, in=[3], op=max)",
         "rank 1: waiting in all_reduce #1 on group 'world' (rank 1 of 3)", "rank 2: finished"});
  }
}

// Each rank's pending call names the file and line of the user's code that
// made it (issue [4/7] item 5: a step with 40 all_reduces). Ranks 0 and 1
// wait in the same all_reduce, called from two lines (callers are never
// compared); rank 2 returned early.
TEST(SimDeadlock, TheReportNamesEachPendingCallsFileAndLine) {
  World w(options(3, 2));
  int line0 = 0, line1 = 0;
  expect_deadlock(w,
                  [&](Rank& r) {
                    Tensor t = f32({1, 2});
                    if (r.rank() == 0) {
                      line0 = __LINE__ + 1;
                      dist::all_reduce(r.world(), t);
                    } else if (r.rank() == 1) {
                      line1 = __LINE__ + 1;
                      dist::all_reduce(r.world(), t);
                    }
                  },
                  {0, 1}, {2}, {});
  const std::string report = w.error_messages()[0];
  const std::string file = __FILE__;
  for (const auto& [rank, line] : {std::pair{0, line0}, std::pair{1, line1}})
    EXPECT_CONTAINS(report, "rank " + std::to_string(rank) +
                                ": waiting in all_reduce #0 on group "
                                "'world' (rank " +
                                std::to_string(rank) +
                                " of 3): all_reduce("
                                "float32, in=[2], op=sum) at " +
                                file + ":" + std::to_string(line) + "\n");
}

// The differentiable ops and new_group name the user's line too, not the
// library's: a pending nn:: forward call, the backward of an nn:: op (at the
// line of its forward call), and a sub-group being created.
TEST(SimDeadlock, NnOpsAndNewGroupNameTheUsersLine) {
  const std::string file = __FILE__;
  auto pending_at = [&](int line) { return "at " + file + ":" + std::to_string(line) + "\n"; };
  {
    World w(options(2, 3));
    int line = 0;
    expect_deadlock(w,
                    [&](Rank& r) {
                      if (r.rank() == 1) return;
                      line = __LINE__ + 1;
                      (void)nn::all_reduce(f32({1, 2}), r.world());
                    },
                    {0}, {1}, {});
    EXPECT_CONTAINS(w.error_messages()[0], pending_at(line));
  }
  {
    World w(options(2, 4));
    int line = 0;
    expect_deadlock(w,
                    [&](Rank& r) {
                      Tensor x = f32({1, 2});
                      x.set_requires_grad(true);
                      line = __LINE__ + 1;
                      Tensor y = nn::canonical_all_reduce(x, r.world());
                      if (r.rank() == 0) (void)grad({sum(y)}, {x});  // rank 1 skips backward
                    },
                    {0}, {1}, {});
    EXPECT_CONTAINS(w.error_messages()[0], "all_reduce #3");  // after agreement, a2a, gather
    EXPECT_CONTAINS(w.error_messages()[0], pending_at(line));
  }
  {
    World w(options(2, 5));
    int line = 0;
    expect_deadlock(w,
                    [&](Rank& r) {
                      if (r.rank() == 1) return;
                      line = __LINE__ + 1;
                      (void)r.world().new_group({0, 1});
                    },
                    {0}, {1}, {});
    EXPECT_CONTAINS(w.error_messages()[0], "new_group #0");
    EXPECT_CONTAINS(w.error_messages()[0], pending_at(line));
  }
}

// A mismatch names where each member made its call, grouped by call site.
TEST(SimMismatch, TheReportNamesWhereEachMemberCalled) {
  World w(options(3, 4));
  int line_a = 0, line_b = 0;
  std::exception_ptr e = run_catching(w, [&](Rank& r) {
    Tensor t = f32({1, 2});
    if (r.rank() < 2) {
      line_a = __LINE__ + 1;
      dist::all_reduce(r.world(), t);
    } else {
      line_b = __LINE__ + 1;
      dist::barrier(r.world());
    }
  });
  ASSERT_TRUE(holds<CollectiveMismatch>(e)) << what_of(e);
  const std::string file = __FILE__;
  EXPECT_CONTAINS(what_of(e), "op differs\ncalled at: " + file + ":" + std::to_string(line_a) +
                                  " (ranks 0,1), " + file + ":" + std::to_string(line_b) +
                                  " (rank 2)");
}

TEST(SimDeadlock, BlockingRecvFromEachOther) {
  World w(options(2, 5));
  expect_deadlock(w,
                  [](Rank& r) {
                    Tensor t = f32({0});
                    dist::recv(r.world(), t, 1 - r.rank(), 3);
                  },
                  {0, 1}, {},
                  {"rank 0: waiting in recv #0 on group 'world'",
                   "rank 1: waiting in recv #0 on group 'world'", "peer=1, tag=3"});
}

TEST(SimDeadlock, RunRethrowsWithTheRankNamed) {
  World w(options(2));
  std::exception_ptr e = run_catching(w, [](Rank& r) {
    if (r.rank() == 0) dist::barrier(r.world());
  });
  ASSERT_TRUE(holds<Deadlock>(e));
  EXPECT_EQ(what_of(e).rfind("rank 0", 0), 0u) << what_of(e);
  // The world is reusable after a deadlock.
  EXPECT_NO_THROW(w.run([](Rank& r) { dist::barrier(r.world()); }));
  for (const auto& err : w.errors()) EXPECT_EQ(err, nullptr);
}

// ============================================================ mismatches

// World of 3; the disagreeing call runs on group g = {global 2, global 0}
// (local 0 = global 2, local 1 = global 0); global 1 is not a member and
// finishes. Every member must get a CollectiveMismatch naming both ranks and
// the field.
void expect_group_mismatch(const std::function<void(const ProcessGroup& g)>& call,
                           const std::vector<std::string>& needles) {
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    World w(options(3, seed));
    std::exception_ptr e = run_catching(w, [&](Rank& r) {
      auto g = r.world().new_group({2, 0}, "g");
      if (g) call(*g);
    });
    ASSERT_TRUE(holds<CollectiveMismatch>(e)) << "seed " << seed << ": " << what_of(e);
    for (int r : {0, 2}) {
      const auto& err = w.errors()[static_cast<std::size_t>(r)];
      EXPECT_TRUE(holds<CollectiveMismatch>(err)) << "global rank " << r << ": " << what_of(err);
      for (const std::string& n : needles) EXPECT_CONTAINS(what_of(err), n);
    }
    EXPECT_EQ(w.errors()[1], nullptr);
  }
}
const std::vector<std::string> kBothRanks = {"rank 0 (global 2)", "rank 1 (global 0)",
                                             "on group 'g'"};
std::vector<std::string> with(std::vector<std::string> v, const std::string& extra) {
  v.push_back(extra);
  return v;
}

TEST(SimMismatch, Op) {
  expect_group_mismatch(
      [](const ProcessGroup& g) {
        Tensor t = f32({1, 2});
        if (g.rank() == 0)
          dist::all_reduce(g, t);
        else
          dist::broadcast(g, t, 0);
      },
      with(with(kBothRanks, "op differs"), "called all_reduce(float32"));
}

TEST(SimMismatch, Dtype) {
  expect_group_mismatch(
      [](const ProcessGroup& g) {
        Tensor t = zeros({4}, g.rank() == 0 ? DType::Float32 : DType::Float64);
        dist::all_reduce(g, t);
      },
      with(with(kBothRanks, "dtype differs"), "float64"));
}

TEST(SimMismatch, Shape) {
  expect_group_mismatch(
      [](const ProcessGroup& g) {
        Tensor t = zeros({g.rank() == 0 ? 3 : 4});
        dist::all_reduce(g, t);
      },
      with(kBothRanks, "shape differs"));
  expect_group_mismatch(
      [](const ProcessGroup& g) {
        const Shape shape = g.rank() == 0 ? Shape{2, 2} : Shape{2, 3};
        dist::all_gather(g, {zeros(shape), zeros(shape)}, zeros(shape));
      },
      with(kBothRanks, "shape differs"));
}

TEST(SimMismatch, Root) {
  expect_group_mismatch(
      [](const ProcessGroup& g) {
        Tensor t = f32({1});
        dist::broadcast(g, t, g.rank());  // each names itself as the source
      },
      with(with(kBothRanks, "root differs"), "root=0"));
}

TEST(SimMismatch, ReduceOp) {
  expect_group_mismatch(
      [](const ProcessGroup& g) {
        Tensor t = f32({1});
        dist::all_reduce(g, t, g.rank() == 0 ? ReduceOp::Sum : ReduceOp::Max);
      },
      with(with(kBothRanks, "reduce op differs"), "op=max"));
}

TEST(SimMismatch, AllGatherVOutputSplits) {
  expect_group_mismatch(
      [](const ProcessGroup& g) {
        // Locally valid on both: input rows == splits[rank], output rows == sum.
        const dist::Splits s = g.rank() == 0 ? dist::Splits{1, 2} : dist::Splits{2, 2};
        Tensor in = zeros({s[static_cast<std::size_t>(g.rank())], 2});
        Tensor out = zeros({s[0] + s[1], 2});
        dist::all_gather_v(g, out, in, s);
      },
      with(with(kBothRanks, "output_splits differs"), "output_splits=[1,2]"));
}

TEST(SimMismatch, ReduceScatterVInputSplits) {
  expect_group_mismatch(
      [](const ProcessGroup& g) {
        const dist::Splits s = g.rank() == 0 ? dist::Splits{1, 2} : dist::Splits{3, 2};
        Tensor in = zeros({s[0] + s[1]});
        Tensor out = zeros({s[static_cast<std::size_t>(g.rank())]});
        dist::reduce_scatter_v(g, out, in, s);
      },
      with(kBothRanks, "input_splits differs"));
}

TEST(SimMismatch, AllToAllSingleCrossRankSplits) {
  // Local 0 sends 1 row to local 1; local 1 sends 2 rows to local 0, but
  // local 0 expects 1 row from it: rank 1's input_splits[0] != rank 0's
  // output_splits[1]. Each call is valid on its own.
  expect_group_mismatch(
      [](const ProcessGroup& g) {
        if (g.rank() == 0) {
          dist::all_to_all_single(g, zeros({2, 2}), zeros({2, 2}), {1, 1}, {1, 1});
        } else {
          dist::all_to_all_single(g, zeros({1, 2}), zeros({2, 2}), {1, 0}, {2, 0});
        }
      },
      {"rank 1 (global 0) sends input_splits[0] = 2 rows to rank 0 (global 2)",
       "expects output_splits[1] = 1 rows", "splits differ", "on group 'g'"});
}

TEST(SimMismatch, AllToAllShapes) {
  expect_group_mismatch(
      [](const ProcessGroup& g) {
        // Local 0 expects 2 elements from local 1, which sends it 3. Each
        // call is valid on its own (outputs[rank] has inputs[rank]'s shape).
        if (g.rank() == 0)
          dist::all_to_all(g, {zeros({1}), zeros({2})}, {zeros({1}), zeros({1})});
        else
          dist::all_to_all(g, {zeros({1}), zeros({2})}, {zeros({3}), zeros({2})});
      },
      {"rank 0 (global 2) expects outputs[1] of shape [2]",
       "rank 1 (global 0) sends inputs[0] of shape [3]", "shape differs"});
}

TEST(SimMismatch, SendRecvShape) {
  expect_group_mismatch(
      [](const ProcessGroup& g) {
        if (g.rank() == 0) {
          dist::send(g, zeros({2}), 1, 4);
        } else {
          Tensor t = zeros({3});
          dist::recv(g, t, 0, 4);
        }
      },
      {"rank 0 (global 2) sends float32[2] (tag 4)", "rank 1 (global 0) receives into float32[3]",
       "shape or dtype differs", "on group 'g'"});
  // Where each side called (issue [4/7] item 5).
  int send_line = 0, recv_line = 0;
  const std::string file = __FILE__;
  World w(options(3, 7));
  std::exception_ptr e = run_catching(w, [&](Rank& r) {
    if (r.rank() == 0) {
      send_line = __LINE__ + 1;
      dist::send(r.world(), zeros({2}), 1, 4);
    } else if (r.rank() == 1) {
      Tensor t = zeros({3});
      recv_line = __LINE__ + 1;
      dist::recv(r.world(), t, 0, 4);
    }
  });
  ASSERT_TRUE(holds<CollectiveMismatch>(e)) << what_of(e);
  EXPECT_CONTAINS(what_of(e), "called at: " + file + ":" + std::to_string(send_line) +
                                  " (rank 0), " + file + ":" + std::to_string(recv_line) +
                                  " (rank 1)");
}

TEST(SimMismatch, NewGroupMemberLists) {
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    World w(options(3, seed));
    std::exception_ptr e = run_catching(w, [](Rank& r) {
      // Rank 1 disagrees on the member list.
      if (r.rank() == 1)
        r.world().new_group({0, 1});
      else
        r.world().new_group({0, 1, 2});
    });
    ASSERT_TRUE(holds<CollectiveMismatch>(e)) << what_of(e);
    for (int r = 0; r < 3; ++r) {
      const auto& err = w.errors()[static_cast<std::size_t>(r)];
      EXPECT_TRUE(holds<CollectiveMismatch>(err)) << what_of(err);
      EXPECT_CONTAINS(what_of(err), "member list differs");
      EXPECT_CONTAINS(what_of(err), "rank 1 (global 1)");
      EXPECT_CONTAINS(what_of(err), "new_group(ranks=[0,1])");
      EXPECT_CONTAINS(what_of(err), "new_group(ranks=[0,1,2])");
    }
  }
  // Same members, other order: also a different group.
  World w(options(2));
  EXPECT_THROW(w.run([](Rank& r) {
    r.world().new_group(r.rank() == 0 ? std::vector<int>{0, 1} : std::vector<int>{1, 0});
  }),
               CollectiveMismatch);
}

// ============================================================ faults

TEST(SimFault, OtherMembersRaiseRankFailure) {
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    WorldOptions o = options(4, seed);
    o.fault = sim::Fault{2, 2};  // rank 2 fails at its 2nd call: the all_reduce
    World w(o);
    std::exception_ptr e = run_catching(w, [](Rank& r) {
      dist::barrier(r.world());
      Tensor t = f32({1});
      dist::all_reduce(r.world(), t);
      dist::barrier(r.world());
    });
    ASSERT_TRUE(holds<RankFailure>(e)) << what_of(e);
    EXPECT_CONTAINS(what_of(e), "injected fault");
    const auto msgs = w.error_messages();
    EXPECT_TRUE(holds<RankFailure>(w.errors()[2]));
    EXPECT_CONTAINS(msgs[2], "rank 2: injected fault at its call #2");
    EXPECT_CONTAINS(msgs[2], "all_reduce #1 on group 'world'");
    for (int r : {0, 1, 3}) {
      EXPECT_TRUE(holds<RankFailure>(w.errors()[static_cast<std::size_t>(r)]))
          << msgs[static_cast<std::size_t>(r)];
      EXPECT_CONTAINS(msgs[static_cast<std::size_t>(r)], "global rank 2 failed");
      EXPECT_CONTAINS(msgs[static_cast<std::size_t>(r)], "all_reduce #1 on group 'world'");
    }
  }
}

TEST(SimFault, MembersOfSubGroupsRaiseRankFailureAndOthersProceed) {
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    WorldOptions o = options(8, seed);
    o.fault = sim::Fault{5, 3};  // calls: #1, #2 new_group, #3 the first all_reduce on G
    World w(o);
    std::vector<double> h_result(8, -1);
    std::exception_ptr e = run_catching(w, [&](Rank& r) {
      auto g = r.world().new_group({6, 5, 1}, "G");
      auto h = r.world().new_group({3, 0}, "H");
      if (g) {
        Tensor t = f32({1});
        dist::all_reduce(*g, t);
        dist::all_reduce(*g, t);
      }
      if (h) {
        Tensor t = f32({static_cast<double>(r.rank())});
        dist::all_reduce(*h, t);
        dist::all_reduce(*h, t);
        h_result[static_cast<std::size_t>(r.rank())] = t.item();
      }
      Tensor t = f32({1});
      dist::all_reduce(r.world(), t);
    });
    ASSERT_TRUE(holds<RankFailure>(e)) << what_of(e);
    const auto msgs = w.error_messages();
    EXPECT_CONTAINS(msgs[5], "injected fault at its call #3");
    for (int r : {6, 1}) {
      EXPECT_TRUE(holds<RankFailure>(w.errors()[static_cast<std::size_t>(r)]));
      EXPECT_CONTAINS(msgs[static_cast<std::size_t>(r)], "on group 'G'");
      EXPECT_CONTAINS(msgs[static_cast<std::size_t>(r)], "global rank 5");
    }
    // H does not contain rank 5: its members finish their work, then fail in
    // the world collective like everybody else.
    EXPECT_EQ(h_result[0], 6.0);  // (0 + 3) summed twice over two members
    EXPECT_EQ(h_result[3], 6.0);
    for (int r : {0, 2, 3, 4, 7}) {
      EXPECT_TRUE(holds<RankFailure>(w.errors()[static_cast<std::size_t>(r)]))
          << msgs[static_cast<std::size_t>(r)];
      EXPECT_CONTAINS(msgs[static_cast<std::size_t>(r)], "on group 'world'");
    }
  }
}

TEST(SimFault, FaultInNewGroupAndInPointToPoint) {
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    WorldOptions o = options(3, seed);
    o.fault = sim::Fault{0, 1};  // the new_group itself
    World w(o);
    EXPECT_THROW(w.run([](Rank& r) { r.world().new_group({1, 2}); }), RankFailure);
    for (const auto& err : w.errors()) EXPECT_TRUE(holds<RankFailure>(err));

    o.fault = sim::Fault{1, 1};  // a send
    World w2(o);
    EXPECT_THROW(w2.run([](Rank& r) {
      Tensor t = f32({1});
      if (r.rank() == 1) dist::send(r.world(), t, 0);
      if (r.rank() == 0) dist::recv(r.world(), t, 1);
    }),
                 RankFailure);
    EXPECT_TRUE(holds<RankFailure>(w2.errors()[0]));
    EXPECT_TRUE(holds<RankFailure>(w2.errors()[1]));
  }
}

TEST(SimFault, AnOrdinaryExceptionOnOneRankReleasesTheOthers) {
  World w(options(3, 2));
  std::exception_ptr e = run_catching(w, [](Rank& r) {
    if (r.rank() == 1) throw std::runtime_error("user code failed");
    dist::barrier(r.world());
  });
  ASSERT_NE(e, nullptr);
  EXPECT_CONTAINS(what_of(e), "rank 1: user code failed");
  EXPECT_TRUE(holds<RankFailure>(w.errors()[0]));
  EXPECT_TRUE(holds<RankFailure>(w.errors()[2]));
  EXPECT_CONTAINS(w.error_messages()[0], "user code failed");
}

}  // namespace
}  // namespace diffcomm
