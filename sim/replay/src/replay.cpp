// Replay of flight recorder dumps in the simulated world (replay.hpp): the
// window each group can be replayed from, each rank's program, the run, and
// the verdict read from the world's own error.
#include "diffcomm/sim/replay.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <regex>
#include <tuple>

#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"
#include "replay_issue.hpp"
#include "replay_prefix.hpp"
#include "replay_table.hpp"

namespace diffcomm::sim {
namespace {
using detail::Cut;
using detail::Step;
using detail::Table;
using dist::FlightRecord;
using dist::OpType;

bool is_p2p(OpType op) { return op == OpType::Send || op == OpType::Recv; }

// What the world runs: each rank's steps from the cut (its next call only,
// unless a rank stopped at a send/recv), and how far each got.
struct Run {
  const Table& table;
  const detail::ShapeOnlyTensors& tensors;
  std::vector<std::vector<Step>> programs;
  std::vector<std::size_t> progress;  // per rank: index of the call it is in
  std::vector<uint32_t> groups;       // the non-world groups the programs call on
};

Run tails_from(const Table& t, const detail::ShapeOnlyTensors& tensors, const Cut& cut) {
  Run run{t, tensors, {}, std::vector<std::size_t>(t.steps.size(), 0), {}};
  const bool whole = cut.any_p2p();
  std::vector<bool> used(t.groups.size(), false);
  for (std::size_t r = 0; r < t.steps.size(); ++r) {
    std::vector<Step> tail;
    for (std::size_t i = cut.pc[r]; i < t.steps[r].size(); ++i) {
      const Step& s = t.steps[r][i];
      if (!t.in_window(s)) continue;
      tail.push_back(s);
      used[t.calls[s.call].group] = true;
      if (!whole) break;
    }
    run.programs.push_back(std::move(tail));
  }
  for (uint32_t g = 0; g < t.groups.size(); ++g)
    if (used[g] && t.groups[g].name != "world") run.groups.push_back(g);
  return run;
}

void run_rank(Rank& rank, Run& run) {
  const Table& t = run.table;
  const dist::ProcessGroup& world = rank.world();
  std::map<std::string, dist::ProcessGroup> groups{{world.name(), world}};
  for (uint32_t gi : run.groups) {
    const detail::TableGroup& plan = t.groups[gi];
    auto g = world.new_group(plan.members, plan.name);
    if (g) groups.emplace(plan.name, *g);
  }
  const auto r = static_cast<std::size_t>(rank.rank());
  const auto& program = run.programs[r];
  for (std::size_t i = 0; i < program.size(); ++i) {
    run.progress[r] = i;
    const FlightRecord c = t.record(program[i]);
    const dist::ProcessGroup& g = groups.at(c.group);
    g.resume_numbering(c.seq, is_p2p(c.op));  // the recorded number, whatever was skipped
    run.tensors.issue(g, c);
  }
  run.progress[r] = program.size();
}

std::string first_line(std::string_view s) { return std::string(s.substr(0, s.find('\n'))); }

// The disagreeing ranks ("(global G)", in order) and the field ("...: shape
// differs") of the simulated world's mismatch message.
void parse_mismatch(const std::string& line, ReplayReport& rep) {
  static const std::regex global(R"(\(global (\d+)\))");
  for (auto it = std::sregex_iterator(line.begin(), line.end(), global);
       it != std::sregex_iterator(); ++it) {
    const int g = std::stoi((*it)[1]);
    if (std::find(rep.ranks.begin(), rep.ranks.end(), g) == rep.ranks.end()) rep.ranks.push_back(g);
  }
  static const std::regex field(R"(: ([a-z_ ()]+?) differs?$)");
  std::smatch m;
  if (std::regex_search(line, m, field)) rep.field = m[1];
}

// Every rank's pending call and, per distinct pending call, the members
// waiting elsewhere or finished (computed once per call: per rank it was
// 16384 x 16384 record copies, half a minute).
void deadlock_table(const Run& run, ReplayReport& rep) {
  const std::size_t n = run.programs.size();
  struct Pending {
    uint32_t group = 0;
    uint64_t seq = 0;
    OpType op = OpType::Barrier;
    bool operator<(const Pending& o) const {
      return std::tie(group, seq, op) < std::tie(o.group, o.seq, o.op);
    }
    bool operator==(const Pending& o) const {
      return group == o.group && seq == o.seq && op == o.op;
    }
  };
  std::vector<std::optional<Pending>> pending(n);
  for (std::size_t r = 0; r < n; ++r) {
    if (run.progress[r] >= run.programs[r].size()) continue;
    const Step& s = run.programs[r][run.progress[r]];
    const detail::TableCall& c = run.table.calls[s.call];
    pending[r] = Pending{c.group, s.seq, c.proto.op};
  }
  std::map<Pending, std::vector<int>> not_reached;
  for (std::size_t r = 0; r < n; ++r) {
    PendingCall p;
    p.rank = static_cast<int>(r);
    p.finished = !pending[r];
    if (pending[r]) {
      const Pending& c = *pending[r];
      const detail::TableGroup& g = run.table.groups[c.group];
      p.group = g.name;
      p.call = c.seq;
      p.op = dist::op_name(c.op);
      p.caller = run.table.calls[run.programs[r][run.progress[r]].call].proto.caller.str();
      auto [it, fresh] = not_reached.try_emplace(c);
      if (fresh)
        for (int m : g.members)
          if (pending[static_cast<std::size_t>(m)] != c) it->second.push_back(m);
      p.not_reached = it->second;
      if (rep.group.empty() && !p.not_reached.empty()) {
        rep.group = p.group;
        rep.call = p.call;
        rep.op = p.op;
        rep.ranks = p.not_reached;
      }
    }
    rep.pending.push_back(std::move(p));
  }
}

ReplayReport incomplete_or_ok(const Table& t) {
  // By name, as the groups were reported before the table kept them in
  // reading order.
  std::map<std::string, const detail::TableGroup*> by_name;
  for (const detail::TableGroup& g : t.groups) by_name.emplace(g.name, &g);
  ReplayReport rep;
  for (const auto& [name, g] : by_name) {
    const detail::TableGroup& plan = *g;
    if (plan.lost.empty()) continue;
    rep.verdict = Verdict::Incomplete;
    rep.group = name;
    rep.call = plan.start;
    rep.ranks = plan.lost;
    rep.message = fmt::format(
        "group '{}': the flight recorders of rank(s) {} no longer hold calls before #{} that "
        "other members recorded; those calls are unknown. The window from #{} replays cleanly",
        name, fmt::join(plan.lost, ","), plan.start, plan.start);
    return rep;
  }
  return rep;
}

// Every member of a disagreeing call raises, each with its own call; which
// one the world reports first depends on the schedule. The report names the
// call of the first rank the message names (the one checked mode's lowest
// raising rank reports), whatever the schedule.
void name_first_rank(const Run& run, ErrorSite& site, const ReplayReport& rep) {
  if (rep.ranks.empty()) return;
  const auto r = static_cast<std::size_t>(rep.ranks[0]);
  if (run.progress[r] >= run.programs[r].size()) return;
  const FlightRecord c = run.table.record(run.programs[r][run.progress[r]]);
  if (c.group != rep.group || c.seq != rep.call) return;
  site.op = dist::op_name(c.op);
  site.rank = run.table.rank_in(rep.ranks[0], run.table.group_index.at(c.group));
}

// A disagreement the settling found that the world would report as its
// first error, in the same words: nothing at a send/recv (whose outcome
// depends on the schedule) and no backward call (the descriptions hold no
// forward call numbers, which the message names).
const Cut::Disagreement* reportable(const Table& t, const Cut& cut) {
  if (!cut.first_disagreement || cut.any_p2p()) return nullptr;
  for (uint32_t c : cut.first_disagreement->calls)
    if (t.calls[c].proto.backward_of) return nullptr;
  return &*cut.first_disagreement;
}

// The mismatch report without running the world: the world's rendezvous
// gives dist::compare's line for the members' descriptions, raised at the
// call of the first rank the line names (name_first_rank).
ReplayReport mismatch_of(const Table& t, const std::vector<dist::CallDesc>& descs,
                         const Cut::Disagreement& d) {
  const detail::TableGroup& g = t.groups[d.group];
  std::vector<const dist::CallDesc*> members;
  members.reserve(d.calls.size());
  for (uint32_t c : d.calls) members.push_back(&descs[c]);
  const std::string line = "collective mismatch: " + dist::compare(members, g.members);
  ReplayReport rep;
  rep.verdict = Verdict::Mismatch;
  rep.group = g.name;
  rep.call = d.seq;
  parse_mismatch(line, rep);
  ErrorSite site;
  site.call = d.seq;
  site.group = g.name;
  site.group_size = static_cast<int>(g.members.size());
  const auto first = std::find(g.members.begin(), g.members.end(),
                               rep.ranks.empty() ? g.members[0] : rep.ranks[0]);
  const auto gr = static_cast<std::size_t>(first - g.members.begin());
  site.rank = static_cast<int>(gr);
  site.op = dist::op_name(t.calls[d.calls[gr]].proto.op);
  rep.op = site.op;
  rep.message = format_error(site, line);
  return rep;
}

// The verdict of a failed run, read from the world's first error.
ReplayReport verdict_of(const Error& e, const Run& run) {
  ReplayReport rep;
  const std::string line = first_line(e.detail());
  ErrorSite site = e.site();
  site.global_rank.reset();
  rep.message = format_error(site, line);
  if (e.kind() == ErrorKind::CollectiveMismatch) {
    rep.verdict = Verdict::Mismatch;
    rep.group = site.group.value_or("");
    rep.call = site.call;
    parse_mismatch(line, rep);
    name_first_rank(run, site, rep);
    rep.op = site.op;
    rep.message = format_error(site, line);
    return rep;
  }
  if (e.kind() == ErrorKind::Deadlock) {
    rep.verdict = Verdict::Deadlock;
    deadlock_table(run, rep);
    return rep;
  }
  raise("replay", fmt::format("the recorded calls cannot be replayed: {}", first_line(e.what())));
}
}  // namespace

const char* verdict_name(Verdict v) {
  switch (v) {
    case Verdict::Ok: return "ok";
    case Verdict::Mismatch: return "mismatch";
    case Verdict::Deadlock: return "deadlock";
    case Verdict::Incomplete: return "incomplete";
  }
  return "?";
}

int ReplayReport::exit_code() const {
  switch (verdict) {
    case Verdict::Ok: return 0;
    case Verdict::Mismatch:
    case Verdict::Deadlock: return 3;
    case Verdict::Incomplete: return 4;
  }
  return 2;
}

ReplayReport replay(const Recording& recording, const ReplayOptions& options) {
  const Table& t = recording.table();
  const detail::ShapeOnlyTensors tensors(t);
  const std::vector<dist::CallDesc> descs = detail::validate_calls(t, tensors);
  const Cut cut = options.settle_prefix ? detail::settle_prefix(t, descs) : detail::no_prefix(t);
  ReplayReport rep;
  if (cut.all_finished()) {
    rep = incomplete_or_ok(t);
  } else if (const auto d = reportable(t, cut)) {
    rep = mismatch_of(t, descs, *d);
  } else if (!cut.any_p2p() && !cut.any_stopped()) {
    // Every unfinished rank waits in a collective some member never
    // reaches: the world would block at once on each rank's next call.
    rep.verdict = Verdict::Deadlock;
    rep.message = std::string(kDeadlockLine);
    deadlock_table(tails_from(t, tensors, cut), rep);
  } else {
    Run run = tails_from(t, tensors, cut);
    WorldOptions wo;
    wo.ranks = t.world_size;
    wo.seed = options.seed;
    wo.trace = false;
    wo.move_payloads = false;  // the tensors have no memory: a verdict needs none
    World world(wo);
    try {
      world.run([&](Rank& rank) { run_rank(rank, run); });
      rep = incomplete_or_ok(t);
    } catch (const Error& e) {
      // Reading the world's report only: nothing here blocks or yields.
      rep = verdict_of(e, run);
    }
  }
  rep.unknown = t.unknown;
  return rep;
}

ReplayReport replay(const std::vector<dist::FlightDump>& dumps, const ReplayOptions& options) {
  return replay(Recording::of(dumps), options);
}

}  // namespace diffcomm::sim
