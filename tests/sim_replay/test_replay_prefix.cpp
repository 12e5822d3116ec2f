// The replay settles the agreeing prefix without the simulated world and
// runs the world only from the cut (sim/replay.hpp). Reference: the same
// dumps replayed with settle_prefix = false, where the world runs every
// recorded call. Random programs on two overlapping groups, with uneven
// all_to_all_single, send/recv and backward calls, each with at most one
// fault (a changed shape or dtype, a dropped call, two calls swapped, a
// backward call naming another forward call), must give the same report.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "diffcomm/distributed/flight_dump.hpp"
#include "diffcomm/sim/replay.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::sim {
namespace {

using dist::FlightDump;
using dist::FlightRecord;
using dist::OpType;

struct Program {
  int n = 0;
  std::vector<FlightDump> dumps;
  std::vector<std::vector<uint64_t>> seq;  // per rank, per group (0 world, 1 pair): next number
  std::vector<uint64_t> p2p;               // per rank: next send/recv number on "pair"
};

Program start(int n) {
  Program p;
  p.n = n;
  p.dumps.resize(static_cast<std::size_t>(n));
  p.seq.assign(static_cast<std::size_t>(n), {0, 0});
  p.p2p.assign(static_cast<std::size_t>(n), 0);
  std::vector<int> all;
  for (int r = 0; r < n; ++r) all.push_back(r);
  for (int r = 0; r < n; ++r) {
    FlightDump& d = p.dumps[static_cast<std::size_t>(r)];
    d.rank = r;
    d.world_size = n;
    dist::DumpedGroup w;
    w.group = {"world", all, r, 0, 0};
    d.groups.push_back(w);
    if (r < 2) {
      dist::DumpedGroup pair;
      pair.group = {"pair", {0, 1}, r, 0, 0};
      d.groups.push_back(pair);
    }
  }
  return p;
}

FlightRecord& append(Program& p, int r, int group, OpType op) {
  FlightDump& d = p.dumps[static_cast<std::size_t>(r)];
  FlightRecord c;
  c.id = d.entries.size() + 1;
  c.group = group == 0 ? "world" : "pair";
  c.group_size = group == 0 ? p.n : 2;
  c.group_rank = r;
  c.op = op;
  const bool p2p = op == OpType::Send || op == OpType::Recv;
  uint64_t& next = p2p ? p.p2p[static_cast<std::size_t>(r)]
                       : p.seq[static_cast<std::size_t>(r)][static_cast<std::size_t>(group)];
  c.seq = next++;
  c.state = FlightRecord::State::Completed;
  d.entries.push_back(c);
  return d.entries.back();
}

// One collective (or a send/recv pair) issued by every member.
void add_call(Program& p, std::mt19937& rng, std::vector<uint64_t>& forwards) {
  const int kind = static_cast<int>(rng() % 6);
  const int group = kind != 4 && p.n > 2 && rng() % 3 == 0 ? 1 : 0;
  const int m = group == 0 ? p.n : 2;
  if (kind == 5) {  // rank 0 sends 3 floats to rank 1 on "pair"
    FlightRecord& s = append(p, 0, 1, OpType::Send);
    s.root = 1;
    s.input_shapes = {{3}};
    FlightRecord& r = append(p, 1, 1, OpType::Recv);
    r.root = 0;
    r.output_shapes = {{3}};
    return;
  }
  for (int r = 0; r < m; ++r) {
    switch (kind) {
      case 0: append(p, r, group, OpType::Barrier); break;
      case 1: {
        FlightRecord& c = append(p, r, group, OpType::AllReduce);
        c.input_shapes = c.output_shapes = {{4}};
        if (group == 0) forwards.push_back(c.seq);
        break;
      }
      case 2: {
        FlightRecord& c = append(p, r, group, OpType::AllGatherSingle);
        c.input_shapes = {{2}};
        c.output_shapes = {{2 * m}};
        break;
      }
      case 3: {  // uneven: rank i sends (i + j) % 3 rows to j
        FlightRecord& c = append(p, r, group, OpType::AllToAllSingle);
        std::vector<int64_t> in, out;
        for (int j = 0; j < m; ++j) {
          in.push_back((r + j) % 3);
          out.push_back((j + r) % 3);
        }
        int64_t rows_in = 0, rows_out = 0;
        for (int j = 0; j < m; ++j) rows_in += in[static_cast<std::size_t>(j)];
        for (int j = 0; j < m; ++j) rows_out += out[static_cast<std::size_t>(j)];
        c.input_shapes = {{rows_in, 2}};
        c.output_shapes = {{rows_out, 2}};
        c.input_splits = dist::SplitList(in);
        c.output_splits = dist::SplitList(out);
        break;
      }
      default: {  // the backward of an earlier world all_reduce
        FlightRecord& c = append(p, r, 0, OpType::AllReduce);
        c.input_shapes = c.output_shapes = {{4}};
        c.backward_of = dist::CallId{OpType::AllReduce, forwards.empty() ? 0 : forwards.back()};
        break;
      }
    }
  }
}

void fault(Program& p, std::mt19937& rng) {
  auto& e = p.dumps[rng() % static_cast<std::size_t>(p.n)].entries;
  if (e.size() < 2) return;
  const std::size_t i = rng() % e.size();
  switch (rng() % 5) {
    case 0:
      if (!e[i].input_shapes.empty()) e[i].input_shapes[0][0] += 1;
      break;
    case 1: e[i].dtype = DType::Float64; break;
    case 2: e.erase(e.begin() + static_cast<std::ptrdiff_t>(i)); break;
    case 3: std::swap(e[i], e[(i + 1) % e.size()]); break;
    default:
      if (e[i].backward_of) e[i].backward_of->seq += 1;
      break;
  }
}

void finish(Program& p) {
  for (int r = 0; r < p.n; ++r)
    for (dist::DumpedGroup& g : p.dumps[static_cast<std::size_t>(r)].groups) {
      const int gi = g.group.name == "world" ? 0 : 1;
      g.group.calls = p.seq[static_cast<std::size_t>(r)][static_cast<std::size_t>(gi)];
      g.group.p2p_calls = gi == 1 ? p.p2p[static_cast<std::size_t>(r)] : 0;
    }
}

std::string summary(const ReplayReport& r) {
  std::string s = std::string(verdict_name(r.verdict)) + "|" + r.group + "|" +
                  (r.call ? std::to_string(*r.call) : "-") + "|" + r.op + "|" + r.field + "|";
  for (int x : r.ranks) s += std::to_string(x) + ",";
  s += "|" + r.message;
  for (const PendingCall& q : r.pending) {
    s += "\n  " + std::to_string(q.rank) + (q.finished ? " finished" : " " + q.op) + " " + q.group +
         "#" + std::to_string(q.call) + " nr:";
    for (int x : q.not_reached) s += std::to_string(x) + ",";
  }
  return s;
}

// The report, or the error of a locally corrupt call (both paths check each
// description with the funnel first).
std::string outcome(const std::vector<FlightDump>& dumps, bool settle, bool* ok) {
  ReplayOptions o;
  o.settle_prefix = settle;
  try {
    const ReplayReport r = replay(dumps, o);
    *ok = r.verdict == Verdict::Ok;
    return summary(r);
  } catch (const InvalidArgument& e) {
    *ok = false;
    return std::string("error: ") + e.what();
  }
}

TEST(ReplayPrefix, SettlingThePrefixGivesTheWholeWorldsReport) {
  int faults = 0, ok = 0;
  for (uint32_t seed = 0; seed < 400; ++seed) {
    std::mt19937 rng(seed);
    Program p = start(2 + static_cast<int>(rng() % 4));
    std::vector<uint64_t> forwards;
    const int calls = 2 + static_cast<int>(rng() % 8);
    for (int k = 0; k < calls; ++k) add_call(p, rng, forwards);
    if (rng() % 5 != 0) {
      fault(p, rng);
      ++faults;
    }
    finish(p);
    bool good = false;
    const std::string want = outcome(p.dumps, false, &good);
    ok += good;
    ASSERT_EQ(outcome(p.dumps, true, &good), want) << "seed " << seed;
  }
  // The programs cover both outcomes.
  EXPECT_GT(ok, 40);
  EXPECT_GT(400 - ok, 100) << faults << " faults";
}

// Two groups entered in opposite orders on two ranks: a cycle no per-group
// check sees; the settling leaves it to the world, which reports it.
TEST(ReplayPrefix, ACrossGroupCycleIsADeadlock) {
  Program p = start(3);
  for (int r = 0; r < 2; ++r) append(p, r, 1, OpType::Barrier);  // pair #0
  for (int r = 0; r < 3; ++r) append(p, r, 0, OpType::Barrier);  // world #0
  auto& e1 = p.dumps[1].entries;
  std::swap(e1[0], e1[1]);  // rank 1: world #0 first, then pair #0
  finish(p);
  const ReplayReport rep = replay(p.dumps);
  EXPECT_EQ(rep.verdict, Verdict::Deadlock) << summary(rep);
  ASSERT_EQ(rep.pending.size(), 3u);
  EXPECT_EQ(rep.pending[0].group, "pair");
  EXPECT_EQ(rep.pending[1].group, "world");
}

}  // namespace
}  // namespace diffcomm::sim
