#include "diffcomm/sim/world.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/fiber/all.hpp>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <list>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>

#include "diffcomm/dist/backend.hpp"
#include "diffcomm/dist/fingerprint.hpp"
#include "diffcomm/dist/flight_recorder.hpp"
#include "diffcomm/dist/reduce_op.hpp"
#include "diffcomm/error.hpp"
#include "scheduler.hpp"

#if DIFFCOMM_SIM_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace diffcomm::sim {

using dist::Call;
using dist::OpType;

namespace {

enum class ErrorKind { None, Mismatch, Deadlock, RankFailure };

struct SimGroup;

// One collective (or send/recv pair) on its way: members deposit their Call,
// the last to arrive checks the fingerprints and moves everybody's data.
struct Rendezvous {
  SimGroup* group = nullptr;
  std::string label;               // for reports
  std::vector<Call*> calls;        // by slot (group rank; p2p: 0 = sender, 1 = receiver)
  std::vector<int> globals;        // global rank per slot
  std::vector<int> arrival_order;  // slots in arrival order
  int arrived = 0;
  bool done = false;
  ErrorKind error = ErrorKind::None;
  std::string message;
  int cause = -1;                             // RankFailure: global rank of the root-cause failure
  std::shared_ptr<const std::string> report;  // Deadlock: the one report every rank shares
  double start_us = 0, end_us = 0;
  std::vector<std::shared_ptr<dist::Backend>> split_results;
  // Members blocked in it, in the order they blocked (woken in that order).
  // Fibers share one OS thread and switch only inside diffcomm calls, so the
  // scheduler's suspend/schedule is all waiting needs: no condition
  // variable, whose lock and wait queue cost a fifth of a small collective.
  std::vector<boost::fibers::context*> waiters;
  std::size_t pending_at = SIZE_MAX;           // index in World::Impl::pending while waited in
  std::vector<const dist::Call*> const_calls;  // compare()'s view of `calls`, kept for reuse
  // all_to_all (list form): row s written by member s on arrival, from its
  // own lists while they are in cache (see fill_all_to_all_row); compared
  // and moved from here. Kept with their capacity for reuse.
  // Not zero-filled: every member's row is written before it is read.
  struct AllToAllTables {
    std::size_t size = 0;                           // entries per table (N^2)
    std::unique_ptr<uint64_t[]> in_code, out_code;  // dist::shape_code per block
    std::unique_ptr<const char*[]> src;             // null when empty
    std::unique_ptr<char*[]> dst;                   // null when empty
    std::unique_ptr<std::size_t[]> len;             // input block bytes
    void resize(std::size_t n) {
      if (size == n) return;
      in_code.reset(new uint64_t[n]);
      out_code.reset(new uint64_t[n]);
      src.reset(new const char*[n]);
      dst.reset(new char*[n]);
      len.reset(new std::size_t[n]);
      size = n;
    }
  } a2a;

  // Ready for another collective of `g`; vectors keep their capacity.
  void reset(SimGroup* g, const std::vector<int>& members) {
    group = g;
    label.clear();
    calls.assign(members.size(), nullptr);
    globals.assign(members.begin(), members.end());
    arrival_order.clear();
    waiters.clear();
    arrived = 0;
    done = false;
    error = ErrorKind::None;
    message.clear();
    report.reset();
    start_us = end_us = 0;
    split_results.clear();
    pending_at = SIZE_MAX;
  }
};

struct SimGroup {
  uint64_t id = 0;
  std::vector<int> members;          // global ranks in group order
  uint32_t trace_name = UINT32_MAX;  // index into World::Impl::trace_names (trace only)
  // Collectives on their way, by call number. At most one in practice (no
  // member can start call k+1 before all have arrived at k, and the last
  // arrival takes k out), so a vector searched from the back, which keeps
  // its capacity: a map node per collective was a malloc/free per call.
  std::vector<std::pair<uint64_t, std::shared_ptr<Rendezvous>>> pending;
  std::shared_ptr<Rendezvous>& pending_entry(uint64_t seq) {
    for (auto it = pending.rbegin(); it != pending.rend(); ++it)
      if (it->first == seq) return it->second;
    return pending.emplace_back(seq, nullptr).second;
  }
  void erase_pending(uint64_t seq) {
    for (auto it = pending.begin(); it != pending.end(); ++it)
      if (it->first == seq) {
        pending.erase(it);
        return;
      }
  }
  // p2p: (src slot, dst slot, tag, n) -> rendezvous
  std::map<std::tuple<int, int, int, uint64_t>, std::shared_ptr<Rendezvous>> pending_p2p;
  // Completed collective rendezvous kept for reuse: a fresh one per call was
  // a make_shared plus four vectors' allocations (arrival_order growing
  // 1, 2, 4, ...) on every collective. One is reused once every member has
  // left it (use_count() == 1: only this list holds it).
  std::vector<std::shared_ptr<Rendezvous>> spare;
};

enum class Status { Running, Blocked, Finished, Failed };

struct RankState {
  Status status = Status::Running;
  const Call* waiting_in = nullptr;  // lives on the waiting rank's stack while it waits
  int calls = 0;
  double clock_us = 0;
  std::shared_ptr<dist::Stats> stats = std::make_shared<dist::Stats>();
  std::exception_ptr error;
  // Shared, not copied: after a deadlock every rank's message is the same
  // N-line report (a copy per rank was O(N^2) memory: bad_alloc at 8192).
  std::shared_ptr<const std::string> error_message;
  uint64_t failure_order = 0;
  int cause = -1;  // set when the world raised RankFailure here: the root-cause rank
};

const std::string& message_of(const RankState& rs) {
  static const std::string none;
  return rs.error_message ? *rs.error_message : none;
}

// Deadlock whose what() is the world's one shared report.
class SharedDeadlock final : public Deadlock {
 public:
  explicit SharedDeadlock(std::shared_ptr<const std::string> report)
      : Deadlock(std::string()), report_(std::move(report)) {}
  const char* what() const noexcept override { return report_->c_str(); }
  const std::shared_ptr<const std::string>& report() const { return report_; }

 private:
  std::shared_ptr<const std::string> report_;
};

}  // namespace

