// The simulated world itself: traffic counters (stats), traces and the cost model.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"
#include "fixtures.hpp"

namespace diffcomm {
namespace {

using namespace sim_testing;  // NOLINT(google-build-using-namespace)

// ============================================================ stats

TEST(SimStats, CallsAndBytesFollowTheDocumentedClosedForms) {
  constexpr int N = 4;
  World w(options(N, 9));
  w.run([](Rank& r) {
    const ProcessGroup& g = r.world();
    const int me = r.rank();
    auto sub = g.new_group({3, 1}, "sub");
    Tensor t = zeros({6});  // 24 bytes
    dist::barrier(g);
    dist::all_reduce(g, t);
    dist::broadcast(g, t, 1);
    dist::reduce(g, t, 2);
    std::vector<Tensor> four = {zeros({6}), zeros({6}), zeros({6}), zeros({6})};
    dist::all_gather(g, four, t);
    dist::all_gather_single(g, zeros({24}), t);
    const dist::Splits splits = {1, 0, 2, 3};  // rows of float64[., 2]: 16 bytes a row
    dist::all_gather_v(g, zeros({6, 2}, DType::Float64),
                       zeros({splits[static_cast<std::size_t>(me)], 2}, DType::Float64), splits);
    dist::gather(g, me == 0 ? four : std::vector<Tensor>{}, t, 0);
    dist::scatter(g, t, me == 3 ? four : std::vector<Tensor>{}, 3);
    dist::reduce_scatter(g, t, four);
    dist::reduce_scatter_single(g, t, zeros({24}));
    dist::reduce_scatter_v(g, zeros({splits[static_cast<std::size_t>(me)], 2}, DType::Float64),
                           zeros({6, 2}, DType::Float64), splits);
    // all_to_all: inputs[j] on i has (i + j) % 3 int32 elements.
    std::vector<Tensor> ins, outs;
    for (int j = 0; j < N; ++j) ins.push_back(zeros({(me + j) % 3}, DType::Int32));
    for (int s = 0; s < N; ++s) outs.push_back(zeros({(s + me) % 3}, DType::Int32));
    dist::all_to_all(g, outs, ins);
    // all_to_all_single: member i sends (i + 2j + 1) % 3 rows of int64[., 2] to j.
    dist::Splits in_s, out_s;
    int64_t in_rows = 0, out_rows = 0;
    for (int j = 0; j < N; ++j) in_rows += in_s.emplace_back((me + 2 * j + 1) % 3);
    for (int s = 0; s < N; ++s) out_rows += out_s.emplace_back((s + 2 * me + 1) % 3);
    dist::all_to_all_single(g, zeros({out_rows, 2}, DType::Int64),
                            zeros({in_rows, 2}, DType::Int64), out_s, in_s);
    if (me == 0) dist::send(g, zeros({5}, DType::UInt8), 1);
    if (me == 1) {
      Tensor u = zeros({5}, DType::UInt8);
      dist::recv(g, u, 0);
    }
    if (sub) dist::all_reduce(*sub, t);
  });

  for (int me = 0; me < N; ++me) {
    const dist::Stats& s = w.stats(me);
    auto check = [&](const std::string& group, const std::string& op, uint64_t calls, uint64_t sent,
                     uint64_t received) {
      const dist::OpStats got = s.get(group, op);
      EXPECT_EQ(got.calls, calls) << "rank " << me << " " << group << " " << op;
      EXPECT_EQ(got.bytes_sent, sent) << "rank " << me << " " << group << " " << op << " sent";
      EXPECT_EQ(got.bytes_received, received)
          << "rank " << me << " " << group << " " << op << " received";
    };
    const uint64_t B = 24;
    check("world", "new_group", 1, 0, 0);
    check("world", "barrier", 1, 0, 0);
    check("world", "all_reduce", 1, 2 * (N - 1) * B / N, 2 * (N - 1) * B / N);  // 36, 36
    check("world", "broadcast", 1, me == 1 ? (N - 1) * B : 0, me == 1 ? 0 : B);
    check("world", "reduce", 1, me == 2 ? 0 : B, me == 2 ? (N - 1) * B : 0);
    check("world", "all_gather", 1, (N - 1) * B, (N - 1) * B);
    check("world", "all_gather_single", 1, (N - 1) * B, (N - 1) * B);
    const uint64_t rows_me = std::vector<uint64_t>{1, 0, 2, 3}[static_cast<std::size_t>(me)];
    check("world", "all_gather_v", 1, (N - 1) * rows_me * 16, (6 - rows_me) * 16);
    check("world", "gather", 1, me == 0 ? 0 : B, me == 0 ? (N - 1) * B : 0);
    check("world", "scatter", 1, me == 3 ? (N - 1) * B : 0, me == 3 ? 0 : B);
    check("world", "reduce_scatter", 1, (N - 1) * B, (N - 1) * B);
    check("world", "reduce_scatter_single", 1, (N - 1) * B, (N - 1) * B);
    check("world", "reduce_scatter_v", 1, (6 - rows_me) * 16, (N - 1) * rows_me * 16);
    uint64_t a2a_sent = 0, a2a_recv = 0, a2as_sent = 0, a2as_recv = 0;
    for (int j = 0; j < N; ++j) {
      if (j == me) continue;
      a2a_sent += static_cast<uint64_t>((me + j) % 3) * 4;
      a2a_recv += static_cast<uint64_t>((j + me) % 3) * 4;
      a2as_sent += static_cast<uint64_t>((me + 2 * j + 1) % 3) * 16;
      a2as_recv += static_cast<uint64_t>((j + 2 * me + 1) % 3) * 16;
    }
    check("world", "all_to_all", 1, a2a_sent, a2a_recv);
    check("world", "all_to_all_single", 1, a2as_sent, a2as_recv);
    check("world", "send", me == 0 ? 1 : 0, me == 0 ? 5 : 0, 0);
    check("world", "recv", me == 1 ? 1 : 0, 0, me == 1 ? 5 : 0);
    const bool in_sub = me == 1 || me == 3;
    check("sub", "all_reduce", in_sub ? 1 : 0, in_sub ? B : 0, in_sub ? B : 0);  // 2(2-1)/2 * 24
    EXPECT_EQ(s.total("all_reduce").calls, in_sub ? 2u : 1u);
    EXPECT_EQ(s.total().calls, 15u + (me <= 1 ? 1u : 0u) + (in_sub ? 1u : 0u));
  }
  // The trace carries the same per-call bytes as the counters, and each end
  // of the send/recv pair under its own op.
  int sends = 0, recvs = 0;
  for (const sim::TraceEvent& e : w.trace()) {
    if (e.op == "send") {
      ++sends;
      EXPECT_EQ(e.rank, 0);
      EXPECT_EQ(e.bytes_sent, 5u);
    }
    if (e.op == "recv") {
      ++recvs;
      EXPECT_EQ(e.rank, 1);
      EXPECT_EQ(e.bytes_received, 5u);
    }
    if (e.op != "all_reduce" || e.group != "world") continue;
    EXPECT_EQ(e.bytes_sent, 36u);
    EXPECT_EQ(e.bytes_received, 36u);
  }
  EXPECT_EQ(sends, 1);
  EXPECT_EQ(recvs, 1);
  EXPECT_THROW(w.stats(N), InvalidArgument);
}

TEST(SimStats, ResetOnEveryRun) {
  World w(options(2));
  auto fn = [](Rank& r) { dist::barrier(r.world()); };
  w.run(fn);
  w.run(fn);
  EXPECT_EQ(w.stats(0).get("world", "barrier").calls, 1u);
  EXPECT_EQ(w.trace().size(), 2u);
}

// ============================================================ trace

TEST(SimTrace, WriteTraceProducesChromeTraceJson) {
  World w(options(3, 4));
  w.run([](Rank& r) {
    auto sub = r.world().new_group({2, 0}, "sub");
    dist::barrier(r.world());
    Tensor t = f32({1, 2});
    dist::all_reduce(r.world(), t);
    if (sub) {
      std::vector<Tensor> outs = {zeros({2}), zeros({2})};
      dist::all_gather(*sub, outs, t);
    }
  });
  // barrier 3 + all_reduce 3 + all_gather 2 events (new_group moves no data
  // and is not traced).
  ASSERT_EQ(w.trace().size(), 8u);
  const std::string path = testing::TempDir() + "diffcomm_sim_world_trace.json";
  w.write_trace(path);
  std::ifstream in(path);
  ASSERT_TRUE(in.good());
  nlohmann::json doc;
  ASSERT_NO_THROW(doc = nlohmann::json::parse(in));
  ASSERT_TRUE(doc.contains("traceEvents"));
  ASSERT_TRUE(doc["traceEvents"].is_array());
  int complete = 0, thread_names = 0;
  std::map<std::string, int> per_op;
  for (const auto& e : doc["traceEvents"]) {
    ASSERT_TRUE(e.contains("ph"));
    if (e["ph"] == "M") {
      EXPECT_EQ(e["name"], "thread_name");
      ++thread_names;
      continue;
    }
    ASSERT_EQ(e["ph"], "X");
    ++complete;
    per_op[e["name"].get<std::string>()]++;
    EXPECT_GE(e["tid"].get<int>(), 0);
    EXPECT_LT(e["tid"].get<int>(), 3);
    EXPECT_GE(e["ts"].get<double>(), 0.0);
    EXPECT_GE(e["dur"].get<double>(), 0.0);
    ASSERT_TRUE(e.contains("args"));
    EXPECT_TRUE(e["args"].contains("seq"));
    EXPECT_TRUE(e["args"].contains("group"));
    EXPECT_TRUE(e["args"].contains("bytes_sent"));
    if (e["name"] == "all_gather") {
      EXPECT_EQ(e["args"]["group"], "sub");
      EXPECT_NE(e["tid"], 1);
    }
  }
  EXPECT_EQ(thread_names, 3);
  EXPECT_EQ(complete, 8);
  EXPECT_EQ(per_op["barrier"], 3);
  EXPECT_EQ(per_op["all_reduce"], 3);
  EXPECT_EQ(per_op["all_gather"], 2);
  std::remove(path.c_str());
  EXPECT_THROW(w.write_trace("/nonexistent-dir/x/trace.json"), InvalidArgument);
}

TEST(SimTrace, DisabledTraceKeepsNoEvents) {
  WorldOptions o = options(2);
  o.trace = false;
  World w(o);
  w.run([](Rank& r) { dist::barrier(r.world()); });
  EXPECT_TRUE(w.trace().empty());
  EXPECT_EQ(w.stats(0).get("world", "barrier").calls, 1u);
}

// move_payloads off: calls meet, are timed and compared, but no byte moves.
TEST(SimPayloads, OffMovesNoBytesButKeepsTheVerdictsAndTheClock) {
  WorldOptions o = options(2);
  o.move_payloads = false;
  {
    World w(o);
    w.run([](Rank& r) {
      Tensor t = full({3}, r.rank() + 1.0);
      dist::all_reduce(r.world(), t);
      EXPECT_EQ(t.to_vector(), std::vector<double>(3, r.rank() + 1.0));  // untouched
      Tensor out = zeros({2});
      dist::all_gather_single(r.world(), out, full({1}, 7.0));
      EXPECT_EQ(out.to_vector(), std::vector<double>(2, 0.0));
    });
    EXPECT_GT(w.sim_time_us(), 0.0);
    EXPECT_EQ(w.stats(1).get("world", "all_reduce").calls, 1u);
  }
  World w(o);
  EXPECT_THROW(w.run([](Rank& r) { dist::all_reduce(r.world(), zeros({r.rank() + 1})); }),
               CollectiveMismatch);
}

// ============================================================ cost model

TEST(SimCost, SingleAllReduceFollowsTheAlphaBetaModel) {
  WorldOptions o = options(4, 3);
  o.cost.alpha_us = 2.0;
  o.cost.bandwidth_gbps = 10.0;  // 1e4 bytes per microsecond
  // float32[1000] = 4000 bytes; all_reduce moves 2(N-1)/N of it each way =
  // 6000 bytes over 2(N-1) = 6 steps: 6 * 2 us + 6000 / 1e4 us = 12.6 us.
  const double expected = 6 * 2.0 + 6000.0 / 1e4;
  {
    World w(o);
    std::vector<double> clocks(4);
    w.run([&](Rank& r) {
      EXPECT_EQ(r.now_us(), 0.0);
      Tensor t = zeros({1000});
      dist::all_reduce(r.world(), t);
      clocks[static_cast<std::size_t>(r.rank())] = r.now_us();
    });
    EXPECT_DOUBLE_EQ(w.sim_time_us(), expected);
    for (double c : clocks) EXPECT_DOUBLE_EQ(c, expected);
    ASSERT_EQ(w.trace().size(), 4u);
    for (const auto& e : w.trace()) {
      EXPECT_DOUBLE_EQ(e.start_us, 0.0);
      EXPECT_DOUBLE_EQ(e.duration_us, expected);
    }
  }
  {  // The collective starts when its last member arrives.
    World w(o);
    w.run([&](Rank& r) {
      if (r.rank() == 3) r.advance_us(5.0);
      EXPECT_THROW(r.advance_us(-1.0), InvalidArgument);
      Tensor t = zeros({1000});
      dist::all_reduce(r.world(), t);
      EXPECT_DOUBLE_EQ(r.now_us(), 5.0 + expected);
    });
    EXPECT_DOUBLE_EQ(w.sim_time_us(), 5.0 + expected);
    for (const auto& e : w.trace()) EXPECT_DOUBLE_EQ(e.start_us, 5.0);
  }
  {  // barrier: N-1 steps, no bytes; send: 1 step; one rank: free.
    World w(o);
    w.run([&](Rank& r) {
      dist::barrier(r.world());
      EXPECT_DOUBLE_EQ(r.now_us(), 3 * 2.0);
      Tensor t = zeros({250});  // 1000 bytes
      if (r.rank() == 0) dist::send(r.world(), t, 1);
      if (r.rank() == 1) dist::recv(r.world(), t, 0);
      if (r.rank() <= 1) {
        EXPECT_DOUBLE_EQ(r.now_us(), 6.0 + 2.0 + 1000.0 / 1e4);
      }
    });
    EXPECT_DOUBLE_EQ(w.sim_time_us(), 8.1);
    o.ranks = 1;
    World one(o);
    one.run([](Rank& r) {
      Tensor t = zeros({1000});
      dist::all_reduce(r.world(), t);
    });
    EXPECT_EQ(one.sim_time_us(), 0.0);
  }
}

}  // namespace
}  // namespace diffcomm
