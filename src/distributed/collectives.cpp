// The funnel: every primitive collective passes through here, so local
// validation, numbering and byte accounting live in one place for all
// backends (the pattern of NCCL's collectives.cc -> enqueue path).
#include "diffcomm/distributed/collectives.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <exception>
#include <numeric>

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::dist {
namespace {

uint64_t nbytes(const Tensor& t) { return static_cast<uint64_t>(t.nbytes()); }
uint64_t nbytes(const std::vector<Tensor>& ts) {
  uint64_t s = 0;
  for (const auto& t : ts) s += nbytes(t);
  return s;
}
int64_t split_sum(const Splits& s) { return std::accumulate(s.begin(), s.end(), int64_t{0}); }
int64_t split_sum(const SplitList& s) { return s.sum(); }

// The aliasing rule, one for every backend: an input whose bytes overlap an
// output of the same call is staged (copied) before the backend sees the
// call, so every primitive reads all of its inputs as they were when called,
// whatever the transport's order of reads and writes (MPI forbids send ==
// receive buffers; an in-place all_to_all would otherwise corrupt rows). The
// in-place ops (all_reduce, broadcast, reduce) take one tensor as both by
// design; their backends handle that. Cost: one range comparison per tensor
// pair for single-tensor ops; list forms sort the output ranges once
// (O(k log k)), never a comparison per rank pair.
using Range = std::pair<const char*, const char*>;
Range range_of(const Tensor& t) {
  const char* p = static_cast<const char*>(t.data_ptr());
  return {p, p + t.nbytes()};
}
bool overlap(const Range& a, const Range& b) { return a.first < b.second && b.first < a.second; }

void stage_aliased_inputs(Call& c) {
  if (c.op == OpType::AllReduce || c.op == OpType::Broadcast || c.op == OpType::Reduce) return;
  if (c.inputs.empty() || c.outputs.empty()) return;
  if (c.outputs.size() == 1) {
    const Range out = range_of(c.outputs[0]);
    if (out.first == out.second) return;
    for (std::size_t i = 0; i < c.inputs.size(); ++i) {
      const Tensor& in = c.inputs[i];
      if (in.nbytes() > 0 && overlap(range_of(in), out)) c.inputs.set(i, in.copy_data());
    }
    return;
  }
  // The hull of the output ranges first: inputs outside it (separate
  // buffers, the common case) need no sorted table. Otherwise the disjoint
  // union of the output ranges, sorted, then one binary search per input.
  std::vector<Range> outs;
  outs.reserve(c.outputs.size());
  for (const Tensor& t : c.outputs)
    if (t.nbytes() > 0) outs.push_back(range_of(t));
  if (outs.empty()) return;
  Range hull = outs[0];
  for (const Range& o : outs) {
    hull.first = std::min(hull.first, o.first);
    hull.second = std::max(hull.second, o.second);
  }
  std::vector<std::size_t> near;  // inputs inside the hull
  for (std::size_t i = 0; i < c.inputs.size(); ++i) {
    const Tensor& in = c.inputs[i];
    if (in.nbytes() > 0 && overlap(range_of(in), hull)) near.push_back(i);
  }
  if (near.empty()) return;
  std::sort(outs.begin(), outs.end());
  std::size_t k = 0;
  for (std::size_t i = 1; i < outs.size(); ++i) {
    if (outs[i].first < outs[k].second)
      outs[k].second = std::max(outs[k].second, outs[i].second);
    else
      outs[++k] = outs[i];
  }
  outs.resize(k + 1);
  for (std::size_t i : near) {
    const Tensor& in = c.inputs[i];
    const Range r = range_of(in);
    // The first output range ending after r begins is the only candidate.
    auto it = std::upper_bound(outs.begin(), outs.end(), r.first,
                               [](const char* p, const Range& o) { return p < o.second; });
    if (it != outs.end() && overlap(r, *it)) c.inputs.set(i, in.copy_data());
  }
}

// Builds the Call and validates it; a bad argument raises InvalidArgument at
// site(): the op, the group, the backend and the rank of this call.
class Checker {
 public:
  Checker(const ProcessGroup& g, OpType op, Caller where = Caller::here()) : g_(g) {
    call_.op = op;
    call_.caller = caller_at(where);
    call_.group = g.name();
    call_.rank = g.rank();
    call_.group_size = g.size();
  }
  Call& call() { return call_; }
  int size() const { return call_.group_size; }
  int rank() const { return call_.rank; }

  // The call not yet numbered: op, group, backend, rank.
  ErrorSite site() const {
    ErrorSite s;
    s.op = op_cstr(call_.op);
    s.group = std::string(call_.group);
    s.backend = g_.backend().backend_name();
    s.rank = call_.rank;
    s.group_size = call_.group_size;
    return s;
  }

  // A bad argument: this rank refuses the call. Where members agree on every
  // call before moving data (checked mode), they learn it now, naming this
  // rank and the error (Backend::announce_refusal), instead of waiting for
  // their deadline; then this rank raises InvalidArgument at site(),
  // whatever the announcement met (the peers' state is theirs to report).
  [[noreturn]] void refuse(std::string_view detail) {
    InvalidArgument error(site(), detail);
    bool announced = false;
    try {
      announced = g_.backend().announce_refusal(call_, std::string(detail));
    } catch (...) {  // NOLINT(bugprone-empty-catch): this rank's error is the refusal
    }
    if (announced) g_.next_seq();  // the peers numbered theirs
    throw error;
  }

  // First tensor sets the call's dtype and device; later ones must agree.
  void tensor(const Tensor& t, const std::string& role) {
    if (!t.defined()) refuse(role + " is undefined");
    if (!have_first_) {
      have_first_ = true;
      call_.dtype = t.dtype();
      device_ = t.device();
      first_role_ = role;
      first_role_lit_ = nullptr;
      if (!g_.backend().supports(device_))
        refuse(fmt::format("{} is on {}, which the {} backend cannot communicate", role,
                           device_.str(), g_.backend().backend_name()));
      return;
    }
    if (t.dtype() != call_.dtype)
      refuse(fmt::format("{} has dtype {} but {} has dtype {}", role, dtype_name(t.dtype()),
                         first_role(), dtype_name(call_.dtype)));
    if (t.device() != device_)
      refuse(fmt::format("{} is on {} but {} is on {}", role, t.device().str(), first_role(),
                         device_.str()));
  }
  // The common call names its tensors with literals ("tensor", "input"):
  // the checks that pass need no std::string built per call.
  void tensor(const Tensor& t, const char* role) {
    if (t.defined()) {
      if (have_first_) {
        if (t.dtype() == call_.dtype && t.device() == device_) return;
      } else if (g_.backend().supports(t.device())) {
        have_first_ = true;
        call_.dtype = t.dtype();
        device_ = t.device();
        first_role_lit_ = role;
        return;
      }
    }
    tensor(t, std::string(role));
  }
  // A list element's role, "outputs[3]", formatted only for a message: a
  // string per element per call was most of a 1024-rank list-form call.
  struct Item {
    const char* list;
    std::size_t i;
    std::string str() const { return fmt::format("{}[{}]", list, i); }
  };
  void tensor(const Tensor& t, Item role) {
    if (have_first_ && t.defined() && t.dtype() == call_.dtype && t.device() == device_) return;
    tensor(t, role.str());
  }
  void same_shape(const Tensor& t, const Shape& expected, Item role) {
    if (t.shape() != expected) same_shape(t, expected, role.str());
  }
  // Roles are string_views: a literal passes without a std::string built
  // per call; a message is formatted only when a check fails.
  void has_rows(const Tensor& t, std::string_view role) {
    if (t.dim() == 0)
      refuse(fmt::format("{} is 0-d; this op moves rows (dim 0), give it at least one dim", role));
  }
  void same_shape(const Tensor& t, const Shape& expected, std::string_view role) {
    if (t.shape() != expected)
      refuse(fmt::format("{} has shape {}, expected {}", role, shape_str(t.shape()),
                         shape_str(expected)));
  }
  void list_size(const std::vector<Tensor>& ts, std::size_t expected, std::string_view role) {
    if (ts.size() != expected)
      refuse(fmt::format("{} has {} tensors, expected {} (one per member)", role, ts.size(),
                         expected));
  }
  void root(int r, const char* what) {
    if (r < 0 || r >= size())
      refuse(
          fmt::format("{} {} out of range [0, {}) (roots are group-local ranks)", what, r, size()));
    call_.root = r;
  }
  // Entries per member, none negative, and the rows they add up to (rows of
  // `row_bytes` bytes) a size a buffer can have: checked without overflow,
  // before any sum is taken or anything is allocated for them. A uniform
  // list (even splits) is checked in O(1).
  void splits(const SplitList& s, std::string_view role, uint64_t row_bytes) {
    if (static_cast<int>(s.size()) != size())
      refuse(
          fmt::format("{} has {} entries, expected {} (one per member)", role, s.size(), size()));
    const uint64_t per_row = std::max<uint64_t>(row_bytes, 1);
    auto too_big = [&]() {
      refuse(fmt::format(
          "{} ask for {} rows of {} bytes (more than {} bytes, the most one tensor may hold)", role,
          fmt::join(s.to_vector(), "+"), row_bytes, kMaxTensorBytes));
    };
    if (s.is_uniform()) {
      if (s.empty()) return;
      if (s[0] < 0) refuse(fmt::format("{}[0] = {} is negative", role, s[0]));
      if (static_cast<uint64_t>(s[0]) > kMaxTensorBytes / per_row / s.size()) too_big();
      return;
    }
    uint64_t rows = 0;
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (s[i] < 0) refuse(fmt::format("{}[{}] = {} is negative", role, i, s[i]));
      const auto r = static_cast<uint64_t>(s[i]);
      if (r > kMaxTensorBytes || rows + r > kMaxTensorBytes / per_row) too_big();
      rows += r;
    }
  }
  // A list checked in one pass (tensor() per entry), with what the call
  // needs of it besides: its bytes and the hull of its non-empty blocks.
  // One pass instead of three (check, bytes, aliasing) over N tensors per
  // rank, most of a 1024-rank list-form call.
  struct ListScan {
    uint64_t bytes = 0;
    Range hull{nullptr, nullptr};
  };
  ListScan scan(const std::vector<Tensor>& ts, const char* role) {
    ListScan r;
    uint64_t esize = 0;  // every entry has the call's dtype once checked
    for (std::size_t i = 0; i < ts.size(); ++i) {
      const Tensor& t = ts[i];
      tensor(t, Item{role, i});
      if (esize == 0) esize = element_size(call_.dtype);
      const uint64_t b = static_cast<uint64_t>(t.numel()) * esize;
      if (b == 0) continue;
      r.bytes += b;
      const char* p = static_cast<const char*>(t.data_ptr());
      if (r.hull.first == r.hull.second) {
        r.hull = {p, p + b};
      } else {
        r.hull.first = std::min(r.hull.first, p);
        r.hull.second = std::max(r.hull.second, p + b);
      }
    }
    return r;
  }
  // The caller proved no input overlaps an output: dispatch skips staging.
  void no_aliasing() { no_aliasing_ = true; }
  static uint64_t row_bytes(const Tensor& t) {
    return static_cast<uint64_t>(t.row_numel()) * element_size(t.dtype());
  }
  void reduce_op(ReduceOp op) {
    // A Kind cast from an integer outside the enum (e.g. ReduceOp::Kind(9)).
    if (static_cast<unsigned>(op.kind()) > ReduceOp::PremulSum)
      refuse(fmt::format("reduce op kind {} is not one of sum, avg, product, min, max, premul_sum",
                         static_cast<unsigned>(op.kind())));
    if ((op == ReduceOp::Avg || op == ReduceOp::PremulSum) && !is_floating(call_.dtype))
      refuse(fmt::format("{} is undefined for integer dtype {}", reduce_op_name(op),
                         dtype_name(call_.dtype)));
    call_.reduce_op = op;
  }
  static Shape trailing(const Tensor& t) { return Shape(t.shape().begin() + 1, t.shape().end()); }
  // Compared in place, the Shapes built only for a message. Both tensors
  // have a dim 0 (every caller runs has_rows on both first).
  void same_trailing(const Tensor& t, const Tensor& ref, std::string_view role,
                     std::string_view ref_role) {
    const Shape &a = t.shape(), &b = ref.shape();
    if (!std::equal(a.begin() + 1, a.end(), b.begin() + 1, b.end()))
      refuse(fmt::format("{} has row shape {} but {} has row shape {}", role,
                         shape_str(trailing(t)), ref_role, shape_str(trailing(ref))));
  }

  // Numbers the call, accounts its bytes, applies the aliasing rule, records
  // it in the rank's flight recorder and hands it to the backend.
  void dispatch(uint64_t sent, uint64_t received) {
    g_.backend().check_caller(call_);
    const ProcessGroup::CallSlot slot_guard(g_, call_);  // one thread per group
    const bool p2p = call_.op == OpType::Send || call_.op == OpType::Recv;
    call_.seq = p2p ? g_.next_p2p_seq() : g_.next_seq();
    if (!p2p) {
      call_.backward_of = g_.backward_of();
      g_.set_last_call({call_.op, call_.seq});
    }
    call_.bytes_sent = sent;
    call_.bytes_received = received;
    g_.stats().record(g_.name(), op_cstr(call_.op), sent, received);
    if (!no_aliasing_) stage_aliased_inputs(call_);
    FlightRecorder& recorder = g_.flight_recorder();
    if (recorder.detailed())
      recorder.note_group(call_.group, call_.rank, [this] { return g_.members(); });
    const std::size_t slot = recorder.begin(call_);
    // The errors that dump the recorder (when a dump directory is set) are
    // kept and rethrown after the handler: the file is written outside any
    // catch block, and a failure to write never replaces the error.
    std::exception_ptr dumped;
    try {
      to_backend();
    } catch (const Timeout& e) {
      // No fiber switch happens in these handlers (the simulated world never
      // raises Timeout; rethrowing does not yield).
      recorder.end(slot, FlightRecord::State::Failed);
      dumped = std::make_exception_ptr(
          Timeout(e.site(), fmt::format("{}\n{}", e.detail(), recorder.dump())));
    } catch (const CollectiveMismatch&) {
      recorder.end(slot, FlightRecord::State::Failed);
      dumped = std::current_exception();
    } catch (const BackendError&) {
      recorder.end(slot, FlightRecord::State::Failed);
      dumped = std::current_exception();
    } catch (const RankFailure&) {  // a production peer ending the job (mpi::end_job)
      recorder.end(slot, FlightRecord::State::Failed);
      dumped = std::current_exception();
    } catch (...) {
      recorder.end(slot, FlightRecord::State::Failed);
      throw;
    }
    if (dumped) {
      recorder.dump_on_error();
      std::rethrow_exception(dumped);
    }
    recorder.end(slot, FlightRecord::State::Completed);
    for (const Tensor& t : call_.outputs) t.bump_version();  // written in place
  }

  std::shared_ptr<Backend> split_result;

 private:
  void to_backend() {
    Backend& b = g_.backend();
    if (call_.op == OpType::NewGroup)
      split_result = b.split(call_, call_.color, call_.key);
    else
      b.run(call_);
  }

  const ProcessGroup& g_;
  Call call_;
  bool have_first_ = false;
  Device device_;
  // The first tensor's role: a literal on the common path (no string built
  // per call), a string only when the role was formatted.
  std::string_view first_role() const {
    return first_role_lit_ != nullptr ? std::string_view(first_role_lit_) : first_role_;
  }
  bool no_aliasing_ = false;
  const char* first_role_lit_ = nullptr;
  std::string first_role_;
};

}  // namespace

