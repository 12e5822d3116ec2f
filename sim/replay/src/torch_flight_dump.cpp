// PyTorch Flight Recorder dumps read as diffcomm flight dumps
// (torch_flight_dump.hpp): load each file (pickle or JSON), settle the world
// size and every group's members across files, then map the entries.
#include "diffcomm/sim/torch_flight_dump.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <stdexcept>
#include <utility>

#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"
#include "unpickle.hpp"

namespace diffcomm::sim {
namespace {
namespace fs = std::filesystem;
using dist::FlightRecord;
using dist::OpType;
using Json = nlohmann::json;

constexpr const char* kWorld = "world";

struct TorchFile {
  std::string path;
  int rank = 0;
  Json data;
  std::string group_name_of(const Json& entry) const;
};

// The group an entry ran on: "world" for torch's default group.
std::string TorchFile::group_name_of(const Json& e) const {
  const Json& pg = e.at("process_group");
  const std::string name = pg.at(0).get<std::string>();
  const std::string desc = pg.size() > 1 ? pg.at(1).get<std::string>() : "";
  return desc == "default_pg" || name == "0" ? kWorld : name;
}

// An integer, checked: nlohmann's own get<int64_t> casts a float such as
// 1e300 to an integer, which is undefined behaviour.
int64_t integer(const Json& v) {
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{INT64_MAX})
    throw std::out_of_range("an integer above 2^63");
  if (!v.is_number_integer())
    throw std::invalid_argument("not an integer: " +
                                v.dump(-1, ' ', false, Json::error_handler_t::replace));
  return v.get<int64_t>();
}

// A number torch wrote as an int (pickle) or a string (JSON's pg_status).
int64_t as_int(const Json& v) {
  return v.is_string() ? std::stoll(v.get<std::string>()) : integer(v);
}

// pg_config's "ranks": "[0, 1]" (a string in every 2.x version) or a list.
std::vector<int> ranks_of(const Json& v) {
  if (v.is_array()) {
    std::vector<int> out;
    for (const Json& m : v) {
      const int64_t x = integer(m);
      if (!std::in_range<int>(x)) throw std::out_of_range("a rank out of range");
      out.push_back(static_cast<int>(x));
    }
    return out;
  }
  std::vector<int> out;
  const std::string s = v.get<std::string>();
  static const std::regex num(R"(-?\d+)");
  for (auto it = std::sregex_iterator(s.begin(), s.end(), num); it != std::sregex_iterator(); ++it)
    out.push_back(std::stoi(it->str()));
  return out;
}

Json load(const std::string& path, int rank) {
  const std::string bytes = dist::read_dump_file(path);  // regular files only
  Json j;
  const bool pickled = !bytes.empty() && static_cast<uint8_t>(bytes[0]) == 0x80;
  if (!pickled && path.ends_with(".pkl"))
    raise(path, bytes.empty() ? std::string("empty (a torch dump .pkl is a pickle)")
                              : fmt::format("not a pickle of protocol 2 or later (its first byte "
                                            "is 0x{:02x}, not 0x80)",
                                            static_cast<uint8_t>(bytes[0])));
  if (pickled) {
    j = detail::unpickle(bytes, path);
  } else {
    try {
      j = Json::parse(bytes);
    } catch (const Json::parse_error& e) {
      // e.byte counts the characters read (1-based); the offset is 0-based.
      raise(path, fmt::format("JSON syntax error at offset {}", e.byte > 0 ? e.byte - 1 : 0));
    } catch (const Json::exception&) {  // out_of_range 406: a number too large for a double
      raise(path, "a JSON number is out of range (too large for a double)");
    }
  }
  if (!j.is_object() || !j.contains("entries") || !j.at("entries").is_array())
    raise(path, fmt::format("not a torch flight recorder dump (no entries list; "
                            "rank {} from its name)",
                            rank));
  return j;
}

// The files <prefix><rank>[.pkl|.json], one prefix, ranks 0..max without gaps.
std::vector<TorchFile> list_files(const std::string& dir) {
  static const std::regex name(R"(^(.*?)(\d{1,6})(\.pkl|\.json)?$)");
  std::map<int, std::string> by_rank;
  std::string prefix;
  for (const auto& f : fs::directory_iterator(dir)) {
    std::smatch m;
    const std::string n = f.path().filename().string();
    if (!f.is_regular_file() || !std::regex_match(n, m, name)) continue;
    if (!by_rank.empty() && m[1] != prefix)
      raise(dir, fmt::format("dumps with two name prefixes, '{}' and '{}'", prefix, m[1].str()));
    prefix = m[1];
    by_rank[std::stoi(m[2])] = f.path().string();
  }
  if (by_rank.empty())
    raise(dir,
          "no flight recorder dumps (rank-<r>.json, or torch's "
          "<prefix><rank>)");
  std::vector<TorchFile> files;
  for (const auto& [r, path] : by_rank) files.push_back({path, r, load(path, r)});
  return files;
}

// One more than the largest rank a file or a pg_config names.
int world_size_of(const std::vector<TorchFile>& files) {
  int top = files.back().rank;
  for (const TorchFile& f : files)
    if (f.data.contains("pg_config"))
      for (const auto& [key, pg] : f.data.at("pg_config").items())
        if (pg.contains("ranks"))
          for (int r : ranks_of(pg.at("ranks"))) top = std::max(top, r);
  return top + 1;
}

void check_no_gap(const std::vector<TorchFile>& files, int world, const std::string& dir) {
  std::set<int> have;
  for (const TorchFile& f : files) have.insert(f.rank);
  const std::string example = fs::path(files.front().path).filename().string();
  for (int r = 0; r < world; ++r)
    if (have.count(r) == 0)
      raise(dir, fmt::format("no dump of rank {} (the world has {} ranks; found e.g. {})", r, world,
                             example));
}

// Every group's members: the world, pg_config where it names the group,
// else the ranks whose dumps record it (listed as unknown).
struct Groups {
  std::map<std::string, std::vector<int>> members;
  std::set<std::string> inferred;
};

Groups groups_of(const std::vector<TorchFile>& files, int world) {
  Groups g;
  std::vector<int> all(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) all[static_cast<std::size_t>(r)] = r;
  g.members[kWorld] = all;
  std::map<std::string, std::set<int>> seen;
  for (const TorchFile& f : files) {
    for (const Json& e : f.data.at("entries")) seen[f.group_name_of(e)].insert(f.rank);
    if (f.data.contains("pg_status"))
      for (const auto& [key, st] : f.data.at("pg_status").items())
        if (key != "0") seen[key].insert(f.rank);
  }
  for (const auto& [name, ranks] : seen) {
    if (name == kWorld) continue;
    for (const TorchFile& f : files)
      if (f.data.contains("pg_config") && f.data.at("pg_config").contains(name))
        g.members[name] = ranks_of(f.data.at("pg_config").at(name).at("ranks"));
    if (g.members.count(name) == 0) {
      g.members[name] = {ranks.begin(), ranks.end()};
      g.inferred.insert(name);
    }
  }
  return g;
}

DType dtype_of(const std::string& torch_name, const std::string& file, std::size_t entry) {
  static const std::map<std::string, DType> names{
      {"Float", DType::Float32}, {"Double", DType::Float64}, {"BFloat16", DType::BFloat16},
      {"Half", DType::Float16},  {"Int", DType::Int32},      {"Long", DType::Int64},
      {"Byte", DType::UInt8}};
  const auto it = names.find(torch_name);
  if (it == names.end())
    raise(file, fmt::format("entry {}: torch dtype '{}' has no diffcomm dtype", entry, torch_name));
  return it->second;
}

// profiling_name "gloo:all_reduce" / "nccl:all_reduce" -> the op; the
// list all_to_all has one input per peer, all_to_all_single one.
OpType op_of(const Json& e, const std::string& file, std::size_t entry) {
  const std::string p = e.at("profiling_name").get<std::string>();
  const std::string op = p.substr(p.find(':') + 1);
  static const std::map<std::string, OpType> ops{
      {"all_reduce", OpType::AllReduce},
      {"allreduce", OpType::AllReduce},
      {"broadcast", OpType::Broadcast},
      {"reduce", OpType::Reduce},
      {"all_gather", OpType::AllGatherSingle},
      {"allgather", OpType::AllGatherSingle},
      {"_allgather_base", OpType::AllGatherSingle},
      {"all_gather_into_tensor", OpType::AllGatherSingle},
      {"gather", OpType::Gather},
      {"scatter", OpType::Scatter},
      {"reduce_scatter", OpType::ReduceScatterSingle},
      {"_reduce_scatter_base", OpType::ReduceScatterSingle},
      {"reduce_scatter_tensor", OpType::ReduceScatterSingle},
      {"all_to_all", OpType::AllToAllSingle},
      {"alltoall", OpType::AllToAllSingle},
      {"alltoall_base", OpType::AllToAllSingle},
      {"barrier", OpType::Barrier},
      {"send", OpType::Send},
      {"recv", OpType::Recv}};
  const auto it = ops.find(op);
  if (it == ops.end())
    raise(file, fmt::format("entry {}: torch op '{}' has no diffcomm equivalent", entry, p));
  if (it->second == OpType::AllToAllSingle && e.at("input_sizes").size() > 1)
    return OpType::AllToAll;
  return it->second;
}

Shape numel_shape(const Json& sizes) {
  int64_t n = 0;
  for (const Json& s : sizes) {
    int64_t k = 1;
    for (const Json& d : s)
      if (__builtin_mul_overflow(k, integer(d), &k)) throw std::out_of_range("a size overflows");
    n += k;
  }
  return {n};
}

std::vector<Shape> shapes_of(const Json& sizes) {
  std::vector<Shape> out;
  for (const Json& s : sizes) {
    Shape shape;
    for (const Json& d : s) shape.push_back(integer(d));
    out.push_back(std::move(shape));
  }
  return out;
}

// The shapes each op is replayed with: torch's where diffcomm's op takes
// them as they are, flattened where torch records the gathered tensor
// stacked, synthesized where only the unknown root holds them.
void set_shapes(FlightRecord& r, const Json& e) {
  const Json& in = e.at("input_sizes");
  const Json& out = e.at("output_sizes");
  const auto n = static_cast<std::size_t>(r.group_size);
  switch (r.op) {
    case OpType::Barrier: return;
    case OpType::AllToAllSingle:
      r.input_shapes = {{0}};
      r.output_shapes = {{0}};
      return;
    case OpType::AllGatherSingle:
    case OpType::ReduceScatterSingle:
      r.input_shapes = {numel_shape(in)};
      r.output_shapes = {numel_shape(out)};
      return;
    case OpType::Gather:
      r.input_shapes = shapes_of(in);
      if (r.group_rank == 0) r.output_shapes.assign(n, r.input_shapes.at(0));
      return;
    case OpType::Scatter:
      r.output_shapes = shapes_of(out);
      if (r.group_rank == 0) r.input_shapes.assign(n, r.output_shapes.at(0));
      return;
    default: r.input_shapes = shapes_of(in); r.output_shapes = shapes_of(out);
  }
}

const char* unknown_of(OpType op) {
  switch (op) {
    case OpType::AllToAllSingle: return "all_to_all_single splits (so its sizes)";
    case OpType::Broadcast:
    case OpType::Gather:
    case OpType::Scatter: return "roots of broadcast, reduce, gather and scatter";
    case OpType::Reduce: return "roots of broadcast, reduce, gather and scatter";
    case OpType::AllReduce:
    case OpType::ReduceScatterSingle: return "reduce ops";
    case OpType::Send:
    case OpType::Recv: return "send/recv peers (point-to-point calls not replayed)";
    default: return nullptr;
  }
}

void note(dist::FlightDump& d, const std::string& what) {
  if (std::find(d.unknown.begin(), d.unknown.end(), what) == d.unknown.end())
    d.unknown.push_back(what);
}

// The last completed collective per group, from pg_status.
std::map<std::string, int64_t> completed_of(const TorchFile& f) {
  std::map<std::string, int64_t> done;
  if (!f.data.contains("pg_status")) return done;
  for (const auto& [key, st] : f.data.at("pg_status").items())
    if (st.contains("last_completed_collective"))
      done[key == "0" ? kWorld : key] = as_int(st.at("last_completed_collective"));
  return done;
}

// The user's call site among an entry's "frames" (torch records them
// innermost first when it keeps stacks: {"name", "filename", "line"}): the
// innermost frame outside torch's own files. None without frames.
dist::Caller user_frame(const Json& e) {
  if (!e.contains("frames") || !e.at("frames").is_array()) return {};
  for (const Json& frame : e.at("frames")) {
    if (!frame.is_object() || !frame.contains("filename") || !frame.at("filename").is_string())
      continue;
    const std::string file = frame.at("filename").get<std::string>();
    if (file.empty() || file.find("/torch/") != std::string::npos) continue;
    const int64_t line = frame.contains("line") ? as_int(frame.at("line")) : 0;
    return {dist::intern_file(file),
            static_cast<uint32_t>(std::clamp<int64_t>(line, 0, UINT32_MAX))};
  }
  return {};
}

FlightRecord record_of(const TorchFile& f, const Json& e, const Groups& groups,
                       const std::map<std::string, int64_t>& completed, std::size_t i) {
  FlightRecord r;
  r.id = i + 1;
  r.group = f.group_name_of(e);
  const std::vector<int>& m = groups.members.at(r.group);
  const auto at = std::find(m.begin(), m.end(), f.rank);
  if (at == m.end())
    raise(f.path,
          fmt::format("entry {}: rank {} is not a member of group '{}'", i, f.rank, r.group));
  r.group_rank = static_cast<int>(at - m.begin());
  r.group_size = static_cast<int>(m.size());
  r.op = op_of(e, f.path, i);
  const int64_t seq = as_int(e.at("collective_seq_id"));
  r.seq = seq > 0 ? static_cast<uint64_t>(seq - 1) : 0;
  for (const char* k : {"input_dtypes", "output_dtypes"})
    if (e.contains(k) && !e.at(k).empty()) {
      r.dtype = dtype_of(e.at(k).at(0).get<std::string>(), f.path, i);
      break;
    }
  r.root = 0;
  set_shapes(r, e);
  r.numel = r.input_shapes.empty() ? 0 : numel_shape(Json(r.input_shapes)).at(0);
  const auto done = completed.find(r.group);
  if (done != completed.end() && seq <= done->second) r.state = FlightRecord::State::Completed;
  r.start_s = static_cast<double>(as_int(e.value("time_created_ns", Json(0)))) * 1e-9;
  r.caller = user_frame(e);
  return r;
}

dist::DumpedGroup& group_entry(std::map<std::string, dist::DumpedGroup>& dumped,
                               const std::string& name, const Groups& groups, int rank) {
  dist::DumpedGroup& g = dumped[name];
  if (g.group.name.empty()) {
    const std::vector<int>& m = groups.members.at(name);
    const auto me = static_cast<int>(std::find(m.begin(), m.end(), rank) - m.begin());
    g.group = {name, m, me, 0, 0};
    g.watermark = UINT64_MAX;
  }
  return g;
}

// A group whose calls all left the ring still counts them in pg_status:
// its watermark is that count (every call of it is unknown here).
void add_status_only_groups(const TorchFile& f, const Groups& groups,
                            std::map<std::string, dist::DumpedGroup>& dumped) {
  if (f.data.contains("pg_status"))
    for (const auto& [key, st] : f.data.at("pg_status").items()) {
      const std::string name = key == "0" ? kWorld : key;
      if (groups.members.count(name) == 0 || !st.contains("last_enqueued_collective")) continue;
      const int64_t n = as_int(st.at("last_enqueued_collective"));
      dist::DumpedGroup& g = group_entry(dumped, name, groups, f.rank);
      g.group.calls = std::max<uint64_t>(g.group.calls, n > 0 ? static_cast<uint64_t>(n) : 0);
    }
  for (auto& [name, g] : dumped) g.watermark = std::min(g.watermark, g.group.calls);
}

// nlohmann's message without its "[json.exception.type_error.302] " tag:
// the reader names the file (and entry) instead.
std::string reason_of(const Json::exception& e) {
  const std::string what = e.what();
  const auto tag_end = what.rfind("] ", what.find(' '));
  return what.rfind("[json.exception.", 0) == 0 && tag_end != std::string::npos
             ? what.substr(tag_end + 2)
             : what;
}

dist::FlightDump dump_of(const TorchFile& f, int world, const Groups& groups) {
  dist::FlightDump d;
  d.rank = f.rank;
  d.world_size = world;
  d.producer = "torch flight recorder " + f.data.value("version", std::string("?"));
  const auto completed = completed_of(f);
  const Json& entries = f.data.at("entries");
  d.capacity = entries.size();
  std::map<std::string, dist::DumpedGroup> dumped;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const Json& e = entries[i];
    FlightRecord r;
    try {
      r = record_of(f, e, groups, completed, i);
    } catch (const Json::exception& x) {
      raise(f.path,
            fmt::format("entry {}: a field is missing or of the wrong type: {}", i, reason_of(x)));
    }
    if (const char* u = unknown_of(r.op)) note(d, u);
    if (groups.inferred.count(r.group) != 0)
      note(d, fmt::format("members of group '{}' (no pg_config entry: taken as the ranks whose "
                          "dumps record it)",
                          r.group));
    if (r.op == OpType::Send || r.op == OpType::Recv) continue;  // no peer: not replayed
    dist::DumpedGroup& g = group_entry(dumped, r.group, groups, f.rank);
    g.group.calls = std::max(g.group.calls, r.seq + 1);
    g.watermark = std::min(g.watermark, r.seq);
    d.entries.push_back(std::move(r));
  }
  add_status_only_groups(f, groups, dumped);
  for (auto& [name, g] : dumped) d.groups.push_back(std::move(g));
  return d;
}
}  // namespace

