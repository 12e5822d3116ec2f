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
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "diffcomm/distributed/caller.hpp"
#include "diffcomm/distributed/reduce_op.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

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

/// Tensors of a Call, as every backend reads them: a read-only list that
/// either borrows the caller's tensors or owns its own.
///  - Borrowed (TensorList::borrow): a view of tensors the caller holds for
///    the whole synchronous call; the funnel's case. Why: a list-form call
///    copied its N tensor handles per direction into every rank's Call (2 x
///    N^2 handle copies and releases per collective at N ranks, most of a
///    1024-rank all_to_all), and a single-tensor call paid a vector
///    allocation per direction per rank.
///  - Owned: one tensor inline (no allocation; the implicit conversion from
///    a Tensor, for transport steps built from temporaries), or a vector.
/// Copying a borrowed list borrows the same tensors: whatever keeps a Call
/// beyond its call must keep owned() copies or descriptions, never the Call.
class TensorList {
 public:
  TensorList() = default;
  /// One tensor, owned, held inline.
  TensorList(Tensor t)  // NOLINT(google-explicit-constructor): `c.inputs = {t}`
      : one_(std::move(t)), data_(&one_), size_(1), kind_(Kind::One) {}
  /// Several tensors, owned.
  explicit TensorList(std::vector<Tensor> ts)
      : many_(std::move(ts)), data_(many_.data()), size_(many_.size()), kind_(Kind::Many) {}
  /// The caller's tensors, not copied: they must outlive every use of the
  /// list. (Temporaries are refused at compile time.)
  static TensorList borrow(const std::vector<Tensor>& ts) {
    TensorList l;
    l.data_ = ts.data();
    l.size_ = ts.size();
    return l;
  }
  static TensorList borrow(const Tensor& t) {
    TensorList l;
    l.data_ = &t;
    l.size_ = 1;
    return l;
  }
  static TensorList borrow(std::vector<Tensor>&&) = delete;
  static TensorList borrow(Tensor&&) = delete;

  TensorList(const TensorList& o) { *this = o; }
  TensorList(TensorList&& o) noexcept { *this = std::move(o); }
  TensorList& operator=(const TensorList& o) {
    if (this != &o) take(o);
    return *this;
  }
  TensorList& operator=(TensorList&& o) noexcept {
    if (kind_ == Kind::Borrowed && o.kind_ == Kind::Borrowed) {  // the funnel's case: two words
      data_ = o.data_;
      size_ = o.size_;
      return *this;
    }
    return move_from(o);
  }
  ~TensorList() = default;

  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const Tensor& operator[](std::size_t i) const { return data_[i]; }
  const Tensor& front() const { return data_[0]; }
  const Tensor* begin() const { return data_; }
  const Tensor* end() const { return data_ + size_; }
  bool borrowed() const { return kind_ == Kind::Borrowed && size_ > 0; }
  /// Entry i for writing its data (Tensor::copy_ and fill_ are non-const
  /// members although they change the elements, never the handle): the
  /// handle itself is not modified, so the caller's list stays as passed.
  Tensor& writable(std::size_t i) const { return const_cast<Tensor&>(data_[i]); }

  /// Replaces entry i (the funnel's staging of aliased inputs, a backend's
  /// device copies). A borrowed list first becomes an owned copy: the
  /// caller's list is never written.
  void set(std::size_t i, Tensor t) {
    if (kind_ == Kind::Borrowed) {
      if (size_ == 1) {
        one_ = data_[0];
        data_ = &one_;
        kind_ = Kind::One;
      } else {
        many_.assign(data_, data_ + size_);
        data_ = many_.data();
        kind_ = Kind::Many;
      }
    }
    (kind_ == Kind::One ? one_ : many_[i]) = std::move(t);
  }
  /// A copy that owns its tensors (to keep beyond the call).
  TensorList owned() const {
    if (kind_ != Kind::Borrowed) return *this;
    if (size_ == 1) return TensorList(data_[0]);
    return TensorList(std::vector<Tensor>(data_, data_ + size_));
  }
  /// The tensors as a vector (handle copies).
  std::vector<Tensor> to_vector() const { return std::vector<Tensor>(begin(), end()); }

