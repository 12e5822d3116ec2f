// Reading a dump directory and writing a replay's report (replay.hpp).
#include <fmt/format.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <utility>

#include "diffcomm/sim/replay.hpp"
#include "diffcomm/sim/torch_flight_dump.hpp"
#include "diffcomm/tensor/error.hpp"
#include "replay_table.hpp"

namespace diffcomm::sim {
namespace {
namespace fs = std::filesystem;
using detail::rank_file;
}  // namespace

std::vector<dist::FlightDump> read_dumps(const std::string& dir) {
  if (!fs::is_directory(dir)) raise(dir, "not a directory");
  const std::string first = rank_file(dir, 0);
  if (!fs::exists(first)) return read_torch_dumps(dir);
  std::vector<dist::FlightDump> dumps;
  dumps.push_back(dist::read_flight_dump(first));
  const int n = dumps[0].world_size;
  if (n < 1 || n > 16384) raise(first, fmt::format("world size {} outside 1..16384", n));
  for (int r = 1; r < n; ++r) {
    const std::string file = rank_file(dir, r);
    if (!fs::exists(file)) raise(file, fmt::format("missing (the world has {} ranks)", n));
    dumps.push_back(dist::read_flight_dump(file));
  }
  std::map<std::string, detail::SeenGroup> first_seen;
  for (std::size_t r = 0; r < dumps.size(); ++r) {
    const dist::FlightDump& d = dumps[r];
    const std::string file = rank_file(dir, static_cast<int>(r));
    for (const dist::DumpedGroup& g : d.groups)
      if (const auto* seen = detail::see_group(first_seen, g, static_cast<int>(r), file))
        detail::check_same_members(g, *seen, file);
    detail::check_dump_header(static_cast<int>(r), d.rank, d.world_size, n, d.groups, file);
  }
  return dumps;
}

std::string replay_json(const ReplayReport& rep) {
  nlohmann::json pending = nlohmann::json::array();
  for (const PendingCall& p : rep.pending) {
    nlohmann::json j = {{"rank", p.rank}, {"finished", p.finished}};
    if (!p.finished) {
      j["group"] = p.group;
      j["call"] = p.call;
      j["op"] = p.op;
      j["not_reached"] = p.not_reached;
      if (!p.caller.empty()) j["caller"] = p.caller;
    }
    pending.push_back(std::move(j));
  }
  nlohmann::json j = {{"verdict", verdict_name(rep.verdict)},
                      {"group", rep.group},
                      {"call", nullptr},
                      {"op", rep.op},
                      {"ranks", rep.ranks},
                      {"field", rep.field},
                      {"message", rep.message},
                      {"pending", std::move(pending)},
                      {"unknown", rep.unknown}};
  if (rep.call) j["call"] = *rep.call;
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

std::string replay_text(const ReplayReport& rep) {
  std::string s = fmt::format("verdict: {}\n", verdict_name(rep.verdict));
  if (!rep.group.empty()) {
    s += fmt::format("call: {}", rep.op.empty() ? "?" : rep.op);
    if (rep.call) s += fmt::format(" #{}", *rep.call);
    s += fmt::format(" on group '{}'\n", rep.group);
  }
  if (!rep.ranks.empty()) s += fmt::format("ranks: {}\n", fmt::join(rep.ranks, ","));
  if (!rep.field.empty()) s += fmt::format("field: {}\n", rep.field);
  if (!rep.message.empty()) s += rep.message + "\n";
  for (const PendingCall& p : rep.pending) {
    if (p.finished) {
      s += fmt::format("  rank {}: finished its recorded calls\n", p.rank);
      continue;
    }
    s += fmt::format("  rank {}: waits in {} #{} on '{}'", p.rank, p.op, p.call, p.group);
    if (!p.not_reached.empty())
      s += fmt::format(" (never reached by rank(s) {})", fmt::join(p.not_reached, ","));
    if (!p.caller.empty()) s += " at " + p.caller;
    s += "\n";
  }
  for (const std::string& u : rep.unknown)
    s += fmt::format("not recorded, so not compared: {}\n", u);
  return s;
}

}  // namespace diffcomm::sim
