// Issuing recorded calls (replay_issue.hpp).
#include "replay_issue.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/mman.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>

#include "diffcomm/distributed/backend.hpp"
#include "diffcomm/distributed/backend/fingerprint.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::sim::detail {
namespace {
using dist::Call;
using dist::FlightRecord;
using dist::OpType;

// A backend that moves nothing: the funnel validates each call, then this
// keeps its description (the funnel's, with even splits filled in, say:
// what the world's rendezvous compares). Group-local rank `rank` of the
// members `members` (global ranks).
class DryBackend final : public dist::Backend {
 public:
  DryBackend(int rank, std::vector<int> members) : rank_(rank), members_(std::move(members)) {}
  std::string backend_name() const override { return "replay-check"; }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  int global_rank(int group_rank) const override {
    return members_.at(static_cast<std::size_t>(group_rank));
  }
  bool supports(const Device& device) const override { return device.is_cpu(); }
  std::shared_ptr<Backend> split(Call&, int, int) override { return nullptr; }
  dist::CallDesc last;  // the last call's description, call numbers zero
  void barrier(Call& c) override { keep(c); }
  void all_reduce(Call& c) override { keep(c); }
  void broadcast(Call& c) override { keep(c); }
  void reduce(Call& c) override { keep(c); }
  void all_gather(Call& c) override { keep(c); }
  void all_gather_single(Call& c) override { keep(c); }
  void all_gather_v(Call& c) override { keep(c); }
  void gather(Call& c) override { keep(c); }
  void scatter(Call& c) override { keep(c); }
  void reduce_scatter(Call& c) override { keep(c); }
  void reduce_scatter_single(Call& c) override { keep(c); }
  void reduce_scatter_v(Call& c) override { keep(c); }
  void all_to_all(Call& c) override { keep(c); }
  void all_to_all_single(Call& c) override { keep(c); }
  void send(Call& c) override { keep(c); }
  void recv(Call& c) override { keep(c); }

 private:
  void keep(const Call& c) {
    last = dist::describe(c);
    last.seq = 0;
    if (last.backward_of) last.backward_of->seq = 0;
  }
  int rank_;
  std::vector<int> members_;
};

// "rank R's all_reduce #S on group 'G'": the first rank that recorded
// table.calls[call] (calls are shared between ranks), for an error message.
std::string recorded_by(const Table& table, std::size_t call) {
  const FlightRecord& r = table.calls[call].proto;
  const std::string& group = table.groups[table.calls[call].group].name;
  for (std::size_t rank = 0; rank < table.steps.size(); ++rank)
    for (const Step& step : table.steps[rank])
      if (step.call == call)
        return fmt::format("rank {}'s {} #{} on group '{}'", rank, dist::op_name(r.op), step.seq,
                           group);
  return fmt::format("a {} on group '{}'", dist::op_name(r.op), group);
}

// Where each tensor of a call starts: 64-byte aligned, one after another.
constexpr double kAlign = 64;
double aligned(double bytes) { return std::ceil(bytes / kAlign) * kAlign; }

// The bytes of a call's tensors laid out, in double: a corrupt shape's
// product must not overflow. A negative dim is refused, named.
double laid_out_bytes(const Table& table, std::size_t call) {
  const FlightRecord& r = table.calls[call].proto;
  double total = 0;
  for (const auto* shapes : {&r.input_shapes, &r.output_shapes})
    for (const Shape& s : *shapes) {
      double n = 1;
      for (int64_t d : s) {
        if (d < 0)
          raise("replay", fmt::format("the recorded calls cannot be replayed: {}: negative dim in "
                                      "shape {}",
                                      recorded_by(table, call), s));
        n *= static_cast<double>(d);
      }
      total += aligned(n * static_cast<double>(element_size(r.dtype)));
    }
  return total;
}

std::shared_ptr<char> reserve_address_space(std::size_t bytes) {
  int flags = MAP_PRIVATE | MAP_ANONYMOUS;
#ifdef MAP_NORESERVE
  flags |= MAP_NORESERVE;
#endif
  void* p = ::mmap(nullptr, bytes, PROT_NONE, flags, -1, 0);
  if (p == MAP_FAILED)
    raise<ResourceExhausted>(
        "replay", fmt::format("cannot reserve {:.4g} GiB of address space for the recorded "
                              "tensors ({}; replay commits no memory for them, but needs the "
                              "addresses: check ulimit -v)",
                              double(bytes) / double(1 << 30), std::strerror(errno)));
  return std::shared_ptr<char>(static_cast<char*>(p), [bytes](char* q) { ::munmap(q, bytes); });
}

}  // namespace

ShapeOnlyTensors::ShapeOnlyTensors(const Table& table) {
  double most = kAlign;
  for (std::size_t call = 0; call < table.calls.size(); ++call) {
    const double bytes = laid_out_bytes(table, call);
    if (bytes > kMaxCallBytes)
      raise("replay",
            fmt::format("{} holds {:.4g} TiB of tensors (shapes in {}, out {}); replay reserves "
                        "address space for each call's tensors and refuses calls over 16 TiB",
                        recorded_by(table, call), bytes / double(std::size_t{1} << 40),
                        fmt::join(table.calls[call].proto.input_shapes, ","),
                        fmt::join(table.calls[call].proto.output_shapes, ",")));
    most = std::max(most, bytes);
  }
  region_ = reserve_address_space(static_cast<std::size_t>(most));
}

