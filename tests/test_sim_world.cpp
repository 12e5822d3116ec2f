// The simulated world itself: deadlock reports, collective mismatches, fault
// injection, determinism, schedules, traffic counters, traces and the cost
// model, device meshes, local validation before communication, and scale.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "diffcomm/dist/collectives.hpp"
#include "diffcomm/dist/flight_recorder.hpp"
#include "diffcomm/dist/mesh.hpp"
#include "diffcomm/error.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor.hpp"
#include "scheduler.hpp"  // sim/src: the seeded scheduling algorithm

namespace diffcomm {
namespace {

using dist::ProcessGroup;
using dist::ReduceOp;
using sim::Rank;
using sim::World;
using sim::WorldOptions;

// Note: rank functions run as fibers on one OS thread, so no SCOPED_TRACE in
// them (gtest's trace stack is per thread); context goes into messages.

WorldOptions options(int ranks, uint64_t seed = 1) {
  WorldOptions o;
  o.ranks = ranks;
  o.seed = seed;
  return o;
}

template <class E>
bool holds(const std::exception_ptr& e) {
  if (!e) return false;
  try {
    std::rethrow_exception(e);
  } catch (const E&) {
    return true;
  } catch (...) {
    return false;
  }
}

std::string what_of(const std::exception_ptr& e) {
  if (!e) return "";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}
#define EXPECT_CONTAINS(haystack, needle)                                                        \
  EXPECT_TRUE(contains((haystack), (needle))) << "expected to find \"" << (needle) << "\" in:\n" \
                                              << (haystack)

/// Runs fn and returns the exception run() raised (null if none).
std::exception_ptr run_catching(World& w, const std::function<void(Rank&)>& fn) {
  try {
    w.run(fn);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

Tensor f32(const std::vector<double>& v) {
  return from_vector(v, {static_cast<int64_t>(v.size())}, DType::Float32);
}

// ============================================================ options

TEST(SimWorldOptions, InvalidOptionsAreRejected) {
  auto make = [](WorldOptions o) { World w(o); };
  EXPECT_THROW(make(options(0)), InvalidArgument);
  EXPECT_THROW(make(options(16385)), InvalidArgument);
  WorldOptions o = options(4);
  o.fault = sim::Fault{4, 1};
  EXPECT_THROW(make(o), InvalidArgument);
  o.fault = sim::Fault{-1, 1};
  EXPECT_THROW(make(o), InvalidArgument);
  o.fault = sim::Fault{1, 0};
  EXPECT_THROW(make(o), InvalidArgument);
  o = options(4);
  o.stack_size = 1024;
  EXPECT_THROW(make(o), InvalidArgument);
  o = options(4);
  o.cost.bandwidth_gbps = 0;
  EXPECT_THROW(make(o), InvalidArgument);
  EXPECT_NO_THROW(make(options(1)));
  EXPECT_NO_THROW(make(options(16384)));
}

// Ranks that catch diffcomm's errors and keep calling: after an injected
// fault the members drift apart (the faulted rank's call number moved on),
// so calls deadlock and a member may arrive at a call that already failed
// for the others. It raises that call's error; it does not join it (that
// read the others' unwound calls: a use after free, found by a hostile test).
TEST(SimWorld, RanksThatCatchErrorsAndGoOnNeverTouchAFailedCall) {
  for (int n : {2, 3, 4, 5, 8})
    for (int at : {1, 2, 3}) {
      sim::WorldOptions o;
      o.ranks = n;
      o.seed = static_cast<uint64_t>(at);
      o.fault = sim::Fault{0, at};
      sim::World world(o);
      std::vector<int> errors(static_cast<std::size_t>(n));
      world.run([&](sim::Rank& rank) {
        for (int i = 0; i < 10; ++i) {
          try {
            Tensor t = full({2}, 1.0);
            dist::all_reduce(rank.world(), t);
          } catch (const Error&) {
            ++errors[static_cast<std::size_t>(rank.rank())];
          }
        }
      });
      for (int r = 0; r < n; ++r)
        EXPECT_GT(errors[static_cast<std::size_t>(r)], 0) << "world " << n << ", rank " << r;
    }
}

TEST(SimWorld, RanksAndWorldGroup) {
  World w(options(5, 3));
  std::vector<int> seen(5, -1);
  w.run([&](Rank& r) {
    EXPECT_EQ(r.world_size(), 5);
    EXPECT_EQ(r.world().size(), 5);
    EXPECT_EQ(r.world().rank(), r.rank());
    EXPECT_EQ(r.world().name(), "world");
    EXPECT_EQ(r.world().backend().backend_name(), "sim");
    EXPECT_EQ(r.world().members(), (std::vector<int>{0, 1, 2, 3, 4}));
    EXPECT_EQ(&r.stats(), &r.world().stats());
    seen[static_cast<std::size_t>(r.rank())] = r.rank();
  });
  EXPECT_EQ(seen, (std::vector<int>{0, 1, 2, 3, 4}));
  for (const auto& e : w.errors()) EXPECT_EQ(e, nullptr);
  for (const auto& m : w.error_messages()) EXPECT_EQ(m, "");
}

TEST(SimWorld, PerRankGeneratorsAreSeededByWorldSeedAndRank) {
  auto draws = [](uint64_t seed) {
    World w(options(3, seed));
    std::vector<uint64_t> out(3);
    w.run([&](Rank& r) { out[static_cast<std::size_t>(r.rank())] = r.generator().next_u64(); });
    return out;
  };
  const auto a = draws(11), b = draws(11), c = draws(12);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(a[0], a[1]);
  EXPECT_NE(a[1], a[2]);
}

TEST(SimWorld, BarrierHoldsEveryRankUntilAllArrive) {
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    World w(options(6, seed));
    int arrived = 0;
    std::vector<int> seen_after(6, -1);
    w.run([&](Rank& r) {
      ++arrived;  // all fibers share this thread: plain shared state is fine
      dist::barrier(r.world());
      seen_after[static_cast<std::size_t>(r.rank())] = arrived;
    });
    EXPECT_EQ(seen_after, std::vector<int>(6, 6)) << "seed " << seed;
  }
}

TEST(SimWorld, SplitByColorAndKey) {
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    World w(options(5, seed));
    w.run([](Rank& r) {
      // Rank 0 opts out (color < 0); the others split by parity, ordered by
      // descending rank (key = -rank).
      const int color = r.rank() == 0 ? -1 : r.rank() % 2;
      auto g = r.world().split(color, -r.rank(), {7}, "half");
      EXPECT_EQ(g.has_value(), r.rank() != 0);
      if (!g) return;
      const std::vector<int> expected =
          color == 0 ? std::vector<int>{4, 2} : std::vector<int>{3, 1};
      EXPECT_EQ(g->members(), expected);
      EXPECT_EQ(g->name(), "half");
      EXPECT_EQ(g->global_rank(g->rank()), r.rank());
      Tensor t = f32({static_cast<double>(r.rank())});
      dist::all_reduce(*g, t);
      EXPECT_EQ(t.item(), color == 0 ? 6.0 : 4.0);
    });
  }
  World w(options(2));
  EXPECT_THROW(
      w.run([](Rank& r) { r.world().split(0, 0, {r.rank() == 0 ? int64_t{1} : int64_t{2}}, "x"); }),
      CollectiveMismatch);
}

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
        if (g.rank() == 0)
          dist::send(g, zeros({2}), 1, 4);
        else {
          Tensor t = zeros({3});
          dist::recv(g, t, 0, 4);
        }
      },
      {"rank 0 (global 2) sends float32[2] (tag 4)", "rank 1 (global 0) receives into float32[3]",
       "shape or dtype differs", "on group 'g'"});
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

