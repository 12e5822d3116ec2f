// Names, signatures and counters of the dist layer.
#include <fmt/format.h>

#include "diffcomm/dist/call.hpp"
#include "diffcomm/dist/reduce_op.hpp"
#include "diffcomm/dist/stats.hpp"

namespace diffcomm::dist {

std::string reduce_op_name(ReduceOp op) {
  switch (op) {
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

namespace {
std::string shapes_str(const std::vector<Tensor>& ts) {
  std::vector<std::string> parts;
  for (const auto& t : ts) parts.push_back(t.defined() ? shape_str(t.shape()) : "undefined");
  return fmt::format("{}", fmt::join(parts, ","));
}
bool has_reduce(OpType op) {
  return op == OpType::AllReduce || op == OpType::Reduce || op == OpType::ReduceScatter ||
         op == OpType::ReduceScatterSingle || op == OpType::ReduceScatterV;
}
bool has_root(OpType op) {
  return op == OpType::Broadcast || op == OpType::Reduce || op == OpType::Gather ||
         op == OpType::Scatter;
}
}  // namespace

std::string Call::signature() const {
  if (op == OpType::NewGroup)
    return fmt::format("new_group(members=[{}])", fmt::join(output_splits, ","));
  std::string s = op_name(op) + "(";
  if (op != OpType::Barrier && op != OpType::NewGroup) {
    s += dtype_name(dtype);
    if (!inputs.empty()) s += fmt::format(", in={}", shapes_str(inputs));
    if (!outputs.empty() && op != OpType::AllReduce && op != OpType::Broadcast &&
        op != OpType::Reduce)
      s += fmt::format(", out={}", shapes_str(outputs));
  }
  if (has_root(op)) s += fmt::format(", root={}", root);
  if (op == OpType::Send || op == OpType::Recv) s += fmt::format(", peer={}, tag={}", root, tag);
  if (has_reduce(op)) s += ", op=" + reduce_op_name(reduce_op);
  if (!input_splits.empty() && op != OpType::NewGroup)
    s += fmt::format(", input_splits=[{}]", fmt::join(input_splits, ","));
  if (!output_splits.empty())
    s += fmt::format(", output_splits=[{}]", fmt::join(output_splits, ","));
  return s + ")";
}

std::string Call::where() const {
  return fmt::format("{} #{} on group '{}' (rank {} of {})", op_name(op), seq, group, rank,
                     group_size);
}

void Stats::record(std::string_view group, std::string_view op, uint64_t sent, uint64_t received) {
  auto it = entries_.find(KeyLess::View{group, op});
  if (it == entries_.end()) it = entries_.emplace(Key{group, op}, OpStats{}).first;
  OpStats& s = it->second;
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
