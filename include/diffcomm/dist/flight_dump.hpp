#pragma once
// The flight recorder dump: one JSON file per rank, rank-<global rank>.json,
// written by FlightRecorder::dump(dir) (and on errors, see flight_recorder.hpp)
// and read by `diffcomm-sim replay`. This header is the schema's source of
// truth (version kFlightDumpVersion):
//
//   {"format": "diffcomm-flight-recorder", "version": 1,
//    "rank": <global rank>, "world_size": <ranks>, "capacity": <ring entries>,
//    "groups": [{"name", "members": [global ranks in group order],
//                "group_rank", "calls", "p2p_calls",
//                "watermark", "p2p_watermark"}, ...],
//    "entries": [{"id", "group", "group_rank", "group_size", "call", "op",
//                 "dtype", "numel", "input_shapes": [[dims]...],
//                 "output_shapes", "input_splits", "output_splits", "root",
//                 "tag", "reduce_op", "reduce_factor", "color", "key",
//                 "members", "members_are_ranks",
//                 "backward_of": {"op", "call"} | null,
//                 "state": "issued" | "completed" | "failed",
//                 "start_s", "duration_s", "bytes_sent", "bytes_received"},
//                ...oldest first]}
//
// A group's watermark is the number of its earliest collective still in the
// ring (its `calls` when none is): calls before it are unknown, never
// evidence of a mismatch. p2p_watermark is the same for send/recv numbers.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "diffcomm/dist/flight_recorder.hpp"

namespace diffcomm::dist {

inline constexpr int kFlightDumpVersion = 1;

/// A group in a dump: RecordedGroup plus its watermarks.
struct DumpedGroup {
  RecordedGroup group;
  uint64_t watermark = 0;      ///< earliest collective number still recorded
  uint64_t p2p_watermark = 0;  ///< earliest send/recv number still recorded
};

/// One rank's dump, as written and as read back.
struct FlightDump {
  int version = kFlightDumpVersion;
  int rank = -1;       ///< global rank
  int world_size = 0;  ///< ranks in the world
  std::size_t capacity = 0;
  std::vector<DumpedGroup> groups;    ///< by name
  std::vector<FlightRecord> entries;  ///< oldest first
  /// Set by readers, not written: who wrote the dump ("diffcomm", or
  /// "torch flight recorder 2.10") and what it does not record, one phrase
  /// each (sim/torch_flight_dump.hpp), which a replay cannot compare.
  std::string producer = "diffcomm";
  std::vector<std::string> unknown;
};

/// The recorder's current content as a dump (groups' watermarks computed).
FlightDump snapshot_flight_dump(const FlightRecorder& recorder);
/// The dump as JSON text (schema above; one line).
std::string flight_dump_json(const FlightDump& dump);
/// Parses JSON text of the schema above. `file` names the source in errors.
/// Throws InvalidArgument with one line naming `file` and the byte offset of
/// a syntax error or truncation, or the entry and field that is missing or
/// of the wrong type, or an unsupported version.
FlightDump parse_flight_dump(std::string_view text, const std::string& file);
/// Writes `dump` as `dir`/rank-<dump.rank>.json (creating `dir`) through a
/// temporary file renamed into place, so a reader never sees half a file;
/// returns the path. Throws InvalidArgument when it cannot be written.
std::string write_flight_dump(const FlightDump& dump, const std::string& dir);
/// Reads and parses one dump file (errors as parse_flight_dump; a file that
/// cannot be opened: InvalidArgument naming it).
FlightDump read_flight_dump(const std::string& path);

}  // namespace diffcomm::dist
