#include "diffcomm/dist/flight_dump.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "diffcomm/error.hpp"

namespace diffcomm::dist {
namespace {
using nlohmann::json;

constexpr const char* kFormat = "diffcomm-flight-recorder";
constexpr OpType kLastOp = OpType::NewGroup;
constexpr const char* kReduceKinds[] = {"sum", "avg", "product", "min", "max", "premul_sum"};

const char* state_str(FlightRecord::State s) {
  switch (s) {
    case FlightRecord::State::Issued: return "issued";
    case FlightRecord::State::Completed: return "completed";
    case FlightRecord::State::Failed: return "failed";
  }
  return "?";
}

bool is_p2p(OpType op) { return op == OpType::Send || op == OpType::Recv; }

json entry_json(const FlightRecord& r) {
  json e = {{"id", r.id},
            {"group", r.group},
            {"group_rank", r.group_rank},
            {"group_size", r.group_size},
            {"call", r.seq},
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
            {"backward_of", nullptr},
            {"state", state_str(r.state)},
            {"start_s", r.start_s},
            {"duration_s", r.duration_s},
            {"bytes_sent", r.bytes_sent},
            {"bytes_received", r.bytes_received}};
  if (r.backward_of)
    e["backward_of"] = {{"op", op_cstr(r.backward_of->op)}, {"call", r.backward_of->seq}};
  return e;
}

// Reading: every failure names the file and where (entry k, field f).
struct Reader {
  const std::string& file;
  std::string where;

  [[noreturn]] void fail(const std::string& what) const {
    throw InvalidArgument(fmt::format("{}: {}{}", file, where, what));
  }
  template <class T>
  T get(const json& obj, const char* field) const {
    auto it = obj.find(field);
    if (it == obj.end()) fail(fmt::format("missing field '{}'", field));
    try {
      return it->get<T>();
    } catch (const json::exception&) {
      fail(fmt::format("field '{}' has the wrong type ({})", field, it->type_name()));
    }
  }
  OpType op(const std::string& name) const {
    for (int i = 0; i <= static_cast<int>(kLastOp); ++i)
      if (op_name(static_cast<OpType>(i)) == name) return static_cast<OpType>(i);
    fail(fmt::format("unknown op '{}'", name));
  }
  DType dtype(const std::string& name) const {
    try {
      return parse_dtype(name);
    } catch (const InvalidArgument&) {
      fail(fmt::format("unknown dtype '{}'", name));
    }
  }
  ReduceOp reduce(const std::string& name, double factor) const {
    for (uint8_t k = 0; k < std::size(kReduceKinds); ++k)
      if (name == kReduceKinds[k]) {
        const auto kind = static_cast<ReduceOp::Kind>(k);
        return kind == ReduceOp::PremulSum ? ReduceOp::premul_sum(factor) : ReduceOp(kind);
      }
    fail(fmt::format("unknown reduce op '{}'", name));
  }
  FlightRecord::State state(const std::string& name) const {
    if (name == "issued") return FlightRecord::State::Issued;
    if (name == "completed") return FlightRecord::State::Completed;
    if (name == "failed") return FlightRecord::State::Failed;
    fail(fmt::format("unknown state '{}'", name));
  }
};

FlightRecord parse_entry(const json& e, const Reader& rd) {
  if (!e.is_object()) rd.fail("is not an object");
  FlightRecord r;
  r.id = rd.get<uint64_t>(e, "id");
  r.group = rd.get<std::string>(e, "group");
  r.group_rank = rd.get<int>(e, "group_rank");
  r.group_size = rd.get<int>(e, "group_size");
  r.seq = rd.get<uint64_t>(e, "call");
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
  if (!b.is_null())
    r.backward_of = CallId{rd.op(rd.get<std::string>(b, "op")), rd.get<uint64_t>(b, "call")};
  r.state = rd.state(rd.get<std::string>(e, "state"));
  r.start_s = rd.get<double>(e, "start_s");
  r.duration_s = rd.get<double>(e, "duration_s");
  r.bytes_sent = rd.get<uint64_t>(e, "bytes_sent");
  r.bytes_received = rd.get<uint64_t>(e, "bytes_received");
  return r;
}

DumpedGroup parse_group(const json& g, const Reader& rd) {
  DumpedGroup d;
  d.group.name = rd.get<std::string>(g, "name");
  d.group.members = rd.get<std::vector<int>>(g, "members");
  d.group.group_rank = rd.get<int>(g, "group_rank");
  d.group.calls = rd.get<uint64_t>(g, "calls");
  d.group.p2p_calls = rd.get<uint64_t>(g, "p2p_calls");
  d.watermark = rd.get<uint64_t>(g, "watermark");
  d.p2p_watermark = rd.get<uint64_t>(g, "p2p_watermark");
  return d;
}
}  // namespace

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
      uint64_t& w = is_p2p(r.op) ? dg.p2p_watermark : dg.watermark;
      w = std::min(w, r.seq);
    }
    dg.group = std::move(g);
    d.groups.push_back(std::move(dg));
  }
  return d;
}