// ============================================================ determinism

// 8 ranks, several groups, collectives interleaving across groups. Returns a
// per-rank checksum of the data so results can be compared across schedules.
std::vector<double> workload(World& w) {
  std::vector<double> sums(static_cast<std::size_t>(w.options().ranks), 0);
  w.run([&](Rank& r) {
    const ProcessGroup& world = r.world();
    auto evens = world.new_group({6, 4, 2, 0}, "evens");
    auto odds = world.new_group({1, 3, 5, 7}, "odds");
    auto trio = world.new_group({3, 1, 6}, "trio");
    auto& mine = evens ? *evens : *odds;
    double sum = 0;
    for (int it = 0; it < 3; ++it) {
      Tensor t = f32({static_cast<double>(r.rank() + it)});
      dist::all_reduce(mine, t);
      sum += t.item();
      if (trio) {
        std::vector<Tensor> outs = {zeros({1}), zeros({1}), zeros({1})};
        dist::all_gather(*trio, outs, f32({static_cast<double>(r.rank())}));
        for (auto& o : outs) sum += o.item();
      }
      Tensor a = f32({static_cast<double>(r.rank())});
      dist::broadcast(mine, a, it % 4);
      sum += a.item();
      dist::barrier(world);
      Tensor x = full({8, 1}, r.rank(), DType::Float32), y = zeros({8, 1});
      dist::all_to_all_single(world, y, x);
      for (double v : y.to_vector()) sum += v;
    }
    sums[static_cast<std::size_t>(r.rank())] = sum;
  });
  return sums;
}

TEST(SimDeterminism, SameSeedSameTraceDifferentSeedsDifferentInterleavings) {
  WorldOptions o = options(8, 42);
  World a(o), b(o);
  const auto ra = workload(a);
  const auto rb = workload(b);
  EXPECT_EQ(ra, rb);
  EXPECT_EQ(a.trace_hash(), b.trace_hash());
  ASSERT_EQ(a.trace().size(), b.trace().size());
  ASSERT_FALSE(a.trace().empty());
  for (std::size_t i = 0; i < a.trace().size(); ++i) {
    const auto &x = a.trace()[i], &y = b.trace()[i];
    EXPECT_EQ(x.op, y.op) << i;
    EXPECT_EQ(x.group, y.group) << i;
    EXPECT_EQ(x.seq, y.seq) << i;
    EXPECT_EQ(x.rank, y.rank) << i;
    EXPECT_EQ(x.start_us, y.start_us) << i;
    EXPECT_EQ(x.duration_us, y.duration_us) << i;
    EXPECT_EQ(x.bytes_sent, y.bytes_sent) << i;
    EXPECT_EQ(x.bytes_received, y.bytes_received) << i;
  }
  // Rerunning one World reproduces its own hash too.
  workload(a);
  EXPECT_EQ(a.trace_hash(), b.trace_hash());

  std::set<uint64_t> hashes;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    World w(options(8, seed));
    EXPECT_EQ(workload(w), ra) << "results do not depend on the interleaving (seed " << seed << ")";
    hashes.insert(w.trace_hash());
  }
  EXPECT_EQ(hashes.size(), 6u) << "six seeds should give six interleavings";
}

TEST(SimDeterminism, RoundRobinScheduleIgnoresTheSeed) {
  WorldOptions o = options(8, 1);
  o.schedule = sim::Schedule::RoundRobin;
  World a(o);
  o.seed = 99;
  World b(o);
  World reference(options(8, 7));
  const auto expected = workload(reference);
  EXPECT_EQ(workload(a), expected);
  EXPECT_EQ(workload(b), expected);
  EXPECT_EQ(a.trace_hash(), b.trace_hash());
}

// ============================================================ stats

