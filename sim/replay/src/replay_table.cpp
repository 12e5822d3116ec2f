// Building a replay's table (replay_table.hpp) from dumps in memory or from a
// dump directory. A directory of diffcomm dumps is read by two threads, each
// parsing whole files into their compact form; only the interning of a
// file's few distinct descriptions and groups is serialised.
#include "replay_table.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <filesystem>
#include <mutex>
#include <thread>

#include "diffcomm/sim/replay.hpp"
#include "diffcomm/sim/torch_flight_dump.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::sim {
namespace detail {
namespace {
namespace fs = std::filesystem;
using dist::FlightRecord;
using dist::OpType;

bool is_p2p(OpType op) { return op == OpType::Send || op == OpType::Recv; }

// What tells two records' descriptions apart (call numbers zero: a step
// holds them).
dist::CallDesc desc_of(const FlightRecord& r) {
  dist::CallDesc d;
  d.op = r.op;
  d.dtype = r.dtype;
  d.root = r.root;
  d.tag = r.tag;
  d.reduce_op = r.reduce_op;
  d.inputs = r.input_shapes;
  d.outputs = r.output_shapes;
  d.input_splits = r.input_splits.to_vector();
  d.output_splits = r.output_splits.to_vector();
  d.members = r.members;
  d.color = r.color;
  d.key = r.key;
  d.members_are_ranks = r.members_are_ranks;
  if (r.backward_of) d.backward_of = dist::CallId{r.backward_of->op, 0};
  return d;
}

// Equal for two records of one group exactly when their descriptions and
// callers are (each rank's pending call keeps its own call site).
std::string call_key(const std::string& group, const dist::CallDesc& d,
                     const dist::Caller& caller) {
  const std::vector<int64_t> words = dist::serialize(d);
  std::string key = group;
  key.push_back('\0');
  key.append(reinterpret_cast<const char*>(words.data()), words.size() * sizeof(int64_t));
  key.push_back('\0');
  key += caller.str();
  return key;
}
}  // namespace

std::string rank_file(const std::string& dir, int rank) {
  return (fs::path(dir) / fmt::format("rank-{}.json", rank)).string();
}

void check_dump_header(int r, int rank, int world_size, int world0,
                       const std::vector<dist::DumpedGroup>& groups, const std::string& file) {
  if (rank != r) raise(file, fmt::format("records rank {}", rank));
  if (world_size != world0)
    raise(file, fmt::format("world size {} but rank-0.json records {}", world_size, world0));
  for (const dist::DumpedGroup& g : groups)
    for (int m : g.group.members)
      if (m < 0 || m >= world_size)
        raise(file, fmt::format("group '{}' has member {} outside the world of {}", g.group.name, m,
                                world_size));
}

const SeenGroup* see_group(std::map<std::string, SeenGroup>& first_seen, const dist::DumpedGroup& g,
                           int r, const std::string& file) {
  const auto [it, fresh] = first_seen.try_emplace(g.group.name, SeenGroup{r, {}});
  if (!fresh) return &it->second;
  std::vector<int> sorted = g.group.members;
  std::sort(sorted.begin(), sorted.end());
  const auto twice = std::adjacent_find(sorted.begin(), sorted.end());
  if (twice != sorted.end()) {
    first_seen.erase(it);
    raise(file, fmt::format("group '{}' lists member {} twice", g.group.name, *twice));
  }
  it->second.members = g.group.members;
  return nullptr;
}

void check_same_members(const dist::DumpedGroup& g, const SeenGroup& seen,
                        const std::string& file) {
  if (g.group.members != seen.members)
    raise(file, fmt::format("group '{}' has members [{}] but rank-{}.json records [{}]",
                            g.group.name, fmt::join(g.group.members, ","), seen.seen_rank,
                            fmt::join(seen.members, ",")));
}

std::vector<uint32_t> Table::intern(const dist::CompactFlightDump& d,
                                    const std::vector<std::string>& what_unknown,
                                    const std::string& file) {
  const auto r = static_cast<std::size_t>(d.rank);
  for (const dist::DumpedGroup& g : d.groups) {
    auto [it, fresh] = group_index.try_emplace(g.group.name, static_cast<uint32_t>(groups.size()));
    if (fresh) {
      TableGroup tg;
      tg.name = g.group.name;
      tg.members = g.group.members;
      tg.watermark.assign(tg.members.size(), 0);
      tg.p2p_watermark.assign(tg.members.size(), 0);
      groups.push_back(std::move(tg));
    }
    TableGroup& tg = groups[it->second];
    auto gr = static_cast<std::size_t>(g.group.group_rank);
    if (gr >= tg.members.size() || tg.members[gr] != d.rank) {  // not as recorded: look
      const auto m = std::find(tg.members.begin(), tg.members.end(), d.rank);
      if (m == tg.members.end())
        raise(file,
              fmt::format("group '{}': rank {} is not among its members", g.group.name, d.rank));
      gr = static_cast<std::size_t>(m - tg.members.begin());
    }
    tg.watermark[gr] = g.watermark;
    tg.p2p_watermark[gr] = g.p2p_watermark;
    group_rank[r].emplace_back(it->second, static_cast<int>(gr));
  }
  std::vector<uint32_t> global(d.calls.size());
  for (std::size_t i = 0; i < d.calls.size(); ++i) {
    const FlightRecord& c = d.calls[i];
    const auto g = group_index.find(c.group);
    if (g == group_index.end())
      raise(file, fmt::format("calls[{}]: group '{}' is not among the dump's groups", i, c.group));
    TableCall tc{c, g->second, is_p2p(c.op)};
    auto [it, fresh] = call_index.try_emplace(call_key(c.group, desc_of(c), c.caller),
                                              static_cast<uint32_t>(calls.size()));
    if (fresh) calls.push_back(std::move(tc));
    global[i] = it->second;
  }
  for (const std::string& u : what_unknown)
    if (std::find(unknown.begin(), unknown.end(), u) == unknown.end()) unknown.push_back(u);
  return global;
}

void Table::fill(const dist::CompactFlightDump& d, const std::vector<uint32_t>& global,
                 const std::string& file) {
  std::vector<Step>& out = steps[static_cast<std::size_t>(d.rank)];
  out.reserve(d.rows.size());
  for (const dist::CompactFlightDump::Row& w : d.rows) {
    if (w.backward_call >= int64_t{UINT32_MAX})
      raise(file, fmt::format("backward call number {} too large", w.backward_call));
    out.push_back({global[w.call_index], static_cast<uint32_t>(w.backward_call + 1), w.seq});
  }
}

void Table::finish() {
  for (TableGroup& g : groups) {
    uint64_t low = UINT64_MAX;
    for (std::size_t i = 0; i < g.members.size(); ++i) {
      g.start = std::max(g.start, g.watermark[i]);
      g.p2p_start = std::max(g.p2p_start, g.p2p_watermark[i]);
      low = std::min(low, g.watermark[i]);
    }
    for (std::size_t i = 0; i < g.members.size(); ++i)
      if (g.watermark[i] > low) g.lost.push_back(g.members[i]);
  }
  call_start.clear();
  for (const TableCall& c : calls) {
    const TableGroup& g = groups[c.group];
    call_start.push_back(c.proto.op == OpType::NewGroup ? UINT64_MAX
                                                        : (c.p2p ? g.p2p_start : g.start));
  }
}

int Table::rank_in(int rank, uint32_t group) const {
  for (const auto& [g, gr] : group_rank[static_cast<std::size_t>(rank)])
    if (g == group) return gr;
  return -1;
}

FlightRecord Table::record(const Step& s) const {
  FlightRecord r = calls[s.call].proto;
  r.seq = s.seq;
  if (r.backward_of) r.backward_of->seq = s.backward_plus1 > 0 ? s.backward_plus1 - 1 : 0;
  return r;
}

namespace {
// Ranks 1..n-1 of a diffcomm dump directory, two at a time; the first
// error in rank order is thrown.
void read_rest(const std::string& dir, Table& table, int world0,
               std::map<std::string, SeenGroup>& first_seen) {
  const int n = table.world_size;
  std::atomic<int> next{1};
  std::mutex lock;
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  auto work = [&] {
    for (int r = next++; r < n; r = next++) {
      try {
        const std::string file = rank_file(dir, r);
        if (!fs::exists(file)) raise(file, fmt::format("missing (the world has {} ranks)", n));
        const dist::CompactFlightDump d =
            dist::parse_compact_flight_dump(dist::read_dump_file(file), file);
        check_dump_header(r, d.rank, d.world_size, world0, d.groups, file);
        // Only the interning holds the lock; members (16384 per file for
        // the world group) are compared and rows converted outside it.
        std::vector<std::pair<const dist::DumpedGroup*, const SeenGroup*>> compare;
        std::vector<uint32_t> global;
        {
          const std::lock_guard<std::mutex> hold(lock);
          for (const dist::DumpedGroup& g : d.groups)
            if (const SeenGroup* seen = see_group(first_seen, g, r, file))
              compare.emplace_back(&g, seen);
          global = table.intern(d, {}, file);
        }
        for (const auto& [g, seen] : compare) check_same_members(*g, *seen, file);
        table.fill(d, global, file);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    }
  };
  std::thread helper(work);
  work();
  helper.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}
}  // namespace
}  // namespace detail

Recording Recording::read(const std::string& dir) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) raise(dir, "not a directory");
  const std::string first = detail::rank_file(dir, 0);
  if (!fs::exists(first)) return of(read_torch_dumps(dir));
  const dist::CompactFlightDump d0 =
      dist::parse_compact_flight_dump(dist::read_dump_file(first), first);
  const int n = d0.world_size;
  if (n < 1 || n > 16384) raise(first, fmt::format("world size {} outside 1..16384", n));
  auto table = std::make_shared<detail::Table>(n);
  std::map<std::string, detail::SeenGroup> first_seen;
  detail::check_dump_header(0, d0.rank, d0.world_size, n, d0.groups, first);
  for (const dist::DumpedGroup& g : d0.groups)
    if (const detail::SeenGroup* seen = detail::see_group(first_seen, g, 0, first))
      detail::check_same_members(g, *seen, first);
  table->add(d0, {}, first);
  detail::read_rest(dir, *table, n, first_seen);
  table->finish();
  Recording rec;
  rec.table_ = std::move(table);
  return rec;
}

Recording Recording::of(const std::vector<dist::FlightDump>& dumps) {
  if (dumps.empty()) raise("replay", "no dumps");
  auto table = std::make_shared<detail::Table>(static_cast<int>(dumps.size()));
  for (std::size_t r = 0; r < dumps.size(); ++r) {
    dist::CompactFlightDump c = dist::compact(dumps[r]);
    c.rank = static_cast<int>(r);  // read_dumps checked it; edits keep it
    table->add(c, dumps[r].unknown, fmt::format("rank {}'s dump", r));
  }
  table->finish();
  Recording rec;
  rec.table_ = std::move(table);
  return rec;
}

int Recording::world_size() const { return table_->world_size; }

}  // namespace diffcomm::sim
