// The closed loop of issue 22 (item 5): hand-written SPMD programs whose
// failure is known, run under mpirun. With DIFFCOMM_CHECK=1 they show what
// checked mode raises; with checking off and DIFFCOMM_FR_DUMP_DIR set every
// rank leaves its flight recorder dump, which `diffcomm-sim replay` must
// turn into the same verdict (tests/mpi/replay_test.py compares both with
// the expectation written there).
//
//   dtype      (np 3) world: all_reduce #0, barrier #1, all_reduce #2 where
//              global rank 2 passes float64 instead of float32
//   a2a-splits (np 4) group {1,2,3}: broadcast #0, then all_to_all_single #1
//              where global rank 3 expects 2 rows (not 1) from global rank 1
//   hang       (np 3) world: all_reduce #0; rank 1 stops there, the others
//              wait in barrier #1 until their deadline (Timeout)
//   healthy    (np 4) uneven all_to_all_single, a sub-group broadcast, a
//              barrier: no error; the dumps are taken on request at the end
//
// REPLAY_SMALL_RING=R gives global rank R a flight recorder of 2 entries (a
// ring that lost calls the others hold: the replay must say incomplete).
// REPLAY_NO_REQUEST=1 skips the dump on request: only the funnel's dumps on
// errors are left.
// Every rank prints "RESULT rank R: <kind>|<group>|<call>|<op>|<detail line>".
#include <fmt/format.h>
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "diffcomm/backends/mpi.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace {
using namespace diffcomm;

void dtype_scenario(const dist::ProcessGroup& world) {
  const Tensor a = ones({4});
  dist::all_reduce(world, a);
  dist::barrier(world);
  const Tensor b = ones({4}, world.rank() == 2 ? DType::Float64 : DType::Float32);
  dist::all_reduce(world, b);
}

// all_to_all_single over `g` with rows[i][j] rows from member i to member j.
void uneven_a2a(const dist::ProcessGroup& g, const std::vector<std::vector<int64_t>>& rows,
                const dist::Splits& out_splits) {
  const auto me = static_cast<std::size_t>(g.rank());
  dist::Splits in_splits = rows[me];
  int64_t in_rows = 0, out_rows = 0;
  for (int64_t r : in_splits) in_rows += r;
  for (int64_t r : out_splits) out_rows += r;
  const Tensor in = ones({in_rows, 2});
  const Tensor out = zeros({out_rows, 2});
  dist::all_to_all_single(g, out, in, out_splits, in_splits);
}

dist::Splits column(const std::vector<std::vector<int64_t>>& rows, std::size_t j) {
  dist::Splits c;
  for (const auto& r : rows) c.push_back(r[j]);
  return c;
}

void a2a_splits_scenario(const dist::ProcessGroup& world) {
  const auto g = world.new_group({1, 2, 3});
  if (!g) return;
  const Tensor t = ones({3});
  dist::broadcast(*g, t, 0);
  const std::vector<std::vector<int64_t>> rows = {{0, 1, 1}, {2, 0, 1}, {1, 3, 0}};
  dist::Splits out = column(rows, static_cast<std::size_t>(g->rank()));
  if (world.rank() == 3) out[0] = 2;  // expects 2 rows from global rank 1, which sends 1
  uneven_a2a(*g, rows, out);
}

void hang_scenario(const dist::ProcessGroup& world) {
  const Tensor a = ones({4});
  dist::all_reduce(world, a);
  if (world.rank() == 1) return;  // leaves the job's collectives early
  dist::barrier(world);
}

void healthy_scenario(const dist::ProcessGroup& world) {
  const Tensor a = ones({4});
  dist::all_reduce(world, a);
  const std::vector<std::vector<int64_t>> rows = {
      {0, 1, 2, 3}, {1, 0, 3, 2}, {2, 3, 0, 1}, {3, 2, 1, 0}};
  uneven_a2a(world, rows, column(rows, static_cast<std::size_t>(world.rank())));
  const auto g = world.new_group({0, 2});
  if (g) {
    const Tensor t = ones({5});
    dist::broadcast(*g, t, 1);
  }
  dist::barrier(world);
  dist::all_reduce(world, a);
}

void run(const std::string& scenario, const dist::ProcessGroup& world) {
  if (scenario == "dtype") return dtype_scenario(world);
  if (scenario == "a2a-splits") return a2a_splits_scenario(world);
  if (scenario == "hang") return hang_scenario(world);
  if (scenario == "healthy") return healthy_scenario(world);
  throw InvalidArgument("unknown scenario " + scenario);
}

std::string first_line(std::string_view s) { return std::string(s.substr(0, s.find('\n'))); }
}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s dtype|a2a-splits|hang|healthy\n", argv[0]);
    return 2;
  }
  const std::string scenario = argv[1];
  mpi::Environment env(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  dist::Options options;
  if (!std::getenv("DIFFCOMM_TIMEOUT")) options.timeout_s = 3.0;
  const char* small = std::getenv("REPLAY_SMALL_RING");
  if (small != nullptr && std::atoi(small) == rank) options.flight_recorder_size = 2;
  const double deadline = options.resolved_timeout_s();
  std::string result = "none||||";
  std::optional<dist::ProcessGroup> world;
  try {
    world = mpi::world(options);
    run(scenario, *world);
  } catch (const Error& e) {
    // Recorded here, acted on after the handler.
    const ErrorSite& s = e.site();
    result = fmt::format("{}|{}|{}|{}|{}", error_kind_name(e.kind()), s.group.value_or(""),
                         s.call ? std::to_string(*s.call) : "", s.op, first_line(e.detail()));
  }
  const std::string dir = options.resolved_flight_recorder_dump_dir();
  const bool on_request = std::getenv("REPLAY_NO_REQUEST") == nullptr;
  if (world && !dir.empty() && on_request) (void)world->flight_recorder().dump(dir);
  std::printf("RESULT rank %d: %s\n", rank, result.c_str());
  std::fflush(stdout);
  if (scenario == "healthy" && result.starts_with("none")) return 0;  // MPI_Finalize
  // A peer may still wait in a call until its deadline (late under load):
  // outlive it with a margin, then leave without MPI_Finalize (a fence over
  // every process).
  std::this_thread::sleep_for(std::chrono::duration<double>(deadline + 5.0));
  std::_Exit(0);
}
