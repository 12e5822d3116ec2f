// Unit tests of the encoder-parallel layer (DESIGN.md "Encoder-parallel
// feature exchange"): Qwen2-VL token counts (checked against transformers' Python smart_resize),
// the contracts, token ownership under CP/TP/SP, the planner and ShardLayout.
//
// Every expected value below is worked out by hand in the comment next to it,
// never taken from the code under test (fixtures.hpp: the shared inputs).
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "diffcomm/encoder_parallel/batch.hpp"
#include "diffcomm/encoder_parallel/contracts.hpp"
#include "diffcomm/encoder_parallel/merge.hpp"
#include "diffcomm/encoder_parallel/planner.hpp"
#include "diffcomm/encoder_parallel/qwen2vl.hpp"
#include "diffcomm/encoder_parallel/tokens.hpp"
#include "fixtures.hpp"

namespace diffcomm {
namespace {

using namespace ep_testing;  // NOLINT(google-build-using-namespace)
using ::testing::HasSubstr;

// ============================================================ qwen2vl

struct ResizeCase {
  int64_t height, width;
  int64_t want_h, want_w;
};

TEST(Qwen2VL, SmartResizeRoundsHalfToEven) {
  // round(x/28) with Python's round: ties go to the even neighbour.
  const std::vector<ResizeCase> cases = {
      {42, 42, 56, 56},      // 1.5 -> 2 -> 56 (56*56 = 3136 = min_pixels: not below it)
      {70, 70, 56, 56},      // 2.5 -> 2 -> 56 (half to even, not up)
      {98, 98, 112, 112},    // 3.5 -> 4 -> 112
      {126, 126, 112, 112},  // 4.5 -> 4 -> 112
      {154, 154, 168, 168},  // 5.5 -> 6 -> 168
      {42, 98, 56, 112},     // 1.5 -> 2, 3.5 -> 4
      {70, 126, 56, 112},    // 2.5 -> 2, 4.5 -> 4
  };
  for (const auto& c : cases) {
    const qw::Resized r = qw::smart_resize(c.height, c.width);
    EXPECT_EQ(r.height, c.want_h) << c.height << "x" << c.width;
    EXPECT_EQ(r.width, c.want_w) << c.height << "x" << c.width;
  }
}

TEST(Qwen2VL, RealCocoSizes) {
  // smart_resize(height, width). 640 wide x 480 high: 480/28 = 17.14 -> 17 ->
  // 476; 640/28 = 22.86 -> 23 -> 644; tokens 17*23 = 391, patches 4*391.
  EXPECT_EQ(qw::smart_resize(480, 640).height, 476);
  EXPECT_EQ(qw::smart_resize(480, 640).width, 644);
  EXPECT_EQ(qw::image_tokens(480, 640), 391);
  EXPECT_EQ(qw::image_patches(480, 640), 1564);
  // COCO 139 (640 x 426): 426/28 = 15.21 -> 15; 23 as above -> 345 tokens.
  EXPECT_EQ(qw::image_tokens(426, 640), 345);
  // COCO 285 (586 x 640): 640/28 = 22.86 -> 23; 586/28 = 20.93 -> 21 -> 483.
  EXPECT_EQ(qw::smart_resize(640, 586).height, 644);
  EXPECT_EQ(qw::smart_resize(640, 586).width, 588);
  EXPECT_EQ(qw::image_tokens(640, 586), 483);
  // 500 x 375: 375/28 = 13.39 -> 13; 500/28 = 17.86 -> 18 -> 234 tokens.
  EXPECT_EQ(qw::image_tokens(375, 500), 234);
  EXPECT_EQ(qw::image_patches(375, 500), 936);
}

TEST(Qwen2VL, TinyImagesReachMinPixels) {
  // 1x1: both round to 0 -> max(28, 0) = 28; 28*28 = 784 < 3136, so
  // beta = sqrt(3136/1) = 56 and h = w = ceil(56/28)*28 = 56 -> 4 tokens.
  EXPECT_EQ(qw::smart_resize(1, 1).height, 56);
  EXPECT_EQ(qw::smart_resize(1, 1).width, 56);
  EXPECT_EQ(qw::image_tokens(1, 1), 4);
  // 20 high x 30 wide: 28x28 = 784 < 3136; beta = sqrt(3136/600) = 2.2862;
  // h = ceil(45.72/28 = 1.63)*28 = 56, w = ceil(68.59/28 = 2.45)*28 = 84.
  EXPECT_EQ(qw::smart_resize(20, 30).height, 56);
  EXPECT_EQ(qw::smart_resize(20, 30).width, 84);
  EXPECT_EQ(qw::image_tokens(20, 30), 6);
  EXPECT_EQ(qw::image_patches(20, 30), 24);
}

TEST(Qwen2VL, HugeImagesCappedAtMaxPixels) {
  // 3000 high x 6000 wide: 2996 x 5992 = 17,952,032 > 12,845,056; beta =
  // sqrt(18e6 / 12845056) = 1.18377; 3000/beta = 2534.3 -> floor(90.51) = 90
  // -> 2520; 6000/beta = 5068.5 -> floor(181.02) = 181 -> 5068.
  const qw::Resized r = qw::smart_resize(3000, 6000);
  EXPECT_EQ(r.height, 2520);
  EXPECT_EQ(r.width, 5068);
  EXPECT_LE(r.height * r.width, qw::kMaxPixels);
  EXPECT_EQ(qw::image_tokens(3000, 6000), 90 * 181);
  // 4000 x 4000 -> exactly 3584 x 3584 = max_pixels (3584 = 128 * 28).
  EXPECT_EQ(qw::image_tokens(4000, 4000), 128 * 128);
}

TEST(Qwen2VL, AspectRatioAndNonPositiveSizes) {
  // Ratio exactly 200 is allowed: 1 x 200 -> h 28, w round(7.14) = 7 -> 196;
  // 28 * 196 = 5488 >= 3136 -> 7 tokens.
  EXPECT_EQ(qw::smart_resize(1, 200).height, 28);
  EXPECT_EQ(qw::smart_resize(1, 200).width, 196);
  EXPECT_EQ(qw::image_tokens(1, 200), 7);
  EXPECT_THAT(invalid_argument_message([] { qw::smart_resize(1, 201); }), HasSubstr("200"));
  EXPECT_THROW(qw::smart_resize(201, 1), InvalidArgument);
  EXPECT_THROW(qw::smart_resize(0, 10), InvalidArgument);
  EXPECT_THROW(qw::smart_resize(10, -1), InvalidArgument);
  EXPECT_THROW(qw::image_tokens(0, 0), InvalidArgument);
}

// ============================================================ contracts

TEST(Contracts, SelectFeatureExchangeAllModes) {
  using M = ep::FeatureExchangeMode;
  auto mode = [](int cp, int tp, bool sp) {
    return ep::select_feature_exchange({cp, tp, sp, 0, 0});
  };
  EXPECT_EQ(mode(1, 1, false), M::Local);
  EXPECT_EQ(mode(1, 1, true), M::Local);
  EXPECT_EQ(mode(1, 2, false), M::TpVariableAllGather);
  EXPECT_EQ(mode(1, 4, true), M::TpVariableA2A);
  EXPECT_EQ(mode(2, 1, false), M::ParentVariableA2A);
  EXPECT_EQ(mode(2, 2, true), M::ParentVariableA2A);
  EXPECT_EQ(mode(3, 2, false), M::ParentVariableA2A);
  EXPECT_THROW(mode(0, 1, false), InvalidArgument);
  EXPECT_THROW(mode(1, 0, false), InvalidArgument);
  EXPECT_EQ(ep::mode_name(M::Local), "local");
  EXPECT_EQ(ep::mode_name(M::TpVariableAllGather), "tp_variable_all_gather");
  EXPECT_EQ(ep::mode_name(M::TpVariableA2A), "tp_variable_a2a");
  EXPECT_EQ(ep::mode_name(M::ParentVariableA2A), "parent_variable_a2a");
}

TEST(Contracts, ReceiverGradConvention) {
  using G = ep::ReceiverGrad;
  EXPECT_EQ(ep::receiver_grad_for({1, 1, false, 0, 0}), G::Partial);
  EXPECT_EQ(ep::receiver_grad_for({1, 2, false, 0, 1}), G::ReplicatedOverTp);
  EXPECT_EQ(ep::receiver_grad_for({1, 2, true, 0, 1}), G::Partial);
  EXPECT_EQ(ep::receiver_grad_for({2, 1, false, 1, 0}), G::Partial);
  EXPECT_EQ(ep::receiver_grad_for({2, 2, false, 1, 0}), G::ReplicatedOverTp);
  EXPECT_EQ(ep::receiver_grad_for({2, 2, true, 1, 1}), G::Partial);
  EXPECT_EQ((ep::MeshContext{3, 4, false, 2, 1}.parent_rank()), 9);
}

// ============================================================ ownership

TEST(Ownership, ContiguousWithAndWithoutSp) {
  // S = 16, cp = 2, tp = 2 (DESIGN's example). SP: 0-3, 4-7, 8-11, 12-15.
  const auto sp = mesh_of(2, 2, true);
  EXPECT_EQ(ep::owned_ranges(16, sp, 0, 0), (Ranges{{0, 4}}));
  EXPECT_EQ(ep::owned_ranges(16, sp, 0, 1), (Ranges{{4, 8}}));
  EXPECT_EQ(ep::owned_ranges(16, sp, 1, 0), (Ranges{{8, 12}}));
  EXPECT_EQ(ep::owned_ranges(16, sp, 1, 1), (Ranges{{12, 16}}));
  // Without SP every TP rank owns its CP rank's half.
  const auto nosp = mesh_of(2, 2, false);
  EXPECT_EQ(ep::owned_ranges(16, nosp, 0, 1), (Ranges{{0, 8}}));
  EXPECT_EQ(ep::owned_ranges(16, nosp, 1, 0), (Ranges{{8, 16}}));
  // cp = 1, tp = 4 with SP: quarters of 12.
  EXPECT_EQ(ep::owned_ranges(12, mesh_of(1, 4, true), 0, 3), (Ranges{{9, 12}}));
  // cp = 3 contiguous, S = 12, no SP: CP 1 owns [4, 8) on every TP rank.
  EXPECT_EQ(ep::owned_ranges(12, mesh_of(3, 2, false), 1, 1), (Ranges{{4, 8}}));
}

TEST(Ownership, OutOfMeshRankRejected) {
  EXPECT_THROW(ep::owned_ranges(12, mesh_of(1, 4, true), 1, 0), InvalidArgument);
  EXPECT_THROW(ep::owned_ranges(12, mesh_of(1, 4, true), 0, 4), InvalidArgument);
  EXPECT_THROW(ep::owned_ranges(12, mesh_of(1, 4, true), -1, 0), InvalidArgument);
  EXPECT_EQ(ep::owned_ranges(12, mesh_of(1, 4, true), 0, 2), (Ranges{{6, 9}}));
}

TEST(Ownership, Zigzag) {
  // S = 16, cp = 2, zigzag: chunks of 4; CP 0 owns chunks 0 and 3, CP 1 owns
  // chunks 1 and 2, in that (local) order.
  const auto zz = mesh_of(2, 2, false, ep::CpLayout::Zigzag);
  EXPECT_EQ(ep::owned_ranges(16, zz, 0, 0), (Ranges{{0, 4}, {12, 16}}));
  EXPECT_EQ(ep::owned_ranges(16, zz, 0, 1), (Ranges{{0, 4}, {12, 16}}));
  EXPECT_EQ(ep::owned_ranges(16, zz, 1, 1), (Ranges{{4, 8}, {8, 12}}));
  // zigzag + SP: the local sequence is cut into tp parts.
  const auto zzsp = mesh_of(2, 2, true, ep::CpLayout::Zigzag);
  EXPECT_EQ(ep::owned_ranges(16, zzsp, 0, 0), (Ranges{{0, 4}}));
  EXPECT_EQ(ep::owned_ranges(16, zzsp, 0, 1), (Ranges{{12, 16}}));
  EXPECT_EQ(ep::owned_ranges(16, zzsp, 1, 0), (Ranges{{4, 8}}));
  EXPECT_EQ(ep::owned_ranges(16, zzsp, 1, 1), (Ranges{{8, 12}}));
  // S = 24, cp = 2, tp = 3, zigzag + SP: chunks of 6; CP 0's local sequence
  // [0,6) ++ [18,24) (12 tokens) in parts of 4: t0 [0,4); t1 [4,6) ++ [18,20)
  // (a part straddling its two chunks); t2 [20,24).
  const auto zz3 = mesh_of(2, 3, true, ep::CpLayout::Zigzag);
  EXPECT_EQ(ep::owned_ranges(24, zz3, 0, 0), (Ranges{{0, 4}}));
  EXPECT_EQ(ep::owned_ranges(24, zz3, 0, 1), (Ranges{{4, 6}, {18, 20}}));
  EXPECT_EQ(ep::owned_ranges(24, zz3, 0, 2), (Ranges{{20, 24}}));
  // CP 1: [6,12) ++ [12,18): t1 owns [10,12) ++ [12,14).
  EXPECT_EQ(ep::owned_ranges(24, zz3, 1, 1), (Ranges{{10, 12}, {12, 14}}));
  // cp = 4, S = 16: chunks of 2; rank 1 owns chunks 1 and 6.
  EXPECT_EQ(ep::owned_ranges(16, mesh_of(4, 1, false, ep::CpLayout::Zigzag), 1, 0),
            (Ranges{{2, 4}, {12, 14}}));
}

TEST(Ownership, IndivisibleLengthsRejected) {
  EXPECT_THROW(ep::owned_ranges(15, mesh_of(2, 1, false), 0, 0), InvalidArgument);
  EXPECT_THROW(ep::owned_ranges(18, mesh_of(2, 1, false, ep::CpLayout::Zigzag), 0, 0),
               InvalidArgument);  // 18 % 4 != 0
  EXPECT_THROW(ep::owned_ranges(18, mesh_of(2, 2, true), 0, 0),
               InvalidArgument);                                      // CP shard of 9 tokens, tp 2
  EXPECT_NO_THROW(ep::owned_ranges(18, mesh_of(2, 2, false), 0, 0));  // no SP: 9 is fine
}

TEST(Ownership, RequiredSeqMultiple) {
  EXPECT_EQ(ep::required_seq_multiple(mesh_of(1, 1, false)), 1);
  EXPECT_EQ(ep::required_seq_multiple(mesh_of(3, 4, false)), 3);
  EXPECT_EQ(ep::required_seq_multiple(mesh_of(3, 4, true)), 12);
  EXPECT_EQ(ep::required_seq_multiple(mesh_of(2, 1, false, ep::CpLayout::Zigzag)), 4);
  EXPECT_EQ(ep::required_seq_multiple(mesh_of(2, 3, true, ep::CpLayout::Zigzag)), 12);
}

// ============================================================ planner

// The exchange group's one rule (DecoderMesh::exchange_size/exchange_rank)
// is what plan_exchange uses, and ExchangePlan::coordinates inverts it.
TEST(Planner, ExchangeRankAndCoordinatesAreInverse) {
  const auto b = design_example();
  for (int cp : {1, 2, 4})
    for (int tp : {1, 2, 4}) {
      const auto mesh = mesh_of(cp, tp, cp > 1 || tp > 1);
      const auto plan =
          ep::plan_exchange(b, mesh, encoder_layout(static_cast<int>(mesh.exchange_size()), 1));
      EXPECT_EQ(plan.exchange_size, mesh.exchange_size());
      for (int c = 0; c < (cp > 1 ? cp : 1); ++c)
        for (int t = 0; t < tp; ++t)
          EXPECT_EQ(plan.coordinates(mesh.exchange_rank(c, t)), std::make_pair(c, t))
              << "cp " << cp << " tp " << tp;
    }
}

TEST(Planner, DesignWorkedExample) {
  const auto b = design_example();
  const auto csp = ep::plan_exchange(b, mesh_of(2, 2, true), encoder_layout(4, 1));
  EXPECT_EQ(csp.mode, ep::FeatureExchangeMode::ParentVariableA2A);
  EXPECT_EQ(csp.exchange_size, 4);
  EXPECT_EQ(csp.destinations, (std::vector<std::vector<int>>{{1, 2}}));
  const auto cnosp = ep::plan_exchange(b, mesh_of(2, 2, false), encoder_layout(4, 1));
  EXPECT_EQ(cnosp.destinations, (std::vector<std::vector<int>>{{0, 1, 2, 3}}));
  const auto zsp =
      ep::plan_exchange(b, mesh_of(2, 2, true, ep::CpLayout::Zigzag), encoder_layout(4, 1));
  EXPECT_EQ(zsp.destinations, (std::vector<std::vector<int>>{{2, 3}}));
  // zigzag without SP: CP 1 (ranks 2, 3) owns tokens 4..11.
  const auto znosp =
      ep::plan_exchange(b, mesh_of(2, 2, false, ep::CpLayout::Zigzag), encoder_layout(2, 2));
  EXPECT_EQ(znosp.destinations, (std::vector<std::vector<int>>{{2, 3}}));
  // The item itself.
  ASSERT_EQ(csp.items.size(), 1u);
  EXPECT_EQ(csp.items[0].item_id, 0);
  EXPECT_EQ(csp.items[0].batch_index, 0);
  EXPECT_EQ(csp.items[0].decoder_token_start, 5);
  EXPECT_EQ(csp.items[0].output_rows, 6);
  EXPECT_EQ(csp.items[0].input_rows, 24);
  EXPECT_EQ(csp.owned(0, 1), (Ranges{{4, 8}}));
  EXPECT_EQ(csp.coordinates(2), (std::pair<int, int>{1, 0}));
  EXPECT_EQ(csp.seq_lens, (std::vector<int64_t>{16}));
}

TEST(Planner, TpModesUseTpCoordinates) {
  // cp = 1, tp = 4 with SP, S = 16: rank t owns [4t, 4t+4); the image 5..10
  // goes to TP ranks 1 and 2. Without SP: to all four (all-gather mode).
  const auto b = design_example();
  const auto sp = ep::plan_exchange(b, mesh_of(1, 4, true), encoder_layout(2, 2));
  EXPECT_EQ(sp.mode, ep::FeatureExchangeMode::TpVariableA2A);
  EXPECT_EQ(sp.exchange_size, 4);
  EXPECT_EQ(sp.destinations, (std::vector<std::vector<int>>{{1, 2}}));
  EXPECT_EQ(sp.coordinates(3), (std::pair<int, int>{0, 3}));
  EXPECT_EQ(sp.producer(1), 2);
  const auto ag = ep::plan_exchange(b, mesh_of(1, 4, false), encoder_layout(4, 1));
  EXPECT_EQ(ag.mode, ep::FeatureExchangeMode::TpVariableAllGather);
  EXPECT_EQ(ag.destinations, (std::vector<std::vector<int>>{{0, 1, 2, 3}}));
  const auto local = ep::plan_exchange(b, mesh_of(1, 1, false), encoder_layout(1, 1));
  EXPECT_EQ(local.mode, ep::FeatureExchangeMode::Local);
  EXPECT_EQ(local.exchange_size, 1);
  EXPECT_EQ(local.destinations, (std::vector<std::vector<int>>{{0}}));
  EXPECT_THROW(local.coordinates(1), InvalidArgument);
}

TEST(Planner, LptBucketsOnHandCase) {
  // LPT on patches, 2 buckets: order 1 (12), 2 (8), 3 (8, tie: lower id
  // first), 0 (4), 4 (2). Loads: 1 -> b0 (12, 0); 2 -> b1 (12, 8); 3 -> b1
  // (12, 16); 0 -> b0 (16, 16); 4 -> tie, lowest bucket b0 (18, 16).
  // Within a bucket items go in id order.
  const auto plan = ep::plan_exchange(five_images(), mesh_of(1, 2, true), encoder_layout(2, 1));
  EXPECT_EQ(plan.buckets, (std::vector<std::vector<int64_t>>{{0, 1, 4}, {2, 3}}));
  EXPECT_EQ(plan.bucket_of, (std::vector<int>{0, 0, 1, 1, 0}));
  // Items: ids in batch order, sample-relative starts.
  ASSERT_EQ(plan.items.size(), 5u);
  EXPECT_EQ(plan.items[3].batch_index, 1);
  EXPECT_EQ(plan.items[3].decoder_token_start, 4);
  EXPECT_EQ(plan.items[3].output_rows, 2);
  EXPECT_EQ(plan.items[3].input_rows, 8);
  for (std::size_t i = 0; i < plan.items.size(); ++i)
    EXPECT_EQ(plan.items[i].item_id, static_cast<int64_t>(i));
  // SP over tp = 2: rank 0 owns [0,4), rank 1 owns [4,8) of each sample.
  EXPECT_EQ(plan.destinations, (std::vector<std::vector<int>>{{0}, {0, 1}, {0}, {1}, {1}}));

  // 4 buckets: 1 -> b0 (12); 2 -> b1 (8); 3 -> b2 (8); 0 -> b3 (4); 4 -> the
  // least loaded, b3 (6).
  const auto four = ep::plan_exchange(five_images(), mesh_of(2, 2, false), encoder_layout(4, 1));
  EXPECT_EQ(four.buckets, (std::vector<std::vector<int64_t>>{{1}, {2}, {3}, {0, 4}}));
  // cp 2 contiguous, no SP: CP 0 (ranks 0, 1) owns [0,4), CP 1 (2, 3) [4,8).
  EXPECT_EQ(four.destinations,
            (std::vector<std::vector<int>>{{0, 1}, {0, 1, 2, 3}, {0, 1}, {2, 3}, {2, 3}}));
  // buckets x encoder_cp = 1 x 4 = exchange group: one bucket with everything.
  const auto one = ep::plan_exchange(five_images(), mesh_of(2, 2, true), encoder_layout(1, 4));
  EXPECT_EQ(one.buckets, (std::vector<std::vector<int64_t>>{{0, 1, 2, 3, 4}}));
  EXPECT_EQ(one.producer(0), 0);
}

TEST(Planner, ExchangeSizeMismatchNamesTheNumbers) {
  // tp = 2 with SP: the exchange group has 2 ranks; 3 x 1 != 2.
  const std::string m = invalid_argument_message(
      [] { ep::plan_exchange(five_images(), mesh_of(1, 2, true), encoder_layout(3, 1)); });
  EXPECT_THAT(m, HasSubstr("3 x 1"));
  EXPECT_THAT(m, HasSubstr("2 ranks"));
  // Parent group of cp 2 x tp 2 = 4 ranks; 2 x 1 != 4.
  const std::string p = invalid_argument_message(
      [] { ep::plan_exchange(five_images(), mesh_of(2, 2, false), encoder_layout(2, 1)); });
  EXPECT_THAT(p, HasSubstr("2 x 1"));
  EXPECT_THAT(p, HasSubstr("4 ranks"));
  EXPECT_THROW(ep::plan_exchange(five_images(), mesh_of(1, 2, true), encoder_layout(0, 2)),
               InvalidArgument);
  EXPECT_THROW(ep::plan_exchange(five_images(), mesh_of(1, 2, true), encoder_layout(2, 0)),
               InvalidArgument);
}

TEST(Planner, RejectsOverlappingAndOutOfRangeImages) {
  const auto m = mesh_of(1, 2, true);
  const auto e = encoder_layout(2, 1);
  ep::Batch overlap;
  overlap.samples.push_back(sample(8, {span(4, 2, 8), span(2, 3, 12)}));  // [4,6) vs [2,5)
  EXPECT_THAT(invalid_argument_message([&] { ep::plan_exchange(overlap, m, e); }),
              HasSubstr("overlapping"));
  ep::Batch touching;  // [2,4) and [4,6) touch but do not overlap
  touching.samples.push_back(sample(8, {span(2, 2, 8), span(4, 2, 8)}));
  EXPECT_NO_THROW(ep::plan_exchange(touching, m, e));
  ep::Batch past_end;
  past_end.samples.push_back(sample(8, {span(6, 3, 12)}));  // [6,9) in 8 tokens
  EXPECT_THAT(invalid_argument_message([&] { ep::plan_exchange(past_end, m, e); }),
              HasSubstr("outside"));
  ep::Batch negative;
  negative.samples.push_back(sample(8, {span(-1, 2, 8)}));
  EXPECT_THROW(ep::plan_exchange(negative, m, e), InvalidArgument);
  ep::Batch indivisible;  // SP over tp 2 needs even lengths
  indivisible.samples.push_back(sample(7, {span(0, 2, 8)}));
  EXPECT_THROW(ep::plan_exchange(indivisible, m, e), InvalidArgument);
}

TEST(Planner, EmptyBatchAndImagelessSamples) {
  ep::Batch b;
  b.samples.push_back(sample(4, {}));
  b.samples.push_back(sample(0, {}));
  const auto plan = ep::plan_exchange(b, mesh_of(1, 2, true), encoder_layout(2, 1));
  EXPECT_TRUE(plan.items.empty());
  EXPECT_EQ(plan.buckets, (std::vector<std::vector<int64_t>>{{}, {}}));
  const auto st = plan.stats(4, DType::Float64);
  EXPECT_TRUE(st.pairs.empty());
  EXPECT_EQ(st.total_bytes, 0u);
  EXPECT_EQ(st.padded_all_gather_bytes, 0u);
  EXPECT_DOUBLE_EQ(st.encoder_imbalance, 1.0);
}

TEST(Planner, StatsClosedFormsA2A) {
  // five_images on cp 1, tp 2, SP (A2A), hidden 4 float64: 32 bytes a row.
  // Rank 0 owns tokens [0, 4) of each sample, rank 1 [4, 8); each rank gets
  // only the rows of its tokens. b0 = {0, 1, 4} on rank 0: item 0 (1 row) ->
  // 0; item 1 (tokens 3..5) -> row 0 to rank 0, rows 1..2 to rank 1; item 4
  // (1) -> 1. b1 = {2, 3} on rank 1: item 2 (2) -> 0; item 3 (2) -> 1.
  // (0,0) 2 rows, (0,1) 3, (1,0) 2, (1,1) 2. Crossing: 5 rows = 160 bytes,
  // the owner minimum (rows the producer owns itself stay).
  const auto plan = ep::plan_exchange(five_images(), mesh_of(1, 2, true), encoder_layout(2, 1));
  const auto st = plan.stats(4, DType::Float64);
  ASSERT_EQ(st.pairs.size(), 4u);
  const std::vector<std::tuple<int, int, int64_t, uint64_t>> want = {
      {0, 0, 2, 64}, {0, 1, 3, 96}, {1, 0, 2, 64}, {1, 1, 2, 64}};
  for (std::size_t k = 0; k < want.size(); ++k) {
    EXPECT_EQ(st.pairs[k].src, std::get<0>(want[k]));
    EXPECT_EQ(st.pairs[k].dst, std::get<1>(want[k]));
    EXPECT_EQ(st.pairs[k].rows, std::get<2>(want[k]));
    EXPECT_EQ(st.pairs[k].bytes, std::get<3>(want[k]));
  }
  EXPECT_EQ(st.total_bytes, 160u);
  EXPECT_EQ(st.owner_minimum_bytes, 160u);
  EXPECT_EQ(st.rows_sent, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(st.rows_received, (std::vector<int64_t>{2, 3}));
  // Pad-to-max all-gather: N (N-1) max_rows row_bytes = 2 * 1 * 5 * 32.
  EXPECT_EQ(st.padded_all_gather_bytes, 320u);
  EXPECT_EQ(st.bucket_patches, (std::vector<int64_t>{18, 16}));
  EXPECT_DOUBLE_EQ(st.encoder_imbalance, 18.0 / 17.0);
}

TEST(Planner, StatsClosedFormsAllGatherAndDesignExample) {
  // All-gather (tp 2, no SP): every bucket goes to both ranks: b0 5 rows,
  // b1 4 rows; crossing 9 rows * 32 bytes = 288.
  const auto ag = ep::plan_exchange(five_images(), mesh_of(1, 2, false), encoder_layout(2, 1));
  const auto st = ag.stats(4, DType::Float64);
  EXPECT_EQ(st.total_bytes, 288u);
  EXPECT_EQ(st.owner_minimum_bytes, 288u);  // both ranks own every token
  EXPECT_EQ(st.rows_sent, (std::vector<int64_t>{5, 4}));
  EXPECT_EQ(st.rows_received, (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(st.padded_all_gather_bytes, 320u);
  // DESIGN example, contiguous + SP, 4 buckets, hidden 8 float32 (32 bytes a
  // row): the one image (tokens 5..10, 6 rows) is made by bucket 0 on rank 0;
  // rank 1 owns tokens 4..7 and gets rows 0..2, rank 2 owns 8..11 and gets
  // rows 3..5: 6 rows = 192 bytes (whole to both was 384); padded 4 * 3 * 6 *
  // 32 = 2304; imbalance = max 24 / mean 6 = 4.
  const auto d = ep::plan_exchange(design_example(), mesh_of(2, 2, true), encoder_layout(4, 1));
  const auto ds = d.stats(8, DType::Float32);
  ASSERT_EQ(ds.pairs.size(), 2u);
  EXPECT_EQ(ds.pairs[0].src, 0);
  EXPECT_EQ(ds.pairs[0].dst, 1);
  EXPECT_EQ(ds.pairs[1].dst, 2);
  EXPECT_EQ(ds.pairs[1].rows, 3);
  EXPECT_EQ(ds.total_bytes, 192u);
  EXPECT_EQ(ds.owner_minimum_bytes, 192u);
  EXPECT_EQ(ds.padded_all_gather_bytes, 2304u);
  EXPECT_EQ(ds.bucket_patches, (std::vector<int64_t>{24, 0, 0, 0}));
  EXPECT_DOUBLE_EQ(ds.encoder_imbalance, 4.0);
  EXPECT_EQ(ds.rows_received, (std::vector<int64_t>{0, 3, 3, 0}));
}

TEST(Planner, RowRoutingSendsEachOwnerItsRuns) {
  // Rank 0 owns rows 0 and 5 of the image (two runs); rank 1 owns rows 1..4,
  // its two chunks joined into one run. Only rank 1's 4 rows cross.
  using Runs = std::vector<std::pair<int64_t, int64_t>>;
  const auto plan = zigzag_straddle();
  EXPECT_EQ(plan.owned_rows(0, 0), (Runs{{0, 1}, {5, 6}}));
  EXPECT_EQ(plan.owned_rows(0, 1), (Runs{{1, 5}}));
  const ep::Transfer out = plan.sends(0);
  EXPECT_EQ(out.splits, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(out.items, (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(out.ranges, (Runs{{0, 1}, {5, 6}, {1, 5}}));
  const ep::Transfer in1 = plan.receives(1);
  EXPECT_EQ(in1.splits, (std::vector<int64_t>{4, 0}));
  EXPECT_EQ(in1.ranges, (Runs{{1, 5}}));
  const auto st = plan.stats(2, DType::Float32);  // 8 bytes a row
  EXPECT_EQ(st.total_bytes, 32u);
  EXPECT_EQ(st.owner_minimum_bytes, 32u);
}

TEST(Planner, FingerprintIsDeterministicAndDistinguishesPlans) {
  const auto a = ep::plan_exchange(five_images(), mesh_of(1, 2, true), encoder_layout(2, 1));
  const auto b = ep::plan_exchange(five_images(), mesh_of(1, 2, true), encoder_layout(2, 1));
  const auto c = ep::plan_exchange(five_images(), mesh_of(1, 2, false), encoder_layout(2, 1));
  EXPECT_EQ(a.fingerprint(), b.fingerprint());
  EXPECT_NE(a.fingerprint(), c.fingerprint());
}

// ============================================================ ShardLayout

TEST(ShardLayout, RowsAndTokens) {
  // cp 2 zigzag (tp 1): sample 0 (S = 8, chunks of 2) and sample 1 (S = 4,
  // chunks of 1). Rank 0 owns [0,2) ++ [6,8) and [0,1) ++ [3,4).
  ep::Batch b;
  b.samples.push_back(sample(8, {}));
  b.samples.push_back(sample(4, {}));
  const auto plan =
      ep::plan_exchange(b, mesh_of(2, 1, false, ep::CpLayout::Zigzag), encoder_layout(2, 1));
  const ep::ShardLayout l0(plan, 0);
  EXPECT_EQ(l0.rows(), 6);
  EXPECT_EQ(l0.tokens(), (std::vector<std::pair<int64_t, int64_t>>{
                             {0, 0}, {0, 1}, {0, 6}, {0, 7}, {1, 0}, {1, 3}}));
  EXPECT_EQ(l0.row_of(0, 6), 2);
  EXPECT_EQ(l0.row_of(1, 3), 5);
  EXPECT_EQ(l0.row_of(0, 3), -1);
  EXPECT_EQ(l0.row_of(2, 0), -1);
  const ep::ShardLayout l1(plan, 1);  // [2,6) and [1,3)
  EXPECT_EQ(l1.rows(), 6);
  EXPECT_EQ(l1.row_of(0, 5), 3);
  EXPECT_EQ(l1.row_of(1, 2), 5);
}

// One contract for sequence lengths (issue 52 item 6): on every mesh up to cp 4 x tp 4 (both
// layouts, with and without SP) and every length 0..2*4*4*2, owned_ranges on every rank and
// plan_exchange accept exactly the multiples of required_seq_multiple, and what they accept is
// owned exactly: each token by one CP rank (and, with SP, by one TP rank of it), in order of the
// layout. 2 * 4 * 4 * 2 * 65 = 4160 (mesh, length) cases.
TEST(SequenceLengthContract, OwnedRangesPlanExchangeAndRequiredMultipleAgree) {
  int cases = 0, accepted = 0;
  for (int cp = 1; cp <= 4; ++cp)
    for (int tp = 1; tp <= 4; ++tp)
      for (bool sp : {false, true})
        for (auto layout : {ep::CpLayout::Contiguous, ep::CpLayout::Zigzag})
          for (int64_t len = 0; len <= 2 * 4 * 4 * 2; ++len) {
            const ep::DecoderMesh mesh = mesh_of(cp, tp, sp, layout);
            const bool valid = len % ep::required_seq_multiple(mesh) == 0;
            const std::string where = fmt::format("cp {} tp {} sp {} {} S = {}", cp, tp, sp,
                                                  ep::cp_layout_name(layout), len);
            ++cases;
            std::vector<int> owners(static_cast<std::size_t>(len), 0);
            int refused_ranks = 0;
            for (int c = 0; c < cp; ++c)
              for (int t = 0; t < tp; ++t) {
                try {
                  for (const auto& [b, e] : ep::owned_ranges(len, mesh, c, t)) {
                    ASSERT_LE(0, b) << where;
                    ASSERT_LE(e, len) << where;
                    // Without SP every TP rank holds its CP rank's tokens: count tp rank 0's.
                    if (sp || t == 0)
                      for (int64_t i = b; i < e; ++i) ++owners[static_cast<std::size_t>(i)];
                  }
                } catch (const InvalidArgument& e) {
                  EXPECT_EQ(e.site().op, "owned_ranges") << where;
                  ++refused_ranks;
                }
              }
            EXPECT_EQ(refused_ranks, valid ? 0 : cp * tp) << where;
            if (valid) {
              for (std::size_t i = 0; i < owners.size(); ++i)
                ASSERT_EQ(owners[i], 1) << where << ", token " << i;
            }
            ep::Batch batch;
            batch.samples.push_back({len, {}});
            const int64_t exchange = mesh.exchange_size();
            bool planned = true;
            try {
              (void)ep::plan_exchange(batch, mesh, encoder_layout(static_cast<int>(exchange), 1));
            } catch (const InvalidArgument&) {
              planned = false;
            }
            EXPECT_EQ(planned, valid) << where;
            accepted += valid ? 1 : 0;
          }
  EXPECT_EQ(cases, 4160);
  EXPECT_GT(accepted, 0);
  // The case the contract and the code used to disagree on: S = 6 on zigzag cp 3, tp 2 with SP.
  EXPECT_EQ(ep::required_seq_multiple(mesh_of(3, 2, true, ep::CpLayout::Zigzag)), 12);
  EXPECT_THROW(ep::owned_ranges(6, mesh_of(3, 2, true, ep::CpLayout::Zigzag), 0, 0),
               InvalidArgument);
  EXPECT_THROW(ep::owned_ranges(-4, mesh_of(2, 1, false), 0, 0), InvalidArgument);
}

}  // namespace
}  // namespace diffcomm
