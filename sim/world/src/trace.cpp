// The simulated world's trace: records, hash, name interning, expansion to
// TraceEvents, Chrome trace-event JSON, and the cost model that times it.
#include "trace.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <nlohmann/json.hpp>

#include "world_impl.hpp"

namespace diffcomm::sim {

using detail::Rendezvous;
using detail::SimGroup;
using dist::Call;
using dist::OpType;

namespace {
// FNV-1a powers of the prime: kFnvPow[k] = prime^k (mod 2^64).
constexpr std::array<uint64_t, 9> kFnvPow = [] {
  std::array<uint64_t, 9> p{};
  p[0] = 1;
  for (std::size_t k = 1; k < p.size(); ++k) p[k] = p[k - 1] * 1099511628211ull;
  return p;
}();
}  // namespace

template <class F>
void World::Impl::for_each_trace_event(F&& f) const {
  for (std::size_t k = 0; k < trace_calls.size(); ++k) {
    const std::size_t end =
        k + 1 < trace_calls.size() ? trace_calls[k + 1].first : trace_members.size();
    for (std::size_t m = trace_calls[k].first; m < end; ++m) f(trace_calls[k], trace_members[m]);
  }
}

void World::Impl::hash(uint64_t v) {
  // FNV-1a over 8 bytes. The zero high bytes of a small value (call
  // numbers, slots, characters) only multiply (h ^ 0 == h): one
  // multiplication by a power of the prime, the same hash in a fraction of
  // the steps (it was eight rounds per character of every op name).
  int i = 0;
  for (; i < 8 && (v >> (8 * i)) != 0; ++i) {
    trace_hash ^= (v >> (8 * i)) & 0xFF;
    trace_hash *= 1099511628211ull;
  }
  trace_hash *= kFnvPow[static_cast<std::size_t>(8 - i)];
}

void World::Impl::hash(const char* s) {
  for (; *s != 0; ++s) hash(static_cast<uint64_t>(static_cast<unsigned char>(*s)));
}

void World::Impl::hash_completion(const Rendezvous& rv) {
  hash(rv.group->id);
  hash(rv.calls[0]->seq);
  hash(dist::op_cstr(rv.calls[0]->op));  // same bytes as op_name, no allocation
  for (int slot : rv.arrival_order) hash(static_cast<uint64_t>(slot));
}

void World::Impl::record_trace(const Rendezvous& rv) {
  for (std::size_t i = 0; i < rv.calls.size(); ++i) {
    const Call& c = *rv.calls[i];
    // A new record where a member's op or call number differs from the one
    // before (a send/recv pair: "send" and "recv", each its own number).
    const Call& prev = *rv.calls[i == 0 ? 0 : i - 1];
    if (i == 0 || c.op != prev.op || c.seq != prev.seq)
      trace_calls.push_back({c.op, intern_trace_name(*rv.group, c.group), c.seq, rv.start_us,
                             rv.end_us - rv.start_us, trace_members.size()});
    trace_members.push_back({rv.globals[i], c.bytes_sent, c.bytes_received});
  }
}

uint32_t World::Impl::intern_trace_name(SimGroup& g, std::string_view name) {
  // Members name their group alike in practice; compare, not assume.
  if (g.trace_name < trace_names.size() && trace_names[g.trace_name] == name) return g.trace_name;
  const auto it = std::find(trace_names.begin(), trace_names.end(), name);
  g.trace_name = static_cast<uint32_t>(it - trace_names.begin());
  if (it == trace_names.end()) trace_names.emplace_back(name);
  return g.trace_name;
}

const std::vector<TraceEvent>& World::Impl::expanded_trace() const {
  if (trace_stale) {
    trace_expanded.clear();
    trace_expanded.reserve(trace_members.size());
    for_each_trace_event([&](const TraceCall& c, const TraceMember& m) {
      trace_expanded.push_back({dist::op_cstr(c.op), trace_names[c.group], c.seq, m.rank,
                                c.start_us, c.duration_us, m.bytes_sent, m.bytes_received});
    });
    trace_stale = false;
  }
  return trace_expanded;
}

double World::Impl::cost_us(const Rendezvous& rv) const {
  const auto n = static_cast<double>(rv.calls.size());
  if (rv.calls.size() <= 1 && rv.calls[0]->op != OpType::Send) return 0.0;
  const OpType op = rv.calls[0]->op;
  if (op == OpType::NewGroup) return 0.0;
  double steps = n - 1;
  if (op == OpType::AllReduce) steps = 2 * (n - 1);
  if (op == OpType::Send || op == OpType::Recv) steps = 1;
  uint64_t bytes = 0;
  for (const Call* c : rv.calls) bytes = std::max({bytes, c->bytes_sent, c->bytes_received});
  return options.cost.alpha_us * steps +
         static_cast<double>(bytes) / (options.cost.bandwidth_gbps * 1e3);
}

void World::write_trace(const std::string& path) const {
  nlohmann::json events = nlohmann::json::array();
  for (std::size_t r = 0; r < impl_->ranks.size(); ++r)
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 0},
                      {"tid", r},
                      {"args", {{"name", fmt::format("rank {}", r)}}}});
  impl_->for_each_trace_event([&](const Impl::TraceCall& c, const Impl::TraceMember& m) {
    events.push_back({{"name", dist::op_cstr(c.op)},
                      {"cat", impl_->trace_names[c.group]},
                      {"ph", "X"},
                      {"pid", 0},
                      {"tid", m.rank},
                      {"ts", c.start_us},
                      {"dur", c.duration_us},
                      {"args",
                       {{"group", impl_->trace_names[c.group]},
                        {"seq", c.seq},
                        {"bytes_sent", m.bytes_sent},
                        {"bytes_received", m.bytes_received}}}});
  });
  std::ofstream out(path);
  if (!out) raise("write_trace", fmt::format("cannot open '{}' for writing", path));
  out << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ns"}}.dump(
             -1, ' ', false, nlohmann::json::error_handler_t::replace)
      << "\n";
  out.flush();  // a full disk (/dev/full) shows only here
  if (!out) raise("write_trace", fmt::format("cannot write '{}'", path));
}

}  // namespace diffcomm::sim
