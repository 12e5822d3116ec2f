#pragma once
// diffcomm::mpi — the dist::Backend on Open MPI (CPU tensors), so the whole
// layer (nn, encoder_parallel) runs across real processes.
//
//  - Groups: from MPI_COMM_WORLD or a caller's communicator (borrowed: never
//    freed by diffcomm); sub-groups through MPI_Comm_split (owned, freed when
//    the last handle goes away, if MPI is still initialised).
//  - Every communicator diffcomm touches gets MPI_ERRORS_RETURN; a failing
//    call raises BackendError with MPI's error string, the op and the rank.
//  - Every call is issued non-blocking and completed in the shared wait loop
//    with a deadline (Options::timeout_s, DIFFCOMM_TIMEOUT): a member that
//    returns early, fails or skips a call makes the others raise Timeout with
//    their flight recorder, never hang.
//  - Reductions (all_reduce, reduce, reduce_scatter*) are diffcomm's
//    deterministic composition (dist/backend/composed.hpp): bit-identical to the
//    simulated world. Options::native_reduction uses MPI's own reductions
//    instead (16-bit types through user ops that round per combine; Avg as a
//    sum then a scale): faster, not bit-reproducible.
//  - Checked mode (Options::check, DIFFCOMM_CHECK; on in Debug builds):
//    dist::CheckedBackend on a duplicate communicator compares every call's
//    fingerprint across members and raises CollectiveMismatch on all.
//  - Counts above 2^31-1 elements: fixed-size collectives are issued in
//    chunks; variable ones (all_gather_v, reduce_scatter_v,
//    all_to_all_single, all_to_all) and send/recv fall back to per-peer
//    non-blocking point-to-point messages in chunks. The chunk limit is
//    max_count() (INT_MAX unless lowered for tests).
//  - Thread model: MPI calls come from the thread that calls diffcomm.
#include <mpi.h>

#include <cstdint>
#include <string>

#include "diffcomm/distributed/backend/options.hpp"
#include "diffcomm/distributed/group.hpp"

namespace diffcomm::mpi {

/// Calls MPI_Init_thread (MPI_THREAD_FUNNELED) unless MPI is already
/// initialised, and on destruction at_exit() then MPI_Finalize if it
/// initialised MPI. If any call of this process timed out, the destructor
/// ends the job instead (at_exit, end_job): MPI_Finalize would wait for the
/// timed-out calls' requests forever, or crash when a late peer completes
/// them into freed buffers. In a process forked after the Environment was made (os.fork(),
/// a multiprocessing worker) the destructor does nothing: the parent's MPI
/// is not the child's, and its MPI_Finalize or MPI_Abort there hung or ended
/// the parent's whole job when the child exited.
class Environment {
 public:
  Environment(int* argc, char*** argv);
  ~Environment();
  Environment(const Environment&) = delete;
  Environment& operator=(const Environment&) = delete;

 private:
  bool owns_ = false;
};

/// Whether this process was fork()ed after diffcomm set up or used MPI (an
/// Environment or a group): the parent's MPI state is copied into the child
/// but is not its own, so the child must not call MPI. Environment's and the
/// groups' destructors and abort_if_timed_out() do nothing in such a child,
/// and its collectives on the parent's groups raise BackendError. A flag set
/// by pthread_atfork: no cost per call.
bool in_forked_child();

/// The group of every process (MPI_COMM_WORLD, borrowed). Its collectives
/// raise BackendError once MPI is finalised or in a forked child
/// (in_forked_child), instead of Open MPI aborting the job. Collective over
/// MPI_COMM_WORLD, with the deadline (Options::timeout_s): the members
/// exchange their checked-mode flag, and a checked group duplicates the
/// communicator for its control traffic (MPI_Comm_idup). Throws BackendError
/// when MPI is not initialised or when members disagree on checked mode
/// (naming which ranks check), Timeout when a member does not arrive in
/// time, InvalidArgument for a bad timeout. Sub-groups inherit `options`.
dist::ProcessGroup world(const dist::Options& options = {});

/// A group over a caller's communicator, borrowed: diffcomm sets
/// MPI_ERRORS_RETURN on it but never frees it. The caller keeps it valid
/// while any handle to the group lives. Collective over `comm`, as world().
dist::ProcessGroup from_comm(MPI_Comm comm, std::string name = "mpi",
                             const dist::Options& options = {});

/// MPI_Abort(MPI_COMM_WORLD, code): ends every process of the job at once,
/// before its peers can dump or report; end_job is the way to end a job
/// after a failure.
[[noreturn]] void abort(int code);

/// Ends the job so that every process reports first (the way to end a job
/// after a failure; abort() ends it at once). With the alarm channel open
/// (the first world() of a job of 2 or more processes opens it):
///  1. tells every other process, out of band, that this one ends the job and
///     why (unless a peer's alarm or this process's Timeout already did): a
///     process waiting in a call stops waiting, raising Timeout when the
///     first alarm came from a Timeout and RankFailure otherwise, naming that
///     MPI rank and its reason; its funnel dumps its flight recorder, and
///     the program reports and ends through end_job in turn; a process at
///     exit (at_exit) dumps its recorders and joins;
///  2. says on the channel that this process has reported, and waits up to
///     3 s until every process has said so;
///  3. the lowest-numbered process that reported calls MPI_Abort(code),
///     printing how many processes reported; any other process waits 2 s
///     for that abort, then aborts itself.
/// So after a failure the job ends within about 3 s of the last report, 5 s
/// at most past the moment this is called, and a process that is stuck
/// outside any call (computing) is killed without a report. Without the
/// channel (no world() yet, one process), abort(code) at once; in a forked
/// child (in_forked_child) or after MPI_Finalize, std::_Exit(code): the job
/// is not this process's to end. Never returns.
[[noreturn]] void end_job(int code, const std::string& why);

/// What a process does as it leaves (Environment's destructor and the Python
/// package's interpreter exit call it, before MPI_Finalize): after a Timeout,
/// abort_if_timed_out(); otherwise, with the alarm channel open, meets every
/// other process at a barrier on the channel, watching for an alarm. When a
/// peer times out or ends the job meanwhile (this process left its calls
/// early), this process dumps its flight recorders (dump_all_on_error: the
/// world group's recorder is kept alive for this), prints a line naming the
/// peer and joins end_job, so its dump is there for replay. When every
/// process arrives, closes the channel and returns. Idempotent; does nothing
/// when MPI is not initialised, finalised, or in a forked child.
void at_exit();

/// Exit code of the MPI_Abort that abort_if_timed_out() issues.
inline constexpr int kTimeoutAbortCode = 124;

/// Whether a call of this process (any group, world creation included) has
/// raised Timeout.
bool timed_out();

/// When timed_out() (and not in_forked_child()), prints which call timed out to stderr and ends the
/// job with end_job(kTimeoutAbortCode, ...): every process reports before the abort. Otherwise
/// (or when MPI is not initialised or already finalised) returns. at_exit() calls it.
void abort_if_timed_out();

/// Largest element count passed to one MPI call (default INT_MAX). Tests
/// lower it to exercise the chunked, large-count paths with small buffers.
int64_t max_count();
void set_max_count(int64_t count);

}  // namespace diffcomm::mpi
