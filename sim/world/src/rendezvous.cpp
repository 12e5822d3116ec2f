// The rendezvous of the simulated world: making groups, joining a call,
// waiting, deadlock detection, failure propagation and completion.
#include "rendezvous.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <boost/fiber/all.hpp>
#include <map>

#include "diffcomm/distributed/backend/fingerprint.hpp"
#include "reference_ops.hpp"
#include "sim_backend.hpp"
#include "world_impl.hpp"

namespace diffcomm::sim {

using detail::RankState;
using detail::Rendezvous;
using detail::SharedDeadlock;
using detail::SimGroup;
using detail::Status;
using dist::Call;
using dist::OpType;

const std::string& detail::message_of(const RankState& rs) {
  static const std::string none;
  return rs.error_message ? *rs.error_message : none;
}

std::shared_ptr<SimGroup> World::Impl::make_group(std::vector<int> members) {
  auto g = std::make_shared<SimGroup>();
  g->id = next_group_id++;
  g->members = std::move(members);
  groups.push_back(g);
  return g;
}

// ---------------------------------------------------------- waiting
void World::Impl::wake(Rendezvous& rv) {
  if (rv.pending_at < pending.size() && pending[rv.pending_at] == &rv) {
    pending[rv.pending_at] = pending.back();
    pending[rv.pending_at]->pending_at = rv.pending_at;
    pending.pop_back();
  }
  rv.pending_at = SIZE_MAX;
  for (int slot : rv.arrival_order) {
    RankState& rs = ranks[static_cast<std::size_t>(rv.globals[static_cast<std::size_t>(slot)])];
    if (rs.status == Status::Blocked) {
      rs.status = Status::Running;
      rs.waiting_in = nullptr;
      --blocked;
    }
  }
  rv.done = true;
  boost::fibers::context* self = boost::fibers::context::active();
  for (boost::fibers::context* waiter : rv.waiters) self->schedule(waiter);
  rv.waiters.clear();
}

void World::Impl::check_deadlock() {
  if (blocked == 0 || blocked < live) return;
  std::string report = std::string(kDeadlockLine) + "\n";
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const RankState& rs = ranks[r];
    switch (rs.status) {
      case Status::Blocked:
        report += fmt::format("  rank {}: waiting in {}: {}", r, rs.waiting_in->where(),
                              rs.waiting_in->signature());
        if (rs.waiting_in->caller) report += " at " + rs.waiting_in->caller.str();
        report += "\n";
        break;
      case Status::Finished: report += fmt::format("  rank {}: finished\n", r); break;
      case Status::Failed:
        report += fmt::format("  rank {}: failed ({})\n", r, message_of(rs));
        break;
      case Status::Running: report += fmt::format("  rank {}: running\n", r); break;
    }
  }
  auto shared = std::make_shared<const std::string>(std::move(report));
  for (Rendezvous* rv : pending_sorted()) {
    rv->error = ErrorKind::Deadlock;
    rv->report = shared;
    wake(*rv);
  }
}

void World::Impl::wait(Rendezvous& rv, int global, const Call& call) {
  RankState& rs = ranks[static_cast<std::size_t>(global)];
  rs.status = Status::Blocked;
  rs.waiting_in = &call;  // formatted only if a deadlock report needs it
  ++blocked;
  if (rv.pending_at == SIZE_MAX) {
    rv.pending_at = pending.size();
    pending.push_back(&rv);
  }
  check_deadlock();
  boost::fibers::context* self = boost::fibers::context::active();
  while (!rv.done) {
    rv.waiters.push_back(self);
    self->suspend();  // until wake() schedules it
    algo->on_resumed();
  }
}

