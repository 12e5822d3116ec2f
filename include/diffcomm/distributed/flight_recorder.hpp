#pragma once
// FlightRecorder: a fixed ring of the last calls one rank issued through the
// funnel (op, group, call number, fingerprint fields, state, times), kept for
// post-mortems — the idea of PyTorch's NCCL flight recorder. Appended (its
// last 64 entries, as text) to every Timeout message a production backend
// raises; written as a JSON dump (flight_dump.hpp) on request (dump(dir))
// and, when a dump directory is set (Options::flight_recorder_dump_dir,
// DIFFCOMM_FR_DUMP_DIR), by the funnel when a call raises Timeout,
// CollectiveMismatch, BackendError or RankFailure (a peer ending the job:
// mpi::end_job), and at exit after an uncaught error
// (dump_all_on_error). One recorder per rank, shared by every
// group made from that rank's world group; never per thread.
//
// Two kinds: a production recorder (MPI, NCCL, torch transport) is
// "detailed": it keeps each call's shapes, full splits and member lists and
// each group's global members, what a replay needs (Options'
// flight_recorder_size entries, default 2000). The simulated world's keeps
// 64 entries without those (cheap at 16384 ranks; the world reports its
// failures itself).
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "diffcomm/distributed/backend/call.hpp"
#include "diffcomm/distributed/backend/options.hpp"

namespace diffcomm::dist {

namespace detail {
// The simulated world's scheduler (sim/world/src/scheduler_access.hpp): prefetches
// a rank's hot data before resuming it. Not an API.
struct SchedulerAccess;
}  // namespace detail

struct FlightRecord {
  enum class State { Issued, Completed, Failed };
  uint64_t id = 0;  ///< 1, 2, ... over the rank's lifetime
  std::string group;
  int group_rank = 0;  ///< this rank's group-local rank
  int group_size = 1;
  OpType op = OpType::Barrier;
  uint64_t seq = 0;  ///< per-group call number (send/recv: the point-to-point number)
  DType dtype = DType::Float32;
  int64_t numel = 0;  ///< elements of the first input (else output)
  int root = -1;      ///< root of rooted ops, peer of send/recv (group-local)
  int tag = 0;        ///< send/recv tag
  ReduceOp reduce_op = ReduceOp::Sum;
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  State state = State::Issued;
  double start_s = 0;     ///< seconds on the recorder's clock (see FlightRecorder)
  double duration_s = 0;  ///< 0 while issued
  Caller caller;          ///< where the user's code made the call (Call::caller)
  // Detailed recorders only (empty otherwise):
  std::vector<Shape> input_shapes;   ///< one per input tensor
  std::vector<Shape> output_shapes;  ///< one per output tensor
  SplitList input_splits;            ///< full lists, as Call carries them
  SplitList output_splits;
  int color = -1;                     ///< new_group/split: this member's color
  int key = 0;                        ///< new_group/split: its key
  std::vector<int64_t> members;       ///< new_group: rank list; split: fingerprint
  bool members_are_ranks = false;     ///< new_group (true) or split (false)
  std::optional<CallId> backward_of;  ///< the forward call a backward call belongs to
};

/// A group as a detailed recorder saw it: its name, its members as global
/// ranks in group order, this rank's group-local rank, and how many
/// collectives (`calls`) and point-to-point calls (`p2p_calls`) this rank
/// numbered on it.
struct RecordedGroup {
  std::string name;
  std::vector<int> members;
  int group_rank = 0;
  uint64_t calls = 0;
  uint64_t p2p_calls = 0;
};

class FlightRecorder {
 public:
  /// Entries of the simulated world's recorders.
  static constexpr std::size_t kSimCapacity = 64;
  /// Entries Timeout messages list (the newest).
  static constexpr std::size_t kTextEntries = 64;
  /// A clock in seconds, read at begin() and end(): `clock(context)`.
  using Clock = double (*)(const void* context);
  /// A production recorder with Options{} resolved (DIFFCOMM_FR_SIZE,
  /// DIFFCOMM_FR_DUMP_DIR). Times are wall-clock seconds (steady_clock)
  /// since the recorder was made. Throws InvalidArgument for a bad
  /// DIFFCOMM_FR_SIZE.
  FlightRecorder();
  /// A production recorder with `options`' flight_recorder_size and
  /// flight_recorder_dump_dir (resolved). Throws InvalidArgument for size 0.
  explicit FlightRecorder(const Options& options);
  /// The simulated world's: kSimCapacity entries, not detailed, no dumps.
  /// Times come from `clock(context)`: each rank's simulated clock (its
  /// CostModel time, Rank::now_us), the same on every run of a seed, and no
  /// clock read per call. `context` must outlive the recorder.
  FlightRecorder(Clock clock, const void* context);
  /// A production recorder with `options`, named as global rank
  /// `global_rank` of `world_size` (set_identity), as backends make them.
  static std::shared_ptr<FlightRecorder> for_rank(const Options& options, int global_rank,
                                                  int world_size);
  ~FlightRecorder();
  // Registered by address while a dump directory is set (exit dumps).
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  /// Ring size (entries).
  std::size_t capacity() const { return ring_.size(); }
  /// True for production recorders (shapes, splits and groups recorded).
  bool detailed() const { return detailed_; }
  /// Where errors dump ("" = nowhere).
  const std::string& dump_dir() const { return dump_dir_; }
  /// This rank's global rank and the world size, written into dumps and
  /// naming the dump file (the MPI backend sets them; unset: -1 and 0, and
  /// dumps take the rank from the first group recorded).
  void set_identity(int global_rank, int world_size);