Splits even_splits(int64_t rows, int parts, const char* op) {
  if (parts <= 0 || rows % parts != 0)
    raise(op, fmt::format("{} rows cannot be split evenly over {} ranks; pass explicit splits",
                          rows, parts));
  return Splits(static_cast<std::size_t>(parts), rows / parts);
}

namespace detail {
std::shared_ptr<Backend> split_backend(const ProcessGroup& group, int color, int key,
                                       const std::vector<int64_t>& fingerprint,
                                       bool members_are_ranks, Caller caller) {
  Checker c(group, OpType::NewGroup, caller);
  c.call().color = color;
  c.call().key = key;
  c.call().members = fingerprint;
  c.call().members_are_ranks = members_are_ranks;
  c.dispatch(0, 0);
  return c.split_result;
}
}  // namespace detail

void barrier(const ProcessGroup& group, Caller caller) {
  Checker c(group, OpType::Barrier, caller);
  c.dispatch(0, 0);
}

void all_reduce(const ProcessGroup& group, const Tensor& tensor, ReduceOp op, Caller caller) {
  Checker c(group, OpType::AllReduce, caller);
  c.tensor(tensor, "tensor");
  c.reduce_op(op);
  c.call().inputs = TensorList::borrow(tensor);
  c.call().outputs = TensorList::borrow(tensor);
  const uint64_t n = static_cast<uint64_t>(c.size());
  const uint64_t bus = n > 1 ? 2 * (n - 1) * nbytes(tensor) / n : 0;
  c.dispatch(bus, bus);
}

