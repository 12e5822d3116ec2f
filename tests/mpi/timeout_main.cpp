// A member that returns early, throws or skips a call must not hang the
// others on a real transport. Run under `mpirun -np 4` with one scenario:
//
//   return-early   rank 3 leaves after the first all_reduce and finalizes
//   throw          rank 3 throws from its step function, the program catches
//                  it at top level (as a trainer would) and finalizes
//   skip-barrier   rank 3 skips a barrier; checked mode (mismatch) or not
//   skip-barrier-unchecked                                    (Timeout)
//
// Every other rank must raise within seconds (DIFFCOMM_TIMEOUT or the 3 s
// set here) and print one line "RESULT rank R: <ErrorKind>: <message>",
// whose message names the op, the call number and the group and carries the
// rank's flight recorder. tests/mpi/timeout_test.py checks those lines.
// After a Timeout the group has calls in flight, so those ranks end with
// _Exit rather than MPI_Finalize (which could wait on them).
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "diffcomm/backends/mpi.hpp"
#include "diffcomm/dist/collectives.hpp"
#include "diffcomm/error.hpp"

namespace {

using namespace diffcomm;

struct Early {};  // rank 3 leaving its step function early

void step(const dist::ProcessGroup& g, const std::string& scenario) {
  Tensor t = full({4}, 1.0);
  dist::all_reduce(g, t);  // everybody gets here
  if (g.rank() == 3) {
    if (scenario == "return-early") throw Early{};
    if (scenario == "throw") throw std::runtime_error("rank 3: CUDA out of memory (simulated)");
  }
  if (g.rank() != 3 || scenario.rfind("skip-barrier", 0) != 0) dist::barrier(g);
  dist::all_reduce(g, t);
}

void report(int rank, const char* kind, const std::string& what) {
  std::printf("RESULT rank %d: %s: %s\n", rank, kind, what.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s return-early|throw|skip-barrier|skip-barrier-unchecked\n",
                 argv[0]);
    return 2;
  }
  const std::string scenario = argv[1];
  mpi::Environment env(&argc, &argv);
  dist::Options options;
  options.check = scenario != "skip-barrier-unchecked";
  if (!std::getenv("DIFFCOMM_TIMEOUT")) options.timeout_s = 3.0;
  const dist::ProcessGroup world = mpi::world(options);
  const int rank = world.rank();
  // Errors are recorded in the handlers and acted on after them.
  std::string kind, what;
  try {
    step(world, scenario);
    kind = "none";
  } catch (const Early&) {
    kind = "left-early";
  } catch (const Timeout& e) {
    kind = "Timeout";
    what = e.what();
  } catch (const CollectiveMismatch& e) {
    kind = "CollectiveMismatch";
    what = e.what();
  } catch (const std::exception& e) {
    kind = "exception";
    what = e.what();
  }
  report(rank, kind.c_str(), what);
  if (kind == "left-early" || kind == "exception") {
    // The misbehaving rank abandoned the job: its peers are stuck in a call
    // until their deadline. MPI_Finalize here would wait for them forever
    // (Open MPI's finalize is a fence over every process; it hung 2 runs in
    // 10 when mpirun failed to kill it after the peers' _Exit). Outlive the
    // peers' deadline and their report instead, then leave the same way.
    std::this_thread::sleep_for(std::chrono::duration<double>(options.resolved_timeout_s() + 3.0));
    std::_Exit(0);
  }
  if (kind == "Timeout") {
    // Calls in flight: no MPI_Finalize. mpirun ends the job when the first
    // process leaves without it, so give the other waiting ranks (whose
    // deadlines expire within milliseconds of this one) time to report.
    std::this_thread::sleep_for(std::chrono::seconds(2));
    std::_Exit(0);
  }
  return 0;
}