// ---------------------------------------------------------- failures
void World::Impl::on_rank_exit(int global, std::exception_ptr error,
                               std::shared_ptr<const std::string> message) {
  RankState& rs = ranks[static_cast<std::size_t>(global)];
  --live;
  if (!error) {
    rs.status = Status::Finished;
  } else {
    rs.status = Status::Failed;
    rs.error = error;
    rs.error_message = std::move(message);
    rs.failure_order = ++failures;
    // Release every member waiting for this rank in a group it belongs to,
    // naming the root cause: a rank that failed because another failed
    // (a victim) passes on that rank, not itself.
    const int root = rs.cause >= 0 ? rs.cause : global;
    std::vector<Rendezvous*> affected;
    for (Rendezvous* rv : pending_sorted()) {
      const auto& m = rv->globals;  // collective: the group; p2p: the pair
      if (std::find(m.begin(), m.end(), global) != m.end()) affected.push_back(rv);
    }
    // Formatted only when someone waits for this rank: after a deadlock
    // every rank leaves with the 1.8 MB report (16384 ranks) and nobody is
    // waiting; formatting it per rank was 30 GB of copying (20 s).
    const std::string what = affected.empty() ? std::string() : failure_text(global);
    for (Rendezvous* rv : affected) {
      rv->error = ErrorKind::RankFailure;
      rv->cause = root;
      rv->message = what;
      for (int slot : rv->arrival_order) {
        RankState& victim =
            ranks[static_cast<std::size_t>(rv->globals[static_cast<std::size_t>(slot)])];
        if (victim.cause < 0) victim.cause = root;
      }
      wake(*rv);
    }
  }
  check_deadlock();
}

// "member global rank R failed: <R's error>" for the root cause R of
// failed rank `global`, plus which member brought it here when that is
// another rank.
std::string World::Impl::failure_text(int global) const {
  const RankState& rs = ranks[static_cast<std::size_t>(global)];
  const int root = rs.cause >= 0 ? rs.cause : global;
  const std::string head = fmt::format("member global rank {} failed: {}", root,
                                       message_of(ranks[static_cast<std::size_t>(root)]));
  if (root == global) return head;
  return fmt::format("{} (root cause; global rank {} of this group failed as a result)", head,
                     global);
}

void World::Impl::raise(const Rendezvous& rv, const Call& call) {
  // Every rank's line (its call included) is in the report; prefixing
  // call.where() would make a per-rank copy of it.
  if (rv.error == ErrorKind::Deadlock) throw SharedDeadlock(rv.report);
  throw_error(*rv.error, call.site(), rv.message);
}

void World::Impl::enter(SimGroup& g, int global, const Call& call) {
  RankState& rs = ranks[static_cast<std::size_t>(global)];
  ++rs.calls;
  if (options.fault && options.fault->rank == global && options.fault->at_call == rs.calls) {
    ErrorSite site;
    site.global_rank = global;
    const RankFailure fault(std::move(site), fmt::format("injected fault at its call #{}: {}: {}",
                                                         rs.calls, call.where(), call.signature()));
    injected_fault = fault.what();
    throw fault;
  }
  if (failures == 0) return;  // the common case: no scan of the members
  for (int m : g.members) {
    const RankState& ms = ranks[static_cast<std::size_t>(m)];
    if (ms.status != Status::Failed) continue;
    rs.cause = ms.cause >= 0 ? ms.cause : m;
    throw RankFailure(call.site(), "(earlier) " + failure_text(m));
  }
}

// ---------------------------------------------------------- fingerprints
// The shared dist::compare, so production's checked mode reports in the
// same words.
std::string World::Impl::compare(Rendezvous& rv) {
  // In place: descriptions are built only on a mismatch (N^2 split
  // entries and shapes otherwise, for all_to_all_single / all_to_all).
  rv.const_calls.assign(rv.calls.begin(), rv.calls.end());
  if (rv.calls[0]->op == OpType::AllToAll)
    return dist::compare(rv.const_calls, rv.group->members,
                         dist::AllToAllCodes{rv.a2a.in_code.get(), rv.a2a.out_code.get()});
  return dist::compare(rv.const_calls, rv.group->members);
}

namespace {
// The members' call sites for a mismatch report (dist::call_sites).
std::string call_sites(const std::vector<Call*>& calls, const std::vector<int>& globals) {
  std::vector<std::string> callers(calls.size());
  for (std::size_t i = 0; i < calls.size(); ++i)
    if (calls[i] != nullptr) callers[i] = calls[i]->caller.str();
  return dist::call_sites(callers, globals);
}
}  // namespace