TEST(SimStats, CallsAndBytesFollowTheDocumentedClosedForms) {
  constexpr int N = 4;
  World w(options(N, 9));
  w.run([](Rank& r) {
    const ProcessGroup& g = r.world();
    const int me = r.rank();
    auto sub = g.new_group({3, 1}, "sub");
    Tensor t = zeros({6});  // 24 bytes
    dist::barrier(g);
    dist::all_reduce(g, t);
    dist::broadcast(g, t, 1);
    dist::reduce(g, t, 2);
    std::vector<Tensor> four = {zeros({6}), zeros({6}), zeros({6}), zeros({6})};
    dist::all_gather(g, four, t);
    dist::all_gather_single(g, zeros({24}), t);
    const dist::Splits splits = {1, 0, 2, 3};  // rows of float64[., 2]: 16 bytes a row
    dist::all_gather_v(g, zeros({6, 2}, DType::Float64),
                       zeros({splits[static_cast<std::size_t>(me)], 2}, DType::Float64), splits);
    dist::gather(g, me == 0 ? four : std::vector<Tensor>{}, t, 0);
    dist::scatter(g, t, me == 3 ? four : std::vector<Tensor>{}, 3);
    dist::reduce_scatter(g, t, four);
    dist::reduce_scatter_single(g, t, zeros({24}));
    dist::reduce_scatter_v(g, zeros({splits[static_cast<std::size_t>(me)], 2}, DType::Float64),
                           zeros({6, 2}, DType::Float64), splits);
    // all_to_all: inputs[j] on i has (i + j) % 3 int32 elements.
    std::vector<Tensor> ins, outs;
    for (int j = 0; j < N; ++j) ins.push_back(zeros({(me + j) % 3}, DType::Int32));
    for (int s = 0; s < N; ++s) outs.push_back(zeros({(s + me) % 3}, DType::Int32));
    dist::all_to_all(g, outs, ins);
    // all_to_all_single: member i sends (i + 2j + 1) % 3 rows of int64[., 2] to j.
    dist::Splits in_s, out_s;
    int64_t in_rows = 0, out_rows = 0;
    for (int j = 0; j < N; ++j) in_rows += in_s.emplace_back((me + 2 * j + 1) % 3);
    for (int s = 0; s < N; ++s) out_rows += out_s.emplace_back((s + 2 * me + 1) % 3);
    dist::all_to_all_single(g, zeros({out_rows, 2}, DType::Int64),
                            zeros({in_rows, 2}, DType::Int64), out_s, in_s);
    if (me == 0) dist::send(g, zeros({5}, DType::UInt8), 1);
    if (me == 1) {
      Tensor u = zeros({5}, DType::UInt8);
      dist::recv(g, u, 0);
    }
    if (sub) dist::all_reduce(*sub, t);
  });

  for (int me = 0; me < N; ++me) {
    const dist::Stats& s = w.stats(me);
    auto check = [&](const std::string& group, const std::string& op, uint64_t calls, uint64_t sent,
                     uint64_t received) {
      const dist::OpStats got = s.get(group, op);
      EXPECT_EQ(got.calls, calls) << "rank " << me << " " << group << " " << op;
      EXPECT_EQ(got.bytes_sent, sent) << "rank " << me << " " << group << " " << op << " sent";
      EXPECT_EQ(got.bytes_received, received)
          << "rank " << me << " " << group << " " << op << " received";
    };
    const uint64_t B = 24;
    check("world", "new_group", 1, 0, 0);
    check("world", "barrier", 1, 0, 0);
    check("world", "all_reduce", 1, 2 * (N - 1) * B / N, 2 * (N - 1) * B / N);  // 36, 36
    check("world", "broadcast", 1, me == 1 ? (N - 1) * B : 0, me == 1 ? 0 : B);
    check("world", "reduce", 1, me == 2 ? 0 : B, me == 2 ? (N - 1) * B : 0);
    check("world", "all_gather", 1, (N - 1) * B, (N - 1) * B);
    check("world", "all_gather_single", 1, (N - 1) * B, (N - 1) * B);
    const uint64_t rows_me = std::vector<uint64_t>{1, 0, 2, 3}[static_cast<std::size_t>(me)];
    check("world", "all_gather_v", 1, (N - 1) * rows_me * 16, (6 - rows_me) * 16);
    check("world", "gather", 1, me == 0 ? 0 : B, me == 0 ? (N - 1) * B : 0);
    check("world", "scatter", 1, me == 3 ? (N - 1) * B : 0, me == 3 ? 0 : B);
    check("world", "reduce_scatter", 1, (N - 1) * B, (N - 1) * B);
    check("world", "reduce_scatter_single", 1, (N - 1) * B, (N - 1) * B);
    check("world", "reduce_scatter_v", 1, (6 - rows_me) * 16, (N - 1) * rows_me * 16);
    uint64_t a2a_sent = 0, a2a_recv = 0, a2as_sent = 0, a2as_recv = 0;
    for (int j = 0; j < N; ++j) {
      if (j == me) continue;
      a2a_sent += static_cast<uint64_t>((me + j) % 3) * 4;
      a2a_recv += static_cast<uint64_t>((j + me) % 3) * 4;
      a2as_sent += static_cast<uint64_t>((me + 2 * j + 1) % 3) * 16;
      a2as_recv += static_cast<uint64_t>((j + 2 * me + 1) % 3) * 16;
    }
    check("world", "all_to_all", 1, a2a_sent, a2a_recv);
    check("world", "all_to_all_single", 1, a2as_sent, a2as_recv);
    check("world", "send", me == 0 ? 1 : 0, me == 0 ? 5 : 0, 0);
    check("world", "recv", me == 1 ? 1 : 0, 0, me == 1 ? 5 : 0);
    const bool in_sub = me == 1 || me == 3;
    check("sub", "all_reduce", in_sub ? 1 : 0, in_sub ? B : 0, in_sub ? B : 0);  // 2(2-1)/2 * 24
    EXPECT_EQ(s.total("all_reduce").calls, in_sub ? 2u : 1u);
    EXPECT_EQ(s.total().calls, 15u + (me <= 1 ? 1u : 0u) + (in_sub ? 1u : 0u));
  }
  // The trace carries the same per-call bytes as the counters, and each end
  // of the send/recv pair under its own op.
  int sends = 0, recvs = 0;
  for (const sim::TraceEvent& e : w.trace()) {
    if (e.op == "send") {
      ++sends;
      EXPECT_EQ(e.rank, 0);
      EXPECT_EQ(e.bytes_sent, 5u);
    }
    if (e.op == "recv") {
      ++recvs;
      EXPECT_EQ(e.rank, 1);
      EXPECT_EQ(e.bytes_received, 5u);
    }
    if (e.op != "all_reduce" || e.group != "world") continue;
    EXPECT_EQ(e.bytes_sent, 36u);
    EXPECT_EQ(e.bytes_received, 36u);
  }
  EXPECT_EQ(sends, 1);
  EXPECT_EQ(recvs, 1);
  EXPECT_THROW(w.stats(N), InvalidArgument);
}