void all_reduce_into(const ProcessGroup& group, const Tensor& output, const Tensor& input,
                     ReduceOp op, Caller caller) {
  if (output.defined() && input.defined() && output.same(input))
    return all_reduce(group, output, op);
  Checker c(group, OpType::AllReduce, caller);
  c.tensor(input, "input");
  c.tensor(output, "output");
  c.same_shape(output, input.shape(), "output");
  c.reduce_op(op);
  Tensor in = input;
  if (output.nbytes() > 0 && overlap(range_of(in), range_of(output))) in = in.copy_data();
  if (!group.backend().all_reduce_out_of_place()) {
    Tensor(output).copy_(in);  // a handle: writes output's elements
    in = output;
  }
  c.call().inputs = TensorList::borrow(in);
  c.call().outputs = TensorList::borrow(output);
  const uint64_t n = static_cast<uint64_t>(c.size());
  const uint64_t bus = n > 1 ? 2 * (n - 1) * nbytes(output) / n : 0;
  c.dispatch(bus, bus);
}

void broadcast(const ProcessGroup& group, const Tensor& tensor, int src, Caller caller) {
  Checker c(group, OpType::Broadcast, caller);
  c.tensor(tensor, "tensor");
  c.root(src, "src");
  c.call().inputs = TensorList::borrow(tensor);
  c.call().outputs = TensorList::borrow(tensor);
  const bool me = c.rank() == src;
  c.dispatch(me ? nbytes(tensor) * static_cast<uint64_t>(c.size() - 1) : 0,
             me ? 0 : nbytes(tensor));
}

