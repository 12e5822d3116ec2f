#pragma once
// What the MPI backend remembers of a Timeout: the first call of this process
// that timed out (its group keeps requests in flight from then on), so the
// process can end the job instead of waiting in MPI_Finalize
// (abort_if_timed_out in backends/mpi.hpp), and whether this process is a
// fork of one that used MPI, so that it leaves MPI alone (in_forked_child).
#include <string>

namespace diffcomm::mpi::detail {

/// Records `where` ("barrier #0 on group 'world' (rank 0 of 2)") if no call
/// timed out before and, with `tell_peers`, raises the alarm (job_end.hpp) so
/// that every other process stops waiting, dumps and reports. Thread-safe.
void note_timeout(const std::string& where, bool tell_peers = true);

/// From now on, a fork()ed child of this process knows it is one
/// (in_forked_child; pthread_atfork, registered once).
void watch_for_fork();

}  // namespace diffcomm::mpi::detail
