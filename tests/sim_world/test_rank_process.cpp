// sim::serve_rank_process / connect_rank_process: ranks in forked processes,
// their calls run by a ThreadedWorld in this one (diffcomm.sim.run's
// isolation="process"). The same program on rank threads is the reference:
// same seed, same trace hash, same results, same report text.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/sim/rank_process.hpp"
#include "diffcomm/sim/threaded_world.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::sim {
namespace {

using testing::HasSubstr;
// A rank's program: returns what the rank reports (its values as text).
using Program = std::function<std::string(int, dist::ProcessGroup&)>;

struct Outcome {
  std::vector<std::string> failures, payloads;
  uint64_t trace_hash = 0;
};

WorldOptions options(int ranks, uint64_t seed) {
  WorldOptions o;
  o.ranks = ranks;
  o.seed = seed;
  return o;
}

std::string text(const Tensor& t) {
  std::string s;
  for (double v : t.to_vector()) s += std::to_string(static_cast<int>(v)) + " ";
  return s;
}

Outcome run_threads(int n, uint64_t seed, const Program& program) {
  ThreadedWorld w(options(n, seed));
  Outcome out{std::vector<std::string>(n), std::vector<std::string>(n)};
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      std::string failure;
      try {
        dist::ProcessGroup g = w.start(r);
        out.payloads[r] = program(r, g);
      } catch (const std::exception& e) {
        failure = e.what();
      }
      out.failures[r] = failure;
      w.finish(r, failure);
    });
  w.run();
  for (auto& t : threads) t.join();
  out.trace_hash = w.world().trace_hash();
  return out;
}

// The rank process: connects, runs the program, reports, exits (never
// returns to the test runner). `die`: exits without reporting instead.
[[noreturn]] void rank_process(int r, int fd, int memory, const Program& program, bool die) {
  std::string failure, payload;
  try {
    dist::ProcessGroup g = connect_rank_process(fd, memory);
    if (die) _exit(3);
    payload = program(r, g);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  finish_rank_process(fd, failure, payload);
  _exit(0);
}

Outcome run_processes(int n, uint64_t seed, const Program& program, int dies = -1) {
  std::vector<int> mine(n), theirs(n), memory(n);
  for (int r = 0; r < n; ++r) {
    int fds[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
    mine[r] = fds[0];
    theirs[r] = fds[1];
    memory[r] = memfd_create("diffcomm-test-rank", MFD_CLOEXEC);
  }
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      for (int o = 0; o < n; ++o)
        if (o != r) close(theirs[o]);
      rank_process(r, theirs[r], memory[r], program, r == dies);
    }
    pids.push_back(pid);
  }
  for (int r = 0; r < n; ++r) close(theirs[r]);
  ThreadedWorld w(options(n, seed));
  Outcome out{std::vector<std::string>(n), std::vector<std::string>(n)};
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      dist::ProcessGroup g = w.start(r);
      RankProcessEnd end = serve_rank_process(w, r, g, mine[r], memory[r]);
      out.failures[r] = end.reported ? end.failure : "died";
      out.payloads[r] = end.payload;
      w.finish(r, out.failures[r]);
    });
  w.run();
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    close(mine[r]);
    close(memory[r]);
    waitpid(pids[r], nullptr, 0);
  }
  out.trace_hash = w.world().trace_hash();
  return out;
}

std::string mixed(int r, dist::ProcessGroup& g) {
  Tensor x = full({4}, r + 1, DType::Float64);
  dist::all_reduce(g, x);
  Tensor rows = empty({2 * g.size()}, DType::Float32);
  dist::all_gather_single(g, rows, full({2}, r));
  auto sub = g.split(r % 2, r, {0, 1}, "parity");
  Tensor y = full({3}, r, DType::Int64);
  if (sub) dist::all_reduce(*sub, y);
  Tensor got = zeros({5}, DType::Float32);
  Tensor empty_out = empty({0}, DType::Float32);
  dist::all_gather_single(g, empty_out, empty({0}, DType::Float32));
  if (r == 0) dist::send(g, full({5}, 7), 1);
  if (r == 1) dist::recv(g, got, 0);
  return text(x) + "| " + text(rows) + "| " + text(y) + "| " + text(got);
}

TEST(RankProcess, SameSeedSameInterleavingResultsAndTraceAsThreads) {
  for (uint64_t seed : {0u, 3u, 11u}) {
    const Outcome threads = run_threads(4, seed, mixed);
    const Outcome processes = run_processes(4, seed, mixed);
    EXPECT_EQ(processes.trace_hash, threads.trace_hash);
    EXPECT_EQ(processes.payloads, threads.payloads);
    EXPECT_EQ(processes.failures, std::vector<std::string>(4));
  }
  // Closed forms: sum of 1..4, rows by rank, parity-group sums, the send.
  EXPECT_EQ(run_processes(4, 0, mixed).payloads[1],
            "10 10 10 10 | 0 0 1 1 2 2 3 3 | 4 4 4 | 7 7 7 7 7 ");
}

TEST(RankProcess, ReportsHaveTheSameTextAsWithThreads) {
  const Program mismatch = [](int r, dist::ProcessGroup& g) {
    Tensor x = full({3}, 1);
    if (r == 1)
      dist::broadcast(g, x, 0);
    else
      dist::all_reduce(g, x);
    return std::string();
  };
  const Outcome threads = run_threads(3, 5, mismatch);
  const Outcome processes = run_processes(3, 5, mismatch);
  EXPECT_EQ(processes.failures, threads.failures);
  EXPECT_THAT(processes.failures[0], HasSubstr("collective mismatch"));
}

TEST(RankProcess, AProcessThatEndsWithoutReportingIsSeenAsDead) {
  const Program reduce = [](int, dist::ProcessGroup& g) {
    Tensor x = full({2}, 1);
    dist::all_reduce(g, x);
    return text(x);
  };
  const Outcome out = run_processes(3, 0, reduce, /*dies=*/2);
  EXPECT_EQ(out.failures[2], "died");
  EXPECT_THAT(out.failures[0], HasSubstr("rank 2"));  // the others hear of it
}

TEST(RankProcess, LargePayloadsGrowTheSharedMemory) {
  const Program big = [](int r, dist::ProcessGroup& g) {
    Tensor x = full({1 << 20}, r + 1, DType::Float64);  // 8 MiB
    dist::all_reduce(g, x);
    return std::to_string(x.to_vector()[12345]);
  };
  EXPECT_EQ(run_processes(2, 0, big).payloads, std::vector<std::string>(2, "3.000000"));
}

}  // namespace
}  // namespace diffcomm::sim
