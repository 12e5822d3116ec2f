// The simulated world's trace as recorded, and its hash. World::Impl's
// hashing, name interning, expansion to TraceEvents, write_trace and the
// cost model are in trace.cpp.
#pragma once

#include <cstddef>
#include <cstdint>

#include "diffcomm/distributed/backend/call.hpp"

namespace diffcomm::sim::detail {

// FNV-1a offset basis: trace_hash() of a run that completed no call.
inline constexpr uint64_t kTraceHashSeed = 1469598103934665603ull;

// The trace as recorded: one fixed-size record per collective (op as an
// enum, group name interned, call number, times: the same for every
// member; a send/recv pair gets one per end) and one small entry per member (rank, bytes), so
// recording costs no allocation per event and 24 bytes per rank-arrival (it was two strings, then
// 56 bytes). trace() expands it to TraceEvents once, on demand, in the same order: each
// collective's members in slot order.
struct TraceCall {
  dist::OpType op;
  uint32_t group;  // index into trace_names
  uint64_t seq;
  double start_us, duration_us;
  std::size_t first;  // index of its first TraceMember
};
struct TraceMember {
  int rank;
  uint64_t bytes_sent, bytes_received;
};

}  // namespace diffcomm::sim::detail