void reduce(const ProcessGroup& group, const Tensor& tensor, int dst, ReduceOp op, Caller caller) {
  Checker c(group, OpType::Reduce, caller);
  c.tensor(tensor, "tensor");
  c.root(dst, "dst");
  c.reduce_op(op);
  c.call().inputs = TensorList::borrow(tensor);
  c.call().outputs = TensorList::borrow(tensor);
  const bool me = c.rank() == dst;
  c.dispatch(me ? 0 : nbytes(tensor),
             me ? nbytes(tensor) * static_cast<uint64_t>(c.size() - 1) : 0);
}

void all_gather(const ProcessGroup& group, const std::vector<Tensor>& outputs, const Tensor& input,
                Caller caller) {
  Checker c(group, OpType::AllGather, caller);
  c.tensor(input, "input");
  c.list_size(outputs, static_cast<std::size_t>(c.size()), "outputs");
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    c.tensor(outputs[i], Checker::Item{"outputs", i});
    c.same_shape(outputs[i], input.shape(), Checker::Item{"outputs", i});
  }
  c.call().inputs = TensorList::borrow(input);
  c.call().outputs = TensorList::borrow(outputs);
  c.dispatch(nbytes(input) * static_cast<uint64_t>(c.size() - 1), nbytes(outputs) - nbytes(input));
}

