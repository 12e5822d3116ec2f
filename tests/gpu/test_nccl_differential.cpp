// The differential test (tests/differential/) on the NCCL backend: random
// SPMD programs run on an NCCL world of one thread per CUDA device (up to
// 4; CPU tensors staged through the device, checked mode on) and in a
// simulated world of the same size; every output byte and every error must
// be identical. With one GPU the world has one rank (no cross-rank
// mismatch can be drawn there); multi-rank semantics are covered on MPI.
// Skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "diffcomm/backends/nccl.hpp"
#include "diffcomm/sim/world.hpp"
#include "program.hpp"

namespace diffcomm {
namespace {

TEST(NcclDifferential, ProgramsMatchTheSimulatedWorld) {
  if (nccl::device_count() == 0) GTEST_SKIP() << "no CUDA device: " << nccl::device_status();
  const int n = std::min(nccl::device_count(), 4);
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    const differential::Program program = differential::make_program(n, seed);
    // A fresh world per program, so call numbers start at 0 as in the sim.
    const ncclUniqueId id = nccl::unique_id();
    std::vector<differential::Outcome> got(static_cast<std::size_t>(n));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        nccl::Options options;
        options.stage_cpu = true;
        options.check = true;
        const dist::ProcessGroup world = nccl::init_rank(id, n, r, r, options);
        got[static_cast<std::size_t>(r)] = differential::run_program(program, seed, world);
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
  }
}

}  // namespace
}  // namespace diffcomm