struct World::Impl {
  WorldOptions options;
  std::vector<RankState> ranks;
  std::list<std::shared_ptr<SimGroup>> groups;
  // Every rendezvous someone waits in, unordered (Rendezvous::pending_at is
  // its index: O(1) insert and swap-remove, no node allocation per waiting
  // rank as std::set had). The rare paths that walk it sort a copy by
  // address, the order the std::set gave, so wake order is unchanged.
  std::vector<Rendezvous*> pending;
  std::vector<Rendezvous*> pending_sorted() const {
    std::vector<Rendezvous*> all(pending);
    std::sort(all.begin(), all.end(), std::less<Rendezvous*>());
    return all;
  }
  uint64_t next_group_id = 0;
  int live = 0;
  int blocked = 0;
  uint64_t failures = 0;
  // The trace as recorded: one fixed-size record per collective (op as an
  // enum, group name interned, call number, times: the same for every
  // member; a send/recv pair gets one per end) and one small entry per member (rank, bytes), so
  // recording costs no allocation per event and 24 bytes per rank-arrival (it was two strings, then
  // 56 bytes). trace() expands it to TraceEvents once, on demand, in the same order: each
  // collective's members in slot order.
  struct TraceCall {
    OpType op;
    uint32_t group;  // index into trace_names
    uint64_t seq;
    double start_us, duration_us;
    std::size_t first;  // index of its first TraceMember
  };
  struct TraceMember {
    int rank;
    uint64_t bytes_sent, bytes_received;
  };
  std::vector<TraceCall> trace_calls;
  std::vector<TraceMember> trace_members;
  // Calls a TraceEvent-shaped f(call, member) for every recorded event.
  template <class F>
  void for_each_trace_event(F&& f) const {
    for (std::size_t k = 0; k < trace_calls.size(); ++k) {
      const std::size_t end =
          k + 1 < trace_calls.size() ? trace_calls[k + 1].first : trace_members.size();
      for (std::size_t m = trace_calls[k].first; m < end; ++m) f(trace_calls[k], trace_members[m]);
    }
  }
  std::vector<std::string> trace_names;
  mutable std::vector<TraceEvent> trace_expanded;
  mutable bool trace_stale = false;
  uint64_t trace_hash = 1469598103934665603ull;
  std::vector<std::exception_ptr> errors;
  detail::SeededAlgorithm* algo = nullptr;  // installed on this thread by run()
  // True while run() runs; each run makes a new flag, every handle of that
  // run shares it, and it outlives the World (handles check it first).
  std::shared_ptr<bool> running = std::make_shared<bool>(false);
  // Held by the thread inside run(): a second thread's run() is refused
  // (`running` is no lock: two threads would both see it false).
  std::atomic<bool> in_run{false};

  std::shared_ptr<SimGroup> make_group(std::vector<int> members) {
    auto g = std::make_shared<SimGroup>();
    g->id = next_group_id++;
    g->members = std::move(members);
    groups.push_back(g);
    return g;
  }

  // FNV-1a powers of the prime: kFnvPow[k] = prime^k (mod 2^64).
  static constexpr std::array<uint64_t, 9> kFnvPow = [] {
    std::array<uint64_t, 9> p{};
    p[0] = 1;
    for (std::size_t k = 1; k < p.size(); ++k) p[k] = p[k - 1] * 1099511628211ull;
    return p;
  }();
  void hash(uint64_t v) {
    // FNV-1a over 8 bytes. The zero high bytes of a small value (call
    // numbers, slots, characters) only multiply (h ^ 0 == h): one
    // multiplication by a power of the prime, the same hash in a fraction of
    // the steps (it was eight rounds per character of every op name).
    int i = 0;
    for (; i < 8 && (v >> (8 * i)) != 0; ++i) {
      trace_hash ^= (v >> (8 * i)) & 0xFF;
      trace_hash *= 1099511628211ull;
    }
    trace_hash *= kFnvPow[static_cast<std::size_t>(8 - i)];
  }
  void hash(const char* s) {
    for (; *s != 0; ++s) hash(static_cast<uint64_t>(static_cast<unsigned char>(*s)));
  }

  uint32_t intern_trace_name(SimGroup& g, std::string_view name) {
    // Members name their group alike in practice; compare, not assume.
    if (g.trace_name < trace_names.size() && trace_names[g.trace_name] == name) return g.trace_name;
    const auto it = std::find(trace_names.begin(), trace_names.end(), name);
    g.trace_name = static_cast<uint32_t>(it - trace_names.begin());
    if (it == trace_names.end()) trace_names.emplace_back(name);
    return g.trace_name;
  }

  const std::vector<TraceEvent>& expanded_trace() const {
    if (trace_stale) {
      trace_expanded.clear();
      trace_expanded.reserve(trace_members.size());
      for_each_trace_event([&](const TraceCall& c, const TraceMember& m) {
        trace_expanded.push_back({dist::op_cstr(c.op), trace_names[c.group], c.seq, m.rank,
                                  c.start_us, c.duration_us, m.bytes_sent, m.bytes_received});
      });
      trace_stale = false;
    }
    return trace_expanded;
  }

  // ---------------------------------------------------------- waiting
  void wake(Rendezvous& rv) {
    if (rv.pending_at < pending.size() && pending[rv.pending_at] == &rv) {
      pending[rv.pending_at] = pending.back();
      pending[rv.pending_at]->pending_at = rv.pending_at;
      pending.pop_back();
    }
    rv.pending_at = SIZE_MAX;
    for (int slot : rv.arrival_order) {
      RankState& rs = ranks[static_cast<std::size_t>(rv.globals[static_cast<std::size_t>(slot)])];
      if (rs.status == Status::Blocked) {
        rs.status = Status::Running;
        rs.waiting_in = nullptr;
        --blocked;
      }
    }
    rv.done = true;
    boost::fibers::context* self = boost::fibers::context::active();
    for (boost::fibers::context* waiter : rv.waiters) self->schedule(waiter);
    rv.waiters.clear();
  }

