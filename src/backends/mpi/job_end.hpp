#pragma once
// The alarm channel: how one process of an MPI job tells the others, out of
// band, that it timed out or is ending the job, so that every process dumps
// its flight recorder and reports before any MPI_Abort (mpi::end_job and
// mpi::at_exit in backends/mpi.hpp say what users see).
//
// A duplicate of MPI_COMM_WORLD made by the first mpi::world(), never used by
// a collective, so it cannot be stuck where the data is: each process keeps
// one receive posted on it (tag kAlarm) and tests it while it waits in a call
// (check_alarm); end_job's "reported" messages (tag kReported) and at_exit's
// barrier travel on it too. MPI_THREAD_FUNNELED allows no listener thread:
// a process learns of an alarm when it waits in a call or leaves.
#include <mpi.h>

#include <memory>
#include <string>

#include "diffcomm/distributed/backend/call.hpp"

namespace diffcomm::dist {
class FlightRecorder;
}

namespace diffcomm::mpi::detail {

/// Opens the channel once per process (later calls return at once): a
/// duplicate of MPI_COMM_WORLD made with the deadline (collective: every
/// process's first mpi::world() calls it), and keeps `recorder` alive so that
/// a process that left its groups early can still dump it when a peer fails.
/// Does nothing in a world of one process. `duplicate(timeout_s)` makes the
/// duplicate (mpi_backend.cpp's, with the deadline of group creation).
void open_alarm_channel(std::shared_ptr<const dist::FlightRecorder> recorder, double timeout_s,
                        MPI_Comm (*duplicate)(double timeout_s));

/// Tells every other process that this one timed out in `where` (the first
/// time only; the channel must be open, else nothing happens).
void raise_timeout_alarm(const std::string& where);

/// When a peer raised the alarm, throws for `c` (the call this process waits
/// in): Timeout if the peer timed out, RankFailure if it is ending the job for
/// another reason, naming that process and its reason. The call's requests
/// stay in flight, so the process counts as timed out (mpi::timed_out()).
/// Cheap enough to call on every poll of a wait; skips when another thread
/// holds the channel.
void check_alarm(const dist::Call& c);

}  // namespace diffcomm::mpi::detail