namespace {
std::vector<dist::FlightDump> dumps_of(const std::vector<TorchFile>& files,
                                       const std::string& dir) {
  const int world = world_size_of(files);
  if (world > kMaxRanks)
    raise(dir, fmt::format("a pg_config names rank {} (at most {} ranks)", world - 1, kMaxRanks));
  check_no_gap(files, world, dir);
  const Groups groups = groups_of(files, world);
  std::vector<dist::FlightDump> dumps;
  for (const TorchFile& f : files) {
    try {
      dumps.push_back(dump_of(f, world, groups));
    } catch (const Json::exception& e) {
      raise(f.path, fmt::format("a field is missing or of the wrong type: {}", reason_of(e)));
    }
  }
  return dumps;
}
}  // namespace

bool is_torch_flight_dump(std::string_view bytes) {
  if (!bytes.empty() && static_cast<uint8_t>(bytes[0]) == 0x80) return true;
  const std::string_view head = bytes.substr(0, 4096);
  return head.find("\"diffcomm-flight-recorder\"") == std::string_view::npos &&
         (head.find("\"pg_config\"") != std::string_view::npos ||
          head.find("\"entries\"") != std::string_view::npos);
}

std::vector<dist::FlightDump> read_torch_dumps(const std::string& dir) {
  if (!fs::is_directory(dir)) raise(dir, "not a directory");
  const std::vector<TorchFile> files = list_files(dir);
  try {
    return dumps_of(files, dir);
  } catch (const Json::exception& e) {  // in pg_config, pg_status or process_group
    raise(dir,
          fmt::format("a torch dump has a field missing or of the wrong type: {}", reason_of(e)));
  } catch (const std::logic_error& e) {  // std::stoll of a number out of range
    raise(dir, fmt::format("a torch dump has a malformed number: {}", e.what()));
  }
}

}  // namespace diffcomm::sim
