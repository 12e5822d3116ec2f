#include "diffcomm/dist/flight_recorder.hpp"

#include <fmt/format.h>

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
}  // namespace

FlightRecorder::FlightRecorder() : ring_(kCapacity), origin_(std::chrono::steady_clock::now()) {}

FlightRecorder::FlightRecorder(Clock clock, const void* context)
    : ring_(kCapacity), clock_(clock), context_(context) {}

double FlightRecorder::now_s() const {
  if (clock_ != nullptr) return clock_(context_);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - origin_).count();
}

std::size_t FlightRecorder::begin(const Call& call) {
  const std::size_t slot = static_cast<std::size_t>((next_id_ - 1) % kCapacity);
  FlightRecord& r = ring_[slot];
  r.id = next_id_++;
  r.group.assign(call.group);  // reuses the slot's buffer: no allocation in steady state
  r.op = call.op;
  r.seq = call.seq;
  r.dtype = call.dtype;
  r.numel = !call.inputs.empty()    ? call.inputs[0].numel()
            : !call.outputs.empty() ? call.outputs[0].numel()
                                    : 0;
  r.root = call.root;
  r.reduce_op = call.reduce_op;
  r.bytes_sent = call.bytes_sent;
  r.bytes_received = call.bytes_received;
  r.state = FlightRecord::State::Issued;
  r.start_s = now_s();
  r.duration_s = 0;
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
  const uint64_t first = calls > kCapacity ? calls - kCapacity : 0;
  for (uint64_t id = first; id < calls; ++id) out.push_back(ring_[id % kCapacity]);
  return out;
}

std::string FlightRecorder::dump() const {
  const auto recs = records();
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
    s += "\n";
  }
  return s;
}

}  // namespace diffcomm::dist
