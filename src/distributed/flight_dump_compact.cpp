// Version 2's layout of a flight dump (dist/flight_dump.hpp): distinct call
// descriptions plus rows of integers. The rows are scanned here directly
// (std::from_chars), not through a JSON tree: a replay at scale reads 32
// million of them, and a tree of each file's entries costs ten times the scan.
#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>

#include "diffcomm/distributed/flight_dump.hpp"
#include "diffcomm/tensor/error.hpp"
#include "flight_dump_fields.hpp"

namespace diffcomm::dist {
namespace {
using dump_fields::Reader;
using nlohmann::json;

constexpr std::size_t kColumns = 9;
const std::vector<std::string> kColumnNames = {"id",          "call_index",    "call",
                                               "state",       "backward_call", "start_ns",
                                               "duration_ns", "bytes_sent",    "bytes_received"};

int64_t to_ns(double s) { return std::llround(s * 1e9); }

[[noreturn]] void syntax_error(const std::string& file, std::size_t offset, std::size_t size) {
  if (offset >= size)
    raise(file, fmt::format("byte offset {}: truncated (the file ends there)", size));
  raise(file, fmt::format("byte offset {}: not valid JSON", offset));
}

// Arrays and objects nested deeper than this are refused while parsing (a
// dump nests four deep). nlohmann's copy constructor recurses: a call
// description holding a 200000-deep array overflowed the stack when it was
// read, instead of being refused as the wrong type.
constexpr int kMaxNesting = 64;

json parse_nested_at_most(std::string_view text, const std::string& file, bool allow_exceptions) {
  const json::parser_callback_t limit = [&](int depth, json::parse_event_t event, json&) {
    const bool opens =
        event == json::parse_event_t::object_start || event == json::parse_event_t::array_start;
    if (opens && depth >= kMaxNesting)
      raise(file, fmt::format("arrays and objects nest deeper than {}", kMaxNesting));
    return true;
  };
  return json::parse(text.begin(), text.end(), limit, allow_exceptions);
}

json parse_json(std::string_view text, const std::string& file) {
  try {
    return parse_nested_at_most(text, file, /*allow_exceptions=*/true);
  } catch (const json::parse_error& e) {
    // e.byte counts the characters read (1-based); the offset is 0-based.
    syntax_error(file, e.byte > 0 ? e.byte - 1 : 0, text.size());
  } catch (const json::exception&) {  // out_of_range 406: a number too large for a double
    raise(file, "a number is out of range");
  }
}

// Scans "[int,...,int]" rows separated by commas up to the closing "]}".
struct RowScanner {
  std::string_view text;
  std::size_t pos;
  const std::string& file;