std::string flight_dump_json(const FlightDump& d) {
  json groups = json::array();
  for (const DumpedGroup& g : d.groups)
    groups.push_back({{"name", g.group.name},
                      {"members", g.group.members},
                      {"group_rank", g.group.group_rank},
                      {"calls", g.group.calls},
                      {"p2p_calls", g.group.p2p_calls},
                      {"watermark", g.watermark},
                      {"p2p_watermark", g.p2p_watermark}});
  json entries = json::array();
  for (const FlightRecord& r : d.entries) entries.push_back(entry_json(r));
  const json doc = {{"format", kFormat},
                    {"version", d.version},
                    {"rank", d.rank},
                    {"world_size", d.world_size},
                    {"capacity", d.capacity},
                    {"groups", std::move(groups)},
                    {"entries", std::move(entries)}};
  return doc.dump() + "\n";
}

FlightDump parse_flight_dump(std::string_view text, const std::string& file) {
  json doc;
  try {
    doc = json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    // e.byte counts the characters read (1-based); the offset is 0-based.
    const std::size_t offset = e.byte > 0 ? e.byte - 1 : 0;
    if (offset >= text.size())
      throw InvalidArgument(
          fmt::format("{}: byte offset {}: truncated (the file ends there)", file, text.size()));
    throw InvalidArgument(fmt::format("{}: byte offset {}: not valid JSON", file, offset));
  }
  Reader rd{file, ""};
  if (!doc.is_object() || doc.value("format", std::string()) != kFormat)
    rd.fail(fmt::format("not a diffcomm flight recorder dump (no \"format\": \"{}\")", kFormat));
  FlightDump d;
  d.version = rd.get<int>(doc, "version");
  if (d.version != kFlightDumpVersion)
    rd.fail(fmt::format("format version {} (this build reads {})", d.version, kFlightDumpVersion));
  d.rank = rd.get<int>(doc, "rank");
  d.world_size = rd.get<int>(doc, "world_size");
  d.capacity = rd.get<std::size_t>(doc, "capacity");
  const json groups = rd.get<json>(doc, "groups");
  const json entries = rd.get<json>(doc, "entries");
  if (!groups.is_array() || !entries.is_array()) rd.fail("'groups' and 'entries' must be arrays");
  for (std::size_t i = 0; i < groups.size(); ++i) {
    rd.where = fmt::format("groups[{}]: ", i);
    d.groups.push_back(parse_group(groups[i], rd));
  }
  for (std::size_t i = 0; i < entries.size(); ++i) {
    rd.where = fmt::format("entries[{}]: ", i);
    d.entries.push_back(parse_entry(entries[i], rd));
  }
  return d;
}

std::string write_flight_dump(const FlightDump& dump, const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw InvalidArgument(
        fmt::format("flight recorder dump: cannot create directory '{}': {}", dir, ec.message()));
  const fs::path path = fs::path(dir) / fmt::format("rank-{}.json", dump.rank);
  const fs::path tmp = fs::path(path).concat(".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << flight_dump_json(dump);
    out.flush();
    if (!out)
      throw InvalidArgument(fmt::format("flight recorder dump: cannot write '{}'", tmp.string()));
  }
  fs::rename(tmp, path, ec);
  if (ec)
    throw InvalidArgument(fmt::format("flight recorder dump: cannot rename '{}' to '{}': {}",
                                      tmp.string(), path.string(), ec.message()));
  return path.string();
}

FlightDump read_flight_dump(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidArgument(fmt::format("{}: cannot open", path));
  std::ostringstream s;
  s << in.rdbuf();
  return parse_flight_dump(s.str(), path);
}

}  // namespace diffcomm::dist