// ---------------------------------------------------------- completion
void World::Impl::complete(Rendezvous& rv) {
  // A send/recv pair has two different ops by design; point_to_point()
  // compared its dtype and shape already.
  const bool p2p = rv.calls[0]->op == OpType::Send;
  std::string mismatch = p2p ? std::string() : compare(rv);
  double start = 0;
  for (std::size_t i = 0; i < rv.calls.size(); ++i)
    start = std::max(start, ranks[static_cast<std::size_t>(rv.globals[i])].clock_us);
  rv.start_us = start;
  if (!mismatch.empty()) {
    rv.error = ErrorKind::CollectiveMismatch;
    rv.message = "collective mismatch: " + mismatch + call_sites(rv.calls, rv.globals);
    rv.end_us = start;
    wake(rv);
    return;
  }
  if (!options.move_payloads)
    ;  // verdicts only (WorldOptions::move_payloads)
  else if (rv.calls[0]->op == OpType::AllToAll)
    detail::move_all_to_all(rv);
  else
    detail::move_data(rv.calls);
  rv.end_us = start + cost_us(rv);
  hash_completion(rv);
  for (std::size_t i = 0; i < rv.calls.size(); ++i)
    ranks[static_cast<std::size_t>(rv.globals[i])].clock_us = rv.end_us;
  if (options.trace) record_trace(rv);
  trace_stale = options.trace;
  wake(rv);
}

// ---------------------------------------------------------- joining
// The one join of every primitive: record the arrival in its slot (an
// all_to_all's row too, see fill_all_to_all_row); the last arrival runs
// `last` (take it out of pending, complete it, wake the others), the others
// wait until then. Nothing here yields before wait(), so the order of
// arrivals, wakes and scheduler draws is the callers' alone.
template <class Make, class Last>
std::shared_ptr<Rendezvous> World::Impl::join(std::shared_ptr<Rendezvous>& entry, Make&& make,
                                              int slot, int n, int global, Call& call,
                                              Last&& last) {
  if (!entry) make(entry);
  std::shared_ptr<Rendezvous> rv = entry;  // keeps it alive after erase
  // A call that already failed for the members who came (a deadlock, a
  // member's failure) stays in the group's table until one of them raises
  // from it. A member arriving now (it caught its own error and went on)
  // raises the same error; it must not join: the rendezvous is no longer
  // pending, and those members' calls are gone from their stacks.
  if (rv->done) return rv;
  rv->calls[static_cast<std::size_t>(slot)] = &call;
  rv->arrival_order.push_back(slot);
  if (call.op == OpType::AllToAll)
    detail::fill_all_to_all_row(*rv, static_cast<std::size_t>(slot), call);
  if (++rv->arrived == n)
    last(rv);
  else
    wait(*rv, global, call);
  return rv;
}

void World::Impl::collective(const std::shared_ptr<SimGroup>& g, int slot, Call& call) {
  const int global = g->members[static_cast<std::size_t>(slot)];
  enter(*g, global, call);
  const auto reuse_or_make = [&](std::shared_ptr<Rendezvous>& entry) {
    for (auto it = g->spare.begin(); it != g->spare.end(); ++it)
      if (it->use_count() == 1) {
        entry = std::move(*it);
        g->spare.erase(it);
        break;
      }
    if (!entry) entry = std::make_shared<Rendezvous>();
    entry->reset(g.get(), g->members);
  };
  const auto last = [&](const std::shared_ptr<Rendezvous>& rv) {
    g->erase_pending(call.seq);
    complete(*rv);
    // Waiters still hold it until they return; reused after that. A failed
    // one is not kept (its members raise from it).
    constexpr std::size_t kSpares = 4;
    if (!rv->error && g->spare.size() < kSpares) g->spare.push_back(rv);
  };
  const std::shared_ptr<Rendezvous> rv =
      join(g->pending_entry(call.seq), reuse_or_make, slot, static_cast<int>(g->members.size()),
           global, call, last);
  if (rv->error) {
    if (rv->error != ErrorKind::CollectiveMismatch) g->erase_pending(call.seq);
    raise(*rv, call);
  }
}