  /// Records that `call` is issued; returns its slot for end().
  std::size_t begin(const Call& call);
  /// Marks the call in `slot` completed or failed.
  void end(std::size_t slot, FlightRecord::State state);
  /// Detailed recorders: registers group `name` on its first call;
  /// `members` (global ranks in group order) is asked for only then.
  void note_group(std::string_view name, int group_rank,
                  const std::function<std::vector<int>()>& members);
  /// The last min(capacity(), calls) records, oldest first.
  std::vector<FlightRecord> records() const;
  /// The groups noted so far, by name (detailed recorders; else empty).
  std::vector<RecordedGroup> groups() const;
  /// This rank's global rank: set_identity()'s, else its rank in the first
  /// group noted (by name), else -1.
  int global_rank() const;
  /// The world size set_identity() recorded (0 when unset).
  int world_size() const { return world_size_; }

  /// The newest kTextEntries records, one line each, oldest first:
  /// "#12 all_reduce #3 on 'world' float32 numel=4 op=sum: completed (12.5 us)".
  std::string dump() const;
  /// Writes this rank's dump as `dir`/rank-<global rank>.json (the schema of
  /// flight_dump.hpp), creating `dir`; returns the file's path. Never
  /// communicates. Throws InvalidArgument when the file cannot be written,
  /// and for a simulated world's recorder (not detailed: without shapes,
  /// groups or its global rank, its dump could not be replayed; dump()
  /// gives its text, str() in Python, and the world reports failures itself).
  std::string dump(const std::string& dir) const;
  /// dump(dump_dir()) when a dump directory is set; never throws (a failure
  /// to write is one line on stderr). The funnel calls it after a call
  /// raised Timeout, CollectiveMismatch, BackendError or RankFailure.
  void dump_on_error() const noexcept;
  /// After std::terminate has dumped every recorder (an uncaught C++
  /// exception), prints "diffcomm: uncaught <Kind>: <what>" to stderr and
  /// calls `end(that text)` instead of the terminate handler it replaced.
  /// The MPI backend sets it (mpi::end_job), so that its peers stop waiting
  /// and report before the job is aborted; `end` must not return. nullptr
  /// restores the default.
  static void set_end_on_terminate(void (*end)(const char* why)) noexcept;
  /// dump_on_error() of every live production recorder that has a dump
  /// directory, for a process ending on an uncaught error: diffcomm's
  /// std::terminate handler (installed with the first such recorder; it
  /// then calls the handler it replaced) and the Python package's
  /// sys.excepthook call it. Returns how many recorders it asked. Never
  /// throws, never communicates.
  static int dump_all_on_error() noexcept;

 private:
  friend struct detail::SchedulerAccess;
  double now_s() const;
  // The recorded group named `name`, or null; remembers the last one found,
  // so a rank calling on one group looks it up once, not twice per call.
  RecordedGroup* group_named(std::string_view name);
  std::vector<FlightRecord> ring_;
  uint64_t next_id_ = 1;
  Clock clock_ = nullptr;  // null: steady_clock since origin_
  const void* context_ = nullptr;
  std::chrono::steady_clock::time_point origin_;
  bool detailed_ = false;
  std::string dump_dir_;
  int global_rank_ = -1;
  int world_size_ = 0;
  std::map<std::string, RecordedGroup, std::less<>> groups_;  // never erased
  RecordedGroup* last_group_ = nullptr;                       // of group_named
};

}  // namespace diffcomm::dist
