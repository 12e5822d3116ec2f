// The simulated world itself: options, one seed = one interleaving (determinism, schedules), and
// scale.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/distributed/flight_recorder.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"
#include "fixtures.hpp"
#include "scheduler.hpp"  // sim/world/src: the seeded scheduling algorithm

namespace diffcomm {
namespace {

using namespace sim_testing;  // NOLINT(google-build-using-namespace)

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
