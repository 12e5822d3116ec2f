// Ending the job: abort(), and after a Timeout the record of the first
// timed-out call and abort_if_timed_out() (through end_job, job_end.cpp)
// (see timeouts.hpp and backends/mpi.hpp).
#include "timeouts.hpp"

#include <mpi.h>
#include <pthread.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "diffcomm/backends/mpi.hpp"
#include "job_end.hpp"

namespace diffcomm::mpi {
namespace {
std::atomic<bool> g_timed_out{false};
std::mutex g_timed_out_mu;
std::string g_timed_out_in;
// Set in the child of a fork() after diffcomm first used MPI (pthread_atfork):
// a flag, not a getpid() syscall per call, since the MPI backend asks on
// every collective.
std::atomic<bool> g_forked_child{false};
}  // namespace

void detail::watch_for_fork() {
  static const int registered =
      pthread_atfork(nullptr, nullptr, [] { g_forked_child.store(true); });
  (void)registered;
}

bool in_forked_child() { return g_forked_child.load(std::memory_order_relaxed); }

void detail::note_timeout(const std::string& where, bool tell_peers) {
  {
    std::lock_guard lock(g_timed_out_mu);
    if (!g_timed_out.exchange(true)) g_timed_out_in = where;
  }
  if (tell_peers) raise_timeout_alarm(where);
}

void abort(int code) {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort does not return; the compiler cannot know
}

bool timed_out() { return g_timed_out.load(); }

void abort_if_timed_out() {
  if (!g_timed_out.load() || in_forked_child()) return;
  int init = 0, finalized = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&finalized);
  if (!init || finalized) return;
  std::string where;
  {
    std::lock_guard lock(g_timed_out_mu);
    where = g_timed_out_in;
  }
  std::fprintf(stderr,
               "diffcomm: ending the MPI job with MPI_Abort (code %d): %s timed out earlier and "
               "its requests are still in flight, so MPI_Finalize could wait for them forever or "
               "free buffers MPI still writes into\n",
               kTimeoutAbortCode, where.c_str());
  std::fflush(stderr);
  end_job(kTimeoutAbortCode, "timed out in " + where);
}

}  // namespace diffcomm::mpi
