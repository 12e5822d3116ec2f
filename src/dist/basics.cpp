// Names, signatures and counters of the dist layer.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "diffcomm/dist/backend/call.hpp"
#include "diffcomm/dist/backend/fingerprint.hpp"
#include "diffcomm/dist/reduce_op.hpp"
#include "diffcomm/dist/stats.hpp"
#include "diffcomm/error.hpp"

namespace diffcomm::dist {

ReduceOp ReduceOp::premul_sum(double factor) {
  if (!std::isfinite(factor))
    throw InvalidArgument(fmt::format("ReduceOp::premul_sum: factor {} is not finite", factor));
  ReduceOp op(PremulSum);
  op.factor_ = factor;
  return op;
}

std::string reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::PremulSum: return fmt::format("premul_sum({})", op.factor());
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Product: return "product";
    case ReduceOp::Min: return "min";
    case ReduceOp::Max: return "max";
  }
  return "?";
}

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

void Stats::record(std::string_view group, std::string_view op, uint64_t sent, uint64_t received) {
  if (last_.key == nullptr || last_.key->second != op || last_.key->first != group) {
    auto it = entries_.find(KeyLess::View{group, op});
    if (it == entries_.end()) it = entries_.emplace(Key{group, op}, OpStats{}).first;
    last_.key = &it->first;
    last_.stats = &it->second;
  }
  OpStats& s = *last_.stats;
  ++s.calls;
  s.bytes_sent += sent;
  s.bytes_received += received;
}

OpStats Stats::get(std::string_view group, std::string_view op) const {
  auto it = entries_.find(KeyLess::View{group, op});
  return it == entries_.end() ? OpStats{} : it->second;
}

OpStats Stats::total(std::string_view op) const {
  OpStats t;
  for (const auto& [key, s] : entries_)
    if (key.second == op) {
      t.calls += s.calls;
      t.bytes_sent += s.bytes_sent;
      t.bytes_received += s.bytes_received;
    }
  return t;
}

OpStats Stats::total() const {
  OpStats t;
  for (const auto& [key, s] : entries_) {
    t.calls += s.calls;
    t.bytes_sent += s.bytes_sent;
    t.bytes_received += s.bytes_received;
  }
  return t;
}

}  // namespace diffcomm::dist
