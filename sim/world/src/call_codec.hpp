#pragma once
// How a dist::Call, its tensors, a backend's identity and an error cross
// between a rank process and the world (rank_process.hpp), over wire.hpp.
// Tensors travel as places in the rank's payload memory: the rank copies
// each run of overlapping tensors once (so an in-place call's input and
// output, or a view into an output, alias on the world side as they did in
// the rank), the world builds tensors over those places, and the rank
// copies back the runs that hold outputs.
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "diffcomm/distributed/backend.hpp"
#include "payload_memory.hpp"
#include "wire.hpp"

namespace diffcomm::sim::detail {

/// What a rank process's backend answers without asking the world.
struct Identity {
  std::string backend_name;
  int rank = 0;
  std::vector<int> members;  ///< global ranks, in group order
  bool cpu = true;
  bool out_of_place = false;
  bool skips_own_block = false;
};
void put_identity(Writer& w, const dist::Backend& backend);
Identity get_identity(Reader& r);

/// A Call decoded on the world side, with the strings its views point into
/// (so it stays where it was built: neither copied nor moved).
struct DecodedCall {
  DecodedCall() = default;
  DecodedCall(const DecodedCall&) = delete;
  DecodedCall& operator=(const DecodedCall&) = delete;
  dist::Call call;
  std::string group;
  std::string part_of;
};
/// Every field of the Call but its tensors.
void put_call(Writer& w, const dist::Call& c);
void get_call(Reader& r, DecodedCall& out);

/// A Call's tensors as placed in the payload memory (rank side).
struct StagedTensors {
  struct Run {
    char* at;  ///< the rank's memory
    std::size_t bytes;
    std::size_t offset;  ///< in the payload memory
    bool written;        ///< holds an output: copied back after the call
  };
  struct Place {
    std::size_t offset;
    DType dtype;
    Shape shape;
  };
  std::vector<Run> runs;
  std::vector<Place> inputs, outputs;
};
/// Copies c's tensors into `memory` (grown as needed). Throws
/// InvalidArgument for a tensor that is not on the CPU.
StagedTensors stage_tensors(const dist::Call& c, PayloadMemory& memory);
void put_tensors(Writer& w, const StagedTensors& staged);
/// After the call: copies the runs that hold outputs back into the rank's
/// tensors.
void unstage_outputs(const StagedTensors& staged, const PayloadMemory& memory);
/// World side: c.inputs and c.outputs over the payload memory at `base`
/// (one tensor handle per distinct place, so aliases stay aliases).
void get_tensors(Reader& r, dist::Call& c, char* base);

/// The Failed reply for an exception (a diffcomm Error keeps its kind, site
/// and detail; anything else becomes an Error with its what()).
Writer error_reply(const std::exception_ptr& error);
/// Rank side: throws the error a Failed reply carries, as its class.
[[noreturn]] void throw_reply_error(Reader& r);

}  // namespace diffcomm::sim::detail