void all_gather_single(const ProcessGroup& group, const Tensor& output, const Tensor& input,
                       Caller caller) {
  Checker c(group, OpType::AllGatherSingle, caller);
  c.tensor(input, "input");
  c.tensor(output, "output");
  c.has_rows(input, "input");
  Shape expected = input.shape();
  expected[0] *= c.size();
  c.same_shape(output, expected, "output");
  c.call().inputs = TensorList::borrow(input);
  c.call().outputs = TensorList::borrow(output);
  c.dispatch(nbytes(input) * static_cast<uint64_t>(c.size() - 1), nbytes(output) - nbytes(input));
}

void all_gather_v(const ProcessGroup& group, const Tensor& output, const Tensor& input,
                  const Splits& output_splits, Caller caller) {
  Checker c(group, OpType::AllGatherV, caller);
  c.tensor(input, "input");
  c.tensor(output, "output");
  c.has_rows(input, "input");
  c.has_rows(output, "output");
  c.splits(output_splits, "output_splits", Checker::row_bytes(input));
  c.same_trailing(output, input, "output", "input");
  if (split_sum(output_splits) != output.size(0))
    c.refuse(fmt::format("output_splits sum to {} but output has {} rows", split_sum(output_splits),
                         output.size(0)));
  if (output_splits[static_cast<std::size_t>(c.rank())] != input.size(0))
    c.refuse(fmt::format("output_splits[{}] = {} but this rank's input has {} rows", c.rank(),
                         output_splits[static_cast<std::size_t>(c.rank())], input.size(0)));
  c.call().inputs = TensorList::borrow(input);
  c.call().outputs = TensorList::borrow(output);
  c.call().output_splits = output_splits;
  c.dispatch(nbytes(input) * static_cast<uint64_t>(c.size() - 1), nbytes(output) - nbytes(input));
}

