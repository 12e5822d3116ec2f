// Settling a recording's agreeing prefix (replay_prefix.hpp). Cost: one
// arrival per recorded call plus one comparison per distinct combination of
// descriptions, so a 16384-rank window of 2000 all_reduce calls is a few
// hundred milliseconds where fibers take minutes.
#include "replay_prefix.hpp"

#include <algorithm>
#include <deque>
#include <map>
#include <unordered_map>

namespace diffcomm::sim::detail {
namespace {
using dist::OpType;

constexpr uint32_t kNone = UINT32_MAX;
constexpr std::size_t kAhead = 8;  // prefetch distance in the ready queue

// A collective some members have arrived at.
struct Instance {
  std::vector<uint32_t> calls;  // per group rank: its description (kNone: not yet)
  uint32_t first = kNone;       // the first arrival's description
  uint32_t backward_plus1 = 0;  // and its forward call
  std::size_t arrived = 0;
  bool uniform = true;        // one description so far
  bool same_backward = true;  // one forward call so far
};

class Settler {
 public:
  Settler(const Table& t, const std::vector<dist::CallDesc>& descs)
      : t_(t), descs_(descs), open_(t.groups.size()), uniform_ok_(t.calls.size(), -1) {
    const auto n = static_cast<std::size_t>(t.world_size);
    cut_.pc.assign(n, 0);
    cut_.at.assign(n, Cut::At::Waiting);
    for (std::size_t r = 0; r < n; ++r) ready_.push_back(static_cast<int>(r));
  }

  Cut run() {
    while (!ready_.empty()) {
      // Each rank's next step is a cache miss (one vector per rank, 16 bytes
      // read per visit, 16384 ranks between two visits): ask for the step
      // of the rank 8 places on while this one runs. Half the settling.
      if (ready_.size() > kAhead) {
        const auto a = static_cast<std::size_t>(ready_[kAhead]);
        __builtin_prefetch(t_.steps[a].data() + cut_.pc[a]);
        __builtin_prefetch(t_.group_rank[a].data());
      }
      const int r = ready_.front();
      ready_.pop_front();
      advance(r);
    }
    return std::move(cut_);
  }

 private:
  // Runs rank r up to its next collective and arrives there.
  void advance(int r) {
    const auto ri = static_cast<std::size_t>(r);
    const std::vector<Step>& steps = t_.steps[ri];
    std::size_t& pc = cut_.pc[ri];
    while (pc < steps.size() && !t_.in_window(steps[pc])) ++pc;
    if (pc == steps.size()) {
      cut_.at[ri] = Cut::At::Finished;
      return;
    }
    const Step& s = steps[pc];
    const TableCall& c = t_.calls[s.call];
    if (c.p2p) {
      cut_.at[ri] = Cut::At::P2p;
      return;
    }
    const TableGroup& g = t_.groups[c.group];
    const int gr = t_.rank_in(r, c.group);
    Instance& in = instance(c.group, s.seq);
    if (in.calls.empty()) {
      in.calls.assign(g.members.size(), kNone);
      in.first = s.call;
      in.backward_plus1 = s.backward_plus1;
    }
    cut_.at[ri] = Cut::At::Waiting;
    if (gr < 0 || in.calls[static_cast<std::size_t>(gr)] != kNone) {
      cut_.at[ri] = Cut::At::Stopped;  // a call recorded twice: the world reports it
      return;
    }
    in.uniform = in.uniform && s.call == in.first;
    in.same_backward = in.same_backward && s.backward_plus1 == in.backward_plus1;
    in.calls[static_cast<std::size_t>(gr)] = s.call;
    if (++in.arrived < g.members.size()) return;
    complete(c.group, s.seq, in);
  }

  void complete(uint32_t group, uint64_t seq, Instance& in) {
    const TableGroup& g = t_.groups[group];
    const bool ok = agree(g, in);
    if (!ok && !cut_.first_disagreement)
      cut_.first_disagreement = Cut::Disagreement{group, seq, in.calls};
    for (int m : g.members) {
      const auto mi = static_cast<std::size_t>(m);
      if (ok) {
        ++cut_.pc[mi];
        ready_.push_back(m);
      } else {
        cut_.at[mi] = Cut::At::Stopped;
      }
    }
    auto& open = open_[group];
    for (std::size_t i = 0; i < open.size(); ++i)
      if (open[i].first == seq) {
        std::swap(open[i], open.back());
        open.pop_back();
        break;
      }
  }

  // The open call `seq` of `group` (a fresh one if none). A group has one
  // or two open calls at a time: a scan beats hashing 32 million arrivals.
  Instance& instance(uint32_t group, uint64_t seq) {
    auto& open = open_[group];
    for (auto& [s, in] : open)
      if (s == seq) return in;
    return open.emplace_back(seq, Instance{}).second;
  }

  // dist::compare of the members' descriptions, once per distinct
  // combination. Differing forward calls of a backward call disagree (the
  // descriptions hold no call numbers).
  bool agree(const TableGroup& g, const Instance& in) {
    if (!in.same_backward) return false;
    if (in.uniform) {
      int& known = uniform_ok_[in.first];
      if (known < 0) known = compare(g, in) ? 1 : 0;
      return known == 1;
    }
    auto [it, fresh] = mixed_ok_.try_emplace(in.calls, false);
    if (fresh) it->second = compare(g, in);
    return it->second;
  }

  bool compare(const TableGroup& g, const Instance& in) const {
    std::vector<const dist::CallDesc*> descs;
    descs.reserve(in.calls.size());
    for (uint32_t c : in.calls) descs.push_back(&descs_[c]);
    return dist::compare(descs, g.members).empty();
  }

  const Table& t_;
  const std::vector<dist::CallDesc>& descs_;
  Cut cut_;
  std::deque<int> ready_;
  std::vector<std::vector<std::pair<uint64_t, Instance>>> open_;  // per group: (call number, call)
  std::vector<int> uniform_ok_;                                   // per description: -1 unknown
  std::map<std::vector<uint32_t>, bool> mixed_ok_;
};
}  // namespace

bool Cut::all_finished() const {
  return std::all_of(at.begin(), at.end(), [](At a) { return a == At::Finished; });
}
bool Cut::any_stopped() const {
  return std::any_of(at.begin(), at.end(), [](At a) { return a == At::Stopped; });
}
bool Cut::any_p2p() const {
  return std::any_of(at.begin(), at.end(), [](At a) { return a == At::P2p; });
}

Cut no_prefix(const Table& table) {
  Cut cut;
  cut.pc.assign(table.steps.size(), 0);
  cut.at.assign(table.steps.size(), Cut::At::P2p);
  return cut;
}

Cut settle_prefix(const Table& table, const std::vector<dist::CallDesc>& descs) {
  return Settler(table, descs).run();
}

}  // namespace diffcomm::sim::detail
