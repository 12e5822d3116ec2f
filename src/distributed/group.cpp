#include "diffcomm/distributed/group.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::dist {

namespace {
// A number for the calling OS thread, never reused in this process
// (std::thread::id values are reused once a thread ends, which would make a
// new thread look like its predecessor on some ranks only). Not
// per-rank state: the simulated world's ranks share one OS thread, one token.
uint64_t thread_token() {
  static std::atomic<uint64_t> next{1};
  thread_local const uint64_t token = next.fetch_add(1, std::memory_order_relaxed);
  return token;
}

// The threads that made collective calls on a group, numbered in order of
// first use.
struct ThreadNumbers {
  std::unordered_map<uint64_t, int> numbers;  // thread_token -> number, in order of first use
  uint64_t last_token = 0;  // the last caller's, and its number: no lookup in steady state
  int last_number = 0;
};

// Sets call.thread_index: collectives only, since a send or recv involves
// two members and the others never see its thread.
void number_thread(ThreadNumbers& t, Call& call) {
  if (call.op == OpType::Send || call.op == OpType::Recv) return;
  const uint64_t me = thread_token();
  if (me != t.last_token) {
    const int next = static_cast<int>(t.numbers.size());
    t.last_number = t.numbers.try_emplace(me, next).first->second;
    t.last_token = me;
  }
  call.thread_index = t.last_number;
}
}  // namespace

struct ProcessGroup::State {
  std::shared_ptr<Backend> backend;
  std::string name;
  std::shared_ptr<Stats> stats;
  std::shared_ptr<FlightRecorder> recorder;
  std::shared_ptr<Cohort> cohort;
  uint64_t seq = 0;
  uint64_t p2p_seq = 0;
  // The thread inside a call on this group (id{} when none), and which call:
  // the funnel's one-thread-per-group check (see CallSlot).
  std::atomic<std::thread::id> caller{};
  std::atomic<int> caller_op{0};
  std::atomic<uint64_t> caller_seq{0};
  // Read and written only by the thread holding the slot. One entry per
  // distinct thread: a program that starts a thread per step adds one entry
  // per step.
  ThreadNumbers threads;
  std::optional<CallId> last_call;    // the last collective numbered here
  std::optional<CallId> backward_of;  // set by a live BackwardOf
};

ProcessGroup::ProcessGroup(std::shared_ptr<Backend> backend, std::string name,
                           std::shared_ptr<Stats> stats, std::shared_ptr<FlightRecorder> recorder,
                           std::shared_ptr<Cohort> cohort)
    : state_(std::make_shared<State>()) {
  if (!backend) raise("ProcessGroup", "null backend");
  state_->backend = std::move(backend);
  state_->name = std::move(name);
  state_->stats = stats ? std::move(stats) : std::make_shared<Stats>();
  state_->recorder = recorder ? std::move(recorder) : std::make_shared<FlightRecorder>();
  state_->cohort = cohort ? std::move(cohort) : std::make_shared<Cohort>();
}

int ProcessGroup::rank() const { return state_->backend->rank(); }
int ProcessGroup::size() const { return state_->backend->size(); }
const std::string& ProcessGroup::name() const { return state_->name; }
Backend& ProcessGroup::backend() const { return *state_->backend; }
Stats& ProcessGroup::stats() const { return *state_->stats; }
FlightRecorder& ProcessGroup::flight_recorder() const { return *state_->recorder; }

namespace {
// An error site on `g` for `op`, before any call number: group, rank, size.
ErrorSite site_of(const ProcessGroup& g, const char* op) {
  ErrorSite s;
  s.op = op;
  s.group = g.name();
  s.rank = g.rank();
  s.group_size = g.size();
  return s;
}
}  // namespace

const std::shared_ptr<Cohort>& ProcessGroup::cohort() const { return state_->cohort; }
uint64_t ProcessGroup::next_seq() const { return state_->seq++; }
uint64_t ProcessGroup::next_p2p_seq() const { return state_->p2p_seq++; }
void ProcessGroup::resume_numbering(uint64_t seq, bool p2p) const {
  (p2p ? state_->p2p_seq : state_->seq) = seq;
}
const std::optional<CallId>& ProcessGroup::backward_of() const { return state_->backward_of; }
void ProcessGroup::set_last_call(CallId call) const { state_->last_call = call; }

CallId ProcessGroup::last_call() const {
  if (!state_->last_call)
    throw InvalidArgument(site_of(*this, "last_call"), "no collective was issued on it yet");
  return *state_->last_call;
}

