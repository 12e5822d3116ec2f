// The differential test (tests/differential/) on the NCCL backend: random
// SPMD programs run on an NCCL world of one thread per CUDA device (up to
// 4; CPU tensors staged through the device, checked mode on) and in a
// simulated world of the same size; every output byte and every error must
// be identical. With one GPU the world has one rank (no cross-rank
// mismatch can be drawn there); multi-rank semantics are covered on MPI.
// Skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "diffcomm/backends/nccl.hpp"
#include "diffcomm/sim/world.hpp"
#include "program.hpp"

namespace diffcomm {
namespace {

// Seeds 1..DIFFCOMM_NCCL_DIFF_SEEDS (default 20). Each seed creates three
// communicators (the world, new_group, split); on the H200 machine of
// bench/RESULTS.md that costs about 3 s per seed whatever the program, so
// the default keeps the test near a minute. The MPI differential runs more.
int seeds() {
  const char* env = std::getenv("DIFFCOMM_NCCL_DIFF_SEEDS");
  const int v = env != nullptr ? std::atoi(env) : 0;
  return v > 0 ? v : 20;
}

TEST(NcclDifferential, ProgramsMatchTheSimulatedWorld) {
  if (nccl::device_count() == 0) GTEST_SKIP() << "no CUDA device: " << nccl::device_status();
  const int n = std::min(nccl::device_count(), 4);
  using Clock = std::chrono::steady_clock;
  using Ms = std::chrono::duration<double, std::milli>;
  const int last = seeds();
  for (uint64_t seed = 1; seed <= static_cast<uint64_t>(last); ++seed) {
    const differential::Program program = differential::make_program(n, seed);
    // A fresh world per program, so call numbers start at 0 as in the sim.
    const ncclUniqueId id = nccl::unique_id();
    std::vector<differential::Outcome> got(static_cast<std::size_t>(n));
    double init_ms = 0, program_ms = 0, destroy_ms = 0;  // rank 0's
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        nccl::Options options;
        options.stage_cpu = true;
        options.check = true;
        // A member left waiting fails the program (Timeout) instead of
        // hanging the test.
        options.timeout_s = 60;
        const auto t0 = Clock::now();
        auto world = std::make_optional(nccl::init_rank(id, n, r, r, options));
        const auto t1 = Clock::now();
        got[static_cast<std::size_t>(r)] = differential::run_program(program, seed, *world);
        const auto t2 = Clock::now();
        world.reset();
        if (r == 0) {
          init_ms = Ms(t1 - t0).count();
          program_ms = Ms(t2 - t1).count();
          destroy_ms = Ms(Clock::now() - t2).count();
        }
      });
    for (auto& t : threads) t.join();
    sim::WorldOptions wo;
    wo.ranks = n;
    wo.seed = seed;
    sim::World world(wo);
    std::vector<differential::Outcome> want(static_cast<std::size_t>(n));
    world.run([&](sim::Rank& r) {
      want[static_cast<std::size_t>(r.rank())] =
          differential::run_program(program, seed, r.world());
    });
    for (int r = 0; r < n; ++r)
      EXPECT_EQ(differential::compare(want[static_cast<std::size_t>(r)],
                                      got[static_cast<std::size_t>(r)]),
                "")
          << "seed " << seed << " rank " << r << "\n"
          << differential::describe(program);
    // Where the time goes (shown by ctest on failure).
    std::fprintf(stderr,
                 "seed %llu: %zu steps; nccl rank 0: init %.0f ms, program (with new_group and "
                 "split) %.0f ms, destroy %.0f ms\n",
                 static_cast<unsigned long long>(seed), program.steps.size(), init_ms, program_ms,
                 destroy_ms);
  }
}

}  // namespace
}  // namespace diffcomm