std::vector<Tensor> ShapeOnlyTensors::views(const std::vector<Shape>& shapes, DType dtype,
                                            std::size_t& offset) const {
  std::vector<Tensor> ts;
  ts.reserve(shapes.size());
  for (const Shape& s : shapes) {
    // Each view holds the region: it outlives the world's run.
    ts.push_back(
        from_blob(region_.get() + offset, s, dtype, Device::cpu(), [keep = region_](void*) {}));
    offset += static_cast<std::size_t>(aligned(static_cast<double>(ts.back().nbytes())));
  }
  return ts;
}

void ShapeOnlyTensors::issue(const dist::ProcessGroup& g, const FlightRecord& r) const {
  std::size_t offset = 0;
  const std::vector<Tensor> in = views(r.input_shapes, r.dtype, offset);
  const std::vector<Tensor> out = views(r.output_shapes, r.dtype, offset);
  const Tensor none;
  const Tensor& i0 = in.empty() ? none : in[0];
  const Tensor& o0 = out.empty() ? none : out[0];
  std::optional<dist::ProcessGroup::BackwardOf> backward;
  if (r.backward_of) backward.emplace(g, *r.backward_of);
  const dist::ScopedCaller dumped_caller(r.caller);  // the report names the user's line
  switch (r.op) {
    case OpType::Barrier: return dist::barrier(g);
    case OpType::AllReduce: return dist::all_reduce(g, i0, r.reduce_op);
    case OpType::Broadcast: return dist::broadcast(g, i0, r.root);
    case OpType::Reduce: return dist::reduce(g, i0, r.root, r.reduce_op);
    case OpType::AllGather: return dist::all_gather(g, out, i0);
    case OpType::AllGatherSingle: return dist::all_gather_single(g, o0, i0);
    case OpType::AllGatherV: return dist::all_gather_v(g, o0, i0, r.output_splits.to_vector());
    case OpType::Gather: return dist::gather(g, out, i0, r.root);
    case OpType::Scatter: return dist::scatter(g, o0, in, r.root);
    case OpType::ReduceScatter: return dist::reduce_scatter(g, o0, in, r.reduce_op);
    case OpType::ReduceScatterSingle: return dist::reduce_scatter_single(g, o0, i0, r.reduce_op);
    case OpType::ReduceScatterV:
      return dist::reduce_scatter_v(g, o0, i0, r.input_splits.to_vector(), r.reduce_op);
    case OpType::AllToAll: return dist::all_to_all(g, out, in);
    case OpType::AllToAllSingle:
      return dist::all_to_all_single(g, o0, i0, r.output_splits.to_vector(),
                                     r.input_splits.to_vector());
    case OpType::Send: return dist::send(g, i0, r.root, r.tag);
    case OpType::Recv: return dist::recv(g, o0, r.root, r.tag);
    case OpType::NewGroup: return;
  }
}

std::vector<dist::CallDesc> validate_calls(const Table& table, const ShapeOnlyTensors& tensors) {
  struct Dry {
    std::shared_ptr<DryBackend> backend;
    dist::ProcessGroup group;
  };
  std::map<std::pair<uint32_t, int>, Dry> dry;  // (group, group rank)
  // One small recorder for every dry group (a fresh one each held 2000
  // entries: 800 MB for 2048 TP groups).
  dist::Options small;
  small.flight_recorder_size = 1;
  const auto recorder = std::make_shared<dist::FlightRecorder>(small);
  std::vector<dist::CallDesc> descs;
  descs.reserve(table.calls.size());
  for (const TableCall& c : table.calls) {
    const FlightRecord& r = c.proto;
    descs.emplace_back();
    if (r.op == OpType::NewGroup) continue;
    const TableGroup& g = table.groups[c.group];
    auto it = dry.find({c.group, r.group_rank});
    if (it == dry.end()) {
      if (r.group_rank < 0 || r.group_rank >= static_cast<int>(g.members.size()))
        raise("replay",
              fmt::format("the recorded calls cannot be replayed: a {} on group '{}' records group "
                          "rank {} of {}",
                          dist::op_name(r.op), g.name, r.group_rank, g.members.size()));
      auto backend = std::make_shared<DryBackend>(r.group_rank, g.members);
      it = dry.emplace(std::pair{c.group, r.group_rank},
                       Dry{backend, dist::ProcessGroup(backend, g.name, nullptr, recorder)})
               .first;
    }
    try {
      tensors.issue(it->second.group, r);
      descs.back() = it->second.backend->last;
    } catch (const InvalidArgument& e) {
      const std::string what = e.what();
      raise("replay",
            fmt::format("the recorded calls cannot be replayed: {}: {}",
                        recorded_by(table, descs.size() - 1), what.substr(0, what.find('\n'))));
    }
  }
  return descs;
}

}  // namespace diffcomm::sim::detail
