// The rendezvous of the simulated world: groups, rank states, and one call on
// its way (members deposit their Call, the last to arrive completes it).
// World::Impl's waiting, deadlock detection and failure propagation are in
// rendezvous.cpp.
#pragma once

#include <boost/fiber/context.hpp>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "diffcomm/distributed/backend.hpp"
#include "diffcomm/distributed/stats.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::sim::detail {

struct SimGroup;

// One collective (or send/recv pair) on its way: members deposit their Call,
// the last to arrive checks the fingerprints and moves everybody's data.
struct Rendezvous {
  SimGroup* group = nullptr;
  std::string label;               // for reports
  std::vector<dist::Call*> calls;  // by slot (group rank; p2p: 0 = sender, 1 = receiver)
  std::vector<int> globals;        // global rank per slot
  std::vector<int> arrival_order;  // slots in arrival order
  int arrived = 0;
  bool done = false;
  std::optional<ErrorKind> error;  // set when the call failed: what its members raise
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
    error.reset();
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
  const dist::Call* waiting_in = nullptr;  // lives on the waiting rank's stack while it waits
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

// The rank's error message, "" when it has none.
const std::string& message_of(const RankState& rs);

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

}  // namespace diffcomm::sim::detail
