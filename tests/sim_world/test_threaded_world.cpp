// sim::ThreadedWorld: ranks on OS threads handing one baton, the world's
// own fiber schedule deciding the interleaving (what diffcomm.sim.run runs
// Python ranks on). Tested here in C++: results, determinism, and the
// world's reports (mismatch, deadlock) reaching every rank instead of a hang.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/sim/threaded_world.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::sim {
namespace {

using testing::HasSubstr;

// Runs body(rank, group) on one OS thread per rank, as diffcomm.sim.run does;
// returns each rank's failure message ("" when it finished).
std::vector<std::string> run_threads(ThreadedWorld& w,
                                     const std::function<void(int, dist::ProcessGroup&)>& body) {
  std::vector<std::string> failures(static_cast<std::size_t>(w.size()));
  std::vector<std::thread> threads;
  for (int r = 0; r < w.size(); ++r)
    threads.emplace_back([&, r] {
      std::string failure;
      try {
        dist::ProcessGroup g = w.start(r);
        body(r, g);
      } catch (const std::exception& e) {
        failure = e.what();
      }
      failures[static_cast<std::size_t>(r)] = failure;
      w.finish(r, failure);
    });
  w.run();
  for (auto& t : threads) t.join();
  return failures;
}

WorldOptions options(int ranks, uint64_t seed) {
  WorldOptions o;
  o.ranks = ranks;
  o.seed = seed;
  return o;
}

int allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (pthread_getaffinity_np(pthread_self(), sizeof(set), &set) != 0) return -1;
  return CPU_COUNT(&set);
}

// CpuPlacement::OneCpu: the world's thread and every rank thread run on the
// world's one CPU while the world runs, and get their CPU sets back after
// (finish() on a rank thread, the end of run() on the world's). Os: nothing
// is pinned.
TEST(ThreadedWorld, OneCpuPinsEveryThreadOnlyWhileTheWorldRuns) {
  const int all = allowed_cpus();
  if (all < 2) GTEST_SKIP() << "this process may use " << all << " CPU(s): pinning is invisible";
  for (CpuPlacement placement : {CpuPlacement::OneCpu, CpuPlacement::Os}) {
    const bool one = placement == CpuPlacement::OneCpu;
    ThreadedWorld w(options(3, 1), placement);
    if (one) {
      ASSERT_GE(w.cpu(), 0);
    } else {
      EXPECT_EQ(w.cpu(), -1);
    }
    std::vector<int> during(3), after(3), cpu(3);
    std::vector<std::thread> threads;
    for (int r = 0; r < 3; ++r)
      threads.emplace_back([&, r] {
        dist::ProcessGroup g = w.start(r);
        dist::barrier(g);
        during[static_cast<std::size_t>(r)] = allowed_cpus();
        cpu[static_cast<std::size_t>(r)] = sched_getcpu();
        w.finish(r, "");
        after[static_cast<std::size_t>(r)] = allowed_cpus();
      });
    w.run();
    for (auto& t : threads) t.join();
    EXPECT_EQ(allowed_cpus(), all) << "the world's thread kept its pinning";
    for (int r = 0; r < 3; ++r) {
      const auto i = static_cast<std::size_t>(r);
      EXPECT_EQ(during[i], one ? 1 : all) << "rank " << r;
      if (one) {
        EXPECT_EQ(cpu[i], w.cpu()) << "rank " << r;
      }
      EXPECT_EQ(after[i], all) << "rank " << r << " kept its pinning after finish()";
    }
  }
}