  void check_deadlock() {
    if (blocked == 0 || blocked < live) return;
    std::string report = "deadlock: every live rank is blocked and none can proceed\n";
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      const RankState& rs = ranks[r];
      switch (rs.status) {
        case Status::Blocked:
          report += fmt::format("  rank {}: waiting in {}: {}\n", r, rs.waiting_in->where(),
                                rs.waiting_in->signature());
          break;
        case Status::Finished: report += fmt::format("  rank {}: finished\n", r); break;
        case Status::Failed:
          report += fmt::format("  rank {}: failed ({})\n", r, message_of(rs));
          break;
        case Status::Running: report += fmt::format("  rank {}: running\n", r); break;
      }
    }
    auto shared = std::make_shared<const std::string>(std::move(report));
    for (Rendezvous* rv : pending_sorted()) {
      rv->error = ErrorKind::Deadlock;
      rv->report = shared;
      wake(*rv);
    }
  }

  // Blocks the calling rank until rv is done (or fails).
  void wait(Rendezvous& rv, int global, const Call& call) {
    RankState& rs = ranks[static_cast<std::size_t>(global)];
    rs.status = Status::Blocked;
    rs.waiting_in = &call;  // formatted only if a deadlock report needs it
    ++blocked;
    if (rv.pending_at == SIZE_MAX) {
      rv.pending_at = pending.size();
      pending.push_back(&rv);
    }
    check_deadlock();
    boost::fibers::context* self = boost::fibers::context::active();
    while (!rv.done) {
      rv.waiters.push_back(self);
      self->suspend();  // until wake() schedules it
      algo->on_resumed();
    }
  }

  void on_rank_exit(int global, std::exception_ptr error,
                    std::shared_ptr<const std::string> message) {
    RankState& rs = ranks[static_cast<std::size_t>(global)];
    --live;
    if (!error) {
      rs.status = Status::Finished;
    } else {
      rs.status = Status::Failed;
      rs.error = error;
      rs.error_message = std::move(message);
      rs.failure_order = ++failures;
      // Release every member waiting for this rank in a group it belongs to,
      // naming the root cause: a rank that failed because another failed
      // (a victim) passes on that rank, not itself.
      const int root = rs.cause >= 0 ? rs.cause : global;
      std::vector<Rendezvous*> affected;
      for (Rendezvous* rv : pending_sorted()) {
        const auto& m = rv->globals;  // collective: the group; p2p: the pair
        if (std::find(m.begin(), m.end(), global) != m.end()) affected.push_back(rv);
      }
      // Formatted only when someone waits for this rank: after a deadlock
      // every rank leaves with the 1.8 MB report (16384 ranks) and nobody is
      // waiting; formatting it per rank was 30 GB of copying (20 s).
      const std::string what = affected.empty() ? std::string() : failure_text(global);
      for (Rendezvous* rv : affected) {
        rv->error = ErrorKind::RankFailure;
        rv->cause = root;
        rv->message = what;
        for (int slot : rv->arrival_order) {
          RankState& victim =
              ranks[static_cast<std::size_t>(rv->globals[static_cast<std::size_t>(slot)])];
          if (victim.cause < 0) victim.cause = root;
        }
        wake(*rv);
      }
    }
    check_deadlock();
  }

  // "member global rank R failed: <R's error>" for the root cause R of
  // failed rank `global`, plus which member brought it here when that is
  // another rank.
  std::string failure_text(int global) const {
    const RankState& rs = ranks[static_cast<std::size_t>(global)];
    const int root = rs.cause >= 0 ? rs.cause : global;
    const std::string head = fmt::format("member global rank {} failed: {}", root,
                                         message_of(ranks[static_cast<std::size_t>(root)]));
    if (root == global) return head;
    return fmt::format("{} (root cause; global rank {} of this group failed as a result)", head,
                       global);
  }

  [[noreturn]] void raise(const Rendezvous& rv, const Call& call) {
    // Every rank's line (its call included) is in the report; prefixing
    // call.where() would make a per-rank copy of it.
    if (rv.error == ErrorKind::Deadlock) throw SharedDeadlock(rv.report);
    const std::string msg = fmt::format("{}: {}", call.where(), rv.message);
    switch (rv.error) {
      case ErrorKind::Mismatch: throw CollectiveMismatch(msg);
      case ErrorKind::Deadlock: throw Deadlock(msg);
      case ErrorKind::RankFailure: throw RankFailure(msg);
      case ErrorKind::None: break;
    }
    throw Error(msg);
  }

  // Entry of every call: fault injection and failed members.
  void enter(SimGroup& g, int global, const Call& call) {
    RankState& rs = ranks[static_cast<std::size_t>(global)];
    ++rs.calls;
    if (options.fault && options.fault->rank == global && options.fault->at_call == rs.calls)
      throw RankFailure(fmt::format("rank {}: injected fault at its call #{}: {}: {}", global,
                                    rs.calls, call.where(), call.signature()));
    if (failures == 0) return;  // the common case: no scan of the members
    for (int m : g.members) {
      const RankState& ms = ranks[static_cast<std::size_t>(m)];
      if (ms.status != Status::Failed) continue;
      rs.cause = ms.cause >= 0 ? ms.cause : m;
      throw RankFailure(fmt::format("{}: (earlier) {}", call.where(), failure_text(m)));
    }
  }

  // ---------------------------------------------------------- fingerprints
  // Returns "" when the members agree, else the mismatch report (the shared
  // dist::compare, so production's checked mode reports in the same words).
  static std::string compare(Rendezvous& rv) {
    // In place: descriptions are built only on a mismatch (N^2 split
    // entries and shapes otherwise, for all_to_all_single / all_to_all).
    rv.const_calls.assign(rv.calls.begin(), rv.calls.end());
    if (rv.calls[0]->op == OpType::AllToAll)
      return dist::compare(rv.const_calls, rv.group->members,
                           dist::AllToAllCodes{rv.a2a.in_code.get(), rv.a2a.out_code.get()});
    return dist::compare(rv.const_calls, rv.group->members);
  }

  // ---------------------------------------------------------- data movement
  // Aliasing: the funnel has already staged every input that overlaps an
  // output of the same call (dist/collectives.cpp), the one rule of every
  // backend, so the data move below never reads what it has written.

  static int64_t offset_of(const dist::SplitList& splits, std::size_t upto) {
    if (splits.is_uniform()) return static_cast<int64_t>(upto) * splits.uniform_value();
    int64_t sum = 0;
    for (std::size_t i = 0; i < upto; ++i) sum += splits[i];
    return sum;
  }

  static void move_data(std::vector<Call*>& c) {
    const std::size_t n = c.size();
    const OpType op = c[0]->op;
    switch (op) {
      case OpType::Barrier:
      case OpType::NewGroup: break;
      case OpType::AllReduce: {
        // Reduced block by block into every member's output at once
        // (reduce_into's list form): each input and output byte is touched
        // once, as a memcpy of the same buffers would.
        std::vector<Tensor> ins, outs;
        ins.reserve(n);
        outs.reserve(n);
        for (auto* ci : c) {
          ins.push_back(ci->inputs[0]);
          outs.push_back(ci->outputs[0]);
        }
        dist::reduce_into(outs, ins, c[0]->reduce_op);
        break;
      }
      case OpType::Broadcast: {
        const auto src = static_cast<std::size_t>(c[0]->root);
        for (std::size_t i = 0; i < n; ++i)
          if (i != src) c[i]->outputs.writable(0).copy_(c[src]->inputs[0]);
        break;
      }
      case OpType::Reduce: {
        // Straight into the root's buffer (reduce_into handles aliasing).
        std::vector<Tensor> ins;
        ins.reserve(n);
        for (auto* ci : c) ins.push_back(ci->inputs[0]);
        dist::reduce_into(c[static_cast<std::size_t>(c[0]->root)]->outputs[0], ins,
                          c[0]->reduce_op);
        break;
      }
      case OpType::AllGather:
        for (std::size_t i = 0; i < n; ++i)
          for (std::size_t s = 0; s < n; ++s) c[i]->outputs.writable(s).copy_(c[s]->inputs[0]);
        break;
      case OpType::AllGatherSingle:
        for (std::size_t i = 0; i < n; ++i) {
          const int64_t rows = c[i]->inputs[0].size(0);
          for (std::size_t s = 0; s < n; ++s)
            c[i]->outputs[0].row_view(static_cast<int64_t>(s) * rows, rows).copy_(c[s]->inputs[0]);
        }
        break;
      case OpType::AllGatherV:
        for (std::size_t i = 0; i < n; ++i)
          for (std::size_t s = 0; s < n; ++s)
            c[i]->outputs[0]
                .row_view(offset_of(c[i]->output_splits, s), c[i]->output_splits[s])
                .copy_(c[s]->inputs[0]);
        break;
      case OpType::Gather: {
        const auto dst = static_cast<std::size_t>(c[0]->root);
        for (std::size_t s = 0; s < n; ++s) c[dst]->outputs.writable(s).copy_(c[s]->inputs[0]);
        break;
      }
      case OpType::Scatter: {
        const auto src = static_cast<std::size_t>(c[0]->root);
        for (std::size_t i = 0; i < n; ++i) c[i]->outputs.writable(0).copy_(c[src]->inputs[i]);
        break;
      }
      case OpType::ReduceScatter:
        for (std::size_t i = 0; i < n; ++i) {
          std::vector<Tensor> ins;
          for (auto* cs : c) ins.push_back(cs->inputs[i]);
          dist::reduce_into(c[i]->outputs[0], ins, c[0]->reduce_op);
        }
        break;
      case OpType::ReduceScatterSingle:
        for (std::size_t i = 0; i < n; ++i) {
          const int64_t rows = c[i]->outputs[0].size(0);
          std::vector<Tensor> ins;
          for (auto* cs : c)
            ins.push_back(cs->inputs[0].row_view(static_cast<int64_t>(i) * rows, rows));
          dist::reduce_into(c[i]->outputs[0], ins, c[0]->reduce_op);
        }
        break;
      case OpType::ReduceScatterV:
        for (std::size_t i = 0; i < n; ++i) {
          std::vector<Tensor> ins;
          for (auto* cs : c)
            ins.push_back(
                cs->inputs[0].row_view(offset_of(cs->input_splits, i), cs->input_splits[i]));
          dist::reduce_into(c[i]->outputs[0], ins, c[0]->reduce_op);
        }
        break;
      case OpType::AllToAll: break;  // move_all_to_all(), from the members' tables
      case OpType::AllToAllSingle: {
        // Offsets are prefix sums kept as running cursors, once per
        // collective: the sender's in its own loop, each receiver's in
        // `cursor` (senders go in order s = 0..N-1, so cursor[j] is the
        // prefix sum of receiver j's output_splits up to s). N-sized state
        // per collective, not N offset tables of N+1 (4 GiB at 16384 ranks);
        // destination pointers resolved once, not per block.
        const auto row_bytes = static_cast<int64_t>(c[0]->inputs[0].row_numel()) *
                               static_cast<int64_t>(element_size(c[0]->dtype));
        std::vector<char*> dst(n);
        std::vector<int64_t> cursor(n, 0);  // bytes
        for (std::size_t j = 0; j < n; ++j)
          dst[j] = static_cast<char*>(c[j]->outputs[0].data_ptr());
        for (std::size_t s = 0; s < n; ++s) {
          const char* src = static_cast<const char*>(c[s]->inputs[0].data_ptr());
          const dist::SplitList& in_splits = c[s]->input_splits;
          int64_t in_at = 0;  // bytes
          for (std::size_t j = 0; j < n; ++j) {
            const int64_t bytes = in_splits[j] * row_bytes;
            if (bytes == 0) continue;
            // Receiver j's output_splits[s] equals in_splits[j] (compared
            // before any data moves), so the sender's split advances both.
            std::memcpy(dst[j] + cursor[j], src + in_at, static_cast<std::size_t>(bytes));
            in_at += bytes;
            cursor[j] += bytes;
          }
        }
        break;
      }
      case OpType::Send:
      case OpType::Recv: c[1]->outputs.writable(0).copy_(c[0]->inputs[0]); break;
    }
  }

  // all_to_all's row of member `slot`, read from its own lists on arrival
  // (one pass over its tensors while the funnel's checks left them in cache;
  // reading every member's N tensors again at the rendezvous, for the
  // compare and then for the move, were two passes over all N^2 tensors,
  // hundreds of MB at 1024 ranks). Block sizes use the call's dtype: the
  // funnel checked that every tensor has it. Rows of members that called
  // something else, or lists of another length, are not written: compare()
  // rejects those calls before reading any row.
  static void fill_all_to_all_row(Rendezvous& rv, std::size_t slot, const Call& call) {
    const std::size_t n = rv.calls.size();
    if (call.inputs.size() != n || call.outputs.size() != n) return;
    auto& t = rv.a2a;
    t.resize(n * n);
    const std::size_t esize = element_size(call.dtype);
    auto bytes_of = [&](const Shape& s) {
      std::size_t e = esize;
      for (int64_t d : s) e *= static_cast<std::size_t>(d);
      return e;
    };
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t k = slot * n + i;
      const Tensor& in = call.inputs[i];
      const Tensor& out = call.outputs[i];
      if (!in.defined() || !out.defined()) {  // compare() reports it
        t.in_code[k] = t.out_code[k] = 0;
        t.src[k] = nullptr;
        t.dst[k] = nullptr;
        t.len[k] = 0;
        continue;
      }
      const Shape& si = in.shape();
      const Shape& so = out.shape();
      t.in_code[k] = dist::shape_code(si);
      t.out_code[k] = dist::shape_code(so);
      t.len[k] = bytes_of(si);
      t.src[k] = t.len[k] != 0 ? static_cast<const char*>(in.data_ptr()) : nullptr;
      t.dst[k] = bytes_of(so) != 0 ? static_cast<char*>(out.data_ptr()) : nullptr;
    }
  }

  // The N^2 blocks moved from the members' tables, receiver by receiver in
  // sender order. Shapes and dtypes were compared before any data moves, so
  // a block's size is its input's.
  // The senders' entries for a panel of kPanel receivers are first gathered
  // into a receiver-major buffer (each sender row read once per panel, a
  // few cache lines), so the moves read it in order: reading the senders'
  // rows in receiver order took a new page for every block at 1024 ranks.
  // The order of the moves is unchanged (receiver by receiver, senders in
  // order).
  static void move_all_to_all(Rendezvous& rv) {
    const std::size_t n = rv.calls.size();
    const auto& t = rv.a2a;
    constexpr std::size_t kPanel = 64;
    struct Block {
      const char* from;
      std::size_t len;
    };
    std::vector<Block> panel(std::min(n, kPanel) * n);
    for (std::size_t i0 = 0; i0 < n; i0 += kPanel) {
      const std::size_t width = std::min(n, i0 + kPanel) - i0;
      for (std::size_t s = 0; s < n; ++s)
        for (std::size_t r = 0; r < width; ++r)
          panel[r * n + s] = {t.src[s * n + i0 + r], t.len[s * n + i0 + r]};
      for (std::size_t r = 0; r < width; ++r)
        for (std::size_t s = 0; s < n; ++s) {
          const Block& b = panel[r * n + s];
          char* to = t.dst[(i0 + r) * n + s];
          if (b.len != 0 && to != b.from) std::memmove(to, b.from, b.len);
        }
    }
  }

  double cost_us(const Rendezvous& rv) const {
    const auto n = static_cast<double>(rv.calls.size());
    if (rv.calls.size() <= 1 && rv.calls[0]->op != OpType::Send) return 0.0;
    const OpType op = rv.calls[0]->op;
    if (op == OpType::NewGroup) return 0.0;
    double steps = n - 1;
    if (op == OpType::AllReduce) steps = 2 * (n - 1);
    if (op == OpType::Send || op == OpType::Recv) steps = 1;
    uint64_t bytes = 0;
    for (const Call* c : rv.calls) bytes = std::max({bytes, c->bytes_sent, c->bytes_received});
    return options.cost.alpha_us * steps +
           static_cast<double>(bytes) / (options.cost.bandwidth_gbps * 1e3);
  }

  // Called by the last member to arrive: check, move, time, trace, wake.
  void complete(Rendezvous& rv);

  // The body of every primitive on the simulated backend.
  void collective(const std::shared_ptr<SimGroup>& g, int slot, Call& call);
  void point_to_point(const std::shared_ptr<SimGroup>& g, int slot, Call& call,
                      std::map<std::tuple<int, int, int>, uint64_t>& counters);
  std::shared_ptr<dist::Backend> split(const std::shared_ptr<SimGroup>& g, int slot, Call& call);
};

