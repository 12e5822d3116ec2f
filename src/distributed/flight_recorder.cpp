#include "diffcomm/distributed/flight_recorder.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <exception>

#include "diffcomm/distributed/flight_dump.hpp"
#include "diffcomm/tensor/error.hpp"
#include "flight_recorder_exit.hpp"

namespace diffcomm::dist {
namespace {
const char* state_name(FlightRecord::State s) {
  switch (s) {
    case FlightRecord::State::Issued: return "issued, not completed";
    case FlightRecord::State::Completed: return "completed";
    case FlightRecord::State::Failed: return "failed";
  }
  return "?";
}

// Copies the shapes of `ts` into `out`, reusing its buffers.
void copy_shapes(const TensorList& ts, std::vector<Shape>& out) {
  out.resize(ts.size());
  for (std::size_t i = 0; i < ts.size(); ++i) out[i] = ts[i].shape();
}
}  // namespace

FlightRecorder::FlightRecorder() : FlightRecorder(Options{}) {}

FlightRecorder::FlightRecorder(const Options& options)
    : ring_(options.resolved_flight_recorder_size()),
      origin_(std::chrono::steady_clock::now()),
      detailed_(true),
      dump_dir_(options.resolved_flight_recorder_dump_dir()) {
  if (!dump_dir_.empty()) detail::register_for_exit_dump(this);
}

FlightRecorder::~FlightRecorder() {
  if (!dump_dir_.empty()) detail::unregister_for_exit_dump(this);
}

std::shared_ptr<FlightRecorder> FlightRecorder::for_rank(const Options& options, int global_rank,
                                                         int world_size) {
  auto recorder = std::make_shared<FlightRecorder>(options);
  recorder->set_identity(global_rank, world_size);
  return recorder;
}

FlightRecorder::FlightRecorder(Clock clock, const void* context)
    : ring_(kSimCapacity), clock_(clock), context_(context) {}

void FlightRecorder::set_identity(int global_rank, int world_size) {
  global_rank_ = global_rank;
  world_size_ = world_size;
}

int FlightRecorder::global_rank() const {
  if (global_rank_ >= 0 || groups_.empty()) return global_rank_;
  const RecordedGroup& g = groups_.begin()->second;
  return g.members.at(static_cast<std::size_t>(g.group_rank));
}

double FlightRecorder::now_s() const {
  if (clock_ != nullptr) return clock_(context_);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - origin_).count();
}

void FlightRecorder::note_group(std::string_view name, int group_rank,
                                const std::function<std::vector<int>()>& members) {
  if (!detailed_ || group_named(name) != nullptr) return;
  RecordedGroup g;
  g.name = std::string(name);
  g.members = members();
  g.group_rank = group_rank;
  last_group_ = &groups_.emplace(g.name, std::move(g)).first->second;
}

RecordedGroup* FlightRecorder::group_named(std::string_view name) {
  if (last_group_ != nullptr && last_group_->name == name) return last_group_;
  auto it = groups_.find(name);
  if (it == groups_.end()) return nullptr;
  last_group_ = &it->second;  // map nodes stay put, and groups_ never erases
  return last_group_;
}