void gather(const ProcessGroup& group, const std::vector<Tensor>& outputs, const Tensor& input,
            int dst, Caller caller) {
  Checker c(group, OpType::Gather, caller);
  c.tensor(input, "input");
  c.root(dst, "dst");
  const bool me = c.rank() == dst;
  if (me) {
    c.list_size(outputs, static_cast<std::size_t>(c.size()), "outputs");
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      c.tensor(outputs[i], Checker::Item{"outputs", i});
      c.same_shape(outputs[i], input.shape(), Checker::Item{"outputs", i});
    }
  } else if (!outputs.empty()) {
    c.refuse(fmt::format("outputs has {} tensors on a non-dst rank; pass an empty list there",
                         outputs.size()));
  }
  c.call().inputs = TensorList::borrow(input);
  c.call().outputs = TensorList::borrow(outputs);
  c.dispatch(me ? 0 : nbytes(input), me ? nbytes(outputs) - nbytes(input) : 0);
}

void scatter(const ProcessGroup& group, const Tensor& output, const std::vector<Tensor>& inputs,
             int src, Caller caller) {
  Checker c(group, OpType::Scatter, caller);
  c.tensor(output, "output");
  c.root(src, "src");
  const bool me = c.rank() == src;
  if (me) {
    c.list_size(inputs, static_cast<std::size_t>(c.size()), "inputs");
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      c.tensor(inputs[i], Checker::Item{"inputs", i});
      c.same_shape(inputs[i], output.shape(), Checker::Item{"inputs", i});
    }
  } else if (!inputs.empty()) {
    c.refuse(fmt::format("inputs has {} tensors on a non-src rank; pass an empty list there",
                         inputs.size()));
  }
  c.call().inputs = TensorList::borrow(inputs);
  c.call().outputs = TensorList::borrow(output);
  c.dispatch(me ? nbytes(inputs) - nbytes(output) : 0, me ? 0 : nbytes(output));
}

