// The differential test: production equals simulation. Under mpirun -np N,
// every process generates the same random SPMD programs (program.hpp), runs
// each on the MPI backend in checked mode as its rank, runs the very same
// program in a simulated world of N ranks in-process, and compares its
// rank's outcome with the simulated one: output bytes bit for bit, and the
// error (kind, step and message) that ended the program. Programs without a
// deliberate mismatch must run to the end; programs with one must end with
// CollectiveMismatch at that step on every rank, in both worlds.
//
//   DIFFCOMM_DIFF_PROGRAMS  how many programs (default 150)
//   DIFFCOMM_DIFF_SEED      the first program's seed (default 1); a failure
//                           prints the line that re-runs just that program
//   DIFFCOMM_DIFF_NATIVE=1  MPI's native reductions instead (a negative
//                           control: they are not bit-identical)
//   DIFFCOMM_DIFF_VERBOSE=1 print every program
//   DIFFCOMM_DIFF_GRAD_PROGRAMS  then how many random programs of
//                           differentiable collectives to check against the
//                           reference gradient (default 100;
//                           gradient_program.hpp: the participation rule)
#include <fmt/format.h>
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "diffcomm/backends/mpi.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"
#include "gradient_program.hpp"
#include "program.hpp"

namespace {
using namespace diffcomm;

uint64_t env_u64(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v ? std::strtoull(v, nullptr, 10) : fallback;
}

// What the program promises, whatever the backend.
std::string expected_shape(const differential::Program& p, const differential::Outcome& o) {
  const bool mismatch = !p.steps.empty() && p.steps.back().mismatch != 0;
  if (!mismatch && !o.error_kind.empty())
    return fmt::format("unexpected {} at step {}: {}", o.error_kind, o.failed_step, o.error);
  if (mismatch && (o.error_kind != "CollectiveMismatch" ||
                   o.failed_step != static_cast<int>(p.steps.size()) - 1))
    return fmt::format("the deliberate mismatch gave '{}' at step {}: {}", o.error_kind,
                       o.failed_step, o.error);
  return "";
}
// The participation rule on MPI (issue [4/8], item 4): random programs of
// differentiable collectives on sub-groups, each rank's loss a random
// subset of its outputs; every rank's gradient must equal the independent
// reference of the summed loss. Returns the number of failed programs.
int run_gradient_programs(int rank, int n, uint64_t count, uint64_t first) {
  int failed = 0;
  for (uint64_t seed = first; seed < first + count; ++seed) {
    const differential::GradProgram p = differential::make_grad_program(n, seed);
    dist::Options options;
    options.check = true;
    std::string why;
    try {
      const std::vector<double> got = differential::run_grad_program(p, mpi::world(options));
      const std::vector<double> want =
          differential::reference_gradients(p)[static_cast<std::size_t>(rank)];
      for (std::size_t e = 0; e < want.size() && why.empty(); ++e)
        if (std::abs(got[e] - want[e]) > 1e-9)
          why = fmt::format("element {}: {} but the reference is {}", e, got[e], want[e]);
    } catch (const Error& e) {
      why = e.what();
    }
    int bad = why.empty() ? 0 : 1;
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (!bad) continue;
    ++failed;
    if (!why.empty())
      std::printf("gradient program %llu rank %d: %s\n", static_cast<unsigned long long>(seed),
                  rank, why.c_str());
    if (rank == 0) std::printf("%s", differential::describe(p).c_str());
    std::fflush(stdout);
  }
  if (rank == 0)
    std::printf("gradient programs (participation rule, %d ranks): %llu passed, %d failed\n", n,
                static_cast<unsigned long long>(count) - static_cast<unsigned long long>(failed),
                failed);
  return failed;
}

}  // namespace

int main(int argc, char** argv) {
  mpi::Environment env(&argc, &argv);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const uint64_t count = env_u64("DIFFCOMM_DIFF_PROGRAMS", 150);
  const uint64_t first = env_u64("DIFFCOMM_DIFF_SEED", 1);
  int failed = 0;
  for (uint64_t seed = first; seed < first + count; ++seed) {
    const differential::Program program = differential::make_program(n, seed);
    // Production: a fresh checked world, so call numbers start at 0 as in
    // the simulated world.
    dist::Options options;
    options.check = true;
    // DIFFCOMM_DIFF_NATIVE=1: MPI's own reductions, to see the test catch
    // what they change (not bit-reproducible; expected to fail).
    options.native_reduction = std::getenv("DIFFCOMM_DIFF_NATIVE") != nullptr;
    const differential::Outcome mine =
        differential::run_program(program, seed, mpi::world(options));
    // The simulated world, every rank in this process.
    sim::WorldOptions wo;
    wo.ranks = n;
    wo.seed = seed;
    sim::World world(wo);
    std::vector<differential::Outcome> simulated(static_cast<std::size_t>(n));
    world.run([&](sim::Rank& r) {
      simulated[static_cast<std::size_t>(r.rank())] =
          differential::run_program(program, seed, r.world());
    });
    if (rank == 0 && std::getenv("DIFFCOMM_DIFF_VERBOSE"))
      std::printf("seed %llu: %zu output bytes, error '%s' at step %d\n%s",
                  static_cast<unsigned long long>(seed), mine.bytes.size(), mine.error_kind.c_str(),
                  mine.failed_step, differential::describe(program).c_str());
    std::string why = differential::compare(simulated[static_cast<std::size_t>(rank)], mine);
    if (why.empty()) why = expected_shape(program, mine);
    int bad = why.empty() ? 0 : 1;
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (bad) {
      ++failed;
      if (!why.empty())
        std::printf("seed %llu rank %d: %s\n", static_cast<unsigned long long>(seed), rank,
                    why.c_str());
      if (rank == 0)
        std::printf(
            "program of seed %llu:\n%sreproduce: DIFFCOMM_DIFF_SEED=%llu "
            "DIFFCOMM_DIFF_PROGRAMS=1 mpirun -np %d %s\n",
            static_cast<unsigned long long>(seed), differential::describe(program).c_str(),
            static_cast<unsigned long long>(seed), n, argv[0]);
      std::fflush(stdout);
    }
  }
  const uint64_t grad_count = env_u64("DIFFCOMM_DIFF_GRAD_PROGRAMS", 100);
  failed += run_gradient_programs(rank, n, grad_count, first);
  if (rank == 0) {
    std::printf("differential (sim vs mpi, %d ranks, seeds %llu..%llu):\n", n,
                static_cast<unsigned long long>(first),
                static_cast<unsigned long long>(first + count - 1));
    std::printf("%llu passed, %d failed\n",
                static_cast<unsigned long long>(count + grad_count - static_cast<uint64_t>(failed)),
                failed);
  }
  return failed ? 1 : 0;
}