TEST(SimStats, ResetOnEveryRun) {
  World w(options(2));
  auto fn = [](Rank& r) { dist::barrier(r.world()); };
  w.run(fn);
  w.run(fn);
  EXPECT_EQ(w.stats(0).get("world", "barrier").calls, 1u);
  EXPECT_EQ(w.trace().size(), 2u);
}

// ============================================================ trace

TEST(SimTrace, WriteTraceProducesChromeTraceJson) {
  World w(options(3, 4));
  w.run([](Rank& r) {
    auto sub = r.world().new_group({2, 0}, "sub");
    dist::barrier(r.world());
    Tensor t = f32({1, 2});
    dist::all_reduce(r.world(), t);
    if (sub) {
      std::vector<Tensor> outs = {zeros({2}), zeros({2})};
      dist::all_gather(*sub, outs, t);
    }
  });
  // barrier 3 + all_reduce 3 + all_gather 2 events (new_group moves no data
  // and is not traced).
  ASSERT_EQ(w.trace().size(), 8u);
  const std::string path = testing::TempDir() + "diffcomm_sim_world_trace.json";
  w.write_trace(path);
  std::ifstream in(path);
  ASSERT_TRUE(in.good());
  nlohmann::json doc;
  ASSERT_NO_THROW(doc = nlohmann::json::parse(in));
  ASSERT_TRUE(doc.contains("traceEvents"));
  ASSERT_TRUE(doc["traceEvents"].is_array());
  int complete = 0, thread_names = 0;
  std::map<std::string, int> per_op;
  for (const auto& e : doc["traceEvents"]) {
    ASSERT_TRUE(e.contains("ph"));
    if (e["ph"] == "M") {
      EXPECT_EQ(e["name"], "thread_name");
      ++thread_names;
      continue;
    }
    ASSERT_EQ(e["ph"], "X");
    ++complete;
    per_op[e["name"].get<std::string>()]++;
    EXPECT_GE(e["tid"].get<int>(), 0);
    EXPECT_LT(e["tid"].get<int>(), 3);
    EXPECT_GE(e["ts"].get<double>(), 0.0);
    EXPECT_GE(e["dur"].get<double>(), 0.0);
    ASSERT_TRUE(e.contains("args"));
    EXPECT_TRUE(e["args"].contains("seq"));
    EXPECT_TRUE(e["args"].contains("group"));
    EXPECT_TRUE(e["args"].contains("bytes_sent"));
    if (e["name"] == "all_gather") {
      EXPECT_EQ(e["args"]["group"], "sub");
      EXPECT_NE(e["tid"], 1);
    }
  }
  EXPECT_EQ(thread_names, 3);
  EXPECT_EQ(complete, 8);
  EXPECT_EQ(per_op["barrier"], 3);
  EXPECT_EQ(per_op["all_reduce"], 3);
  EXPECT_EQ(per_op["all_gather"], 2);
  std::remove(path.c_str());
  EXPECT_THROW(w.write_trace("/nonexistent-dir/x/trace.json"), InvalidArgument);
}

TEST(SimTrace, DisabledTraceKeepsNoEvents) {
  WorldOptions o = options(2);
  o.trace = false;
  World w(o);
  w.run([](Rank& r) { dist::barrier(r.world()); });
  EXPECT_TRUE(w.trace().empty());
  EXPECT_EQ(w.stats(0).get("world", "barrier").calls, 1u);
}

// ============================================================ cost model

TEST(SimCost, SingleAllReduceFollowsTheAlphaBetaModel) {
  WorldOptions o = options(4, 3);
  o.cost.alpha_us = 2.0;
  o.cost.bandwidth_gbps = 10.0;  // 1e4 bytes per microsecond
  // float32[1000] = 4000 bytes; all_reduce moves 2(N-1)/N of it each way =
  // 6000 bytes over 2(N-1) = 6 steps: 6 * 2 us + 6000 / 1e4 us = 12.6 us.
  const double expected = 6 * 2.0 + 6000.0 / 1e4;
  {
    World w(o);
    std::vector<double> clocks(4);
    w.run([&](Rank& r) {
      EXPECT_EQ(r.now_us(), 0.0);
      Tensor t = zeros({1000});
      dist::all_reduce(r.world(), t);
      clocks[static_cast<std::size_t>(r.rank())] = r.now_us();
    });
    EXPECT_DOUBLE_EQ(w.sim_time_us(), expected);
    for (double c : clocks) EXPECT_DOUBLE_EQ(c, expected);
    ASSERT_EQ(w.trace().size(), 4u);
    for (const auto& e : w.trace()) {
      EXPECT_DOUBLE_EQ(e.start_us, 0.0);
      EXPECT_DOUBLE_EQ(e.duration_us, expected);
    }
  }
  {  // The collective starts when its last member arrives.
    World w(o);
    w.run([&](Rank& r) {
      if (r.rank() == 3) r.advance_us(5.0);
      EXPECT_THROW(r.advance_us(-1.0), InvalidArgument);
      Tensor t = zeros({1000});
      dist::all_reduce(r.world(), t);
      EXPECT_DOUBLE_EQ(r.now_us(), 5.0 + expected);
    });
    EXPECT_DOUBLE_EQ(w.sim_time_us(), 5.0 + expected);
    for (const auto& e : w.trace()) EXPECT_DOUBLE_EQ(e.start_us, 5.0);
  }
  {  // barrier: N-1 steps, no bytes; send: 1 step; one rank: free.
    World w(o);
    w.run([&](Rank& r) {
      dist::barrier(r.world());
      EXPECT_DOUBLE_EQ(r.now_us(), 3 * 2.0);
      Tensor t = zeros({250});  // 1000 bytes
      if (r.rank() == 0) dist::send(r.world(), t, 1);
      if (r.rank() == 1) dist::recv(r.world(), t, 0);
      if (r.rank() <= 1) {
        EXPECT_DOUBLE_EQ(r.now_us(), 6.0 + 2.0 + 1000.0 / 1e4);
      }
    });
    EXPECT_DOUBLE_EQ(w.sim_time_us(), 8.1);
    o.ranks = 1;
    World one(o);
    one.run([](Rank& r) {
      Tensor t = zeros({1000});
      dist::all_reduce(r.world(), t);
    });
    EXPECT_EQ(one.sim_time_us(), 0.0);
  }
}