// ---------------------------------------------------------------- backend
namespace {

class SimBackend final : public dist::Backend {
 public:
  SimBackend(World::Impl* world, std::shared_ptr<SimGroup> group, int slot,
             std::shared_ptr<const bool> running)
      : world_(world), group_(std::move(group)), slot_(slot), running_(std::move(running)) {}

  std::string backend_name() const override { return "sim"; }
  int rank() const override { return slot_; }
  int size() const override { return static_cast<int>(group_->members.size()); }
  int global_rank(int r) const override { return group_->members[static_cast<std::size_t>(r)]; }
  bool supports(const Device& d) const override { return d.is_cpu(); }

  // O(1): the run flag, and the rank of the running fiber (its properties)
  // against this handle's owner. Touches nothing of the World unless its run
  // is still going (the World may be gone).
  void check_caller(const Call& call) const override {
    const int owner = group_->members[static_cast<std::size_t>(slot_)];
    if (!*running_)
      throw InvalidArgument(fmt::format(
          "{} on group '{}' (sim backend, global rank {}): this group handle belongs to a "
          "sim::World run that has finished, or to a World that was destroyed; a handle lives "
          "only for the run() whose rank function obtained it",
          dist::op_name(call.op), call.group, owner));
    const auto* props =
        static_cast<const detail::FiberProps*>(boost::fibers::context::active()->get_properties());
    const int caller = props != nullptr ? props->rank : -1;
    if (caller != owner)
      throw InvalidArgument(fmt::format(
          "{} on group '{}' (sim backend): called from {}, but this handle is global rank {}'s "
          "(group rank {} of {}); a group handle is per rank: every member calls through the "
          "handle its own rank function obtained, and non-members cannot call",
          dist::op_name(call.op), call.group,
          caller >= 0 ? fmt::format("global rank {}", caller) : std::string("outside the ranks"),
          owner, slot_, group_->members.size()));
  }

