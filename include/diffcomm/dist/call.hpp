#pragma once
// Call: one primitive collective as every backend sees it, after validation.
// The funnel (collectives.cpp) builds it, checks it locally, numbers it,
// accounts its bytes, then hands it to the group's Backend. The same record is
// the call's fingerprint: the simulated world compares the members' Calls
// before moving any data.
#include <cstdint>
#include <string>
#include <vector>

#include "diffcomm/dist/reduce_op.hpp"
#include "diffcomm/tensor.hpp"

namespace diffcomm::dist {

enum class OpType {
  Barrier,
  AllReduce,
  Broadcast,
  Reduce,
  AllGather,
  AllGatherSingle,
  AllGatherV,
  Gather,
  Scatter,
  ReduceScatter,
  ReduceScatterSingle,
  ReduceScatterV,
  AllToAll,
  AllToAllSingle,
  Send,
  Recv,
  NewGroup,
};

/// "all_reduce", "all_to_all_single", ... (the torch.distributed spelling).
std::string op_name(OpType op);
/// The same name as a static C string (no allocation; for hot paths).
const char* op_cstr(OpType op);

struct Call {
  OpType op = OpType::Barrier;
  uint64_t seq = 0;   ///< per-group call number (collectives and send/recv counted apart)
  std::string group;  ///< group name, for messages
  int rank = 0;       ///< caller's group-local rank
  int group_size = 1;
  DType dtype = DType::Float32;
  int root = -1;  ///< src/dst of rooted ops, peer of send/recv
  int tag = 0;    ///< send/recv tag
  ReduceOp reduce_op = ReduceOp::Sum;
  std::vector<Tensor> inputs;   ///< read-only buffers
  std::vector<Tensor> outputs;  ///< written buffers (in-place ops: inputs == outputs)
  /// Rows per peer. all_to_all_single: both (even splits made explicit);
  /// all_gather_v: output_splits; reduce_scatter_v: input_splits.
  std::vector<int64_t> input_splits;
  std::vector<int64_t> output_splits;
  /// new_group/split: this member's color (< 0: not in any new group) and
  /// key, and the fingerprint every member must pass (new_group: the member
  /// list).
  int color = -1;
  int key = 0;
  std::vector<int64_t> members;
  /// new_group/split: true when `members` is new_group's rank list, false
  /// when it is the fingerprint a ProcessGroup::split caller passed.
  bool members_are_ranks = false;
  /// Payload bytes this rank sends to / receives from other ranks (see
  /// Stats); set by the funnel, used by cost models and traces.
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  /// Set on the transport steps of a composed call (dist/composed.hpp): the
  /// user's op this step belongs to, for messages. Null otherwise.
  const char* part_of = nullptr;

  /// "all_reduce(float32[4], op=sum)" — the fields a fingerprint compares.
  std::string signature() const;
  /// "all_reduce #3 on group 'world' (rank 1 of 4)".
  std::string where() const;
};

}  // namespace diffcomm::dist