  void skip_ws() {
    while (pos < text.size() &&
           (text[pos] == ' ' || text[pos] == '\n' || text[pos] == '\r' || text[pos] == '\t'))
      ++pos;
  }
  void expect(char c) {
    skip_ws();
    if (pos >= text.size() || text[pos] != c) syntax_error(file, pos, text.size());
    ++pos;
  }
  int64_t integer() {
    skip_ws();
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(text.data() + pos, text.data() + text.size(), v);
    if (ec != std::errc()) syntax_error(file, pos, text.size());
    pos = static_cast<std::size_t>(end - text.data());
    return v;
  }
  // A row exactly as the writer puts it ("[1,0,...,9]", no spaces): true
  // and past it, or false with pos unchanged (then read it piece by piece).
  bool strict_row(int64_t (&v)[kColumns]) {
    const char* p = text.data() + pos;
    const char* end = text.data() + text.size();
    if (p == end || *p++ != '[') return false;
    for (std::size_t k = 0; k < kColumns; ++k) {
      const auto [q, ec] = std::from_chars(p, end, v[k]);
      if (ec != std::errc() || q == end || *q != (k + 1 < kColumns ? ',' : ']')) return false;
      p = q + 1;
    }
    pos = static_cast<std::size_t>(p - text.data());
    return true;
  }
  bool next_is(char c) {
    skip_ws();
    return pos < text.size() && text[pos] == c;
  }
};

// Row `index` (named only in an error: formatting it per row was a tenth of
// reading 32 million rows).
CompactFlightDump::Row row_of(const int64_t (&v)[kColumns], std::size_t calls, const Reader& rd,
                              std::size_t index) {
  if (v[0] < 0 || v[1] < 0 || static_cast<uint64_t>(v[1]) >= calls || v[2] < 0 || v[3] < 0 ||
      v[3] > 2 || v[4] < -1 || v[7] < 0 || v[8] < 0)
    raise(rd.file, fmt::format("entries[{}]: a value is out of range (call_index < {}, state "
                               "0..2, backward_call >= -1, others >= 0)",
                               index, calls));
  CompactFlightDump::Row w;
  w.id = static_cast<uint64_t>(v[0]);
  w.call_index = static_cast<uint32_t>(v[1]);
  w.seq = static_cast<uint64_t>(v[2]);
  w.state = static_cast<FlightRecord::State>(v[3]);
  w.backward_call = v[4];
  w.start_ns = v[5];
  w.duration_ns = v[6];
  w.bytes_sent = static_cast<uint64_t>(v[7]);
  w.bytes_received = static_cast<uint64_t>(v[8]);
  return w;
}

void read_header(const json& doc, CompactFlightDump& c, Reader& rd) {
  c.rank = rd.get<int>(doc, "rank");
  c.world_size = rd.get<int>(doc, "world_size");
  c.capacity = rd.get<std::size_t>(doc, "capacity");
  if (rd.get<std::vector<std::string>>(doc, "columns") != kColumnNames)
    raise(rd.file, rd.where + fmt::format("'columns' must be [{}]", fmt::join(kColumnNames, ", ")));
  const json groups = rd.get<json>(doc, "groups");
  const json calls = rd.get<json>(doc, "calls");
  if (!groups.is_array() || !calls.is_array())
    raise(rd.file, rd.where + "'groups' and 'calls' must be arrays");
  for (std::size_t i = 0; i < groups.size(); ++i) {
    rd.where = fmt::format("groups[{}]: ", i);
    c.groups.push_back(dump_fields::parse_group(groups[i], rd));
  }
  for (std::size_t i = 0; i < calls.size(); ++i) {
    rd.where = fmt::format("calls[{}]: ", i);
    c.calls.push_back(dump_fields::parse_desc(calls[i], rd));
  }
  rd.where.clear();
}

// Where version 2's writer put "entries": the offset of the comma before its
// name and of the "[" that opens the rows; nullopt when the text has no
// `,"entries":[`. Those bytes cannot occur inside a JSON string (a quote
// there is escaped), so the first occurrence is a key; the writer makes it
// the top level's last (a file whose first one is nested fails the header
// parse and is read as a tree).
std::optional<std::pair<std::size_t, std::size_t>> entries_key(std::string_view text) {
  constexpr std::string_view key = ",\"entries\":[";
  const std::size_t at = text.find(key);
  if (at == std::string_view::npos) return std::nullopt;
  return std::pair{at, at + key.size() - 1};
}

void scan_rows(RowScanner& s, CompactFlightDump& c, Reader& rd) {
  int64_t v[kColumns];
  if (!s.next_is(']')) {
    do {
      s.skip_ws();
      if (!s.strict_row(v)) {
        s.expect('[');
        for (std::size_t k = 0; k < kColumns; ++k) {
          if (k > 0) s.expect(',');
          v[k] = s.integer();
        }
        s.expect(']');
      }
      c.rows.push_back(row_of(v, c.calls.size(), rd, c.rows.size()));
      if (!s.next_is(',')) break;
      ++s.pos;
    } while (true);
  }
  s.expect(']');
  s.expect('}');
  s.skip_ws();
  if (s.pos != s.text.size()) syntax_error(s.file, s.pos, s.text.size());
  rd.where.clear();
}

// Version 2 through a JSON tree (a file another tool rewrote, say).
void rows_from_tree(const json& doc, CompactFlightDump& c, Reader& rd) {
  const json entries = rd.get<json>(doc, "entries");
  if (!entries.is_array()) raise(rd.file, rd.where + "'entries' must be an array");
  for (std::size_t i = 0; i < entries.size(); ++i) {
    rd.where = fmt::format("entries[{}]: ", i);
    const auto a = rd.get<std::vector<int64_t>>(json{{"row", entries[i]}}, "row");
    if (a.size() != kColumns)
      raise(rd.file, rd.where + fmt::format("{} values, expected {}", a.size(), kColumns));
    int64_t v[kColumns];
    std::copy(a.begin(), a.end(), v);
    c.rows.push_back(row_of(v, c.calls.size(), rd, i));
  }
  rd.where.clear();
}

void check_format(const json& doc, Reader& rd) {
  if (!doc.is_object() || doc.value("format", json()) != dump_fields::kFormat)
    raise(rd.file,
          rd.where + fmt::format("not a diffcomm flight recorder dump (no \"format\": \"{}\")",
                                 dump_fields::kFormat));
  const int version = rd.get<int>(doc, "version");
  if (version != 1 && version != kFlightDumpVersion)
    raise(rd.file, rd.where + fmt::format("format version {} (this build reads 1 and {})", version,
                                          kFlightDumpVersion));
}

// Version 2 as written: the header through a JSON tree, the rows scanned.
// nullopt when the header is not a version 2 header (read as a tree then).
std::optional<CompactFlightDump> parse_as_written(std::string_view text, const std::string& file) {
  const auto key = entries_key(text);
  if (!key) return std::nullopt;
  std::string head(text.substr(0, key->first));
  head += '}';
  json doc;
  try {
    doc = parse_nested_at_most(head, file, /*allow_exceptions=*/false);
  } catch (const json::exception&) {  // a number too large: the tree reports it
    return std::nullopt;
  }
  // Not a version 2 header (or a broken one): the tree names what is wrong.
  if (!doc.is_object() || doc.value("format", json()) != dump_fields::kFormat ||
      doc.value("version", json()) != kFlightDumpVersion)
    return std::nullopt;
  Reader rd{file, ""};
  CompactFlightDump c;
  read_header(doc, c, rd);
  RowScanner s{text, key->second + 1, file};
  scan_rows(s, c, rd);
  return c;
}
// A rank numbers its calls on a group 0, 1, 2, ... in the order it makes
// them (send/recv apart): numbers that go back or repeat mean a corrupt
// dump, which replayed as a deadlock that never happened. Each description's
// (group, p2p) sequence is found once; each row then costs two loads.
void check_numbering(const CompactFlightDump& d, const std::string& file) {
  std::map<std::pair<std::string_view, bool>, uint32_t> sequence_of;
  std::vector<uint32_t> sequence(d.calls.size());
  for (std::size_t i = 0; i < d.calls.size(); ++i)
    sequence[i] = sequence_of
                      .try_emplace({d.calls[i].group, dump_fields::is_p2p(d.calls[i].op)},
                                   static_cast<uint32_t>(sequence_of.size()))
                      .first->second;
  std::vector<uint64_t> least(sequence_of.size(), 0);  // what the next number may be, at least
  for (std::size_t i = 0; i < d.rows.size(); ++i) {
    const CompactFlightDump::Row& w = d.rows[i];
    uint64_t& next = least[sequence[w.call_index]];
    if (w.seq < next) {
      const FlightRecord& c = d.calls[w.call_index];
      raise(file,
            fmt::format(
                "entry {}: {} #{} on group '{}' comes after #{} there (a rank numbers its calls on "
                "a group in the order it makes them: the dump is corrupt)",
                i, op_name(c.op), w.seq, c.group, next - 1));
    }
    next = w.seq == UINT64_MAX ? w.seq : w.seq + 1;
  }
}

// Elements of `shape`, or -1 when a dimension is negative or the product
// overflows (the replay names negative shapes itself). shape_numel would
// overflow on a hostile dump's shape.
int64_t elements(const Shape& shape) {
  int64_t n = 1;
  for (const int64_t d : shape)
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return -1;
  return n;
}

// What the recorder writes agrees with itself (FlightRecorder::begin,
// snapshot_flight_dump): a call's group_size and group_rank are its group's,
// numel is the first input's (else output's) elements, and each entry's
// number on its group lies in [watermark, calls). A dump that breaks one was
// edited or corrupted, and replayed it could give a verdict about calls that
// never happened (found by a hostile-input run), so it is refused here.
void check_consistency(const CompactFlightDump& d, const std::string& file) {
  std::map<std::string_view, const DumpedGroup*> group_of;
  for (std::size_t k = 0; k < d.groups.size(); ++k) {
    const DumpedGroup& g = d.groups[k];
    group_of.emplace(g.group.name, &g);
    const auto members = static_cast<int64_t>(g.group.members.size());
    if (g.group.group_rank < 0 || g.group.group_rank >= members)
      raise(file, fmt::format("groups[{}]: group_rank {} of group '{}' outside its {} "
                              "members",
                              k, g.group.group_rank, g.group.name, members));
    if (g.watermark > g.group.calls || g.p2p_watermark > g.group.p2p_calls)
      raise(file,
            fmt::format(
                "groups[{}]: group '{}' has watermark {} / p2p_watermark {} above its calls {} / "
                "p2p_calls {} (a watermark is an earliest recorded call number)",
                k, g.group.name, g.watermark, g.p2p_watermark, g.group.calls, g.group.p2p_calls));
  }
  std::vector<const DumpedGroup*> call_group(d.calls.size(), nullptr);
  for (std::size_t i = 0; i < d.calls.size(); ++i) {
    const FlightRecord& c = d.calls[i];
    const auto it = group_of.find(c.group);
    if (it != group_of.end()) {
      const RecordedGroup& g = it->second->group;
      if (c.group_size != static_cast<int>(g.members.size()) || c.group_rank != g.group_rank)
        raise(file,
              fmt::format(
                  "calls[{}]: {} on group '{}' records group_rank {} of {}, but the group is rank "
                  "{} of {} members",
                  i, op_name(c.op), c.group, c.group_rank, c.group_size, g.group_rank,
                  g.members.size()));
      call_group[i] = it->second;
    }
    const std::vector<Shape>& shapes = c.input_shapes.empty() ? c.output_shapes : c.input_shapes;
    if (shapes.empty()) continue;  // no tensor (a barrier): nothing to count
    const int64_t n = elements(shapes[0]);
    if (n >= 0 && n != c.numel)
      raise(
          file,
          fmt::format(
              "calls[{}]: {} on group '{}' records numel {}, but its first {} shape [{}] holds {}",
              i, op_name(c.op), c.group, c.numel, c.input_shapes.empty() ? "output" : "input",
              fmt::join(shapes[0], ","), n));
  }
  for (std::size_t i = 0; i < d.rows.size(); ++i) {
    const CompactFlightDump::Row& w = d.rows[i];
    const DumpedGroup* g = call_group[w.call_index];
    if (g == nullptr) continue;
    const FlightRecord& c = d.calls[w.call_index];
    const bool p2p = dump_fields::is_p2p(c.op);
    const uint64_t lo = p2p ? g->p2p_watermark : g->watermark;
    const uint64_t hi = p2p ? g->group.p2p_calls : g->group.calls;
    if (w.seq < lo || w.seq >= hi)
      raise(file,
            fmt::format(
                "entry {}: {} #{} on group '{}' lies outside its group's recorded {} [{}, {})", i,
                op_name(c.op), w.seq, c.group, p2p ? "send/recv numbers" : "call numbers", lo, hi));
  }
}

CompactFlightDump parse_tree(std::string_view text, const std::string& file) {
  Reader rd{file, ""};
  const json doc = parse_json(text, file);
  check_format(doc, rd);
  if (rd.get<int>(doc, "version") == 1) return compact(dump_fields::parse_v1(doc, rd));
  CompactFlightDump c;
  read_header(doc, c, rd);
  rows_from_tree(doc, c, rd);
  return c;
}
}  // namespace

CompactFlightDump parse_compact_flight_dump(std::string_view text, const std::string& file) {
  std::optional<CompactFlightDump> c = parse_as_written(text, file);
  if (!c) c = parse_tree(text, file);
  check_numbering(*c, file);
  check_consistency(*c, file);
  return std::move(*c);
}

CompactFlightDump compact(const FlightDump& d) {
  CompactFlightDump c;
  c.version = d.version;
  c.rank = d.rank;
  c.world_size = d.world_size;
  c.capacity = d.capacity;
  c.groups = d.groups;
  std::map<std::string, uint32_t> index;  // a description's JSON text -> calls
  for (const FlightRecord& r : d.entries) {
    const std::string key =
        dump_fields::desc_json(r).dump(-1, ' ', false, json::error_handler_t::replace);
    auto [it, fresh] = index.try_emplace(key, static_cast<uint32_t>(c.calls.size()));
    if (fresh) c.calls.push_back(dump_fields::parse_desc(json::parse(key), Reader{key, ""}));
    CompactFlightDump::Row w;
    w.id = r.id;
    w.call_index = it->second;
    w.seq = r.seq;
    w.state = r.state;
    w.backward_call = r.backward_of ? static_cast<int64_t>(r.backward_of->seq) : -1;
    w.start_ns = to_ns(r.start_s);
    w.duration_ns = to_ns(r.duration_s);
    w.bytes_sent = r.bytes_sent;
    w.bytes_received = r.bytes_received;
    c.rows.push_back(w);
  }
  return c;
}

FlightDump expand(const CompactFlightDump& c) {
  FlightDump d;
  d.version = c.version;
  d.rank = c.rank;
  d.world_size = c.world_size;
  d.capacity = c.capacity;
  d.groups = c.groups;
  d.entries.reserve(c.rows.size());
  for (const CompactFlightDump::Row& w : c.rows) {
    FlightRecord r = c.calls.at(w.call_index);
    r.id = w.id;
    r.seq = w.seq;
    r.state = w.state;
    if (r.backward_of)
      r.backward_of->seq = static_cast<uint64_t>(std::max<int64_t>(0, w.backward_call));
    r.start_s = static_cast<double>(w.start_ns) * 1e-9;
    r.duration_s = static_cast<double>(w.duration_ns) * 1e-9;
    r.bytes_sent = w.bytes_sent;
    r.bytes_received = w.bytes_received;
    d.entries.push_back(std::move(r));
  }
  return d;
}

}  // namespace diffcomm::dist
