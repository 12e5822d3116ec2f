// Unit tests of the encoder-parallel layer (DESIGN.md "Encoder-parallel
// feature exchange"): the exchange (route_features in every mode on small simulated
// worlds, forward and gradients), unpack_records and merge_into_decoder.
//
// Every expected value below is worked out by hand in the comment next to it,
// never taken from the code under test (fixtures.hpp: the shared inputs).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "../exception_testing.hpp"
#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/encoder_parallel/contracts.hpp"
#include "diffcomm/encoder_parallel/exchange.hpp"
#include "diffcomm/encoder_parallel/merge.hpp"
#include "diffcomm/encoder_parallel/planner.hpp"
#include "diffcomm/sim/world.hpp"
#include "fixtures.hpp"

namespace diffcomm {
namespace {

using namespace ep_testing;  // NOLINT(google-build-using-namespace)
using ::testing::HasSubstr;

// ============================================================ exchange

std::vector<double> expected_rows(const std::vector<int64_t>& ids, const ep::ExchangePlan& plan) {
  std::vector<double> v;
  for (int64_t id : ids) {
    const auto t = item_rows(plan.items[static_cast<std::size_t>(id)]).to_vector();
    v.insert(v.end(), t.begin(), t.end());
  }
  return v;
}

// Rows [begin, end) of item id: a piece as the A2A modes deliver it.
struct Piece {
  int64_t id, begin, end;
};

std::vector<double> expected_pieces(const std::vector<Piece>& pieces,
                                    const ep::ExchangePlan& plan) {
  std::vector<double> v;
  for (const Piece& p : pieces) {
    const auto t = item_rows(plan.items[static_cast<std::size_t>(p.id)]).to_vector();
    const auto at = [&](int64_t r) { return t.begin() + static_cast<std::ptrdiff_t>(r * kHidden); };
    v.insert(v.end(), at(p.begin), at(p.end));
  }
  return v;
}

struct RouteResult {
  std::vector<std::vector<int64_t>> received_ids;  // per exchange rank
  std::vector<std::vector<double>> rows;           // per exchange rank
  std::map<int64_t, std::vector<double>> grad;     // per item: d loss / d record rows
};

// Runs route_features on a world whose ranks are the exchange group (so
// exchange rank = world rank; for the parent mode with dp = 1 this is the
// mesh order c*tp + t). Each rank's loss is (q + 1) * sum of its received
// rows, so a record's gradient is, per element, the sum of (q + 1) over the
// receivers whose copy counts.
RouteResult route(const ep::ExchangePlan& plan, ep::ReceiverGrad grad, uint64_t seed = 7) {
  const int n = plan.exchange_size;
  RouteResult res;
  res.received_ids.resize(static_cast<std::size_t>(n));
  res.rows.resize(static_cast<std::size_t>(n));
  std::vector<std::vector<ep::EncoderFeature>> recs(static_cast<std::size_t>(n));
  sim::WorldOptions o;
  o.ranks = n;
  o.seed = seed;
  sim::World world(o);
  world.run([&](sim::Rank& rk) {
    const int q = rk.rank();
    auto& mine = recs[static_cast<std::size_t>(q)];
    mine = records_of(plan, q);
    Tensor proto = zeros({0, kHidden}, DType::Float64);
    proto.set_requires_grad(true);
    const ep::RoutedFeatures r =
        ep::route_features(plan.mode, mine, proto, q, plan, rk.world(), grad);
    for (const auto& it : r.items)
      res.received_ids[static_cast<std::size_t>(q)].push_back(it.item_id);
    res.rows[static_cast<std::size_t>(q)] = r.rows.to_vector();
    const Tensor loss = dot(r.rows, full(r.rows.shape(), q + 1.0, DType::Float64));
    backward({loss});
  });
  for (const auto& mine : recs)
    for (const auto& f : mine)
      res.grad[f.item.item_id] =
          f.rows.grad().defined()
              ? f.rows.grad().to_vector()
              : std::vector<double>(static_cast<std::size_t>(f.rows.numel()), 0.0);
  return res;
}

void expect_grad(const RouteResult& r, const ep::ExchangePlan& plan,
                 const std::map<int64_t, double>& per_item) {
  ASSERT_EQ(r.grad.size(), plan.items.size());
  for (const auto& [id, w] : per_item) {
    const auto& g = r.grad.at(id);
    ASSERT_EQ(static_cast<int64_t>(g.size()),
              plan.items[static_cast<std::size_t>(id)].output_rows * kHidden);
    for (double v : g) EXPECT_EQ(v, w) << "item " << id;
  }
}

// Like expect_grad for one item whose rows differ: per_row[r] for row r.
void expect_row_grad(const RouteResult& r, int64_t id, const std::vector<double>& per_row) {
  const auto& g = r.grad.at(id);
  ASSERT_EQ(g.size(), per_row.size() * static_cast<std::size_t>(kHidden));
  for (std::size_t k = 0; k < g.size(); ++k)
    EXPECT_EQ(g[k], per_row[k / static_cast<std::size_t>(kHidden)]) << "item " << id << " at " << k;
}

TEST(RouteFeatures, LocalMode) {
  // One rank, one bucket {0..4} in id order; rows arrive unchanged.
  const auto plan = ep::plan_exchange(five_images(), mesh_of(1, 1, false), encoder_layout(1, 1));
  const auto r = route(plan, ep::ReceiverGrad::Partial);
  EXPECT_EQ(r.received_ids[0], (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(r.rows[0], expected_rows({0, 1, 2, 3, 4}, plan));
  expect_grad(r, plan, {{0, 1.0}, {1, 1.0}, {2, 1.0}, {3, 1.0}, {4, 1.0}});
}

TEST(RouteFeatures, TpVariableA2A) {
  // tp 2 + SP: b0 = {0, 1, 4} on rank 0, b1 = {2, 3} on rank 1;
  // destinations 0:{0} 1:{0,1} 2:{0} 3:{1} 4:{1}. Rows arrive by producer,
  // then bucket order: rank 0 gets 0, 1 (from rank 0) then 2; rank 1 gets
  // 1, 4 then 3. Item 1 (tokens 3..5) straddles: rank 0 owns token 3 and
  // gets row 0 only, rank 1 rows 1..2. Gradient (Partial, the adjoint): sum
  // of (q + 1) over the receivers of a row: items 0, 2 -> 1; items 3, 4 -> 2;
  // item 1 -> 1, 2, 2 by row.
  const auto plan = ep::plan_exchange(five_images(), mesh_of(1, 2, true), encoder_layout(2, 1));
  const auto r = route(plan, ep::ReceiverGrad::Partial);
  EXPECT_EQ(r.received_ids[0], (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(r.received_ids[1], (std::vector<int64_t>{1, 4, 3}));
  EXPECT_EQ(r.rows[0], expected_pieces({{0, 0, 1}, {1, 0, 1}, {2, 0, 2}}, plan));
  EXPECT_EQ(r.rows[1], expected_pieces({{1, 1, 3}, {4, 0, 1}, {3, 0, 2}}, plan));
  expect_grad(r, plan, {{0, 1.0}, {2, 1.0}, {3, 2.0}, {4, 2.0}});
  expect_row_grad(r, 1, {1.0, 2.0, 2.0});
}

TEST(RouteFeatures, TpVariableA2AWithEncoderCp) {
  // tp 2 + SP, buckets 1 x encoder_cp 2: everything is produced on rank 0,
  // rank 1 sends nothing (an empty sender, still in forward and backward).
  const auto plan = ep::plan_exchange(five_images(), mesh_of(1, 2, true), encoder_layout(1, 2));
  const auto r = route(plan, ep::ReceiverGrad::Partial);
  EXPECT_EQ(r.received_ids[0], (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(r.received_ids[1], (std::vector<int64_t>{1, 3, 4}));
  EXPECT_EQ(r.rows[1], expected_pieces({{1, 1, 3}, {3, 0, 2}, {4, 0, 1}}, plan));
  expect_grad(r, plan, {{0, 1.0}, {2, 1.0}, {3, 2.0}, {4, 2.0}});
  expect_row_grad(r, 1, {1.0, 2.0, 2.0});
}

TEST(RouteFeatures, TpVariableAllGather) {
  // tp 2, no SP: every rank gets producer 0's {0, 1, 4} then producer 1's
  // {2, 3}. Partial counts both receivers (1 + 2 = 3); ReplicatedOverTp
  // keeps each producer's own copy: bucket 0 -> 1, bucket 1 -> 2.
  const auto plan = ep::plan_exchange(five_images(), mesh_of(1, 2, false), encoder_layout(2, 1));
  const auto partial = route(plan, ep::ReceiverGrad::Partial);
  for (int q = 0; q < 2; ++q) {
    EXPECT_EQ(partial.received_ids[static_cast<std::size_t>(q)],
              (std::vector<int64_t>{0, 1, 4, 2, 3}));
    EXPECT_EQ(partial.rows[static_cast<std::size_t>(q)], expected_rows({0, 1, 4, 2, 3}, plan));
  }
  expect_grad(partial, plan, {{0, 3.0}, {1, 3.0}, {2, 3.0}, {3, 3.0}, {4, 3.0}});
  const auto repl = route(plan, ep::ReceiverGrad::ReplicatedOverTp);
  EXPECT_EQ(repl.rows[1], expected_rows({0, 1, 4, 2, 3}, plan));
  expect_grad(repl, plan, {{0, 1.0}, {1, 1.0}, {2, 2.0}, {3, 2.0}, {4, 1.0}});
}

TEST(RouteFeatures, ParentVariableA2A) {
  // cp 2, tp 2, no SP, 4 buckets: b0 {1}, b1 {2}, b2 {3}, b3 {0, 4};
  // destinations 0:{0,1} 1:{0,1,2,3} 2:{0,1} 3:{2,3} 4:{2,3}. Ranks 0 and 1
  // receive 1 (from 0), 2 (from 1), 0 (from 3); ranks 2 and 3 receive 1, 3,
  // 4. Item 1 (tokens 3..5): CP rank 0 (ranks 0, 1) owns token 3 and gets
  // row 0, CP rank 1 (ranks 2, 3) rows 1..2. Partial: item 0 -> 1+2; 1 ->
  // 1+2, 3+4, 3+4 by row; 2 -> 3; 3, 4 -> 3+4. ReplicatedOverTp counts the
  // TP rank 0 copies (ranks 0 and 2, weights 1 and 3): item 0 -> 1; 1 -> 1,
  // 3, 3; 2 -> 1; 3, 4 -> 3.
  const auto plan = ep::plan_exchange(five_images(), mesh_of(2, 2, false), encoder_layout(4, 1));
  const auto partial = route(plan, ep::ReceiverGrad::Partial);
  EXPECT_EQ(partial.received_ids[0], (std::vector<int64_t>{1, 2, 0}));
  EXPECT_EQ(partial.received_ids[1], (std::vector<int64_t>{1, 2, 0}));
  EXPECT_EQ(partial.received_ids[2], (std::vector<int64_t>{1, 3, 4}));
  EXPECT_EQ(partial.received_ids[3], (std::vector<int64_t>{1, 3, 4}));
  EXPECT_EQ(partial.rows[3], expected_pieces({{1, 1, 3}, {3, 0, 2}, {4, 0, 1}}, plan));
  expect_grad(partial, plan, {{0, 3.0}, {2, 3.0}, {3, 7.0}, {4, 7.0}});
  expect_row_grad(partial, 1, {3.0, 7.0, 7.0});
  const auto repl = route(plan, ep::ReceiverGrad::ReplicatedOverTp);
  EXPECT_EQ(repl.rows[0], expected_pieces({{1, 0, 1}, {2, 0, 2}, {0, 0, 1}}, plan));
  expect_grad(repl, plan, {{0, 1.0}, {2, 1.0}, {3, 3.0}, {4, 3.0}});
  expect_row_grad(repl, 1, {1.0, 3.0, 3.0});
  // cp 2, tp 1 (contiguous): the same destinations as tp 2 + SP above.
  const auto cp2 = ep::plan_exchange(five_images(), mesh_of(2, 1, false), encoder_layout(2, 1));
  EXPECT_EQ(cp2.mode, ep::FeatureExchangeMode::ParentVariableA2A);
  const auto r2 = route(cp2, ep::ReceiverGrad::Partial);
  EXPECT_EQ(r2.received_ids[1], (std::vector<int64_t>{1, 4, 3}));
  EXPECT_EQ(r2.rows[0], expected_pieces({{0, 0, 1}, {1, 0, 1}, {2, 0, 2}}, cp2));
}

TEST(RouteFeatures, ZigzagPiecesAndTheirGradients) {
  // zigzag_straddle: rank 0 keeps rows 0 and 5 (two pieces of item 0), rank 1
  // gets rows 1..4. Partial: rows 0, 5 -> 1, rows 1..4 -> 2.
  const auto plan = zigzag_straddle();
  const auto r = route(plan, ep::ReceiverGrad::Partial);
  EXPECT_EQ(r.received_ids[0], (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(r.received_ids[1], (std::vector<int64_t>{0}));
  EXPECT_EQ(r.rows[0], expected_pieces({{0, 0, 1}, {0, 5, 6}}, plan));
  EXPECT_EQ(r.rows[1], expected_pieces({{0, 1, 5}}, plan));
  expect_row_grad(r, 0, {1.0, 2.0, 2.0, 2.0, 2.0, 1.0});
}

TEST(RouteFeatures, GroupSizeMustEqualBucketsTimesEncoderCp) {
  // A plan for tp 2 (2 x 1) on a 4-rank group: every rank refuses before
  // communicating, naming both sizes.
  const auto plan = ep::plan_exchange(five_images(), mesh_of(1, 2, true), encoder_layout(2, 1));
  sim::WorldOptions o;
  o.ranks = 4;
  sim::World world(o);
  EXPECT_THROW(world.run([&](sim::Rank& rk) {
    Tensor proto = zeros({0, kHidden}, DType::Float64);
    ep::route_features(plan.mode, records_of(plan, rk.rank() % 2), proto, rk.rank(), plan,
                       rk.world(), ep::ReceiverGrad::Partial);
  }),
               InvalidArgument);
  const auto msgs = world.error_messages();
  ASSERT_EQ(msgs.size(), 4u);
  for (const auto& m : msgs) {
    EXPECT_THAT(m, HasSubstr("4 ranks"));
    EXPECT_THAT(m, HasSubstr("2 x 1"));
  }
}

TEST(RouteFeatures, RecordsThatDisagreeWithThePlanAreRejected) {
  const auto plan = ep::plan_exchange(five_images(), mesh_of(1, 2, true), encoder_layout(2, 1));
  auto run_with = [&](const std::function<std::vector<ep::EncoderFeature>(int)>& records) {
    sim::WorldOptions o;
    o.ranks = 2;
    auto world = std::make_unique<sim::World>(o);
    try {
      world->run([&](sim::Rank& rk) {
        Tensor proto = zeros({0, kHidden}, DType::Float64);
        proto.set_requires_grad(true);
        ep::route_features(plan.mode, records(rk.rank()), proto, rk.rank(), plan, rk.world(),
                           ep::ReceiverGrad::Partial);
      });
    } catch (const Error&) {
    }
    return world;
  };
  // Rank 0 swaps its records; rank 1 is fine: rank 0 refuses, rank 1 gets a
  // RankFailure (not a hang).
  {
    auto w = run_with([&](int q) {
      auto r = records_of(plan, q);
      if (q == 0) std::swap(r[0], r[1]);
      return r;
    });
    EXPECT_TRUE(test_util::holds<InvalidArgument>(w->errors()[0]));
    EXPECT_THAT(w->error_messages()[0], HasSubstr("item"));
    ASSERT_TRUE(w->errors()[1]);
    EXPECT_THROW(std::rethrow_exception(w->errors()[1]), RankFailure);
  }
  // Wrong row count on rank 1, a missing record on rank 0.
  {
    auto w = run_with([&](int q) {
      auto r = records_of(plan, q);
      if (q == 1) r[1].rows = narrow(r[1].rows, 0, 1);
      if (q == 0) r.pop_back();
      return r;
    });
    EXPECT_TRUE(test_util::holds<InvalidArgument>(w->errors()[0]));
    EXPECT_TRUE(test_util::holds<InvalidArgument>(w->errors()[1]));
    EXPECT_THAT(w->error_messages()[0], HasSubstr("2 records"));
    EXPECT_THAT(w->error_messages()[1], HasSubstr("item 3"));
  }
  // Records on a non-producer (buckets 1 x encoder_cp 2: rank 1 produces nothing).
  {
    const auto plan12 = ep::plan_exchange(five_images(), mesh_of(1, 2, true), encoder_layout(1, 2));
    sim::WorldOptions o;
    o.ranks = 2;
    sim::World world(o);
    EXPECT_THROW(world.run([&](sim::Rank& rk) {
      Tensor proto = zeros({0, kHidden}, DType::Float64);
      auto r = records_of(plan12, 0);
      ep::route_features(plan12.mode, r, proto, rk.rank(), plan12, rk.world(),
                         ep::ReceiverGrad::Partial);
    }),
                 Error);
    EXPECT_TRUE(test_util::holds<InvalidArgument>(world.errors()[1]));
  }
}

TEST(RouteFeatures, ModeMustMatchThePlan) {
  const auto plan = ep::plan_exchange(five_images(), mesh_of(1, 2, true), encoder_layout(2, 1));
  sim::WorldOptions o;
  o.ranks = 2;
  sim::World world(o);
  EXPECT_THROW(world.run([&](sim::Rank& rk) {
    Tensor proto = zeros({0, kHidden}, DType::Float64);
    ep::route_features(ep::FeatureExchangeMode::TpVariableAllGather, records_of(plan, rk.rank()),
                       proto, rk.rank(), plan, rk.world(), ep::ReceiverGrad::Partial);
  }),
               InvalidArgument);
}

// ============================================================ unpack

ep::EncoderWorkItem work_item(int64_t id, int64_t batch, int64_t start, int64_t rows) {
  ep::EncoderWorkItem it;
  it.item_id = id;
  it.batch_index = batch;
  it.decoder_token_start = start;
  it.input_rows = 4 * rows;
  it.output_rows = rows;
  return it;
}

TEST(Unpack, OrdersByBatchStartAndItemId) {
  // Transport order: 7 (b1, t0, 2 rows), 2 (b0, t5, 1), 9 (b0, t5, 0 rows),
  // 1 (b0, t5, 2), 3 (b0, t0, 1). Sorted: 3 (b0 t0), then the three at b0
  // t5 by id: 1, 2, 9, then 7 (b1).
  const std::vector<ep::EncoderWorkItem> items = {work_item(7, 1, 0, 2), work_item(2, 0, 5, 1),
                                                  work_item(9, 0, 5, 0), work_item(1, 0, 5, 2),
                                                  work_item(3, 0, 0, 1)};
  // Row k of the transport holds value k in every column.
  std::vector<double> v;
  for (int k = 0; k < 6; ++k)
    for (int h = 0; h < 2; ++h) v.push_back(k);
  Tensor rows = from_vector(v, {6, 2}, DType::Float64);
  rows.set_requires_grad(true);
  const auto recs = ep::unpack_records(rows, items);
  ASSERT_EQ(recs.size(), 5u);
  std::vector<int64_t> ids;
  for (const auto& r : recs) ids.push_back(r.item.item_id);
  EXPECT_EQ(ids, (std::vector<int64_t>{3, 1, 2, 9, 7}));
  // Transport rows: 7 -> 0, 1; 2 -> 2; 9 -> none; 1 -> 3, 4; 3 -> 5.
  EXPECT_EQ(recs[0].rows.to_vector(), (std::vector<double>{5, 5}));
  EXPECT_EQ(recs[1].rows.to_vector(), (std::vector<double>{3, 3, 4, 4}));
  EXPECT_EQ(recs[2].rows.to_vector(), (std::vector<double>{2, 2}));
  EXPECT_EQ(recs[3].rows.shape(), (Shape{0, 2}));
  EXPECT_EQ(recs[4].rows.to_vector(), (std::vector<double>{0, 0, 1, 1}));
  EXPECT_EQ(recs[1].item, items[3]);
  // Records are differentiable views: d/d rows of sum_k (k+1) * sum(record k)
  // puts k+1 on the record's transport rows.
  Tensor loss = scale(sum(recs[0].rows), 1.0);
  for (std::size_t k = 1; k < recs.size(); ++k)
    loss = add(loss, scale(sum(recs[k].rows), static_cast<double>(k + 1)));
  const auto g = grad({loss}, {rows})[0].to_vector();
  // rows 0,1 -> record 4 (weight 5); row 2 -> record 2 (3); rows 3,4 ->
  // record 1 (2); row 5 -> record 0 (1).
  EXPECT_EQ(g, (std::vector<double>{5, 5, 5, 5, 3, 3, 2, 2, 2, 2, 1, 1}));
}

TEST(Unpack, RowCountMismatchStatesBothCounts) {
  const std::vector<ep::EncoderWorkItem> items = {work_item(0, 0, 0, 2), work_item(1, 0, 4, 4)};
  const Tensor five = zeros({5, 2}, DType::Float64);
  const std::string m = invalid_argument_message([&] { ep::unpack_records(five, items); });
  EXPECT_THAT(m, HasSubstr("5 rows"));
  EXPECT_THAT(m, HasSubstr("6 rows"));
  const Tensor seven = zeros({7, 2}, DType::Float64);
  EXPECT_THROW(ep::unpack_records(seven, items), InvalidArgument);
  EXPECT_THROW(ep::unpack_records(zeros({6}, DType::Float64), items), InvalidArgument);
  EXPECT_THROW(ep::unpack_records(Tensor{}, items), InvalidArgument);
  EXPECT_TRUE(ep::unpack_records(zeros({0, 2}, DType::Float64), {}).empty());
}

// ============================================================ merge

TEST(Merge, ForwardAndClosedFormGradient) {
  // tp 2 + SP, S = 8: rank 1 owns tokens 4..7 (shard rows 0..3). Item at
  // tokens [3,6): rank 1 owns tokens 4, 5 = record rows 1, 2 -> shard rows 0, 1.
  ep::Batch b;
  b.samples.push_back(sample(8, {span(3, 3, 12)}));
  const auto plan = ep::plan_exchange(b, mesh_of(1, 2, true), encoder_layout(2, 1));
  const ep::ShardLayout layout(plan, 1);
  ASSERT_EQ(layout.rows(), 4);
  Tensor base = from_vector({-1, -2, -3, -4, -5, -6, -7, -8}, {4, 2}, DType::Float64);
  Tensor rec = from_vector({10, 11, 20, 21, 30, 31}, {3, 2}, DType::Float64);
  base.set_requires_grad(true);
  rec.set_requires_grad(true);
  const Tensor out = ep::merge_into_decoder(base, {{plan.items[0], rec}}, layout);
  EXPECT_EQ(out.to_vector(), (std::vector<double>{20, 21, 30, 31, -5, -6, -7, -8}));
  const Tensor g = from_vector({1, 2, 3, 4, 5, 6, 7, 8}, {4, 2}, DType::Float64);
  const auto grads = grad({out}, {base, rec}, {g});
  EXPECT_EQ(grads[0].to_vector(), (std::vector<double>{0, 0, 0, 0, 5, 6, 7, 8}));
  EXPECT_EQ(grads[1].to_vector(), (std::vector<double>{0, 0, 1, 2, 3, 4}));
}

TEST(Merge, ZigzagLocalOrderAndGradcheck) {
  // cp 2 zigzag, S = 8 (chunks of 2): rank 0 owns [0,2) ++ [6,8). Images at
  // [0,1) and [5,8): rank 0 owns token 0 (row 0) and tokens 6, 7 (rows 2, 3
  // = record rows 1, 2).
  ep::Batch b;
  b.samples.push_back(sample(8, {span(0, 1, 4), span(5, 3, 12)}));
  const auto plan =
      ep::plan_exchange(b, mesh_of(2, 1, false, ep::CpLayout::Zigzag), encoder_layout(2, 1));
  const ep::ShardLayout layout(plan, 0);
  Tensor base = from_vector({1, 2, 3, 4, 5, 6, 7, 8}, {4, 2}, DType::Float64);
  const Tensor r0 = from_vector({9, 9}, {1, 2}, DType::Float64);
  const Tensor r1 = from_vector({10, 11, 20, 21, 30, 31}, {3, 2}, DType::Float64);
  const Tensor out =
      ep::merge_into_decoder(base, {{plan.items[0], r0}, {plan.items[1], r1}}, layout);
  EXPECT_EQ(out.to_vector(), (std::vector<double>{9, 9, 3, 4, 20, 21, 30, 31}));
  // Finite differences agree with the backward in float64.
  const auto items = plan.items;
  const double err = gradcheck_max_error(
      [&](const std::vector<Tensor>& in) {
        return ep::merge_into_decoder(in[0], {{items[0], in[1]}, {items[1], in[2]}}, layout);
      },
      {base.copy_data(), r0.copy_data(), r1.copy_data()});
  EXPECT_LT(err, 1e-8);
}

TEST(Merge, RejectsBadShapes) {
  ep::Batch b;
  b.samples.push_back(sample(8, {span(3, 3, 12)}));
  const auto plan = ep::plan_exchange(b, mesh_of(1, 2, true), encoder_layout(2, 1));
  const ep::ShardLayout layout(plan, 1);
  const Tensor base = zeros({4, 2}, DType::Float64);
  EXPECT_THROW(ep::merge_into_decoder(zeros({3, 2}, DType::Float64), {}, layout), InvalidArgument);
  EXPECT_THROW(
      ep::merge_into_decoder(base, {{plan.items[0], zeros({3, 3}, DType::Float64)}}, layout),
      InvalidArgument);  // width
  EXPECT_THROW(
      ep::merge_into_decoder(base, {{plan.items[0], zeros({2, 2}, DType::Float64)}}, layout),
      InvalidArgument);  // rows vs output_rows
  EXPECT_THROW(
      ep::merge_into_decoder(base, {{plan.items[0], zeros({3, 2}, DType::Float32)}}, layout),
      InvalidArgument);  // dtype
}

}  // namespace
}  // namespace diffcomm
