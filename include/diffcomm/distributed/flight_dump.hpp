#pragma once
// The flight recorder dump: one JSON file per rank, rank-<global rank>.json,
// written by FlightRecorder::dump(dir) (and on errors, see flight_recorder.hpp)
// and read by `diffcomm-sim replay`. This header is the schema's source of
// truth. Version 2 (kFlightDumpVersion) keeps each distinct
// call description once and an entry as a row of integers, one per line, so
// 16384 ranks x 2000 entries read in seconds (bench/RESULTS.md):
//
//   {"format": "diffcomm-flight-recorder", "version": 2,
//    "rank": <global rank>, "world_size": <ranks>, "capacity": <ring entries>,
//    "groups": [{"name", "members": [global ranks in group order]
//                        | "member_range": [first, step, count],
//                "group_rank", "calls", "p2p_calls",
//                "watermark", "p2p_watermark"}, ...],
//    "calls": [{"group", "group_rank", "group_size", "op", "dtype", "numel",
//               "input_shapes": [[dims]...], "output_shapes", "input_splits",
//               "output_splits", "root", "tag", "reduce_op", "reduce_factor",
//               "color", "key", "members", "members_are_ranks",
//               "backward_of": {"op"} | null}, ...distinct],
//    "columns": ["id", "call_index", "call", "state", "backward_call",
//                "start_ns", "duration_ns", "bytes_sent", "bytes_received"],
//    "entries": [[<one integer per column>], ...oldest first]}
//
// An entry's description is calls[call_index]; its per-group call number is
// `call`; state is 0 issued, 1 completed, 2 failed; backward_call is the
// number of the forward call a backward call belongs to (-1 for none); times
// are nanoseconds on the recorder's clock. Version 1 (still read) wrote each
// entry as one object with the description's fields plus "id", "call",
// "state" ("issued" | "completed" | "failed"), "start_s", "duration_s",
// "bytes_sent", "bytes_received" and "backward_of": {"op", "call"}.
//
// A group's watermark is the number of its earliest collective still in the
// ring (its `calls` when none is): calls before it are unknown, never
// evidence of a mismatch. p2p_watermark is the same for send/recv numbers.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "diffcomm/distributed/flight_recorder.hpp"

namespace diffcomm::dist {

inline constexpr int kFlightDumpVersion = 2;

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

/// A dump in version 2's layout: each distinct call description once and one
/// small row per entry. What a replay at scale keeps while it reads (2000 rows
/// are 128 KB where 2000 FlightRecords are megabytes).
struct CompactFlightDump {
  struct Row {
    uint64_t id = 0;
    uint32_t call_index = 0;  ///< into calls
    uint64_t seq = 0;         ///< per-group call number
    FlightRecord::State state = FlightRecord::State::Issued;
    int64_t backward_call = -1;  ///< backward_of's call number, -1 for none
    int64_t start_ns = 0;
    int64_t duration_ns = 0;
    uint64_t bytes_sent = 0;
    uint64_t bytes_received = 0;
  };
  int version = kFlightDumpVersion;
  int rank = -1;
  int world_size = 0;
  std::size_t capacity = 0;
  std::vector<DumpedGroup> groups;
  /// Distinct descriptions: id, seq, state, times, bytes and backward_of's
  /// call are zero (a row holds them).
  std::vector<FlightRecord> calls;
  std::vector<Row> rows;  ///< oldest first
};

/// The recorder's current content as a dump (groups' watermarks computed).
FlightDump snapshot_flight_dump(const FlightRecorder& recorder);
/// The dump as JSON text (schema above, version 2; one line for the header,
/// one per entry).
std::string flight_dump_json(const FlightDump& dump);
/// Parses JSON text of the schema above (version 1 or 2). `file` names the
/// source in errors. Throws InvalidArgument with one line naming `file` and
/// the byte offset of a syntax error or truncation, or the entry and field
/// that is missing or of the wrong type, or an unsupported version, or
/// arrays and objects nested deeper than 64, or an entry whose call number
/// on its group (send/recv apart) is not above the one before it there, or
/// fields that disagree with each other as a recorder never writes them: a
/// call's numel against its first input (else output) shape, its group_size
/// or group_rank against its group's members, a group_rank outside its
/// group, a watermark above its group's calls, an entry's call number
/// outside [watermark, calls) of its group.
FlightDump parse_flight_dump(std::string_view text, const std::string& file);
/// The same, without expanding the entries (errors as parse_flight_dump).
/// Version 2's rows are scanned directly, not through a JSON tree.
CompactFlightDump parse_compact_flight_dump(std::string_view text, const std::string& file);
/// The two layouts of one dump. compact() keeps a description once per
/// distinct (description, backward_of op); expand(compact(d)) == d but for
/// times rounded to nanoseconds.
CompactFlightDump compact(const FlightDump& dump);
FlightDump expand(const CompactFlightDump& dump);
/// Writes `dump` as `dir`/rank-<dump.rank>.json (creating `dir`) through a
/// temporary file renamed into place, so a reader never sees half a file;
/// returns the path. Throws InvalidArgument when it cannot be written.
std::string write_flight_dump(const FlightDump& dump, const std::string& dir);
/// Reads the whole file. Throws InvalidArgument naming it when it is not a
/// regular file (a directory, a FIFO: never opened, never waited on) or
/// cannot be opened or read.
std::string read_dump_file(const std::string& path);
/// Reads and parses one dump file (errors as parse_flight_dump).
FlightDump read_flight_dump(const std::string& path);

}  // namespace diffcomm::dist
