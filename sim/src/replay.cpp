// Replay of flight recorder dumps in the simulated world (replay.hpp): the
// window each group can be replayed from, each rank's program, the run, and
// the verdict read from the world's own error.
#include "diffcomm/sim/replay.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <regex>

#include "diffcomm/dist/collectives.hpp"
#include "diffcomm/error.hpp"
#include "diffcomm/sim/world.hpp"

namespace diffcomm::sim {
namespace {
using dist::FlightRecord;
using dist::OpType;

bool is_p2p(OpType op) { return op == OpType::Send || op == OpType::Recv; }

// A group as the replay sees it: its members and the first collective and
// send/recv numbers every member still holds (the latest watermark).
struct GroupPlan {
  std::vector<int> members;  // global ranks in group order
  uint64_t start = 0;
  uint64_t p2p_start = 0;
  std::vector<int> lost;  // members whose ring lost calls another member holds
};

const dist::DumpedGroup* find_group(const dist::FlightDump& d, const std::string& name) {
  for (const dist::DumpedGroup& g : d.groups)
    if (g.group.name == name) return &g;
  return nullptr;
}

// Every group of the dumps with its replay window. A member without the
// group in its dump never called on it: it holds all of its (zero) calls.
std::map<std::string, GroupPlan> plan_groups(const std::vector<dist::FlightDump>& dumps) {
  std::map<std::string, GroupPlan> plans;
  for (const dist::FlightDump& d : dumps)
    for (const dist::DumpedGroup& g : d.groups) plans[g.group.name].members = g.group.members;
  for (auto& [name, plan] : plans) {
    uint64_t low = UINT64_MAX;
    for (int m : plan.members) {
      const dist::DumpedGroup* g = find_group(dumps.at(static_cast<std::size_t>(m)), name);
      const uint64_t w = g != nullptr ? g->watermark : 0;
      plan.start = std::max(plan.start, w);
      plan.p2p_start = std::max(plan.p2p_start, g != nullptr ? g->p2p_watermark : 0);
      low = std::min(low, w);
    }
    for (int m : plan.members) {
      const dist::DumpedGroup* g = find_group(dumps.at(static_cast<std::size_t>(m)), name);
      if (g != nullptr && g->watermark > low) plan.lost.push_back(m);
    }
  }
  return plans;
}

// The recorded calls of one rank inside the windows, in its call order.
std::vector<const FlightRecord*> program_of(const dist::FlightDump& d,
                                            const std::map<std::string, GroupPlan>& plans) {
  std::vector<const FlightRecord*> program;
  for (const FlightRecord& r : d.entries) {
    if (r.op == OpType::NewGroup) continue;  // groups are made before the window
    const GroupPlan& p = plans.at(r.group);
    if (r.seq >= (is_p2p(r.op) ? p.p2p_start : p.start)) program.push_back(&r);
  }
  return program;
}

std::vector<Tensor> zeros_of(const std::vector<Shape>& shapes, DType dtype) {
  std::vector<Tensor> ts;
  ts.reserve(shapes.size());
  for (const Shape& s : shapes) ts.push_back(zeros(s, dtype));
  return ts;
}

// Issues the recorded call `r` on `g` with zero tensors of its shapes.
void issue(const dist::ProcessGroup& g, const FlightRecord& r) {
  const std::vector<Tensor> in = zeros_of(r.input_shapes, r.dtype);
  const std::vector<Tensor> out = zeros_of(r.output_shapes, r.dtype);
  const Tensor none;
  const Tensor& i0 = in.empty() ? none : in[0];
  const Tensor& o0 = out.empty() ? none : out[0];
  std::optional<dist::ProcessGroup::BackwardOf> backward;
  if (r.backward_of) backward.emplace(g, *r.backward_of);
  switch (r.op) {
    case OpType::Barrier: return dist::barrier(g);
    case OpType::AllReduce: return dist::all_reduce(g, i0, r.reduce_op);
    case OpType::Broadcast: return dist::broadcast(g, i0, r.root);
    case OpType::Reduce: return dist::reduce(g, i0, r.root, r.reduce_op);
    case OpType::AllGather: return dist::all_gather(g, out, i0);
    case OpType::AllGatherSingle: return dist::all_gather_single(g, o0, i0);
    case OpType::AllGatherV: return dist::all_gather_v(g, o0, i0, r.output_splits.to_vector());
    case OpType::Gather: return dist::gather(g, out, i0, r.root);
    case OpType::Scatter: return dist::scatter(g, o0, in, r.root);
    case OpType::ReduceScatter: return dist::reduce_scatter(g, o0, in, r.reduce_op);
    case OpType::ReduceScatterSingle: return dist::reduce_scatter_single(g, o0, i0, r.reduce_op);
    case OpType::ReduceScatterV:
      return dist::reduce_scatter_v(g, o0, i0, r.input_splits.to_vector(), r.reduce_op);
    case OpType::AllToAll: return dist::all_to_all(g, out, in);
    case OpType::AllToAllSingle:
      return dist::all_to_all_single(g, o0, i0, r.output_splits.to_vector(),
                                     r.input_splits.to_vector());
    case OpType::Send: return dist::send(g, i0, r.root, r.tag);
    case OpType::Recv: return dist::recv(g, o0, r.root, r.tag);
    case OpType::NewGroup: return;
  }
}

// What one run needs: the plans, each rank's program and how far it got.
struct Run {
  std::map<std::string, GroupPlan> plans;
  std::vector<std::vector<const FlightRecord*>> programs;
  std::vector<std::size_t> progress;  // per rank: index of the call it is in
};

void run_rank(Rank& rank, Run& run) {
  const dist::ProcessGroup& world = rank.world();
  std::map<std::string, dist::ProcessGroup> groups{{world.name(), world}};
  for (const auto& [name, plan] : run.plans) {
    if (name == world.name()) continue;
    auto g = world.new_group(plan.members, name);
    if (g) groups.emplace(name, *g);
  }
  const auto r = static_cast<std::size_t>(rank.rank());
  const auto& program = run.programs[r];
  for (std::size_t i = 0; i < program.size(); ++i) {
    run.progress[r] = i;
    const FlightRecord& c = *program[i];
    const dist::ProcessGroup& g = groups.at(c.group);
    g.resume_numbering(c.seq, is_p2p(c.op));  // the recorded number, whatever was skipped
    issue(g, c);
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

void deadlock_table(const Run& run, ReplayReport& rep) {
  const std::size_t n = run.programs.size();
  auto pending = [&](std::size_t r) -> const FlightRecord* {
    return run.progress[r] < run.programs[r].size() ? run.programs[r][run.progress[r]] : nullptr;
  };
  for (std::size_t r = 0; r < n; ++r) {
    PendingCall p;
    p.rank = static_cast<int>(r);
    const FlightRecord* c = pending(r);
    p.finished = c == nullptr;
    if (c != nullptr) {
      p.group = c->group;
      p.call = c->seq;
      p.op = dist::op_name(c->op);
      for (int m : run.plans.at(c->group).members) {
        const FlightRecord* o = pending(static_cast<std::size_t>(m));
        if (o == nullptr || o->group != c->group || o->seq != c->seq || o->op != c->op)
          p.not_reached.push_back(m);
      }
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

ReplayReport incomplete_or_ok(const std::map<std::string, GroupPlan>& plans) {
  ReplayReport rep;
  for (const auto& [name, plan] : plans) {
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
    rep.op = site.op;
    parse_mismatch(line, rep);
    return rep;
  }
  if (e.kind() == ErrorKind::Deadlock) {
    rep.verdict = Verdict::Deadlock;
    deadlock_table(run, rep);
    return rep;
  }
  throw InvalidArgument(
      fmt::format("replay: the recorded calls cannot be replayed: {}", first_line(e.what())));
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

ReplayReport replay(const std::vector<dist::FlightDump>& dumps, const ReplayOptions& options) {
  if (dumps.empty()) throw InvalidArgument("replay: no dumps");
  Run run;
  run.plans = plan_groups(dumps);
  for (const dist::FlightDump& d : dumps) run.programs.push_back(program_of(d, run.plans));
  run.progress.assign(dumps.size(), 0);
  WorldOptions wo;
  wo.ranks = static_cast<int>(dumps.size());
  wo.seed = options.seed;
  wo.trace = false;
  World world(wo);
  ReplayReport rep;
  try {
    world.run([&](Rank& rank) { run_rank(rank, run); });
    rep = incomplete_or_ok(run.plans);
  } catch (const Error& e) {
    // Reading the world's report only: nothing here blocks or yields.
    rep = verdict_of(e, run);
  }
  for (const dist::FlightDump& d : dumps)
    for (const std::string& u : d.unknown)
      if (std::find(rep.unknown.begin(), rep.unknown.end(), u) == rep.unknown.end())
        rep.unknown.push_back(u);
  return rep;
}

}  // namespace diffcomm::sim
