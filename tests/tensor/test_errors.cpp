// Typed errors (issue 25, item 5): every Error carries its kind, its site and
// a detail, and what() is format_error(site, detail). Checked on the
// formatter itself, on the funnel's validation, on the simulated world's
// mismatch, deadlock and injected fault, and on what World::run throws.
#include <gtest/gtest.h>

#include <string>
#include <string_view>
#include <vector>

#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm {
namespace {

sim::World make_world(int ranks, uint64_t seed = 1) {
  sim::WorldOptions o;
  o.ranks = ranks;
  o.seed = seed;
  o.schedule = sim::Schedule::RoundRobin;
  return sim::World(o);
}

bool starts_with(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

TEST(ErrorFormat, EachPartOfTheSiteInItsPlace) {
  ErrorSite s;
  EXPECT_TRUE(s.empty());
  EXPECT_EQ(format_site(s), "");
  EXPECT_EQ(format_error(s, "plain"), "plain");

  s.op = "all_reduce";
  s.call = 3;
  s.group = "world";
  s.rank = 1;
  s.group_size = 4;
  EXPECT_FALSE(s.empty());
  EXPECT_EQ(format_site(s), "all_reduce #3 on group 'world' (rank 1 of 4)");
  EXPECT_EQ(format_error(s, "boom"), "all_reduce #3 on group 'world' (rank 1 of 4): boom");

  s.step = "all_to_all";
  EXPECT_EQ(format_site(s), "all_reduce #3 on group 'world' (rank 1 of 4, all_to_all step)");

  ErrorSite funnel;
  funnel.op = "broadcast";
  funnel.group = "tp";
  funnel.backend = "mpi";
  funnel.rank = 0;
  funnel.group_size = 2;
  EXPECT_EQ(format_error(funnel, "x"), "broadcast on group 'tp' (mpi backend, rank 0 of 2): x");

  ErrorSite global;
  global.global_rank = 5;
  EXPECT_EQ(format_error(global, "oops"), "rank 5: oops");
  global.op = "barrier";
  global.call = 0;
  EXPECT_EQ(format_error(global, "oops"), "rank 5: barrier #0: oops");
}

TEST(ErrorFormat, WhatIsTheFormattedSiteAndDetail) {
  ErrorSite s;
  s.op = "send";
  s.call = 7;
  s.group = "pp";
  s.rank = 0;
  s.group_size = 2;
  const Deadlock e(s, "stuck");
  EXPECT_EQ(e.kind(), ErrorKind::Deadlock);
  EXPECT_EQ(e.site().op, "send");
  EXPECT_EQ(e.site().call, 7u);
  EXPECT_EQ(e.site().group, "pp");
  EXPECT_EQ(e.detail(), "stuck");
  EXPECT_EQ(std::string(e.what()), "send #7 on group 'pp' (rank 0 of 2): stuck");
  EXPECT_EQ(format_error(e.site(), e.detail()), e.what());
  const Error copy = e;  // a copy keeps kind, site and detail
  EXPECT_EQ(copy.kind(), ErrorKind::Deadlock);
  EXPECT_EQ(copy.site().group, "pp");
  EXPECT_EQ(copy.detail(), "stuck");
}

TEST(ErrorFormat, AMessageOnlyErrorHasAnEmptySite) {
  const InvalidArgument e("just words");
  EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
  EXPECT_TRUE(e.site().empty());
  EXPECT_EQ(e.detail(), "just words");
  EXPECT_EQ(std::string(e.what()), "just words");
  EXPECT_EQ(Error("base").kind(), ErrorKind::Error);
}

TEST(ErrorFormat, ThrowErrorThrowsTheClassOfTheKind) {
  ErrorSite s;
  s.op = "barrier";
  EXPECT_THROW(throw_error(ErrorKind::InvalidArgument, s, "d"), InvalidArgument);
  EXPECT_THROW(throw_error(ErrorKind::CollectiveMismatch, s, "d"), CollectiveMismatch);
  EXPECT_THROW(throw_error(ErrorKind::Deadlock, s, "d"), Deadlock);
  EXPECT_THROW(throw_error(ErrorKind::RankFailure, s, "d"), RankFailure);
  EXPECT_THROW(throw_error(ErrorKind::Timeout, s, "d"), Timeout);
  EXPECT_THROW(throw_error(ErrorKind::BackendError, s, "d"), BackendError);
  try {
    throw_error(ErrorKind::Error, s, "d");
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Error);
    EXPECT_EQ(std::string(e.what()), "barrier: d");
  }
  EXPECT_STREQ(error_kind_name(ErrorKind::RankFailure), "RankFailure");
  EXPECT_STREQ(error_kind_name(ErrorKind::Error), "Error");
}

// raise: the one way diffcomm throws. raise(op, detail) and raise(site,
// detail) (a designated initializer naming only the parts set) build the
// same message as the class's (site, detail) constructor; InvalidArgument
// unless another class is named.
TEST(ErrorFormat, RaiseThrowsTheClassAtTheSite) {
  try {
    raise("plan_exchange", "buckets 0 must be >= 1");
    ADD_FAILURE() << "raise returned";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    EXPECT_EQ(e.site().op, "plan_exchange");
    EXPECT_FALSE(e.site().rank);
    EXPECT_EQ(e.detail(), "buckets 0 must be >= 1");
    EXPECT_EQ(std::string(e.what()), "plan_exchange: buckets 0 must be >= 1");
  }
  try {
    raise<BackendError>({.op = "nccl::init_over_mpi", .rank = 3, .group_size = 4},
                        std::string("no peer"));
    ADD_FAILURE() << "raise returned";
  } catch (const BackendError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::BackendError);
    EXPECT_EQ(e.site().op, "nccl::init_over_mpi");
    EXPECT_EQ(e.site().rank, 3);
    EXPECT_EQ(e.detail(), "no peer");
    EXPECT_EQ(std::string(e.what()), "nccl::init_over_mpi (rank 3 of 4): no peer");
  }
  const std::string op = "route_features";
  EXPECT_THROW(raise<Deadlock>(op, "d"), Deadlock);
  try {
    raise<Error>(std::string_view("diffcomm.sim"), "started twice");
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Error);
    EXPECT_EQ(std::string(e.what()), "diffcomm.sim: started twice");
  }
}