// ============================================================ device mesh

TEST(SimMesh, DpCpTpCoordinatesGroupsAndRanks) {
  World w(options(8, 5));
  w.run([](Rank& r) {
    dist::DeviceMesh mesh = r.mesh({{"dp", 2}, {"cp", 2}, {"tp", 2}});
    const int g = r.rank();
    const int d = g / 4, c = (g / 2) % 2, t = g % 2;  // rank = d*cp*tp + c*tp + t
    EXPECT_EQ(mesh.coordinate("dp"), d);
    EXPECT_EQ(mesh.coordinate("cp"), c);
    EXPECT_EQ(mesh.coordinate("tp"), t);
    EXPECT_EQ(mesh.size("dp"), 2);
    EXPECT_EQ(mesh.dims().size(), 3u);
    EXPECT_EQ(mesh.rank_of({d, c, t}), g);
    EXPECT_EQ(mesh.rank_of({1, 0, 1}), 5);
    EXPECT_EQ(mesh.rank_of({0, 1, 0}), 2);

    EXPECT_EQ(mesh.group("tp").members(), (std::vector<int>{4 * d + 2 * c, 4 * d + 2 * c + 1}));
    EXPECT_EQ(mesh.group("tp").rank(), t);
    EXPECT_EQ(mesh.group("cp").members(), (std::vector<int>{4 * d + t, 4 * d + 2 + t}));
    EXPECT_EQ(mesh.group("cp").rank(), c);
    EXPECT_EQ(mesh.group("dp").members(), (std::vector<int>{2 * c + t, 4 + 2 * c + t}));
    EXPECT_EQ(mesh.group("dp").rank(), d);

    ProcessGroup parent = mesh.group(std::vector<std::string>{"cp", "tp"});
    EXPECT_EQ(parent.members(), (std::vector<int>{4 * d, 4 * d + 1, 4 * d + 2, 4 * d + 3}));
    EXPECT_EQ(parent.rank(), c * 2 + t);
    // Dims in another order: row-major in the order given (cp fastest here).
    ProcessGroup tp_cp = mesh.group(std::vector<std::string>{"tp", "cp"});
    EXPECT_EQ(tp_cp.members(), (std::vector<int>{4 * d, 4 * d + 2, 4 * d + 1, 4 * d + 3}));
    EXPECT_EQ(tp_cp.rank(), t * 2 + c);
    ProcessGroup all = mesh.group(std::vector<std::string>{"dp", "cp", "tp"});
    EXPECT_EQ(all.members(), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));

    // The groups communicate: sum of global ranks along each.
    Tensor x = full({1}, g, DType::Float64);
    dist::all_reduce(mesh.group("tp"), x);
    EXPECT_EQ(x.item(), 2.0 * (4 * d + 2 * c) + 1);
    Tensor y = full({1}, g, DType::Float64);
    dist::all_reduce(parent, y);
    EXPECT_EQ(y.item(), 16.0 * d + 6);
    Tensor z = full({1}, g, DType::Float64);
    dist::all_reduce(mesh.group("dp"), z);
    EXPECT_EQ(z.item(), 2.0 * (2 * c + t) + 4);

    EXPECT_THROW(mesh.size("pp"), InvalidArgument);
    EXPECT_THROW(mesh.coordinate("pp"), InvalidArgument);
    EXPECT_THROW(mesh.group("pp"), InvalidArgument);
    EXPECT_THROW(mesh.rank_of({0, 0}), InvalidArgument);
    EXPECT_THROW(mesh.rank_of({2, 0, 0}), InvalidArgument);
    EXPECT_THROW(mesh.group(std::vector<std::string>{"tp", "tp"}), InvalidArgument);
    // Bad dims are refused locally, before any communication.
    EXPECT_THROW(r.mesh({{"dp", 3}, {"tp", 2}}), InvalidArgument);
    EXPECT_THROW(r.mesh({{"dp", 4}, {"dp", 2}}), InvalidArgument);
    EXPECT_THROW(r.mesh({{"dp", 8}, {"tp", 0}}), InvalidArgument);
    EXPECT_THROW(r.mesh({{"", 8}}), InvalidArgument);
  });
}

// ============================================================ local validation

// Runs call on this rank and expects InvalidArgument naming the op, the
// group, this rank, and `needle`.
void expect_invalid(const ProcessGroup& g, const std::string& op, const std::string& needle,
                    const std::function<void()>& call) {
  std::string message;
  bool thrown = false;
  try {
    call();
  } catch (const InvalidArgument& e) {
    thrown = true;
    message = e.what();
  } catch (const std::exception& e) {
    message = std::string("wrong exception type: ") + e.what();
  }
  // Checks outside the catch handler (no fiber switch happens inside one).
  EXPECT_TRUE(thrown) << op << " on group '" << g.name() << "' rank " << g.rank() << ": " << needle
                      << " — " << message;
  if (!thrown) return;
  EXPECT_CONTAINS(message, op + " on group '" + g.name() + "'");
  EXPECT_CONTAINS(message, "rank " + std::to_string(g.rank()) + " of " + std::to_string(g.size()));
  EXPECT_CONTAINS(message, needle);
}

