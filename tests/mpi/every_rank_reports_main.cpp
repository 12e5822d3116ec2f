// Issue [4/7] item 1: after a Timeout every rank reports and dumps before the
// job ends. Run under `mpirun -np 4` with DIFFCOMM_FR_DUMP_DIR set and
// checking off (as a production job): every rank makes all_reduce #0, then
// rank 3 leaves (returns from main: its Environment meets the others at
// exit) while ranks 0-2 wait in barrier #1 until the first of them times
// out and raises the alarm (mpi::end_job).
//
//   caught     ranks 0-2 catch the error, print "RESULT rank R: <Kind>:
//              <message>" and return from main (Environment's destructor
//              ends the job)
//   uncaught   ranks 0-2 let it escape main: std::terminate dumps, prints
//              "diffcomm: uncaught <Kind>: ..." and ends the job
//
// Each of ranks 0-2 prints "WAIT rank R <CLOCK_MONOTONIC seconds>" as it
// enters the barrier, so tests/mpi/every_rank_reports_test.py can time the
// end of the job against the deadline.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "diffcomm/backends/mpi.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace {
using namespace diffcomm;

void step(const dist::ProcessGroup& world) {
  const Tensor t = ones({4});
  dist::all_reduce(world, t);
  if (world.rank() == 3) return;  // leaves the job's collectives early
  const double now =
      std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  std::printf("WAIT rank %d %.6f\n", world.rank(), now);
  std::fflush(stdout);
  dist::barrier(world);
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s caught|uncaught\n", argv[0]);
    return 2;
  }
  const std::string scenario = argv[1];
  mpi::Environment env(&argc, &argv);
  const dist::ProcessGroup world = mpi::world();
  if (scenario == "uncaught") {
    step(world);
    return 0;
  }
  std::string kind = "none", what;
  try {
    step(world);
  } catch (const Error& e) {
    kind = error_kind_name(e.kind());
    what = e.what();
  }
  std::printf("RESULT rank %d: %s: %s\n", world.rank(), kind.c_str(), what.c_str());
  std::fflush(stdout);
  return 0;
}