// The funnel refuses an output of another dtype before any communication.
TEST(TypedErrors, FunnelValidationNamesOpGroupBackendAndRank) {
  sim::World world = make_world(2);
  std::vector<std::string> seen(2);
  world.run([&](sim::Rank& rk) {
    const Tensor in = zeros({1}, DType::Float32);
    const Tensor out = zeros({2}, DType::Float64);
    try {
      dist::all_gather_single(rk.world(), out, in);
      ADD_FAILURE() << "no error";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
      EXPECT_EQ(e.site().op, "all_gather_single");
      EXPECT_EQ(e.site().group, "world");
      EXPECT_EQ(e.site().backend, "sim");
      EXPECT_EQ(e.site().rank, rk.rank());
      EXPECT_EQ(e.site().group_size, 2);
      EXPECT_FALSE(e.site().call.has_value());  // refused before it was numbered
      EXPECT_EQ(e.detail(), "output has dtype float64 but input has dtype float32");
      EXPECT_EQ(format_error(e.site(), e.detail()), e.what());
      seen[static_cast<std::size_t>(rk.rank())] = e.what();
    }
  });
  EXPECT_EQ(seen[1],
            "all_gather_single on group 'world' (sim backend, rank 1 of 2): output has dtype "
            "float64 but input has dtype float32");
}

// Two members pass different shapes: each raises CollectiveMismatch at its
// numbered call.
TEST(TypedErrors, SimMismatchCarriesTheCallsSite) {
  sim::World world = make_world(2);
  std::vector<int> caught(2, 0);
  world.run([&](sim::Rank& rk) {
    dist::barrier(rk.world());  // call #0; the mismatch is #1
    Tensor x = zeros({rk.rank() == 0 ? 2 : 3});
    try {
      dist::all_reduce(rk.world(), x);
    } catch (const CollectiveMismatch& e) {
      EXPECT_EQ(e.kind(), ErrorKind::CollectiveMismatch);
      EXPECT_EQ(e.site().op, "all_reduce");
      EXPECT_EQ(e.site().call, 1u);
      EXPECT_EQ(e.site().group, "world");
      EXPECT_EQ(e.site().rank, rk.rank());
      EXPECT_EQ(e.site().group_size, 2);
      EXPECT_TRUE(e.site().backend.empty());
      EXPECT_TRUE(starts_with(e.detail(), "collective mismatch: ")) << e.detail();
      const std::string head = rk.rank() == 0 ? "all_reduce #1 on group 'world' (rank 0 of 2): "
                                              : "all_reduce #1 on group 'world' (rank 1 of 2): ";
      EXPECT_EQ(std::string(e.what()), head + std::string(e.detail()));
      ++caught[static_cast<std::size_t>(rk.rank())];
    }
  });
  EXPECT_EQ(caught, (std::vector<int>{1, 1}));
}