// Every bad call below must fail on the calling rank alone, before it is
// numbered or sent: afterwards all ranks still agree on the next collective,
// and no bad call was counted.
void bad_calls(const ProcessGroup& g) {
  const int n = g.size(), me = g.rank();
  const auto un = static_cast<std::size_t>(n);
  Tensor row = zeros({1, 2});
  auto list = [](std::size_t k, const Shape& s, DType dt = DType::Float32) {
    std::vector<Tensor> v;
    for (std::size_t i = 0; i < k; ++i) v.push_back(zeros(s, dt));
    return v;
  };
  dist::Splits ones_splits(un, 1);

  // splits vs rows, negative splits, wrong lengths
  expect_invalid(g, "all_gather_v", "output_splits sum to", [&] {
    dist::all_gather_v(g, zeros({n + 1, 2}), row, ones_splits);
  });
  expect_invalid(g, "all_gather_v", "is negative", [&] {
    dist::Splits s = ones_splits;
    s[0] = -1;
    dist::all_gather_v(g, zeros({n, 2}), row, s);
  });
  expect_invalid(g, "all_gather_v", "entries, expected", [&] {
    dist::all_gather_v(g, zeros({n + 1, 2}), row, dist::Splits(un + 1, 1));
  });
  expect_invalid(g, "all_gather_v", "but this rank's input has 2 rows", [&] {
    dist::all_gather_v(g, zeros({n, 2}), zeros({2, 2}), ones_splits);
  });
  expect_invalid(g, "reduce_scatter_v", "input_splits sum to", [&] {
    dist::reduce_scatter_v(g, row, zeros({n + 2, 2}), ones_splits);
  });
  expect_invalid(g, "reduce_scatter_v", "is negative", [&] {
    dist::Splits s = ones_splits;
    s[un - 1] = -2;
    dist::reduce_scatter_v(g, row, zeros({n, 2}), s);
  });
  expect_invalid(g, "all_to_all_single", "is negative", [&] {
    dist::Splits s = ones_splits;
    s[0] = -1;
    dist::all_to_all_single(g, zeros({n, 2}), zeros({n, 2}), ones_splits, s);
  });
  expect_invalid(g, "all_to_all_single", "input_splits sum to", [&] {
    dist::all_to_all_single(g, zeros({n, 2}), zeros({n + 1, 2}), ones_splits, ones_splits);
  });
  expect_invalid(g, "all_to_all_single", "output_splits has", [&] {
    dist::all_to_all_single(g, zeros({n, 2}), zeros({n, 2}), dist::Splits(un + 1, 0), ones_splits);
  });
  if (n > 1)
    expect_invalid(g, "all_to_all_single", "cannot split evenly", [&] {
      dist::all_to_all_single(g, zeros({n, 2}), zeros({n + 1, 2}));
    });
  expect_invalid(g, "all_to_all_single", "row shape", [&] {
    dist::all_to_all_single(g, zeros({n, 3}), zeros({n, 2}));
  });
  // roots out of range
  expect_invalid(g, "broadcast", "src " + std::to_string(n) + " out of range",
                 [&] { dist::broadcast(g, row, n); });
  expect_invalid(g, "broadcast", "src -1 out of range", [&] { dist::broadcast(g, row, -1); });
  expect_invalid(g, "reduce", "dst " + std::to_string(n) + " out of range",
                 [&] { dist::reduce(g, row, n); });
  expect_invalid(g, "gather", "dst -1 out of range", [&] { dist::gather(g, {}, row, -1); });
  expect_invalid(g, "scatter", "out of range", [&] { dist::scatter(g, row, {}, n + 3); });
  expect_invalid(g, "send", "out of range", [&] { dist::send(g, row, n); });
  expect_invalid(g, "recv", "out of range", [&] { dist::recv(g, row, -1); });
  expect_invalid(g, "send", "dst is this rank", [&] { dist::send(g, row, me); });
  expect_invalid(g, "recv", "src is this rank", [&] { dist::recv(g, row, me); });
  // dtypes of inputs and outputs disagree
  expect_invalid(g, "all_gather_single", "has dtype float64", [&] {
    dist::all_gather_single(g, zeros({n, 2}, DType::Float64), row);
  });
  expect_invalid(g, "all_to_all_single", "has dtype int32", [&] {
    dist::all_to_all_single(g, zeros({n, 2}, DType::Int32), zeros({n, 2}));
  });
  expect_invalid(g, "all_gather", "outputs[0] has dtype bfloat16", [&] {
    dist::all_gather(g, list(un, {1, 2}, DType::BFloat16), row);
  });
  expect_invalid(g, "reduce_scatter", "has dtype", [&] {
    auto ins = list(un, {1, 2});
    ins[un - 1] = zeros({1, 2}, DType::Int64);
    dist::reduce_scatter(g, row, ins);
  });
  expect_invalid(g, "reduce_scatter_v", "has dtype uint8", [&] {
    dist::reduce_scatter_v(g, zeros({1, 2}, DType::UInt8), zeros({n, 2}), ones_splits);
  });
  // list lengths
  expect_invalid(g, "all_gather", "has " + std::to_string(n + 1) + " tensors, expected", [&] {
    dist::all_gather(g, list(un + 1, {1, 2}), row);
  });
  expect_invalid(g, "reduce_scatter", "tensors, expected", [&] {
    dist::reduce_scatter(g, row, list(un + 1, {1, 2}));
  });
  expect_invalid(g, "all_to_all", "tensors, expected",
                 [&] { dist::all_to_all(g, list(un, {1}), list(un + 1, {1})); });
  expect_invalid(g, "gather", "tensors, expected", [&] {
    dist::gather(g, list(un + 1, {1, 2}), row, me);
  });
  if (n > 1) {
    const int other = (me + 1) % n;
    expect_invalid(g, "gather", "non-dst rank", [&] {
      dist::gather(g, list(un, {1, 2}), row, other);
    });
    expect_invalid(g, "scatter", "non-src rank", [&] {
      dist::scatter(g, row, list(un, {1, 2}), other);
    });
  }
  // shapes
  expect_invalid(g, "all_gather_single", "has shape", [&] {
    dist::all_gather_single(g, zeros({n + 1, 2}), row);
  });
  expect_invalid(g, "all_gather_single", "0-d",
                 [&] { dist::all_gather_single(g, zeros({n}), zeros({})); });
  expect_invalid(g, "reduce_scatter_single", "has shape", [&] {
    dist::reduce_scatter_single(g, row, zeros({n, 3}));
  });
  expect_invalid(g, "all_gather", "outputs[0] has shape", [&] {
    dist::all_gather(g, list(un, {2, 2}), row);
  });
  expect_invalid(g, "scatter", "inputs[0] has shape",
                 [&] { dist::scatter(g, row, list(un, {3}), me); });
  expect_invalid(g, "all_to_all", "has shape", [&] {
    auto outs = list(un, {1});
    outs[static_cast<std::size_t>(me)] = zeros({2});
    dist::all_to_all(g, outs, list(un, {1}));
  });
  // reduce ops and undefined tensors
  expect_invalid(g, "all_reduce", "avg is undefined for integer dtype int32",
                 [&] { dist::all_reduce(g, zeros({2}, DType::Int32), ReduceOp::Avg); });
  expect_invalid(g, "reduce_scatter_single", "avg is undefined", [&] {
    dist::reduce_scatter_single(g, zeros({1}, DType::UInt8), zeros({n}, DType::UInt8),
                                ReduceOp::Avg);
  });
  expect_invalid(g, "all_reduce", "undefined", [&] { dist::all_reduce(g, Tensor()); });
}