  std::shared_ptr<dist::Backend> split(Call& call, int, int) override {
    return world_->split(group_, slot_, call);
  }
  void barrier(Call& c) override { world_->collective(group_, slot_, c); }
  void all_reduce(Call& c) override { world_->collective(group_, slot_, c); }
  void broadcast(Call& c) override { world_->collective(group_, slot_, c); }
  void reduce(Call& c) override { world_->collective(group_, slot_, c); }
  void all_gather(Call& c) override { world_->collective(group_, slot_, c); }
  void all_gather_single(Call& c) override { world_->collective(group_, slot_, c); }
  void all_gather_v(Call& c) override { world_->collective(group_, slot_, c); }
  void gather(Call& c) override { world_->collective(group_, slot_, c); }
  void scatter(Call& c) override { world_->collective(group_, slot_, c); }
  void reduce_scatter(Call& c) override { world_->collective(group_, slot_, c); }
  void reduce_scatter_single(Call& c) override { world_->collective(group_, slot_, c); }
  void reduce_scatter_v(Call& c) override { world_->collective(group_, slot_, c); }
  void all_to_all(Call& c) override { world_->collective(group_, slot_, c); }
  void all_to_all_single(Call& c) override { world_->collective(group_, slot_, c); }
  void send(Call& c) override { world_->point_to_point(group_, slot_, c, p2p_counters_); }
  void recv(Call& c) override { world_->point_to_point(group_, slot_, c, p2p_counters_); }

 private:
  World::Impl* world_;
  std::shared_ptr<SimGroup> group_;
  int slot_;
  std::shared_ptr<const bool> running_;  // false once the run that made this handle ended
  std::map<std::tuple<int, int, int>, uint64_t> p2p_counters_;  // (src, dst, tag) -> n
};

}  // namespace

void World::Impl::complete(Rendezvous& rv) {
  // A send/recv pair has two different ops by design; point_to_point()
  // compared its dtype and shape already.
  const bool p2p = rv.calls[0]->op == OpType::Send;
  std::string mismatch = p2p ? std::string() : compare(rv);
  double start = 0;
  for (std::size_t i = 0; i < rv.calls.size(); ++i)
    start = std::max(start, ranks[static_cast<std::size_t>(rv.globals[i])].clock_us);
  rv.start_us = start;
  if (!mismatch.empty()) {
    rv.error = ErrorKind::Mismatch;
    rv.message = "collective mismatch: " + mismatch;
    rv.end_us = start;
    wake(rv);
    return;
  }
  if (rv.calls[0]->op == OpType::AllToAll)
    move_all_to_all(rv);
  else
    move_data(rv.calls);
  rv.end_us = start + cost_us(rv);
  hash(rv.group->id);
  hash(rv.calls[0]->seq);
  hash(dist::op_cstr(rv.calls[0]->op));  // same bytes as op_name, no allocation
  for (int slot : rv.arrival_order) hash(static_cast<uint64_t>(slot));
  for (std::size_t i = 0; i < rv.calls.size(); ++i) {
    const Call& c = *rv.calls[i];
    ranks[static_cast<std::size_t>(rv.globals[i])].clock_us = rv.end_us;
    if (!options.trace) continue;
    // A new record where a member's op or call number differs from the one
    // before (a send/recv pair: "send" and "recv", each its own number).
    const Call& prev = *rv.calls[i == 0 ? 0 : i - 1];
    if (i == 0 || c.op != prev.op || c.seq != prev.seq)
      trace_calls.push_back({c.op, intern_trace_name(*rv.group, c.group), c.seq, rv.start_us,
                             rv.end_us - rv.start_us, trace_members.size()});
    trace_members.push_back({rv.globals[i], c.bytes_sent, c.bytes_received});
  }
  trace_stale = options.trace;
  wake(rv);
}