void World::Impl::point_to_point(const std::shared_ptr<SimGroup>& g, int slot, Call& call,
                                 std::map<std::tuple<int, int, int>, uint64_t>& counters) {
  const int global = g->members[static_cast<std::size_t>(slot)];
  enter(*g, global, call);
  const bool sending = call.op == OpType::Send;
  const int src = sending ? slot : call.root;
  const int dst = sending ? call.root : slot;
  const uint64_t n = counters[{src, dst, call.tag}]++;
  const auto key = std::make_tuple(src, dst, call.tag, n);
  const auto make = [&](std::shared_ptr<Rendezvous>& entry) {
    entry = std::make_shared<Rendezvous>();
    entry->group = g.get();
    entry->calls.assign(2, nullptr);
    entry->globals = {g->members[static_cast<std::size_t>(src)],
                      g->members[static_cast<std::size_t>(dst)]};
  };
  const auto last = [&](const std::shared_ptr<Rendezvous>& rv) {
    g->pending_p2p.erase(key);
    Call& s = *rv->calls[0];
    Call& r = *rv->calls[1];
    const std::string mismatch =
        dist::compare_p2p(dist::describe(s), src, g->members[static_cast<std::size_t>(src)],
                          dist::describe(r), dst, g->members[static_cast<std::size_t>(dst)]);
    if (!mismatch.empty()) {
      rv->error = ErrorKind::CollectiveMismatch;
      rv->message = "collective mismatch: " + mismatch;  // as checked mode's envelope: no sites
      wake(*rv);
    } else {
      complete(*rv);
    }
  };
  const int my_slot = sending ? 0 : 1;
  const std::shared_ptr<Rendezvous> rv =
      join(g->pending_p2p[key], make, my_slot, 2, global, call, last);
  if (rv->error) raise(*rv, call);
}

std::shared_ptr<dist::Backend> World::Impl::split(const std::shared_ptr<SimGroup>& g, int slot,
                                                  Call& call) {
  const int global = g->members[static_cast<std::size_t>(slot)];
  enter(*g, global, call);
  const std::size_t n = g->members.size();
  const auto make = [&](std::shared_ptr<Rendezvous>& entry) {
    entry = std::make_shared<Rendezvous>();
    entry->group = g.get();
    entry->calls.assign(n, nullptr);
    entry->globals = g->members;
  };
  const auto last = [&](const std::shared_ptr<Rendezvous>& rv) {
    g->erase_pending(call.seq);
    const std::string mismatch = compare(*rv);
    if (mismatch.empty()) {
      split_groups(*rv, *g);
      wake(*rv);
    } else {
      rv->error = ErrorKind::CollectiveMismatch;
      rv->message = "collective mismatch: " + mismatch + call_sites(rv->calls, rv->globals);
      wake(*rv);
    }
  };
  const std::shared_ptr<Rendezvous> rv =
      join(g->pending_entry(call.seq), make, slot, static_cast<int>(n), global, call, last);
  if (rv->error) raise(*rv, call);
  return rv->split_results[static_cast<std::size_t>(slot)];
}

void World::Impl::split_groups(Rendezvous& rv, const SimGroup& g) {
  const std::size_t n = g.members.size();
  // Members with one color form a group, ordered by (key, old rank).
  std::map<int64_t, std::vector<std::pair<int64_t, int>>> by_color;
  for (std::size_t i = 0; i < n; ++i) {
    const int64_t color = rv.calls[i]->color;
    if (color >= 0) by_color[color].push_back({rv.calls[i]->key, static_cast<int>(i)});
  }
  rv.split_results.assign(n, nullptr);
  for (auto& [color, members] : by_color) {
    std::sort(members.begin(), members.end());
    std::vector<int> globals;
    for (auto& m : members) globals.push_back(g.members[static_cast<std::size_t>(m.second)]);
    auto sub = make_group(globals);
    for (std::size_t k = 0; k < members.size(); ++k)
      rv.split_results[static_cast<std::size_t>(members[k].second)] =
          std::make_shared<detail::SimBackend>(this, sub, static_cast<int>(k), running);
  }
}

}  // namespace diffcomm::sim