TEST(SimValidation, LocalErrorsComeBeforeAnyCommunication) {
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    World w(options(3, seed));
    w.run([](Rank& r) {
      auto sub = r.world().new_group({2, 1}, "sub");
      bad_calls(r.world());
      if (sub) bad_calls(*sub);
      // Nothing was numbered or sent: the next collective still matches.
      Tensor t = f32({static_cast<double>(r.rank())});
      dist::all_reduce(r.world(), t);
      EXPECT_EQ(t.item(), 3.0);
      if (sub) {
        Tensor u = f32({1});
        dist::all_reduce(*sub, u);
        EXPECT_EQ(u.item(), 2.0);
      }
      // Nothing was counted either: one new_group, one all_reduce on the
      // world, one on sub for its members.
      const dist::Stats& s = r.stats();
      EXPECT_EQ(s.total().calls, r.rank() == 0 ? 2u : 3u);
      EXPECT_EQ(s.get("world", "all_reduce").calls, 1u);
    });
    // Only the valid collectives were traced: world all_reduce x3, sub all_reduce x2.
    EXPECT_EQ(w.trace().size(), 5u);
  }
}

TEST(SimValidation, NewGroupArgumentsAreCheckedLocally) {
  World w(options(3));
  w.run([](Rank& r) {
    const ProcessGroup& g = r.world();
    expect_invalid(g, "new_group", "listed twice", [&] { g.new_group({0, 1, 0}); });
    expect_invalid(g, "new_group", "out of range", [&] { g.new_group({0, 3}); });
    expect_invalid(g, "new_group", "out of range", [&] { g.new_group({-1}); });
    EXPECT_THROW(g.new_group({}), InvalidArgument);
    // Still in step.
    auto sub = g.new_group({1, 2});
    EXPECT_EQ(sub.has_value(), r.rank() != 0);
    if (sub) {
      EXPECT_EQ(sub->name(), "{1,2}");
    }
    dist::barrier(g);
  });
}

TEST(SimValidation, ABadCallOnOneRankFailsThereAndReleasesTheOthers) {
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    World w(options(3, seed));
    std::exception_ptr e = run_catching(w, [](Rank& r) {
      Tensor t = f32({1});
      dist::broadcast(r.world(), t, r.rank() == 1 ? 7 : 0);
    });
    ASSERT_TRUE(holds<InvalidArgument>(e)) << what_of(e);
    EXPECT_CONTAINS(what_of(e), "rank 1");
    EXPECT_CONTAINS(what_of(e), "broadcast on group 'world'");
    EXPECT_TRUE(holds<InvalidArgument>(w.errors()[1]));
    EXPECT_TRUE(holds<RankFailure>(w.errors()[0])) << w.error_messages()[0];
    EXPECT_TRUE(holds<RankFailure>(w.errors()[2])) << w.error_messages()[2];
    EXPECT_EQ(w.stats(1).get("world", "broadcast").calls, 0u);
  }
}

// ============================================================ scale

TEST(SimScale, FourThousandRanksBarrierAndAllReduce) {
  constexpr int N = 4096;
  WorldOptions o = options(N, 17);
  o.trace = false;
  o.stack_size = 64 * 1024;
  World w(o);
  int correct = 0;
  w.run([&](Rank& r) {
    dist::barrier(r.world());
    Tensor t = ones({2});
    t.data<float>()[1] = static_cast<float>(r.rank() % 2);
    dist::all_reduce(r.world(), t);
    if (t.to_vector() == std::vector<double>{N, N / 2}) ++correct;
  });
  EXPECT_EQ(correct, N);
  EXPECT_EQ(w.stats(N - 1).get("world", "all_reduce").calls, 1u);
}

// Half of a 1024-rank world fails midway: every failure is reported as on a
// small world (the leavers' own errors, RankFailure on the ranks they
// strand). At this size the scheduler prefetches from per-rank hints (from
// 512 ranks), so under ASan this also runs that path while ranks die.
TEST(SimScale, AThousandRanksWhereHalfFailMidway) {
  constexpr int N = 1024;
  WorldOptions o = options(N, 5);
  o.stack_size = 64 * 1024;
  World w(o);
  std::exception_ptr e = run_catching(w, [](Rank& r) {
    dist::barrier(r.world());
    if (r.rank() % 2 == 1) throw std::runtime_error("odd rank leaves");
    Tensor t = ones({2});
    dist::all_reduce(r.world(), t);
  });
  ASSERT_TRUE(e != nullptr);
  int left = 0, released = 0;
  for (int r = 0; r < N; ++r) {
    const auto& err = w.errors()[static_cast<std::size_t>(r)];
    if (r % 2 == 1 && holds<std::runtime_error>(err) && !holds<RankFailure>(err)) ++left;
    if (r % 2 == 0 && holds<RankFailure>(err)) ++released;
  }
  EXPECT_EQ(left, N / 2);
  EXPECT_EQ(released, N / 2);
  EXPECT_EQ(w.stats(0).get("world", "barrier").calls, 1u);
}