void World::Impl::collective(const std::shared_ptr<SimGroup>& g, int slot, Call& call) {
  const int global = g->members[static_cast<std::size_t>(slot)];
  enter(*g, global, call);
  const std::size_t n = g->members.size();
  std::shared_ptr<Rendezvous>& entry = g->pending_entry(call.seq);
  if (!entry) {
    for (auto it = g->spare.begin(); it != g->spare.end(); ++it)
      if (it->use_count() == 1) {
        entry = std::move(*it);
        g->spare.erase(it);
        break;
      }
    if (!entry) entry = std::make_shared<Rendezvous>();
    entry->reset(g.get(), g->members);
  }
  std::shared_ptr<Rendezvous> rv = entry;  // keeps it alive after erase
  rv->calls[static_cast<std::size_t>(slot)] = &call;
  rv->arrival_order.push_back(slot);
  if (call.op == OpType::AllToAll) fill_all_to_all_row(*rv, static_cast<std::size_t>(slot), call);
  if (++rv->arrived == static_cast<int>(n)) {
    g->erase_pending(call.seq);
    complete(*rv);
    // Waiters still hold it until they return; reused after that. A failed
    // one is not kept (its members raise from it).
    constexpr std::size_t kSpares = 4;
    if (rv->error == ErrorKind::None && g->spare.size() < kSpares) g->spare.push_back(rv);
  } else {
    wait(*rv, global, call);
  }
  if (rv->error != ErrorKind::None) {
    if (rv->error != ErrorKind::Mismatch) g->erase_pending(call.seq);
    raise(*rv, call);
  }
}

void World::Impl::point_to_point(const std::shared_ptr<SimGroup>& g, int slot, Call& call,
                                 std::map<std::tuple<int, int, int>, uint64_t>& counters) {
  const int global = g->members[static_cast<std::size_t>(slot)];
  enter(*g, global, call);
  const bool sending = call.op == OpType::Send;
  const int src = sending ? slot : call.root;
  const int dst = sending ? call.root : slot;
  const uint64_t n = counters[{src, dst, call.tag}]++;
  const auto key = std::make_tuple(src, dst, call.tag, n);
  std::shared_ptr<Rendezvous>& entry = g->pending_p2p[key];
  if (!entry) {
    entry = std::make_shared<Rendezvous>();
    entry->group = g.get();
    entry->calls.assign(2, nullptr);
    entry->globals = {g->members[static_cast<std::size_t>(src)],
                      g->members[static_cast<std::size_t>(dst)]};
  }
  std::shared_ptr<Rendezvous> rv = entry;
  const int my_slot = sending ? 0 : 1;
  rv->calls[static_cast<std::size_t>(my_slot)] = &call;
  rv->arrival_order.push_back(my_slot);
  if (++rv->arrived == 2) {
    g->pending_p2p.erase(key);
    Call& s = *rv->calls[0];
    Call& r = *rv->calls[1];
    const std::string mismatch =
        dist::compare_p2p(dist::describe(s), src, g->members[static_cast<std::size_t>(src)],
                          dist::describe(r), dst, g->members[static_cast<std::size_t>(dst)]);
    if (!mismatch.empty()) {
      rv->error = ErrorKind::Mismatch;
      rv->message = "collective mismatch: " + mismatch;
      wake(*rv);
    } else {
      complete(*rv);
    }
  } else {
    wait(*rv, global, call);
  }
  if (rv->error != ErrorKind::None) raise(*rv, call);
}

std::shared_ptr<dist::Backend> World::Impl::split(const std::shared_ptr<SimGroup>& g, int slot,
                                                  Call& call) {
  const int global = g->members[static_cast<std::size_t>(slot)];
  enter(*g, global, call);
  const std::size_t n = g->members.size();
  std::shared_ptr<Rendezvous>& entry = g->pending_entry(call.seq);
  if (!entry) {
    entry = std::make_shared<Rendezvous>();
    entry->group = g.get();
    entry->calls.assign(n, nullptr);
    entry->globals = g->members;
  }
  std::shared_ptr<Rendezvous> rv = entry;
  rv->calls[static_cast<std::size_t>(slot)] = &call;
  rv->arrival_order.push_back(slot);
  if (++rv->arrived == static_cast<int>(n)) {
    g->erase_pending(call.seq);
    const std::string mismatch = compare(*rv);
    if (mismatch.empty()) {
      // Members with one color form a group, ordered by (key, old rank).
      std::map<int64_t, std::vector<std::pair<int64_t, int>>> by_color;
      for (std::size_t i = 0; i < n; ++i) {
        const int64_t color = rv->calls[i]->color;
        if (color >= 0) by_color[color].push_back({rv->calls[i]->key, static_cast<int>(i)});
      }
      rv->split_results.assign(n, nullptr);
      for (auto& [color, members] : by_color) {
        std::sort(members.begin(), members.end());
        std::vector<int> globals;
        for (auto& m : members) globals.push_back(g->members[static_cast<std::size_t>(m.second)]);
        auto sub = make_group(globals);
        for (std::size_t k = 0; k < members.size(); ++k)
          rv->split_results[static_cast<std::size_t>(members[k].second)] =
              std::make_shared<SimBackend>(this, sub, static_cast<int>(k), running);
      }
      wake(*rv);
    } else {
      rv->error = ErrorKind::Mismatch;
      rv->message = "collective mismatch: " + mismatch;
      wake(*rv);
    }
  } else {
    wait(*rv, global, call);
  }
  if (rv->error != ErrorKind::None) raise(*rv, call);
  return rv->split_results[static_cast<std::size_t>(slot)];
}

// ---------------------------------------------------------------- Rank
int Rank::world_size() const { return world_->impl_->options.ranks; }

dist::DeviceMesh Rank::mesh(dist::DeviceMesh::Dims dims) const {
  return dist::DeviceMesh(world_group_, std::move(dims));
}

double Rank::now_us() const {
  return world_->impl_->ranks[static_cast<std::size_t>(rank_)].clock_us;
}

void Rank::advance_us(double us) {
  if (us < 0) throw InvalidArgument(fmt::format("advance_us: negative time {}", us));
  world_->impl_->ranks[static_cast<std::size_t>(rank_)].clock_us += us;
}

// ---------------------------------------------------------------- World
World::World(WorldOptions options) : impl_(std::make_unique<Impl>()) {
  if (options.ranks < 1 || options.ranks > 16384)
    throw InvalidArgument(fmt::format("sim::World: ranks = {}, expected 1..16384", options.ranks));
  if (options.stack_size < 16 * 1024)
    throw InvalidArgument(
        fmt::format("sim::World: stack_size = {} bytes, expected >= 16384", options.stack_size));
  if (options.fault && (options.fault->rank < 0 || options.fault->rank >= options.ranks ||
                        options.fault->at_call < 1))
    throw InvalidArgument(
        fmt::format("sim::World: fault rank {} at call {} is invalid (rank in [0, {}), call >= 1)",
                    options.fault->rank, options.fault->at_call, options.ranks));
  if (options.cost.bandwidth_gbps <= 0 || options.cost.alpha_us < 0)
    throw InvalidArgument("sim::World: cost model needs alpha_us >= 0 and bandwidth_gbps > 0");
  impl_->options = options;
}