ProcessGroup::BackwardOf::BackwardOf(const ProcessGroup& group, CallId forward)
    : state_(group.state_.get()), previous_(state_->backward_of) {
  state_->backward_of = forward;
}
ProcessGroup::BackwardOf::~BackwardOf() { state_->backward_of = previous_; }

ProcessGroup::CallSlot::CallSlot(const ProcessGroup& group, Call& call)
    : state_(group.state_.get()) {
  const std::thread::id me = std::this_thread::get_id();
  std::thread::id none{};
  if (state_->caller.compare_exchange_strong(none, me, std::memory_order_acquire)) {
    claimed_ = true;
    state_->caller_op.store(static_cast<int>(call.op), std::memory_order_relaxed);
    state_->caller_seq.store(group.state_->seq, std::memory_order_relaxed);
    number_thread(state_->threads, call);
    return;
  }
  if (none == me) return;  // a call of this thread already holds the group
  std::ostringstream mine, theirs;
  mine << me;
  theirs << none;
  const auto busy_op = static_cast<OpType>(state_->caller_op.load(std::memory_order_relaxed));
  // The call's own site without its number (not taken yet) and with the backend.
  ErrorSite site = call.site();
  site.call.reset();
  site.backend = group.backend().backend_name();
  throw InvalidArgument(
      std::move(site),
      fmt::format(
          "called from thread {} while thread {} is inside {} #{} on this group; a group takes "
          "one call at a time, from one thread at a time (as NCCL communicators and c10d "
          "process groups): issue a group's calls from one thread, or give each thread its own "
          "group (new_group)",
          mine.str(), theirs.str(), op_name(busy_op),
          state_->caller_seq.load(std::memory_order_relaxed)));
}

ProcessGroup::CallSlot::~CallSlot() {
  if (claimed_) state_->caller.store(std::thread::id{}, std::memory_order_release);
}

int ProcessGroup::global_rank(int group_rank) const {
  if (group_rank < 0 || group_rank >= size())
    raise("global_rank", fmt::format("rank {} out of range for group '{}' of size {}", group_rank,
                                     name(), size()));
  return state_->backend->global_rank(group_rank);
}

int ProcessGroup::group_rank(int global) const {
  for (int r = 0; r < size(); ++r)
    if (state_->backend->global_rank(r) == global) return r;
  raise("group_rank", fmt::format("global rank {} is not a member of group '{}' ({})", global,
                                  name(), fmt::join(members(), ",")));
}

std::vector<int> ProcessGroup::members() const {
  std::vector<int> m;
  for (int r = 0; r < size(); ++r) m.push_back(state_->backend->global_rank(r));
  return m;
}

std::optional<ProcessGroup> ProcessGroup::split(int color, int key,
                                                const std::vector<int64_t>& fingerprint,
                                                std::string new_name, Caller caller) const {
  // Through the funnel like every other call (numbering, stats, recorder).
  std::shared_ptr<Backend> b =
      detail::split_backend(*this, color, key, fingerprint, /*members_are_ranks=*/false, caller);
  if (!b) return std::nullopt;
  return ProcessGroup(std::move(b), std::move(new_name), state_->stats, state_->recorder,
                      state_->cohort);
}

std::optional<ProcessGroup> ProcessGroup::new_group(const std::vector<int>& ranks,
                                                    std::string new_name, Caller caller) const {
  std::vector<int> seen(static_cast<std::size_t>(size()), 0);
  for (int r : ranks) {
    if (r < 0 || r >= size())
      throw InvalidArgument(site_of(*this, "new_group"),
                            fmt::format("rank {} out of range [0, {})", r, size()));
    if (seen[static_cast<std::size_t>(r)]++)
      throw InvalidArgument(site_of(*this, "new_group"), fmt::format("rank {} listed twice", r));
  }
  if (ranks.empty()) throw InvalidArgument(site_of(*this, "new_group"), "empty rank list");
  auto pos = std::find(ranks.begin(), ranks.end(), rank());
  const int color = pos == ranks.end() ? -1 : 0;
  const int key = static_cast<int>(pos - ranks.begin());
  if (new_name.empty()) {
    std::vector<int> globals;
    for (int r : ranks) globals.push_back(global_rank(r));
    new_name = fmt::format("{}{{{}}}", name() == "world" ? "" : name(), fmt::join(globals, ","));
  }
  std::shared_ptr<Backend> b =
      detail::split_backend(*this, color, key, std::vector<int64_t>(ranks.begin(), ranks.end()),
                            /*members_are_ranks=*/true, caller);
  if (!b) return std::nullopt;
  return ProcessGroup(std::move(b), std::move(new_name), state_->stats, state_->recorder,
                      state_->cohort);
}

}  // namespace diffcomm::dist