// Misuse gets an error, never a crash or a hang: a group kept past its
// rank's end (the world's backend is gone by then), a group used from
// another thread, start() twice, finish() without start(), run() twice.
TEST(ThreadedWorld, MisuseIsRefusedNotACrashOrAHang) {
  ThreadedWorld w(options(3, 4));
  std::vector<std::string> after_end(3), other_thread(3), own_call(3);
  std::string second_start;
  std::atomic<bool> world_ended{false};
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      const auto i = static_cast<std::size_t>(r);
      std::optional<dist::ProcessGroup> kept;
      {
        dist::ProcessGroup g = w.start(r);
        kept = g;
        std::thread([&] {
          try {
            dist::barrier(g);
          } catch (const InvalidArgument& e) {
            other_thread[i] = e.what();
          }
        }).join();
        try {
          dist::barrier(g);  // rank 2 never started: fails, naming it
        } catch (const Error& e) {
          own_call[i] = e.what();
        }
      }
      w.finish(r, "");
      try {
        (void)w.start(r);
      } catch (const Error& e) {
        if (r == 0) second_start = e.what();
      }
      while (!world_ended) std::this_thread::yield();
      try {
        dist::barrier(*kept);  // the world's backends are gone
      } catch (const InvalidArgument& e) {
        after_end[i] = e.what();
      }
    });
  // Rank 2's thread gives up before start(): the world counts it finished,
  // so the others' barrier fails instead of waiting for ever.
  threads.emplace_back([&] { w.finish(2, "gave up before start"); });
  w.run();
  world_ended = true;
  EXPECT_THROW(w.run(), InvalidArgument);
  for (auto& t : threads) t.join();
  EXPECT_THAT(second_start, HasSubstr("already started"));
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_THAT(other_thread[i], HasSubstr("from a thread that is not the rank's")) << i;
    EXPECT_THAT(own_call[i], HasSubstr("gave up before start")) << i;
    EXPECT_THAT(after_end[i], HasSubstr("has finished")) << i;
  }
}

TEST(ThreadedWorld, RanksOnThreadsComputeTheWorldsResults) {
  ThreadedWorld w(options(4, 3));
  std::vector<double> sums(4);
  const auto failures = run_threads(w, [&](int r, dist::ProcessGroup& g) {
    Tensor x = full({2}, static_cast<double>(r + 1), DType::Float64);
    dist::all_reduce(g, x);
    sums[static_cast<std::size_t>(r)] = x.to_vector()[1];
  });
  EXPECT_EQ(failures, std::vector<std::string>(4));
  EXPECT_EQ(sums, std::vector<double>(4, 10.0));
}

TEST(ThreadedWorld, TheSameSeedGivesTheSameInterleaving) {
  auto hash_of = [](uint64_t seed) {
    ThreadedWorld w(options(3, seed));
    run_threads(w, [](int r, dist::ProcessGroup& g) {
      Tensor x = full({1}, static_cast<double>(r), DType::Float64);
      for (int k = 0; k < 5; ++k) dist::all_reduce(g, x);
    });
    return w.world().trace_hash();
  };
  EXPECT_EQ(hash_of(11), hash_of(11));
  EXPECT_NE(hash_of(11), hash_of(12));
}

TEST(ThreadedWorld, AMismatchReachesEveryRank) {
  ThreadedWorld w(options(2, 1));
  const auto failures = run_threads(w, [](int r, dist::ProcessGroup& g) {
    Tensor x = full({r == 0 ? 2 : 3}, 1.0, DType::Float64);
    dist::all_reduce(g, x);
  });
  for (const std::string& f : failures) EXPECT_THAT(f, HasSubstr("collective mismatch"));
}

TEST(ThreadedWorld, ASkippedCallIsADeadlockNotAHang) {
  ThreadedWorld w(options(3, 0));
  const auto failures = run_threads(w, [](int r, dist::ProcessGroup& g) {
    Tensor x = full({1}, 1.0, DType::Float64);
    if (r != 2) dist::all_reduce(g, x);  // rank 2 skips it
  });
  EXPECT_EQ(failures[2], "");
  EXPECT_THAT(failures[0], HasSubstr("deadlock"));
  EXPECT_THAT(failures[1], HasSubstr("deadlock"));
}

}  // namespace
}  // namespace diffcomm::sim