World::~World() {
  if (impl_) *impl_->running = false;  // handles still around refuse calls
}

const WorldOptions& World::options() const { return impl_->options; }
const std::vector<std::exception_ptr>& World::errors() const { return impl_->errors; }
const dist::Stats& World::stats(int rank) const {
  if (rank < 0 || rank >= static_cast<int>(impl_->ranks.size()))
    throw InvalidArgument(fmt::format("World::stats: rank {} out of range (run() first?)", rank));
  return *impl_->ranks[static_cast<std::size_t>(rank)].stats;
}
const std::vector<TraceEvent>& World::trace() const { return impl_->expanded_trace(); }
uint64_t World::trace_hash() const { return impl_->trace_hash; }

double World::sim_time_us() const {
  double t = 0;
  for (const auto& r : impl_->ranks) t = std::max(t, r.clock_us);
  return t;
}

std::vector<std::string> World::error_messages() const {
  std::vector<std::string> out;
  for (const auto& r : impl_->ranks) out.push_back(message_of(r));
  return out;
}

void World::write_trace(const std::string& path) const {
  nlohmann::json events = nlohmann::json::array();
  for (std::size_t r = 0; r < impl_->ranks.size(); ++r)
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 0},
                      {"tid", r},
                      {"args", {{"name", fmt::format("rank {}", r)}}}});
  impl_->for_each_trace_event([&](const Impl::TraceCall& c, const Impl::TraceMember& m) {
    events.push_back({{"name", dist::op_cstr(c.op)},
                      {"cat", impl_->trace_names[c.group]},
                      {"ph", "X"},
                      {"pid", 0},
                      {"tid", m.rank},
                      {"ts", c.start_us},
                      {"dur", c.duration_us},
                      {"args",
                       {{"group", impl_->trace_names[c.group]},
                        {"seq", c.seq},
                        {"bytes_sent", m.bytes_sent},
                        {"bytes_received", m.bytes_received}}}});
  });
  std::ofstream out(path);
  if (!out) throw InvalidArgument(fmt::format("write_trace: cannot open '{}' for writing", path));
  out << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ns"}}.dump() << "\n";
  out.flush();  // a full disk (/dev/full) shows only here
  if (!out) throw InvalidArgument(fmt::format("write_trace: cannot write '{}'", path));
}

namespace {
// Every rank's fiber stack, allocated before any fiber exists: running out
// of memory (or of mappings) then raises BackendError from run() with
// nothing to unwind, where failing inside the fiber loop destroyed joinable
// fibers (std::terminate). A stack handed to a fiber is the fiber's; the
// rest are freed here.
class Stacks {
 public:
  Stacks(int ranks, std::size_t size)
      : alloc_(size), stacks_(static_cast<std::size_t>(ranks)), taken_(stacks_.size(), true) {
    for (std::size_t r = 0; r < stacks_.size(); ++r) {
      try {
        stacks_[r] = alloc_.allocate();
      } catch (const std::bad_alloc&) {
        release_unused();
        throw BackendError(fmt::format(
            "sim::World::run: cannot allocate the fiber stack of rank {} of {} ({} bytes each, "
            "{:.1f} MiB for the world): out of memory or of memory mappings; use fewer ranks or "
            "a smaller WorldOptions::stack_size (>= 16 KiB)",
            r, ranks, size, static_cast<double>(size) * ranks / (1 << 20)));
      }
      taken_[r] = false;
    }
  }
  ~Stacks() { release_unused(); }
  Stacks(const Stacks&) = delete;
  Stacks& operator=(const Stacks&) = delete;

  // The stack allocator of rank r's fiber: it takes r's stack.
  struct Handout {
    Stacks* stacks;
    std::size_t rank;
    boost::context::stack_context allocate() {
      stacks->taken_[rank] = true;
      const boost::context::stack_context s = stacks->stacks_[rank];
#if DIFFCOMM_SIM_ASAN
      // Memory of an earlier fiber's stack may come back from mmap with that
      // fiber's last frames still poisoned in ASan's shadow (a fiber's bottom
      // frames never return): start every stack clean.
      __asan_unpoison_memory_region(static_cast<char*>(s.sp) - s.size, s.size);
#endif
      return s;
    }
    void deallocate(boost::context::stack_context& s) noexcept { stacks->alloc_.deallocate(s); }
  };
  Handout handout(int rank) { return {this, static_cast<std::size_t>(rank)}; }
  const boost::context::stack_context& operator[](int rank) const {
    return stacks_[static_cast<std::size_t>(rank)];
  }

 private:
  void release_unused() {
    for (std::size_t r = 0; r < stacks_.size(); ++r)
      if (!taken_[r]) {
        alloc_.deallocate(stacks_[r]);
        taken_[r] = true;
      }
  }
  boost::fibers::protected_fixedsize_stack alloc_;
  std::vector<boost::context::stack_context> stacks_;
  std::vector<bool> taken_;  // true: handed to a fiber, or never allocated
};

// Raises the run's failures as a RunError of the first failure's kind, its
// message naming that rank and then one line per other failed rank (a rank
// whose message is the first's shared report, e.g. a deadlock, is listed
// without repeating it).
[[noreturn]] void rethrow_named(std::shared_ptr<const std::vector<RankError>> failures,
                                const std::vector<const std::string*>& texts) {
  const RankError& first = failures->front();
  const std::string& what = first.message();
  std::string msg =
      what.rfind("rank ", 0) == 0 ? what : fmt::format("rank {}: {}", first.rank, what);
  if (failures->size() > 1) {
    msg += fmt::format("\n{} ranks failed in this run (RunFailures::failures() has each):",
                       failures->size());
    for (std::size_t i = 0; i < failures->size(); ++i) {
      const RankError& f = (*failures)[i];
      if (i > 0 && texts[i] == texts[0]) {
        msg += fmt::format("\n  rank {}: the same report", f.rank);
        continue;
      }
      const std::string& m = f.message();
      msg += fmt::format("\n  rank {}: {}", f.rank, m.substr(0, m.find('\n')));
    }
  }
  try {
    std::rethrow_exception(first.error);
  } catch (const Deadlock&) {
    throw RunError<Deadlock>(msg, std::move(failures));
  } catch (const CollectiveMismatch&) {
    throw RunError<CollectiveMismatch>(msg, std::move(failures));
  } catch (const RankFailure&) {
    throw RunError<RankFailure>(msg, std::move(failures));
  } catch (const InvalidArgument&) {
    throw RunError<InvalidArgument>(msg, std::move(failures));
  } catch (const BackendError&) {
    throw RunError<BackendError>(msg, std::move(failures));
  } catch (const Timeout&) {
    throw RunError<Timeout>(msg, std::move(failures));
  } catch (...) {
    throw RunError<Error>(msg, std::move(failures));
  }
}
}  // namespace