void reduce_scatter(const ProcessGroup& group, const Tensor& output,
                    const std::vector<Tensor>& inputs, ReduceOp op, Caller caller) {
  Checker c(group, OpType::ReduceScatter, caller);
  c.tensor(output, "output");
  c.reduce_op(op);
  c.list_size(inputs, static_cast<std::size_t>(c.size()), "inputs");
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    c.tensor(inputs[i], Checker::Item{"inputs", i});
    c.same_shape(inputs[i], output.shape(), Checker::Item{"inputs", i});
  }
  c.call().inputs = TensorList::borrow(inputs);
  c.call().outputs = TensorList::borrow(output);
  c.dispatch(nbytes(inputs) - nbytes(output), nbytes(output) * static_cast<uint64_t>(c.size() - 1));
}

void reduce_scatter_single(const ProcessGroup& group, const Tensor& output, const Tensor& input,
                           ReduceOp op, Caller caller) {
  Checker c(group, OpType::ReduceScatterSingle, caller);
  c.tensor(output, "output");
  c.tensor(input, "input");
  c.reduce_op(op);
  c.has_rows(output, "output");
  Shape expected = output.shape();
  expected[0] *= c.size();
  c.same_shape(input, expected, "input");
  c.call().inputs = TensorList::borrow(input);
  c.call().outputs = TensorList::borrow(output);
  c.dispatch(nbytes(input) - nbytes(output), nbytes(output) * static_cast<uint64_t>(c.size() - 1));
}

void reduce_scatter_v(const ProcessGroup& group, const Tensor& output, const Tensor& input,
                      const Splits& input_splits, ReduceOp op, Caller caller) {
  Checker c(group, OpType::ReduceScatterV, caller);
  c.tensor(output, "output");
  c.tensor(input, "input");
  c.reduce_op(op);
  c.has_rows(output, "output");
  c.has_rows(input, "input");
  c.splits(input_splits, "input_splits", Checker::row_bytes(input));
  c.same_trailing(output, input, "output", "input");
  if (split_sum(input_splits) != input.size(0))
    c.refuse(fmt::format("input_splits sum to {} but input has {} rows", split_sum(input_splits),
                         input.size(0)));
  if (input_splits[static_cast<std::size_t>(c.rank())] != output.size(0))
    c.refuse(fmt::format("input_splits[{}] = {} but this rank's output has {} rows", c.rank(),
                         input_splits[static_cast<std::size_t>(c.rank())], output.size(0)));
  c.call().inputs = TensorList::borrow(input);
  c.call().outputs = TensorList::borrow(output);
  c.call().input_splits = input_splits;
  c.dispatch(nbytes(input) - nbytes(output), nbytes(output) * static_cast<uint64_t>(c.size() - 1));
}

