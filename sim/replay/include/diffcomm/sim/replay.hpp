#pragma once
// Replay of production flight recorder dumps (dist/flight_dump.hpp) in the
// simulated world: each rank's recorded calls become its program, run with
// zero payloads of the recorded shapes, so the world's own checks give the
// report checked mode would have given: the first call the members disagree
// on (in the simulated world's wording), or the deadlock with every rank's
// pending call, or ok. Calls before a group's latest watermark are unknown
// on some member: they are not replayed, and a clean replay of what remains
// is `incomplete`, never a mismatch.
//
// The replay first settles the agreeing prefix without the world: it counts
// each collective's arrivals and compares the members' descriptions once
// per distinct combination (dist::compare, the world's own rule), as a
// blocking program would run. The world then runs only from where that
// stops (a disagreement, a call that never completes, a send/recv), with
// each rank's next call, or its whole remaining program when a rank stopped
// at a send/recv (whose matching depends on the interleaving). That is how
// 16384 ranks x 2000 calls replay in seconds (bench/RESULTS.md). A call in
// the agreeing prefix is compared with its peers but not re-issued, so its
// own local checks (a corrupt description) are not re-run.
//
// Limits: groups are created before the window (every non-world group of
// the dumps, by name, with its recorded global members), so new_group and
// split calls themselves are not compared; send/recv are replayed in
// recorded order.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "diffcomm/distributed/flight_dump.hpp"

namespace diffcomm::sim {

enum class Verdict { Ok, Mismatch, Deadlock, Incomplete };

/// "ok", "mismatch", "deadlock", "incomplete".
const char* verdict_name(Verdict v);

/// A rank's state when the replay deadlocked.
struct PendingCall {
  int rank = 0;           ///< global rank
  bool finished = false;  ///< its recorded program ended (no pending call)
  std::string group;      ///< the call it waits in (unset when finished)
  uint64_t call = 0;
  std::string op;
  std::vector<int> not_reached;  ///< members of that group waiting elsewhere or finished
  std::string caller;            ///< "train.py:42" where the dump records it, else ""
};

struct ReplayReport {
  Verdict verdict = Verdict::Ok;
  std::string group;  ///< the call the verdict is about ("" for ok)
  std::optional<uint64_t> call;
  std::string op;
  std::vector<int> ranks;  ///< global ranks: the disagreeing pair, the ranks that never
                           ///< reached the pending call, or the ranks whose ring lost calls
  std::string field;       ///< mismatch: "dtype", "shape", "splits", "op", ...
  std::string message;     ///< the simulated world's message (first line)
  std::vector<PendingCall> pending;  ///< deadlock: every rank
  /// What the dumps do not record and the replay therefore did not compare
  /// (torch's dumps: splits, roots, reduce ops, ...; empty for diffcomm's).
  std::vector<std::string> unknown;
  /// 0 ok, 3 mismatch or deadlock, 4 incomplete (diffcomm-sim replay's exit code).
  int exit_code() const;
};

struct ReplayOptions {
  uint64_t seed = 0;  ///< the simulated world's seed (interleaving)
  /// false: the world runs every recorded call, no prefix settled first
  /// (slow; the reference the settling is tested against).
  bool settle_prefix = true;
};

/// Reads DIR/rank-0.json ... rank-<N-1>.json, N the world size the files
/// record, or, when DIR holds no rank-0.json, PyTorch Flight Recorder dumps
/// (torch_flight_dump.hpp). Throws InvalidArgument (one line naming the file) for a missing
/// rank file, a file that is corrupt or truncated (with its byte offset), or
/// files that disagree on the world size or on a group's members.
std::vector<dist::FlightDump> read_dumps(const std::string& dir);

namespace detail {
struct Table;
}

/// Every rank's recorded calls as a replay holds them: one row per call into
/// one table of distinct call descriptions (16384 ranks x 2000 calls of a few
/// kinds: about 0.5 GiB, where FlightDumps would be tens of GiB).
class Recording {
 public:
  /// read_dumps' files and errors; diffcomm's dumps are read two files at a
  /// time without expanding their entries, torch's through read_torch_dumps.
  static Recording read(const std::string& dir);
  /// `dumps` as read_dumps returns them (after edits, say).
  static Recording of(const std::vector<dist::FlightDump>& dumps);
  int world_size() const;
  const detail::Table& table() const { return *table_; }

 private:
  std::shared_ptr<const detail::Table> table_;
};

/// Replays `recording`. Throws InvalidArgument when the recorded calls
/// cannot be rebuilt (a rank's own call fails its local checks: a corrupt dump).
ReplayReport replay(const Recording& recording, const ReplayOptions& options = {});
/// replay(Recording::of(dumps), options).
ReplayReport replay(const std::vector<dist::FlightDump>& dumps, const ReplayOptions& options = {});

/// The report as JSON: {"verdict", "group", "call", "op", "ranks", "field",
/// "message", "pending": [{"rank", "finished", "group", "call", "op",
/// "not_reached", "caller" (where the dump records it)}], "unknown": [what the
/// dumps lack]}; call is null when unset.
std::string replay_json(const ReplayReport& report);
/// The report as text for a terminal (a few lines; the table for a deadlock).
std::string replay_text(const ReplayReport& report);

}  // namespace diffcomm::sim
