// Ending an MPI job so that every process reports first: the alarm channel
// (job_end.hpp), mpi::end_job and mpi::at_exit (backends/mpi.hpp).
//
// Why the order matters: Open MPI's MPI_Abort kills every process of the job
// at once. When the first of several stuck ranks to time out aborted right
// away, the others died before their own deadline fired, so their reports and
// flight-recorder dumps were lost and the dumps could not be replayed. Now the
// first process to time out raises the alarm, every process that learns of it
// dumps and reports, says so on the channel, and only then does one process,
// the lowest-numbered of those that reported, call MPI_Abort.
#include "job_end.hpp"

#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "diffcomm/backends/mpi.hpp"
#include "diffcomm/distributed/flight_recorder.hpp"
#include "diffcomm/tensor/error.hpp"
#include "timeouts.hpp"

namespace diffcomm::mpi {
namespace {

constexpr int kAlarmTag = 1;
constexpr int kReportedTag = 2;

enum AlarmKind : int32_t { kTimedOut = 0, kEnding = 1 };

// One alarm, sent as bytes: every process of one job runs the same build.
struct AlarmMessage {
  int32_t from = -1;  // MPI_COMM_WORLD rank of the sender
  int32_t kind = kTimedOut;
  int32_t code = 0;     // the MPI_Abort code the sender will end the job with
  char text[500] = {};  // where it timed out, or why it ends the job (truncated)
};

struct Channel {
  std::mutex mu;
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  std::shared_ptr<const dist::FlightRecorder> recorder;  // dumped at exit on an alarm
  MPI_Request alarm_req = MPI_REQUEST_NULL;
  AlarmMessage incoming;
  bool received = false;  // `incoming` holds a peer's alarm
  bool sent = false;      // this process raised the alarm
  AlarmMessage outgoing;
  int32_t reported_from = -1;      // the payload of this process's "reported" messages
  std::vector<MPI_Request> sends;  // never completed: the job ends after them
  bool opened = false;             // open_alarm_channel ran (even for one process)
};

// Leaked: used at exit, after static destructors may have run.
Channel& channel() {
  static Channel* c = new Channel;
  return *c;
}

bool mpi_usable() {
  int init = 0, finalized = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&finalized);
  return init && !finalized && !in_forked_child();
}

// Sends `count` items at `buf` to every other process on the channel; the
// requests are kept, never waited for (small messages, and the job ends).
void send_to_others_locked(Channel& ch, const void* buf, int count, MPI_Datatype type, int tag) {
  for (int p = 0; p < ch.size; ++p) {
    if (p == ch.rank) continue;
    MPI_Request r = MPI_REQUEST_NULL;
    MPI_Isend(buf, count, type, p, tag, ch.comm, &r);
    ch.sends.push_back(r);
  }
}

void send_alarm_locked(Channel& ch, AlarmKind kind, int code, const std::string& text) {
  if (ch.sent || ch.received || ch.comm == MPI_COMM_NULL) return;  // one alarm is enough
  ch.sent = true;
  ch.outgoing.from = ch.rank;
  ch.outgoing.kind = kind;
  ch.outgoing.code = code;
  std::snprintf(ch.outgoing.text, sizeof ch.outgoing.text, "%s", text.c_str());
  send_to_others_locked(ch, &ch.outgoing, sizeof(AlarmMessage), MPI_BYTE, kAlarmTag);
}

void poll_alarm_locked(Channel& ch) {
  if (ch.received || ch.alarm_req == MPI_REQUEST_NULL) return;
  int flag = 0;
  MPI_Test(&ch.alarm_req, &flag, MPI_STATUS_IGNORE);
  if (flag) ch.received = true;
}

// The channel after a clean exit barrier: nothing of it is in flight.
void close_locked(Channel& ch) {
  if (ch.alarm_req != MPI_REQUEST_NULL) {
    MPI_Cancel(&ch.alarm_req);
    MPI_Wait(&ch.alarm_req, MPI_STATUS_IGNORE);
  }
  MPI_Comm_free(&ch.comm);
  ch.recorder.reset();
}

std::string describe(const AlarmMessage& a) {
  const std::string text(a.text, strnlen(a.text, sizeof a.text));
  if (a.kind == kTimedOut)
    return fmt::format("MPI rank {} timed out in {} and is ending the job", a.from, text);
  return fmt::format("MPI rank {} is ending the job ({})", a.from, text);
}

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// end_job's wait: every other process's "reported", for at most kGraceS.
// Returns which processes reported (this one included).
std::vector<char> collect_reports(Channel& ch) {
  constexpr double kGraceS = 3.0;
  std::vector<char> reported(static_cast<std::size_t>(ch.size), 0);
  reported[static_cast<std::size_t>(ch.rank)] = 1;
  int count = 1;
  int32_t from = -1;
  MPI_Request req = MPI_REQUEST_NULL;
  MPI_Irecv(&from, 1, MPI_INT32_T, MPI_ANY_SOURCE, kReportedTag, ch.comm, &req);
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(kGraceS);
  while (count < ch.size && std::chrono::steady_clock::now() < end) {
    int flag = 0;
    MPI_Status status;
    MPI_Test(&req, &flag, &status);
    if (!flag) {
      sleep_ms(1);
      continue;
    }
    const auto src = static_cast<std::size_t>(status.MPI_SOURCE);
    if (!reported[src]) ++count;
    reported[src] = 1;
    MPI_Irecv(&from, 1, MPI_INT32_T, MPI_ANY_SOURCE, kReportedTag, ch.comm, &req);
  }
  return reported;
}

}  // namespace

