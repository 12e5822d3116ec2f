// A collective call as backends see it (backend/call.hpp): op names, split
// lists, a composed call's steps and the error site a call names.
#include "diffcomm/distributed/backend/call.hpp"

#include <algorithm>
#include <numeric>

#include "diffcomm/distributed/backend/fingerprint.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::dist {

const char* op_cstr(OpType op) {
  switch (op) {
    case OpType::Barrier: return "barrier";
    case OpType::AllReduce: return "all_reduce";
    case OpType::Broadcast: return "broadcast";
    case OpType::Reduce: return "reduce";
    case OpType::AllGather: return "all_gather";
    case OpType::AllGatherSingle: return "all_gather_single";
    case OpType::AllGatherV: return "all_gather_v";
    case OpType::Gather: return "gather";
    case OpType::Scatter: return "scatter";
    case OpType::ReduceScatter: return "reduce_scatter";
    case OpType::ReduceScatterSingle: return "reduce_scatter_single";
    case OpType::ReduceScatterV: return "reduce_scatter_v";
    case OpType::AllToAll: return "all_to_all";
    case OpType::AllToAllSingle: return "all_to_all_single";
    case OpType::Send: return "send";
    case OpType::Recv: return "recv";
    case OpType::NewGroup: return "new_group";
  }
  return "?";
}

std::string op_name(OpType op) { return op_cstr(op); }

SplitList::SplitList(std::vector<int64_t> values) : n_(values.size()) {
  // All-equal lists (explicitly passed even splits too) need no storage.
  if (values.empty() ||
      std::all_of(values.begin(), values.end(), [&](int64_t x) { return x == values[0]; })) {
    value_ = values.empty() ? 0 : values[0];
    return;
  }
  owned_ = std::make_shared<const std::vector<int64_t>>(std::move(values));
  data_ = owned_->data();
}

SplitList SplitList::uniform(std::size_t n, int64_t value) {
  SplitList s;
  s.n_ = n;
  s.value_ = n == 0 ? 0 : value;
  return s;
}

int64_t SplitList::sum() const {
  if (is_uniform()) return static_cast<int64_t>(n_) * value_;
  return std::accumulate(owned_->begin(), owned_->end(), int64_t{0});
}

std::vector<int64_t> SplitList::to_vector() const {
  if (!is_uniform()) return *owned_;
  return std::vector<int64_t>(n_, value_);
}

bool SplitList::operator==(const SplitList& o) const {
  if (n_ != o.n_) return false;
  if (is_uniform() && o.is_uniform()) return n_ == 0 || value_ == o.value_;
  for (std::size_t i = 0; i < n_; ++i)
    if ((*this)[i] != o[i]) return false;
  return true;
}

std::string Call::signature() const { return dist::signature(describe(*this)); }

Call Call::step(OpType step_op) const {
  Call c;
  c.op = step_op;
  c.seq = seq;
  c.group = group;
  c.rank = rank;
  c.group_size = group_size;
  c.dtype = dtype;
  c.part_of = op_cstr(op);
  c.thread_index = thread_index;
  c.caller = caller;
  return c;
}

ErrorSite Call::site() const {
  ErrorSite s;
  s.op = part_of != nullptr ? part_of : op_cstr(op);
  s.call = seq;
  s.group = std::string(group);
  s.rank = rank;
  s.group_size = group_size;
  if (part_of != nullptr) s.step = op_cstr(op);
  return s;
}

std::string Call::where() const { return format_site(site()); }

}  // namespace diffcomm::dist