std::size_t FlightRecorder::begin(const Call& call) {
  const std::size_t slot = static_cast<std::size_t>((next_id_ - 1) % ring_.size());
  FlightRecord& r = ring_[slot];
  r.id = next_id_++;
  r.group.assign(call.group);  // reuses the slot's buffer: no allocation in steady state
  r.group_rank = call.rank;
  r.group_size = call.group_size;
  r.op = call.op;
  r.seq = call.seq;
  r.dtype = call.dtype;
  r.numel = !call.inputs.empty()    ? call.inputs[0].numel()
            : !call.outputs.empty() ? call.outputs[0].numel()
                                    : 0;
  r.root = call.root;
  r.tag = call.tag;
  r.reduce_op = call.reduce_op;
  r.bytes_sent = call.bytes_sent;
  r.bytes_received = call.bytes_received;
  r.state = FlightRecord::State::Issued;
  r.start_s = now_s();
  r.duration_s = 0;
  r.caller = call.caller;
  if (detailed_) {
    copy_shapes(call.inputs, r.input_shapes);
    copy_shapes(call.outputs, r.output_shapes);
    r.input_splits = call.input_splits;
    r.output_splits = call.output_splits;
    r.color = call.color;
    r.key = call.key;
    r.members = call.members;
    r.members_are_ranks = call.members_are_ranks;
    r.backward_of = call.backward_of;
    if (RecordedGroup* g = group_named(call.group)) {
      const bool p2p = call.op == OpType::Send || call.op == OpType::Recv;
      (p2p ? g->p2p_calls : g->calls) = call.seq + 1;
    }
  }
  return slot;
}

void FlightRecorder::end(std::size_t slot, FlightRecord::State state) {
  FlightRecord& r = ring_[slot];
  r.state = state;
  r.duration_s = now_s() - r.start_s;
}

std::vector<FlightRecord> FlightRecorder::records() const {
  std::vector<FlightRecord> out;
  const uint64_t calls = next_id_ - 1;
  const uint64_t cap = ring_.size();
  const uint64_t first = calls > cap ? calls - cap : 0;
  for (uint64_t id = first; id < calls; ++id) out.push_back(ring_[id % cap]);
  return out;
}

std::vector<RecordedGroup> FlightRecorder::groups() const {
  std::vector<RecordedGroup> out;
  for (const auto& [name, g] : groups_) out.push_back(g);
  return out;
}

std::string FlightRecorder::dump() const {
  auto recs = records();
  if (recs.size() > kTextEntries)
    recs.erase(recs.begin(), recs.end() - static_cast<std::ptrdiff_t>(kTextEntries));
  std::string s =
      fmt::format("flight recorder: last {} call(s) of this rank, oldest first\n", recs.size());
  for (const auto& r : recs) {
    s += fmt::format("  #{} {} #{} on '{}'", r.id, op_cstr(r.op), r.seq, r.group);
    if (r.op != OpType::Barrier && r.op != OpType::NewGroup)
      s += fmt::format(" {} numel={}", dtype_name(r.dtype), r.numel);
    if (r.root >= 0) s += fmt::format(" root={}", r.root);
    if (r.op == OpType::AllReduce || r.op == OpType::Reduce || r.op == OpType::ReduceScatter ||
        r.op == OpType::ReduceScatterSingle || r.op == OpType::ReduceScatterV)
      s += fmt::format(" op={}", reduce_op_name(r.reduce_op));
    s += fmt::format(" sent={}B received={}B: {}", r.bytes_sent, r.bytes_received,
                     state_name(r.state));
    if (r.state != FlightRecord::State::Issued)
      s += fmt::format(" ({:.1f} us)", r.duration_s * 1e6);
    if (r.caller) s += " at " + r.caller.str();
    s += "\n";
  }
  return s;
}

std::string FlightRecorder::dump(const std::string& dir) const {
  if (!detailed_)
    raise(fmt::format("FlightRecorder::dump('{}')", dir),
          fmt::format("this is a simulated world's recorder, which keeps no shapes, splits, groups "
                      "or global rank, so its dump could not be replayed; dump() without a "
                      "directory (str() in Python) gives its last {} calls as text (production "
                      "recorders: MPI, NCCL, the torch transport, write dumps)",
                      kTextEntries));
  return write_flight_dump(snapshot_flight_dump(*this), dir);
}

void FlightRecorder::dump_on_error() const noexcept {
  if (dump_dir_.empty()) return;
  try {
    (void)dump(dump_dir_);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "diffcomm: flight recorder dump failed: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "diffcomm: flight recorder dump failed\n");
  }
}

}  // namespace diffcomm::dist