void detail::open_alarm_channel(std::shared_ptr<const dist::FlightRecorder> recorder,
                                double timeout_s, MPI_Comm (*duplicate)(double)) {
  Channel& ch = channel();
  const std::lock_guard lock(ch.mu);
  if (ch.opened) return;
  ch.opened = true;
  MPI_Comm_rank(MPI_COMM_WORLD, &ch.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ch.size);
  if (ch.size < 2) return;
  ch.comm = duplicate(timeout_s);
  ch.recorder = std::move(recorder);
  // An uncaught C++ exception ends the job through end_job too, after the
  // recorders' dumps, instead of a bare abort() that mpirun answers by
  // killing every peer before it reports.
  dist::FlightRecorder::set_end_on_terminate([](const char* why) { end_job(1, why); });
  MPI_Irecv(&ch.incoming, sizeof(AlarmMessage), MPI_BYTE, MPI_ANY_SOURCE, kAlarmTag, ch.comm,
            &ch.alarm_req);
}

void detail::raise_timeout_alarm(const std::string& where) {
  if (!mpi_usable()) return;
  Channel& ch = channel();
  const std::lock_guard lock(ch.mu);
  send_alarm_locked(ch, kTimedOut, kTimeoutAbortCode, where);
}

void detail::check_alarm(const dist::Call& c) {
  Channel& ch = channel();
  std::unique_lock lock(ch.mu, std::try_to_lock);
  if (!lock.owns_lock() || ch.comm == MPI_COMM_NULL) return;
  poll_alarm_locked(ch);
  if (!ch.received) return;
  const AlarmMessage a = ch.incoming;
  lock.unlock();
  note_timeout(c.where(), /*tell_peers=*/false);  // this call's requests stay in flight
  // Worded as wait_until_done's Timeout: the call's place, then why.
  const std::string message = fmt::format(
      "stopped waiting in {}: {}: {}, so this call cannot complete (the group is unusable now)",
      c.where(), c.signature(), describe(a));
  if (a.kind == kTimedOut) throw Timeout(message);
  throw RankFailure(message);
}

void end_job(int code, const std::string& why) {
  // A forked child (the job is its parent's) or MPI gone: leave alone.
  if (!mpi_usable()) std::_Exit(code);
  Channel& ch = channel();
  std::unique_lock lock(ch.mu);
  if (ch.comm == MPI_COMM_NULL) {
    lock.unlock();
    abort(code);
  }
  send_alarm_locked(ch, kEnding, code, why);
  // This process has written its dumps and report: say so to every other.
  ch.reported_from = ch.rank;
  send_to_others_locked(ch, &ch.reported_from, 1, MPI_INT32_T, kReportedTag);
  const std::vector<char> reported = collect_reports(ch);
  const auto count = std::count(reported.begin(), reported.end(), 1);
  // Which process aborts: the lowest-numbered that reported. Every process
  // that saw all reports picks the same one; a process that missed some
  // (a peer stuck outside any call) waits for that abort a little longer,
  // then aborts itself, so the job never outlives the grace by much.
  const auto leader = std::find(reported.begin(), reported.end(), 1) - reported.begin();
  if (leader == ch.rank) {
    std::vector<int> missing;
    for (int p = 0; p < ch.size; ++p)
      if (!reported[static_cast<std::size_t>(p)]) missing.push_back(p);
    std::fprintf(stderr, "%s\n",
                 fmt::format("diffcomm: MPI rank {} ends the job with MPI_Abort (code {}) after "
                             "{} of {} processes reported{}",
                             ch.rank, code, count, ch.size,
                             missing.empty() ? std::string()
                                             : fmt::format(" (no word from ranks [{}] within 3 s)",
                                                           fmt::join(missing, ",")))
                     .c_str());
    std::fflush(stderr);
    lock.unlock();
    abort(code);
  }
  lock.unlock();
  sleep_ms(2000);
  abort(code);
}

void at_exit() {
  if (!mpi_usable()) return;
  abort_if_timed_out();  // does not return after a Timeout
  Channel& ch = channel();
  std::unique_lock lock(ch.mu);
  if (ch.comm == MPI_COMM_NULL) return;
  // Every process meets here before MPI_Finalize, watching for an alarm: a
  // process that left its calls early still dumps and reports when a peer
  // times out waiting for it (MPI_Finalize would leave it deaf and dumb).
  MPI_Request barrier = MPI_REQUEST_NULL;
  MPI_Ibarrier(ch.comm, &barrier);
  for (;;) {
    int flag = 0;
    MPI_Test(&barrier, &flag, MPI_STATUS_IGNORE);
    if (flag) return close_locked(ch);
    poll_alarm_locked(ch);
    if (ch.received) break;
    sleep_ms(1);
  }
  const AlarmMessage a = ch.incoming;
  lock.unlock();
  const int dumped = dist::FlightRecorder::dump_all_on_error();
  std::fprintf(
      stderr, "%s\n",
      fmt::format(
          "diffcomm: MPI rank {} was leaving the job (at exit) when {}; {}", ch.rank, describe(a),
          dumped > 0 ? "its flight recorder is dumped" : "it has no flight recorder dump directory")
          .c_str());
  std::fflush(stderr);
  end_job(a.code, "left its calls before the failure");
}

}  // namespace diffcomm::mpi