void all_to_all(const ProcessGroup& group, const std::vector<Tensor>& outputs,
                const std::vector<Tensor>& inputs, Caller caller) {
  Checker c(group, OpType::AllToAll, caller);
  c.list_size(inputs, static_cast<std::size_t>(c.size()), "inputs");
  c.list_size(outputs, static_cast<std::size_t>(c.size()), "outputs");
  const Checker::ListScan in = c.scan(inputs, "inputs");
  const Checker::ListScan out = c.scan(outputs, "outputs");
  const auto me = static_cast<std::size_t>(c.rank());
  c.same_shape(outputs[me], inputs[me].shape(), Checker::Item{"outputs", me});
  c.call().inputs = TensorList::borrow(inputs);
  c.call().outputs = TensorList::borrow(outputs);
  // Separate input and output buffers (the common case): nothing to stage,
  // and no second pass over the lists to find that out.
  if (!overlap(in.hull, out.hull)) c.no_aliasing();
  c.dispatch(in.bytes - nbytes(inputs[me]), out.bytes - nbytes(outputs[me]));
}

void all_to_all_single(const ProcessGroup& group, const Tensor& output, const Tensor& input,
                       const Splits& output_splits, const Splits& input_splits, Caller caller) {
  Checker c(group, OpType::AllToAllSingle, caller);
  c.tensor(input, "input");
  c.tensor(output, "output");
  c.has_rows(input, "input");
  c.has_rows(output, "output");
  c.same_trailing(output, input, "output", "input");
  // Empty splits mean even blocks; an indivisible row count is reported by
  // the checker, so the message names the group and rank like every other.
  auto even = [&](const Tensor& t, const char* role) {
    if (t.size(0) % c.size() != 0)
      c.refuse(
          fmt::format("{} has {} rows, which {} ranks cannot split evenly; pass explicit {}_splits",
                      role, t.size(0), c.size(), role));
    // Uniform: no N-entry vector per rank (see SplitList).
    return SplitList::uniform(static_cast<std::size_t>(c.size()), t.size(0) / c.size());
  };
  SplitList in = input_splits.empty() ? even(input, "input") : SplitList(input_splits);
  SplitList out = output_splits.empty() ? even(output, "output") : SplitList(output_splits);
  c.splits(in, "input_splits", Checker::row_bytes(input));
  c.splits(out, "output_splits", Checker::row_bytes(input));
  if (split_sum(in) != input.size(0))
    c.refuse(
        fmt::format("input_splits sum to {} but input has {} rows", split_sum(in), input.size(0)));
  if (split_sum(out) != output.size(0))
    c.refuse(fmt::format("output_splits sum to {} but output has {} rows", split_sum(out),
                         output.size(0)));
  const auto me = static_cast<std::size_t>(c.rank());
  if (in[me] != out[me])
    c.refuse(fmt::format("input_splits[{}] = {} (rows kept) but output_splits[{}] = {}", me, in[me],
                         me, out[me]));
  const uint64_t row_bytes = static_cast<uint64_t>(input.row_numel()) * element_size(input.dtype());
  const uint64_t sent = static_cast<uint64_t>(split_sum(in) - in[me]) * row_bytes;
  const uint64_t received = static_cast<uint64_t>(split_sum(out) - out[me]) * row_bytes;
  c.call().inputs = TensorList::borrow(input);
  c.call().outputs = TensorList::borrow(output);
  c.call().input_splits = std::move(in);
  c.call().output_splits = std::move(out);
  c.dispatch(sent, received);
}

void send(const ProcessGroup& group, const Tensor& tensor, int dst, int tag, Caller caller) {
  Checker c(group, OpType::Send, caller);
  c.tensor(tensor, "tensor");
  c.root(dst, "dst");
  if (dst == c.rank()) c.refuse("dst is this rank; send to yourself would never match");
  c.call().tag = tag;
  c.call().inputs = TensorList::borrow(tensor);
  c.dispatch(nbytes(tensor), 0);
}

void recv(const ProcessGroup& group, const Tensor& tensor, int src, int tag, Caller caller) {
  Checker c(group, OpType::Recv, caller);
  c.tensor(tensor, "tensor");
  c.root(src, "src");
  if (src == c.rank()) c.refuse("src is this rank; recv from yourself would never match");
  c.call().tag = tag;
  c.call().outputs = TensorList::borrow(tensor);
  c.dispatch(0, nbytes(tensor));
}

}  // namespace diffcomm::dist
