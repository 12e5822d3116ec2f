#pragma once
// PyTorch Flight Recorder dumps as diffcomm flight dumps, so that
// `diffcomm-sim replay` and diffcomm.sim.replay read them too. Torch writes
// one file per rank (pickle: torch._C._distributed_c10d._dump_fr_trace, the
// NCCL watchdog's TORCH_FR_DUMP_TEMP_FILE<rank>; JSON: _dump_fr_trace_json),
// schema versions "2.x" (torch >= 2.5); this reader follows the fields of
// torch's own fr_trace tool (torch/distributed/flight_recorder).
//
// Mapping: an entry's process_group name becomes the group ("world" for the
// default group, whose members are every rank), collective_seq_id - 1 the
// call number (diffcomm counts from 0), profiling_name's op the op, the
// first input (else output) dtype the dtype, input/output sizes the shapes;
// pg_status' last_completed_collective gives completed vs issued. What
// torch does not record is never guessed: each dump's FlightDump::unknown
// names it and the replay leaves it out of the comparison —
//   - all_to_all_single's splits (replayed with empty tensors: op and dtype
//     are compared, sizes cannot be);
//   - the root of broadcast, reduce, gather and scatter (replayed as group
//     rank 0; a gather/scatter root's buffers follow the others' shapes);
//   - the reduce op of all_reduce, reduce and reduce_scatter (sum);
//   - the peer of send/recv (not replayed);
//   - a group's members when pg_config does not name the group (gloo's
//     dumps key it by ""): taken as the ranks whose dumps record the group.
#include <string>
#include <string_view>
#include <vector>

#include "diffcomm/distributed/flight_dump.hpp"

namespace diffcomm::sim {

/// True when `bytes` start like a torch dump (a pickle, or a JSON object
/// with "pg_config" or "entries" and no diffcomm "format").
bool is_torch_flight_dump(std::string_view bytes);

/// Reads the torch dumps of a directory: files named <prefix><global
/// rank>[.pkl|.json] with one common prefix (e.g. torch's default
/// nccl_trace_rank_<r>); other files are ignored. The world size is one more
/// than the largest rank a file name or any group's pg_config names. Throws
/// InvalidArgument (one line naming the file) for a missing rank, a corrupt
/// or truncated file (with its byte offset), an op or dtype diffcomm has no
/// equivalent for, or no torch dump at all.
std::vector<dist::FlightDump> read_torch_dumps(const std::string& dir);

}  // namespace diffcomm::sim