 private:
  enum class Kind : uint8_t { Borrowed, One, Many };
  // Out of line on purpose: the borrowed fast path of operator= stays small
  // enough to inline into the funnel.
  [[gnu::noinline]] TensorList& move_from(TensorList& o) noexcept {
    if (this == &o) return *this;
    take(std::move(o));
    o.clear();
    return *this;
  }
  // Copies (lvalue `o`) or moves (rvalue `o`) o's tensors in; the storage
  // not in use is emptied, so no stale handles are kept alive.
  template <class L>
  void take(L&& o) {
    kind_ = o.kind_;
    size_ = o.size_;
    switch (kind_) {
      case Kind::Borrowed:
        data_ = o.data_;
        one_ = Tensor();
        many_.clear();
        break;
      case Kind::One:
        one_ = std::forward<L>(o).one_;
        data_ = &one_;
        many_.clear();
        break;
      case Kind::Many:
        many_ = std::forward<L>(o).many_;
        data_ = many_.data();
        one_ = Tensor();
        break;
    }
  }
  void clear() {
    one_ = Tensor();
    many_.clear();
    data_ = nullptr;
    size_ = 0;
    kind_ = Kind::Borrowed;
  }

  Tensor one_;
  std::vector<Tensor> many_;
  const Tensor* data_ = nullptr;
  std::size_t size_ = 0;
  Kind kind_ = Kind::Borrowed;
};

/// A call on a group, by op and call number: how the backward of a
/// differentiable collective names the forward call it belongs to.
struct CallId {
  OpType op = OpType::Barrier;
  uint64_t seq = 0;
  bool operator==(const CallId&) const = default;
};

struct Call {
  OpType op = OpType::Barrier;
  uint64_t seq = 0;  ///< per-group call number (collectives and send/recv counted apart)
  /// Group name, for messages: the ProcessGroup's own name (it outlives the
  /// call), not a copy per call.
  std::string_view group;
  int rank = 0;  ///< caller's group-local rank
  int group_size = 1;
  DType dtype = DType::Float32;
  int root = -1;  ///< src/dst of rooted ops, peer of send/recv
  int tag = 0;    ///< send/recv tag
  ReduceOp reduce_op = ReduceOp::Sum;
  TensorList inputs;   ///< read-only buffers
  TensorList outputs;  ///< written buffers (in-place ops: inputs == outputs)
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
  /// Set on the transport steps of a composed call (dist/backend/composed.hpp): the
  /// user's op this step belongs to, for messages. Null otherwise.
  const char* part_of = nullptr;
  /// Set by a composed reduction on its steps, only over a transport whose
  /// skips_own_block() is true: this member's own block is already where
  /// the caller reads it, so the step moves only the other members' blocks.
  /// all_to_all_single: the own input block is not copied into the output
  /// (that output block is left as it was; the caller reads the input's).
  /// all_gather_v: the input is the output's own block (a view of it), not
  /// copied onto itself.
  bool own_block_placed = false;
  /// Set on the calls a differentiable collective's backward makes: its
  /// forward call on the same group (ProcessGroup::BackwardOf). Members must
  /// agree on it like on the op, so ranks running the backward of different
  /// forward calls raise CollectiveMismatch naming both forward calls,
  /// instead of pairing silently.
  std::optional<CallId> backward_of;
  /// The calling thread as the group numbers the threads that make its
  /// collectives, in order of first use from 0 (ProcessGroup::CallSlot sets
  /// it; send/recv neither count nor carry it; a thread that ended and a new
  /// one at the same std::thread::id are two threads). Members agree on it in
  /// checked mode and in the simulated world, so threads taking turns on one
  /// group in different orders on different ranks (pairing one thread's call
  /// with another's, silently) raise CollectiveMismatch naming both threads.
  /// The same order on every rank (forward on one thread, backward on
  /// autograd's) agrees; two threads swapped consistently on one rank cannot
  /// be told apart.
  int thread_index = 0;
  /// Where the user's code made this call (caller.hpp; steps inherit it).
  /// Not compared across ranks: members call from different lines legally.
  Caller caller;

  /// "all_reduce(float32[4], op=sum)" — the fields a fingerprint compares.
  std::string signature() const;
  /// Where this call is, for errors: op (a step: the user's op, and the
  /// step's op as `step`), call number, group, rank and group size.
  ErrorSite site() const;
  /// format_site(site()): "all_reduce #3 on group 'world' (rank 1 of 4)",
  /// "all_reduce #3 on group 'world' (rank 1 of 4, all_to_all step)".
  std::string where() const;
  /// A transport step of this call (a composed reduction's all-to-all, a
  /// checked mode's fingerprint exchange): same group, rank, size, number
  /// and dtype, op `op`, part_of naming this call's op. No tensors.
  Call step(OpType op) const;
};

}  // namespace diffcomm::dist