void World::run(const std::function<void(Rank&)>& fn) {
  Impl& w = *impl_;
  // Inside a fiber (a rank function of this or another World) Boost.Fiber
  // would abort on the nested scheduler switch: refuse before touching it.
  if (!boost::fibers::context::active()->is_context(boost::fibers::type::main_context))
    throw InvalidArgument(
        "sim::World::run: called from inside a fiber (a rank function of a running World); "
        "run() must be called from a plain thread, and one World runs one run() at a time");
  // Claimed before anything of the World is read: a second thread gets here
  // only while the first is inside run().
  if (w.in_run.exchange(true))
    throw InvalidArgument(
        "sim::World::run: this World is already running on another thread; one World runs one "
        "run() at a time (give each thread its own World)");
  struct LeaveRun {
    std::atomic<bool>& flag;
    ~LeaveRun() { flag = false; }
  } leave_run{w.in_run};
  const int n = w.options.ranks;
  Stacks stacks(n, w.options.stack_size);  // before any state changes: may throw
  w.ranks.assign(static_cast<std::size_t>(n), RankState{});
  for (auto& rs : w.ranks) rs.stats = std::make_shared<dist::Stats>();  // one per rank, not shared
  w.groups.clear();
  w.next_group_id = 0;  // group ids enter trace_hash(): same seed, same hash on every run
  w.pending.clear();
  w.trace_calls.clear();
  w.trace_members.clear();
  w.trace_names.clear();
  w.trace_expanded.clear();
  w.trace_stale = false;
  w.trace_hash = 1469598103934665603ull;
  w.live = n;
  w.blocked = 0;
  w.failures = 0;
  w.errors.assign(static_cast<std::size_t>(n), nullptr);
  // A new flag per run: handles of an earlier run keep the old, false one.
  *w.running = false;
  w.running = std::make_shared<bool>(true);
  struct EndRun {  // the run is over however run() leaves
    bool& flag;
    ~EndRun() { flag = false; }
  } end_run{*w.running};

  w.algo = new detail::SeededAlgorithm(w.options.seed, w.options.schedule == Schedule::Random);
  boost::fibers::context::active()->get_scheduler()->set_algo(w.algo);  // takes ownership
  w.algo->set_ranks(n);

  std::vector<int> all(static_cast<std::size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  auto world_group = w.make_group(all);

  std::vector<boost::fibers::fiber> fibers;
  fibers.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    fibers.emplace_back(std::allocator_arg, stacks.handout(r), [this, &w, &fn, world_group, r] {
      w.algo->on_resumed();
      auto backend = std::make_shared<SimBackend>(&w, world_group, r, w.running);
      // Per-rank generator seed: a SplitMix64 step over (seed, rank).
      uint64_t z = w.options.seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(r + 1);
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      // The flight recorder reads the rank's simulated clock, not the
      // wall clock: deterministic, and free.
      RankState& state = w.ranks[static_cast<std::size_t>(r)];
      auto recorder = std::make_shared<dist::FlightRecorder>(
          [](const void* s) { return static_cast<const RankState*>(s)->clock_us * 1e-6; }, &state);
      const dist::FlightRecorder* recorder_ptr = recorder.get();
      Rank rank(this, r, dist::ProcessGroup(backend, "world", state.stats, std::move(recorder)), z);
      // What this rank touches first when resumed in a world-group call,
      // for the scheduler to prefetch. The fiber never returns to the
      // ready set once these objects die (it ends without yielding), so
      // no stale hint is read; withdrawing them anyway keeps that true
      // if the exit path ever yields.
      const auto group_hot = rank.world().hot_addresses();
      w.algo->set_hints(r, {{group_hot[0], group_hot[1], &state}, recorder_ptr, state.stats.get()});
      struct WithdrawHints {
        detail::SeededAlgorithm* algo;
        int rank;
        ~WithdrawHints() { algo->set_hints(rank, {}); }
      } withdraw_hints{w.algo, r};
      std::exception_ptr error;
      std::shared_ptr<const std::string> message;
      try {
        fn(rank);
      } catch (const SharedDeadlock& e) {
        error = std::current_exception();
        message = e.report();  // shared with every other blocked rank
      } catch (const std::exception& e) {
        // Never block or yield inside a catch handler (Boost 1.74 loses
        // the exception state across a fiber switch): record and leave.
        error = std::current_exception();
        message = std::make_shared<const std::string>(e.what());
      } catch (...) {
        error = std::current_exception();
        message = std::make_shared<const std::string>("unknown exception");
      }
      w.errors[static_cast<std::size_t>(r)] = error;
      w.on_rank_exit(r, error, std::move(message));
      static_cast<detail::FiberProps*>(boost::fibers::context::active()->get_properties())
          ->terminating = true;
    });
    auto& props = fibers.back().properties<detail::FiberProps>();
    props.stack_bottom = static_cast<char*>(stacks[r].sp) - stacks[r].size;
    props.stack_size = stacks[r].size;
    props.rank = r;
  }
  for (auto& f : fibers) {
    f.join();
    w.algo->on_resumed();
  }
  // An ended fiber waits in Boost's terminated queue, with its stack and
  // properties, until Boost's dispatcher runs; the seeded algorithm always
  // has a ready fiber to hand over, so the dispatcher never ran and every run
  // kept all of its fibers (N stacks per run; the leak fuzz_plan_exchange
  // found). A zero sleep hands the main context to the dispatcher once,
  // which releases them before run() returns.
  fibers.clear();
  boost::this_fiber::sleep_for(std::chrono::seconds(0));
  w.algo->on_resumed();

  // Report every failure on the caller, the first (in failure order) leading.
  std::vector<int> failed;
  for (int r = 0; r < n; ++r)
    if (w.ranks[static_cast<std::size_t>(r)].error) failed.push_back(r);
  if (failed.empty()) return;
  std::sort(failed.begin(), failed.end(), [&](int a, int b) {
    return w.ranks[static_cast<std::size_t>(a)].failure_order <
           w.ranks[static_cast<std::size_t>(b)].failure_order;
  });
  auto failures = std::make_shared<std::vector<RankError>>();
  std::vector<const std::string*> texts;
  failures->reserve(failed.size());
  for (int r : failed) {
    const RankState& rs = w.ranks[static_cast<std::size_t>(r)];
    failures->push_back({r, rs.error, rs.error_message, rs.cause});
    texts.push_back(rs.error_message.get());
  }
  rethrow_named(std::move(failures), texts);
}

}  // namespace diffcomm::sim
