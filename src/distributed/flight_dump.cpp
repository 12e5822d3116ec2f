#include "diffcomm/distributed/flight_dump.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "diffcomm/tensor/error.hpp"
#include "flight_dump_fields.hpp"

namespace diffcomm::dist {
namespace dump_fields {
using nlohmann::json;

namespace {
constexpr OpType kLastOp = OpType::NewGroup;
constexpr const char* kReduceKinds[] = {"sum", "avg", "product", "min", "max", "premul_sum"};

// first, step, count when `m` is an arithmetic progression of 3 or more.
std::optional<std::array<int, 3>> as_range(const std::vector<int>& m) {
  if (m.size() < 3) return std::nullopt;
  const int64_t step = int64_t{m[1]} - m[0];
  for (std::size_t i = 2; i < m.size(); ++i)
    if (int64_t{m[i]} - m[i - 1] != step) return std::nullopt;
  return std::array<int, 3>{m[0], static_cast<int>(step), static_cast<int>(m.size())};
}
}  // namespace

OpType Reader::op(const std::string& name) const {
  for (int i = 0; i <= static_cast<int>(kLastOp); ++i)
    if (op_name(static_cast<OpType>(i)) == name) return static_cast<OpType>(i);
  raise(file, where + fmt::format("unknown op '{}'", name));
}
DType Reader::dtype(const std::string& name) const {
  try {
    return parse_dtype(name);
  } catch (const InvalidArgument&) {
    raise(file, where + fmt::format("unknown dtype '{}'", name));
  }
}
ReduceOp Reader::reduce(const std::string& name, double factor) const {
  for (uint8_t k = 0; k < std::size(kReduceKinds); ++k)
    if (name == kReduceKinds[k]) {
      const auto kind = static_cast<ReduceOp::Kind>(k);
      return kind == ReduceOp::PremulSum ? ReduceOp::premul_sum(factor) : ReduceOp(kind);
    }
  raise(file, where + fmt::format("unknown reduce op '{}'", name));
}
FlightRecord::State Reader::state(const std::string& name) const {
  if (name == "issued") return FlightRecord::State::Issued;
  if (name == "completed") return FlightRecord::State::Completed;
  if (name == "failed") return FlightRecord::State::Failed;
  raise(file, where + fmt::format("unknown state '{}'", name));
}

json group_json(const DumpedGroup& g) {
  json j = {{"name", g.group.name},     {"group_rank", g.group.group_rank},
            {"calls", g.group.calls},   {"p2p_calls", g.group.p2p_calls},
            {"watermark", g.watermark}, {"p2p_watermark", g.p2p_watermark}};
  if (const auto r = as_range(g.group.members))
    j["member_range"] = *r;
  else
    j["members"] = g.group.members;
  return j;
}

DumpedGroup parse_group(const json& g, const Reader& rd) {
  DumpedGroup d;
  d.group.name = rd.get<std::string>(g, "name");
  if (g.contains("member_range")) {
    const auto r = rd.get<std::array<int, 3>>(g, "member_range");
    if (r[2] < 0 || r[2] > 1 << 20)
      raise(rd.file, rd.where + fmt::format("member_range count {} out of range", r[2]));
    for (int i = 0; i < r[2]; ++i) d.group.members.push_back(r[0] + i * r[1]);
  } else {
    d.group.members = rd.get<std::vector<int>>(g, "members");
  }
  d.group.group_rank = rd.get<int>(g, "group_rank");
  d.group.calls = rd.get<uint64_t>(g, "calls");
  d.group.p2p_calls = rd.get<uint64_t>(g, "p2p_calls");
  d.watermark = rd.get<uint64_t>(g, "watermark");
  d.p2p_watermark = rd.get<uint64_t>(g, "p2p_watermark");
  return d;
}

json desc_json(const FlightRecord& r) {
  json e = {{"group", r.group},
            {"group_rank", r.group_rank},
            {"group_size", r.group_size},
            {"op", op_cstr(r.op)},
            {"dtype", dtype_name(r.dtype)},
            {"numel", r.numel},
            {"input_shapes", r.input_shapes},
            {"output_shapes", r.output_shapes},
            {"input_splits", r.input_splits.to_vector()},
            {"output_splits", r.output_splits.to_vector()},
            {"root", r.root},
            {"tag", r.tag},
            {"reduce_op", kReduceKinds[r.reduce_op.kind()]},
            {"reduce_factor", r.reduce_op.factor()},
            {"color", r.color},
            {"key", r.key},
            {"members", r.members},
            {"members_are_ranks", r.members_are_ranks},
            {"backward_of", nullptr}};
  if (r.backward_of) e["backward_of"] = {{"op", op_cstr(r.backward_of->op)}};
  if (r.caller) e["caller"] = {{"file", r.caller.file}, {"line", r.caller.line}};
  return e;
}

FlightRecord parse_desc(const json& e, const Reader& rd) {
  if (!e.is_object()) raise(rd.file, rd.where + "is not an object");
  FlightRecord r;
  r.group = rd.get<std::string>(e, "group");
  r.group_rank = rd.get<int>(e, "group_rank");
  r.group_size = rd.get<int>(e, "group_size");
  r.op = rd.op(rd.get<std::string>(e, "op"));
  r.dtype = rd.dtype(rd.get<std::string>(e, "dtype"));
  r.numel = rd.get<int64_t>(e, "numel");
  r.input_shapes = rd.get<std::vector<Shape>>(e, "input_shapes");
  r.output_shapes = rd.get<std::vector<Shape>>(e, "output_shapes");
  r.input_splits = SplitList(rd.get<std::vector<int64_t>>(e, "input_splits"));
  r.output_splits = SplitList(rd.get<std::vector<int64_t>>(e, "output_splits"));
  r.root = rd.get<int>(e, "root");
  r.tag = rd.get<int>(e, "tag");
  r.reduce_op = rd.reduce(rd.get<std::string>(e, "reduce_op"), rd.get<double>(e, "reduce_factor"));
  r.color = rd.get<int>(e, "color");
  r.key = rd.get<int>(e, "key");
  r.members = rd.get<std::vector<int64_t>>(e, "members");
  r.members_are_ranks = rd.get<bool>(e, "members_are_ranks");
  const json b = rd.get<json>(e, "backward_of");
  if (!b.is_null()) r.backward_of = CallId{rd.op(rd.get<std::string>(b, "op")), 0};
  if (e.contains("caller")) {  // optional: absent when unknown, and in older dumps
    const json c = rd.get<json>(e, "caller");
    r.caller.file = intern_file(rd.get<std::string>(c, "file"));
    r.caller.line = rd.get<uint32_t>(c, "line");
  }
  return r;
}

namespace {
FlightRecord parse_v1_entry(const json& e, const Reader& rd) {
  FlightRecord r = parse_desc(e, rd);
  r.id = rd.get<uint64_t>(e, "id");
  r.seq = rd.get<uint64_t>(e, "call");
  if (r.backward_of) r.backward_of->seq = rd.get<uint64_t>(e["backward_of"], "call");
  r.state = rd.state(rd.get<std::string>(e, "state"));
  r.start_s = rd.get<double>(e, "start_s");
  r.duration_s = rd.get<double>(e, "duration_s");
  r.bytes_sent = rd.get<uint64_t>(e, "bytes_sent");
  r.bytes_received = rd.get<uint64_t>(e, "bytes_received");
  return r;
}
}  // namespace

FlightDump parse_v1(const json& doc, Reader& rd) {
  FlightDump d;
  d.version = 1;
  d.rank = rd.get<int>(doc, "rank");
  d.world_size = rd.get<int>(doc, "world_size");
  d.capacity = rd.get<std::size_t>(doc, "capacity");
  const json groups = rd.get<json>(doc, "groups");
  const json entries = rd.get<json>(doc, "entries");
  if (!groups.is_array() || !entries.is_array())
    raise(rd.file, rd.where + "'groups' and 'entries' must be arrays");
  for (std::size_t i = 0; i < groups.size(); ++i) {
    rd.where = fmt::format("groups[{}]: ", i);
    d.groups.push_back(parse_group(groups[i], rd));
  }
  for (std::size_t i = 0; i < entries.size(); ++i) {
    rd.where = fmt::format("entries[{}]: ", i);
    d.entries.push_back(parse_v1_entry(entries[i], rd));
  }
  return d;
}
bool is_p2p(OpType op) { return op == OpType::Send || op == OpType::Recv; }
}  // namespace dump_fields

FlightDump snapshot_flight_dump(const FlightRecorder& recorder) {
  FlightDump d;
  d.rank = recorder.global_rank();
  d.world_size = recorder.world_size();
  d.capacity = recorder.capacity();
  d.entries = recorder.records();
  for (RecordedGroup& g : recorder.groups()) {
    DumpedGroup dg;
    dg.watermark = g.calls;
    dg.p2p_watermark = g.p2p_calls;
    for (const FlightRecord& r : d.entries) {
      if (r.group != g.name) continue;
      uint64_t& w = dump_fields::is_p2p(r.op) ? dg.p2p_watermark : dg.watermark;
      w = std::min(w, r.seq);
    }
    dg.group = std::move(g);
    d.groups.push_back(std::move(dg));
  }
  return d;
}

std::string flight_dump_json(const FlightDump& d) {
  using nlohmann::json;
  const CompactFlightDump c = compact(d);
  json groups = json::array();
  for (const DumpedGroup& g : c.groups) groups.push_back(dump_fields::group_json(g));
  json calls = json::array();
  for (const FlightRecord& r : c.calls) calls.push_back(dump_fields::desc_json(r));
  json header = {{"format", dump_fields::kFormat},
                 {"version", kFlightDumpVersion},
                 {"rank", c.rank},
                 {"world_size", c.world_size},
                 {"capacity", c.capacity},
                 {"groups", std::move(groups)},
                 {"calls", std::move(calls)},
                 {"columns",
                  {"id", "call_index", "call", "state", "backward_call", "start_ns", "duration_ns",
                   "bytes_sent", "bytes_received"}}};
  // The header, then one row per line: "entries" is the last key, and no
  // string follows its name (what parse_compact_flight_dump relies on).
  std::string text = header.dump(-1, ' ', false, json::error_handler_t::replace);
  text.pop_back();  // the header's closing brace
  text += ",\"entries\":[";
  for (std::size_t i = 0; i < c.rows.size(); ++i) {
    const CompactFlightDump::Row& w = c.rows[i];
    fmt::format_to(std::back_inserter(text), "{}\n[{},{},{},{},{},{},{},{},{}]", i ? "," : "", w.id,
                   w.call_index, w.seq, static_cast<int>(w.state), w.backward_call, w.start_ns,
                   w.duration_ns, w.bytes_sent, w.bytes_received);
  }
  text += "]}\n";
  return text;
}

FlightDump parse_flight_dump(std::string_view text, const std::string& file) {
  return expand(parse_compact_flight_dump(text, file));
}

std::string write_flight_dump(const FlightDump& dump, const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    raise("flight recorder dump",
          fmt::format("cannot create directory '{}': {}", dir, ec.message()));
  const fs::path path = fs::path(dir) / fmt::format("rank-{}.json", dump.rank);
  const fs::path tmp = fs::path(path).concat(".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << flight_dump_json(dump);
    out.flush();
    if (!out) raise("flight recorder dump", fmt::format("cannot write '{}'", tmp.string()));
  }
  fs::rename(tmp, path, ec);
  if (ec)
    raise("flight recorder dump",
          fmt::format("cannot rename '{}' to '{}': {}", tmp.string(), path.string(), ec.message()));
  return path.string();
}

std::string read_dump_file(const std::string& path) {
  namespace fs = std::filesystem;
  // A dump is a regular file. Anything else is refused before it is opened:
  // opening a FIFO blocks until a writer comes (replay hung), and a directory
  // opens but has no size (its -1 became a 2^64-byte buffer: std::bad_alloc).
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!ec && fs::exists(st) && !fs::is_regular_file(st))
    raise(path, fs::is_directory(st) ? "is a directory, not a dump file"
                                     : "is not a regular file (a FIFO, socket or device), not a "
                                       "dump file");
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) raise(path, "cannot open");
  // One read into a buffer of the file's size (a stream copy moved every
  // byte twice, a tenth of a replay at scale).
  std::string text(static_cast<std::size_t>(in.tellg()), '\0');
  in.seekg(0);
  if (!in.read(text.data(), static_cast<std::streamsize>(text.size()))) raise(path, "cannot read");
  return text;
}

FlightDump read_flight_dump(const std::string& path) {
  return parse_flight_dump(read_dump_file(path), path);
}

}  // namespace diffcomm::dist
