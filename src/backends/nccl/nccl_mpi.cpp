// nccl::init_over_mpi: the unique id travels over MPI, the communicator is
// NCCL's. Written on the public nccl:: API only; compiled when diffcomm is
// built with MPI (DIFFCOMM_HAVE_MPI), empty otherwise.
#include "diffcomm/backends/nccl.hpp"

#if DIFFCOMM_HAVE_MPI
#include <fmt/format.h>

#include <cstring>
#include <string>
#include <vector>

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::nccl {
namespace {

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  raise<BackendError>("nccl::init_over_mpi",
                      fmt::format("{} failed: {} (MPI code {})", what,
                                  std::string(text, static_cast<std::size_t>(len)), rc));
}

}  // namespace

dist::ProcessGroup init_over_mpi(MPI_Comm comm, int device, Options options, std::string name) {
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (!initialised)
    raise<BackendError>("nccl::init_over_mpi",
                        "MPI is not initialised (create an mpi::Environment first)");
  if (comm == MPI_COMM_NULL) raise("nccl::init_over_mpi", "MPI_COMM_NULL");
  int rank = 0, size = 0, world_rank = 0;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), "MPI_Comm_rank(MPI_COMM_WORLD)");

  // Every rank states whether it can take part before anyone enters
  // ncclCommInitRank, so one rank's failure is an error everywhere, not a hang.
  std::string problem;
  if (device < 0) {
    MPI_Comm node = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node),
              "MPI_Comm_split_type");
    int local = 0;
    const int rc = MPI_Comm_rank(node, &local);
    MPI_Comm_free(&node);
    check_mpi(rc, "MPI_Comm_rank(node)");
    const int devices = device_count();
    if (devices == 0)
      problem = "no CUDA device: " + device_status();
    else
      device = local % devices;
  }
  // Rank 0 makes the id; a failure there is broadcast instead of the id.
  struct Payload {
    int ok;
    ncclUniqueId id;
  } payload;
  std::memset(&payload, 0, sizeof payload);
  if (rank == 0) {
    try {
      payload.id = unique_id();
      payload.ok = 1;
    } catch (const Error& e) {
      problem = e.what();
    }
  }
  check_mpi(MPI_Bcast(&payload, static_cast<int>(sizeof payload), MPI_BYTE, 0, comm), "MPI_Bcast");
  int ready = problem.empty() ? 1 : 0, all_ready = 0;
  check_mpi(MPI_Allreduce(&ready, &all_ready, 1, MPI_INT, MPI_MIN, comm), "MPI_Allreduce");
  if (!problem.empty())
    raise<BackendError>({.op = "nccl::init_over_mpi", .rank = rank, .group_size = size}, problem);
  if (!payload.ok || !all_ready)
    raise<BackendError>({.op = "nccl::init_over_mpi", .rank = rank, .group_size = size},
                        "another rank could not take part (see its error)");

  options.members.assign(static_cast<std::size_t>(size), 0);
  check_mpi(MPI_Allgather(&world_rank, 1, MPI_INT, options.members.data(), 1, MPI_INT, comm),
            "MPI_Allgather");
  return init_rank(payload.id, size, rank, device, std::move(options), std::move(name));
}

}  // namespace diffcomm::nccl
#endif  // DIFFCOMM_HAVE_MPI
