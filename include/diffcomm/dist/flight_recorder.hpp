#pragma once
// FlightRecorder: a fixed ring of the last calls one rank issued through the
// funnel (op, group, call number, fingerprint fields, state, times), kept for
// post-mortems — the idea of PyTorch's NCCL flight recorder. Dumped on
// request (dump()), and appended to every Timeout and RankFailure message a
// production backend raises. One recorder per rank, shared by every group
// made from that rank's world group; never per thread.
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "diffcomm/dist/backend/call.hpp"

namespace diffcomm::dist {

namespace detail {
// The simulated world's scheduler (sim/src/scheduler_access.hpp): prefetches
// a rank's hot data before resuming it. Not an API.
struct SchedulerAccess;
}  // namespace detail

struct FlightRecord {
  enum class State { Issued, Completed, Failed };
  uint64_t id = 0;  ///< 1, 2, ... over the rank's lifetime
  std::string group;
  OpType op = OpType::Barrier;
  uint64_t seq = 0;
  DType dtype = DType::Float32;
  int64_t numel = 0;  ///< elements of the first input (else output)
  int root = -1;
  ReduceOp reduce_op = ReduceOp::Sum;
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  State state = State::Issued;
  double start_s = 0;     ///< seconds on the recorder's clock (see FlightRecorder)
  double duration_s = 0;  ///< 0 while issued
};

class FlightRecorder {
 public:
  static constexpr std::size_t kCapacity = 64;
  /// A clock in seconds, read at begin() and end(): `clock(context)`.
  using Clock = double (*)(const void* context);
  /// Times are wall-clock seconds (steady_clock) since the recorder was made
  /// (production backends).
  FlightRecorder();
  /// Times come from `clock(context)`. The simulated world passes each
  /// rank's simulated clock (its CostModel time, Rank::now_us): the same on
  /// every run of a seed, and no clock read per call (two steady_clock
  /// reads were about a fifth of a small simulated collective). `context`
  /// must outlive the recorder.
  FlightRecorder(Clock clock, const void* context);
  /// Records that `call` is issued; returns its slot for end().
  std::size_t begin(const Call& call);
  /// Marks the call in `slot` completed or failed.
  void end(std::size_t slot, FlightRecord::State state);
  /// The last min(kCapacity, calls) records, oldest first.
  std::vector<FlightRecord> records() const;
  /// One line per record, oldest first:
  /// "#12 all_reduce #3 on 'world' float32 numel=4 op=sum: completed (12.5 us)".
  std::string dump() const;

 private:
  friend struct detail::SchedulerAccess;
  double now_s() const;
  std::vector<FlightRecord> ring_;
  uint64_t next_id_ = 1;
  Clock clock_ = nullptr;  // null: steady_clock since origin_
  const void* context_ = nullptr;
  std::chrono::steady_clock::time_point origin_;
};

}  // namespace diffcomm::dist