// Rank 2 skips an all_reduce: World::run throws a Deadlock that carries both
// blocked ranks' failures; its site names the first failed rank.
TEST(TypedErrors, RunThrowsTheDeadlockWithItsFailures) {
  sim::World world = make_world(3);
  try {
    world.run([](sim::Rank& rk) {
      Tensor x = zeros({1});
      if (rk.rank() != 2) dist::all_reduce(rk.world(), x);
    });
    ADD_FAILURE() << "run returned";
  } catch (const Deadlock& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Deadlock);
    const sim::RunFailures* all = sim::run_failures(e);
    ASSERT_NE(all, nullptr);
    ASSERT_EQ(all->failures().size(), 2u);
    const int first = all->failures()[0].rank;
    EXPECT_TRUE(first == 0 || first == 1) << first;
    EXPECT_EQ(all->failures()[0].rank + all->failures()[1].rank, 1);
    EXPECT_EQ(e.site().global_rank, first);
    EXPECT_TRUE(e.site().op.empty());
    EXPECT_TRUE(
        starts_with(e.detail(),
                    "deadlock: every live rank is blocked and none can proceed\n  rank 0: waiting "
                    "in all_reduce #0 on group 'world' (rank 0 of 3): all_reduce("))
        << e.detail();
    EXPECT_NE(e.detail().find("\n  rank 2: finished\n"), std::string_view::npos) << e.detail();
    EXPECT_EQ(std::string(e.what()),
              "rank " + std::to_string(first) + ": " + std::string(e.detail()));
  }
}

// The injected fault's site is the faulty rank; the run's error keeps it
// (no second "rank R: ").
TEST(TypedErrors, InjectedFaultNamesItsGlobalRank) {
  sim::WorldOptions o;
  o.ranks = 2;
  o.schedule = sim::Schedule::RoundRobin;
  o.fault = sim::Fault{1, 1};
  sim::World world(o);
  try {
    world.run([](sim::Rank& rk) { dist::barrier(rk.world()); });
    ADD_FAILURE() << "run returned";
  } catch (const RankFailure& e) {
    EXPECT_EQ(e.kind(), ErrorKind::RankFailure);
    const sim::RunFailures* all = sim::run_failures(e);
    ASSERT_NE(all, nullptr);
    ASSERT_GE(all->failures().size(), 1u);
    EXPECT_EQ(all->failures()[0].rank, 1);
    EXPECT_EQ(e.site().global_rank, 1);
    EXPECT_TRUE(starts_with(e.what(),
                            "rank 1: injected fault at its call #1: barrier #0 on group 'world' "
                            "(rank 1 of 2): barrier"))
        << e.what();
    EXPECT_EQ(world.injected_fault(), all->failures()[0].message());
    EXPECT_EQ(format_error(e.site(), e.detail()), e.what());
  }
}

// A non-diffcomm exception is relayed as a plain Error (kind Error).
TEST(TypedErrors, AForeignExceptionIsAPlainError) {
  sim::World world = make_world(2);
  try {
    world.run([](sim::Rank& rk) {
      if (rk.rank() == 1) throw std::runtime_error("not ours");
    });
    ADD_FAILURE() << "run returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Error);
    EXPECT_EQ(e.site().global_rank, 1);
    EXPECT_EQ(e.detail(), "not ours");
    EXPECT_EQ(std::string(e.what()), "rank 1: not ours");
    ASSERT_NE(sim::run_failures(e), nullptr);
  }
}

}  // namespace
}  // namespace diffcomm
