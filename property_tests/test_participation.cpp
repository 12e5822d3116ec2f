// Property 5: participation. A member whose loss ignores a collective's
// output still takes part in its backward (it calls grad with a zero
// cotangent), and the others' gradients reach it; a member that never calls
// grad leaves the others waiting in a backward collective, which the
// simulated world reports as diffcomm::Deadlock instead of hanging.
//
// Property 6: all_gather's backward is ONE reduce_scatter. The rank's Stats
// (Rank::stats(), and World::stats(rank) after the run) show, for backward
// alone, exactly one reduce_scatter call on the group, no all_reduce, nothing
// else, and the closed-form traffic: a member sends its N-1 foreign blocks
// and receives N-1 blocks, (N-1) * numel * element size bytes each way.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include "diffcomm/nn/functional.hpp"
#include "support.hpp"

namespace diffcomm::prop {
namespace {

using Rows = std::vector<std::vector<double>>;  // a tensor as rows of values

Rows split_rows(const std::vector<double>& v, int64_t row) {
  Rows out;
  if (row == 0) return out;  // callers track row counts themselves
  for (std::size_t i = 0; i < v.size(); i += static_cast<std::size_t>(row))
    out.emplace_back(v.begin() + static_cast<std::ptrdiff_t>(i),
                     v.begin() + static_cast<std::ptrdiff_t>(i) + row);
  return out;
}

// ---------------------------------------------------------------- property 5a

enum class PartOp { AllGatherSingle, AllToAllSingle };

void check_ignoring_members(PartOp op) {
  const WorldCase w = gen_world(1, 10);
  const int n = w.group_size();
  const Shape row_shape = {*rc::gen::inRange<int64_t>(1, 3)};  // row width 1..2
  const int64_t width = row_shape[0];
  const auto rows = *rc::gen::inRange<int64_t>(0, 3);
  const auto m = gen_split_matrix(n, 2);
  // Which members ignore the output (zero cotangent); any number, even all.
  const auto ignores =
      *rc::gen::container<std::vector<int>>(static_cast<std::size_t>(n), rc::gen::inRange(0, 2));
  std::string what =
      fmt::format("{} {} width={} rows={} ignores=[{}]",
                  op == PartOp::AllGatherSingle ? "all_gather_single" : "all_to_all_single",
                  describe(w), width, rows, fmt::join(ignores, ","));
  if (op == PartOp::AllToAllSingle)
    for (std::size_t i = 0; i < m.size(); ++i)
      what += fmt::format(" m[{}]=[{}]", i, fmt::join(m[i], ","));
  RC_LOG() << what << "\n";

  const auto un = static_cast<std::size_t>(n);
  std::vector<Rows> cot(un), dx(un);
  std::vector<uint64_t> backward_calls(un, 0);
  run_world(w, what, [&](sim::Rank& rk) {
    auto g = make_group(rk, w);
    if (!g) return;
    const auto me = static_cast<std::size_t>(g->rank());
    Tensor x, y;
    const char* backward_op = nullptr;
    if (op == PartOp::AllGatherSingle) {
      x = draw_leaf(with_rows(rows, row_shape), DType::Float64, rk.generator());
      y = nn::all_gather_single(x, *g);
      backward_op = "reduce_scatter_single";
    } else {
      x = draw_leaf(with_rows(total(m[me]), row_shape), DType::Float64, rk.generator());
      y = nn::all_to_all_single(x, column(m, me), m[me], *g);
      backward_op = "all_to_all_single";
    }
    // An ignoring member has no loss term on y: zero cotangent.
    Tensor c = ignores[me] ? zeros_like(y) : draw(y.shape(), DType::Float64, rk.generator());
    const uint64_t before = rk.stats().get(g->name(), backward_op).calls;
    Tensor d = diffcomm::grad({y}, {x}, {c})[0];
    backward_calls[me] = rk.stats().get(g->name(), backward_op).calls - before;
    cot[me] = split_rows(c.to_vector(), width);
    dx[me] = split_rows(d.to_vector(), width);
  });

  // Closed-form gradients from the recorded cotangents.
  for (std::size_t r = 0; r < un; ++r) {
    Rows want;
    if (op == PartOp::AllGatherSingle) {
      // dx_r = sum over members s of rows [r*rows, (r+1)*rows) of cot_s.
      want.assign(static_cast<std::size_t>(rows),
                  std::vector<double>(static_cast<std::size_t>(width), 0.0));
      for (std::size_t s = 0; s < un; ++s)
        for (std::size_t i = 0; i < static_cast<std::size_t>(rows); ++i)
          for (std::size_t k = 0; k < static_cast<std::size_t>(width); ++k)
            want[i][k] += cot[s][r * static_cast<std::size_t>(rows) + i][k];
    } else {
      // Block j of dx_r is the block of cot_j that came from r.
      for (std::size_t j = 0; j < un; ++j) {
        int64_t offset = 0;
        for (std::size_t s = 0; s < r; ++s) offset += m[s][j];
        for (int64_t i = 0; i < m[r][j]; ++i)
          want.push_back(cot[j][static_cast<std::size_t>(offset + i)]);
      }
    }
    if (backward_calls[r] != 1)
      RC_FAIL(fmt::format("{}: member {} ran {} backward collectives, expected 1", what, r,
                          backward_calls[r]));
    // Sums of <= 10 doubles: allow rounding, compare elementwise.
    bool ok = want.size() == dx[r].size();
    for (std::size_t i = 0; ok && i < want.size(); ++i)
      for (std::size_t k = 0; k < want[i].size(); ++k)
        ok = ok && std::fabs(dx[r][i][k] - want[i][k]) <= 1e-12 * (1 + std::fabs(want[i][k]));
    if (!ok) RC_FAIL(fmt::format("{}: member {}: gradient differs from the closed form", what, r));
  }
}

RC_GTEST_PROP(Participation, IgnoringMembersCompleteAllGatherSingleBackward, ()) {
  check_ignoring_members(PartOp::AllGatherSingle);
}
RC_GTEST_PROP(Participation, IgnoringMembersCompleteAllToAllSingleBackward, ()) {
  check_ignoring_members(PartOp::AllToAllSingle);
}

// ---------------------------------------------------------------- property 5b

enum class SkipOp { AllReduce, Broadcast, AllGather, ReduceScatterSingle, AllToAllSingle, Count };

// The collective each op's backward runs (what the others wait in).
const char* backward_text(SkipOp op) {
  switch (op) {
    case SkipOp::AllReduce: return "all_reduce";
    case SkipOp::Broadcast: return "reduce";
    case SkipOp::AllGather: return "reduce_scatter";
    case SkipOp::ReduceScatterSingle: return "all_gather_single";
    case SkipOp::AllToAllSingle: return "all_to_all_single";
    case SkipOp::Count: break;
  }
  return "?";
}

const char* skip_text(SkipOp op) {
  switch (op) {
    case SkipOp::AllReduce: return "all_reduce";
    case SkipOp::Broadcast: return "broadcast";
    case SkipOp::AllGather: return "all_gather";
    case SkipOp::ReduceScatterSingle: return "reduce_scatter_single";
    case SkipOp::AllToAllSingle: return "all_to_all_single";
    case SkipOp::Count: break;
  }
  return "?";
}

RC_GTEST_PROP(Participation, SkippedBackwardIsReportedAsDeadlock, ()) {
  const WorldCase w = gen_world(2, 8, /*min_group=*/2);
  const int n = w.group_size();
  const auto op = static_cast<SkipOp>(*rc::gen::inRange(0, static_cast<int>(SkipOp::Count)));
  const int skipper = *rc::gen::inRange(0, n);
  const auto rows = *rc::gen::inRange<int64_t>(0, 3);
  const std::string what = fmt::format("{} {} rows={} member {} never calls grad", skip_text(op),
                                       describe(w), rows, skipper);
  RC_LOG() << what << "\n";

  sim::WorldOptions opt;
  opt.ranks = w.world;
  opt.seed = w.seed;
  opt.trace = false;
  sim::World world(opt);
  std::vector<bool> finished(static_cast<std::size_t>(w.world), false);
  std::string outcome = "world.run returned normally";
  std::string group_name;
  bool deadlock = false;
  try {
    world.run([&](sim::Rank& rk) {
      auto g = make_group(rk, w);
      if (!g) return;
      const int me = g->rank();
      group_name = g->name();
      Tensor x = draw_leaf({rows * n, 2}, DType::Float64, rk.generator());
      Tensor y;
      switch (op) {
        case SkipOp::AllReduce: y = nn::all_reduce(x, *g); break;
        case SkipOp::Broadcast: y = nn::broadcast(x, n - 1, *g); break;
        case SkipOp::AllGather: y = cat(nn::all_gather(x, *g)); break;
        case SkipOp::ReduceScatterSingle: y = nn::reduce_scatter_single(x, *g); break;
        case SkipOp::AllToAllSingle: y = nn::all_to_all_single(x, {}, {}, *g); break;
        case SkipOp::Count: break;
      }
      if (me == skipper) return;  // forgets its backward
      diffcomm::grad({y}, {x}, {draw(y.shape(), DType::Float64, rk.generator())});
      finished[static_cast<std::size_t>(rk.rank())] = true;
    });
  } catch (const Deadlock& e) {
    deadlock = true;
    outcome = std::string("Deadlock: ") + e.what();
  } catch (const std::exception& e) {
    outcome = std::string("a non-Deadlock error: ") + e.what();
  }
  if (!deadlock) RC_FAIL(fmt::format("{}: expected diffcomm::Deadlock, got {}", what, outcome));
  // The report names the call the others wait in: the group's second call
  // (#0 forward, #1 backward), op and group.
  const std::string call = fmt::format("{} #1 on group '{}'", backward_text(op), group_name);
  if (outcome.find(call) == std::string::npos)
    RC_FAIL(fmt::format("{}: the Deadlock report does not name the waited-for call \"{}\": {}",
                        what, call, outcome));
  for (std::size_t r = 0; r < finished.size(); ++r)
    if (finished[r])
      RC_FAIL(fmt::format("{}: global rank {} finished its backward alone", what, r));
}

// ---------------------------------------------------------------- property 6

uint64_t element_bytes(DType dt) {
  switch (dt) {
    case DType::Float64: return 8;
    case DType::Float32: return 4;
    case DType::BFloat16: return 2;
    default: return 0;
  }
}

RC_GTEST_PROP(Traffic, AllGatherBackwardIsOneReduceScatter, ()) {
  const WorldCase w = gen_world(1, 12);
  const int n = w.group_size();
  const Shape shape = gen_any_shape();
  const DType dtypes[] = {DType::Float64, DType::Float32, DType::BFloat16};
  const DType dt = dtypes[*rc::gen::inRange(0, 3)];
  const std::string what =
      fmt::format("all_gather {} {} shape={}", dtype_name(dt), describe(w), shape_text(shape));
  RC_LOG() << what << "\n";

  struct Seen {
    bool member = false;
    std::string group;
    dist::OpStats fwd_all_gather, bwd_reduce_scatter, bwd_all_reduce;
    uint64_t bwd_calls_all_groups = 0;
    uint64_t total_calls_end = 0;
  };
  const auto uw = static_cast<std::size_t>(w.world);
  std::vector<Seen> seen(uw);
  sim::WorldOptions opt;
  opt.ranks = w.world;
  opt.seed = w.seed;
  opt.trace = false;
  sim::World world(opt);
  std::string error;
  try {
    world.run([&](sim::Rank& rk) {
      auto g = make_group(rk, w);
      if (!g) return;
      Seen& s = seen[static_cast<std::size_t>(rk.rank())];
      s.member = true;
      s.group = g->name();
      Tensor x = draw_leaf(shape, dt, rk.generator());
      const dist::Stats start = rk.stats();
      std::vector<Tensor> ys = nn::all_gather(x, *g);
      const dist::Stats mid = rk.stats();
      std::vector<Tensor> cots;
      for (const auto& y : ys) cots.push_back(draw(y.shape(), dt, rk.generator()));
      diffcomm::grad(ys, {x}, cots);
      const dist::Stats end = rk.stats();
      auto diff = [&](const dist::Stats& a, const dist::Stats& b, const char* op) {
        const dist::OpStats x1 = a.get(g->name(), op), x0 = b.get(g->name(), op);
        return dist::OpStats{x1.calls - x0.calls, x1.bytes_sent - x0.bytes_sent,
                             x1.bytes_received - x0.bytes_received};
      };
      s.fwd_all_gather = diff(mid, start, "all_gather");
      s.bwd_reduce_scatter = diff(end, mid, "reduce_scatter");
      s.bwd_all_reduce = diff(end, mid, "all_reduce");
      s.bwd_calls_all_groups = end.total().calls - mid.total().calls;
      s.total_calls_end = end.total().calls;
    });
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!error.empty()) RC_FAIL(fmt::format("{}: world.run threw: {}", what, error));

  const uint64_t block = static_cast<uint64_t>(shape_numel(shape)) * element_bytes(dt);
  const uint64_t foreign = static_cast<uint64_t>(n - 1) * block;
  for (std::size_t r = 0; r < uw; ++r) {
    const Seen& s = seen[r];
    if (!s.member) continue;
    const auto fail = [&](const std::string& m) {
      RC_FAIL(fmt::format("{}: global rank {} (group '{}'): {}", what, r, s.group, m));
    };
    if (s.fwd_all_gather.calls != 1)
      fail(fmt::format("forward made {} all_gather calls", s.fwd_all_gather.calls));
    if (s.bwd_reduce_scatter.calls != 1)
      fail(fmt::format("backward made {} reduce_scatter calls, expected 1",
                       s.bwd_reduce_scatter.calls));
    if (s.bwd_all_reduce.calls != 0)
      fail(fmt::format("backward made {} all_reduce calls, expected 0", s.bwd_all_reduce.calls));
    if (s.bwd_calls_all_groups != 1)
      fail(fmt::format("backward made {} calls in all, expected 1", s.bwd_calls_all_groups));
    if (s.bwd_reduce_scatter.bytes_sent != foreign ||
        s.bwd_reduce_scatter.bytes_received != foreign)
      fail(fmt::format(
          "backward reduce_scatter moved {} sent / {} received bytes, expected {} "
          "each ((N-1) * numel * element size)",
          s.bwd_reduce_scatter.bytes_sent, s.bwd_reduce_scatter.bytes_received, foreign));
    // The world's view of the same rank agrees.
    const dist::Stats& ws = world.stats(static_cast<int>(r));
    if (ws.get(s.group, "reduce_scatter").calls != 1 || ws.get(s.group, "all_reduce").calls != 0 ||
        ws.total().calls != s.total_calls_end)
      fail("World::stats disagrees with Rank::stats");
  }
}

}  // namespace
}  // namespace diffcomm::prop
