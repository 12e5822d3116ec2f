#pragma once
// Call: one primitive collective as every backend sees it, after validation.
// The funnel (collectives.cpp) builds it, checks it locally, numbers it,
// accounts its bytes, then hands it to the group's Backend. The same record is
// the call's fingerprint: the simulated world compares the members' Calls
// before moving any data.
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
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

/// Rows per peer as a Call carries them: a read-only list whose copies never
/// copy its entries. A list whose entries are all equal (even splits, the
/// common all_to_all_single) is stored as (size, value) with no allocation;
/// any other list is one immutable vector shared by every copy of the Call.
/// Why: a Call per rank holding N explicit entries per direction is 2 x N
/// int64 per rank (4 GiB at 16384 ranks), more than the payload itself.
class SplitList {
 public:
  class iterator {
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = int64_t;
    using difference_type = std::ptrdiff_t;
    using pointer = const int64_t*;
    using reference = int64_t;
    iterator() = default;
    iterator(const SplitList* list, std::size_t i) : list_(list), i_(i) {}
    int64_t operator*() const { return (*list_)[i_]; }
    iterator& operator++() {
      ++i_;
      return *this;
    }
    iterator operator++(int) {
      iterator old = *this;
      ++i_;
      return old;
    }
    bool operator==(const iterator& o) const { return i_ == o.i_; }

   private:
    const SplitList* list_ = nullptr;
    std::size_t i_ = 0;
  };

  SplitList() = default;
  // Implicit on purpose: Call fields were std::vector<int64_t> and are
  // assigned from Splits throughout the backends.
  SplitList(std::vector<int64_t> values);  // NOLINT(google-explicit-constructor)
  /// n entries, each `value`.
  static SplitList uniform(std::size_t n, int64_t value);

  std::size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  int64_t operator[](std::size_t i) const { return data_ != nullptr ? data_[i] : value_; }
  /// True when every entry is equal (then each is uniform_value()).
  bool is_uniform() const { return data_ == nullptr; }
  int64_t uniform_value() const { return value_; }
  /// The sum of all entries.
  int64_t sum() const;
  std::vector<int64_t> to_vector() const;
  iterator begin() const { return {this, 0}; }
  iterator end() const { return {this, n_}; }
  bool operator==(const SplitList& o) const;

 private:
  std::size_t n_ = 0;
  int64_t value_ = 0;
  const int64_t* data_ = nullptr;  ///< into owned_; null when uniform
  std::shared_ptr<const std::vector<int64_t>> owned_;
};

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
  /// Rows per peer. all_to_all_single: both (even splits as a uniform
  /// list, never empty); all_gather_v: output_splits; reduce_scatter_v:
  /// input_splits.
  SplitList input_splits;
  SplitList output_splits;
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
  /// A transport step of this call (a composed reduction's all-to-all, a
  /// checked mode's fingerprint exchange): same group, rank, size, number
  /// and dtype, op `op`, part_of naming this call's op. No tensors.
  Call step(OpType op) const;
};

}  // namespace diffcomm::dist