// ---------------------------------------------------------------- flight recorder
// The flight recorder of a simulated rank reads the rank's simulated clock:
// a call starts at the rank's now_us() and ends where the collective leaves
// the rank's clock, the same on every run of a seed.
TEST(SimFlightRecorder, TimesAreTheRanksSimulatedClock) {
  auto run = [] {
    sim::WorldOptions o;
    o.ranks = 4;
    o.seed = 7;
    std::vector<std::vector<double>> got(4);
    sim::World world(o);
    world.run([&](sim::Rank& r) {
      const auto& g = r.world();
      r.advance_us(10.0 * (r.rank() + 1));  // ranks arrive at 10, 20, 30, 40 us
      const double before = r.now_us();
      Tensor x = full({3}, 1.0, DType::Float32);
      dist::all_reduce(g, x);
      const double after = r.now_us();
      const auto recs = g.flight_recorder().records();
      ASSERT_EQ(recs.size(), 1u);
      const dist::FlightRecord& rec = recs[0];
      EXPECT_EQ(rec.op, dist::OpType::AllReduce);
      EXPECT_EQ(rec.state, dist::FlightRecord::State::Completed);
      EXPECT_DOUBLE_EQ(rec.start_s, before * 1e-6);
      EXPECT_DOUBLE_EQ(rec.start_s + rec.duration_s, after * 1e-6);
      EXPECT_GE(after, 40.0);  // nobody leaves before the last arrival
      got[static_cast<std::size_t>(r.rank())] = {rec.start_s, rec.duration_s};
    });
    return got;
  };
  const auto a = run();
  EXPECT_EQ(a, run());
  EXPECT_DOUBLE_EQ(a[0][0], 10e-6);
  EXPECT_GT(a[0][1], a[3][1]);  // rank 0 waited longest
}

// A recorder with its own clock records begin/end times from it, keeps the
// last kSimCapacity calls oldest first, and dumps one line per call.
TEST(FlightRecorder, OwnClockRingAndDump) {
  double t = 1.5;
  dist::FlightRecorder rec([](const void* c) { return *static_cast<const double*>(c); }, &t);
  dist::Call call;
  call.op = dist::OpType::Barrier;
  call.group = "world";
  const std::size_t n = dist::FlightRecorder::kSimCapacity + 3;
  for (std::size_t i = 0; i < n; ++i) {
    call.seq = i;
    const std::size_t slot = rec.begin(call);
    t += 0.25;
    rec.end(slot,
            i + 1 == n ? dist::FlightRecord::State::Failed : dist::FlightRecord::State::Completed);
  }
  const auto recs = rec.records();
  ASSERT_EQ(recs.size(), dist::FlightRecorder::kSimCapacity);
  EXPECT_EQ(recs.front().id, 4u);  // the first 3 were overwritten
  EXPECT_EQ(recs.back().id, n);
  EXPECT_EQ(recs.back().seq, n - 1);
  EXPECT_DOUBLE_EQ(recs.back().start_s, 1.5 + 0.25 * static_cast<double>(n - 1));
  EXPECT_DOUBLE_EQ(recs.back().duration_s, 0.25);
  EXPECT_EQ(recs.back().state, dist::FlightRecord::State::Failed);
  const std::string dump = rec.dump();
  EXPECT_NE(dump.find("last 64 call(s)"), std::string::npos) << dump;
  EXPECT_NE(dump.find("barrier #66 on 'world'"), std::string::npos) << dump;
  EXPECT_NE(dump.find("failed (250000.0 us)"), std::string::npos) << dump;
}

// Without a clock (production backends) the times are wall-clock seconds
// since the recorder was made: non-negative and ordered.
TEST(FlightRecorder, DefaultClockIsWallTimeSinceCreation) {
  dist::FlightRecorder rec;
  dist::Call call;
  call.group = "g";
  const std::size_t a = rec.begin(call);
  rec.end(a, dist::FlightRecord::State::Completed);
  const std::size_t b = rec.begin(call);
  rec.end(b, dist::FlightRecord::State::Completed);
  const auto recs = rec.records();
  ASSERT_EQ(recs.size(), 2u);
  EXPECT_GE(recs[0].start_s, 0.0);
  EXPECT_GE(recs[0].duration_s, 0.0);
  EXPECT_GE(recs[1].start_s, recs[0].start_s + recs[0].duration_s);
}

// The scheduler prefetches the fibers of the next two picks; its guess
// (next_picks) must name exactly the fibers the pick rule then takes when no
// fiber wakes up in between. Reference: the rule as documented, on a plain
// vector (Random: draw % size and swap-remove when more than one is ready,
// else the front; RoundRobin: the front).
TEST(SimScheduler, NextPicksNameTheFibersThePickRuleTakes) {
  std::mt19937_64 draws(20261130);
  for (int trial = 0; trial < 4000; ++trial) {
    const bool random = trial % 4 != 0;
    const std::size_t n = 1 + static_cast<std::size_t>(draws() % 40);
    std::vector<int> ready(n);
    for (std::size_t i = 0; i < n; ++i) ready[i] = static_cast<int>(i);
    const uint64_t d0 = draws(), d1 = draws();
    const auto guess = sim::detail::next_picks(n, random, d0, d1);
    std::vector<int> taken;
    uint64_t next_draw[2] = {d0, d1};
    int used = 0;
    for (int pick = 0; pick < 2 && !ready.empty(); ++pick) {
      std::size_t i = 0;
      if (random && ready.size() > 1)
        i = static_cast<std::size_t>(next_draw[used++] % ready.size());
      taken.push_back(ready[i]);
      if (random) {
        ready[i] = ready.back();
        ready.pop_back();
      } else {
        ready.erase(ready.begin());
      }
    }
    ASSERT_EQ(static_cast<int>(guess.first), taken[0]) << "n=" << n << " random=" << random;
    if (n >= 2) {
      ASSERT_EQ(static_cast<int>(guess.second), taken[1]) << "n=" << n << " random=" << random;
    }
  }
}

}  // namespace

}  // namespace diffcomm
