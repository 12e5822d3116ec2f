// Unit tests of the encoder-parallel layer (DESIGN.md "Encoder-parallel
// feature exchange"): Qwen2-VL token counts, token ownership and the
// planner, the exchange on small simulated worlds, unpack, the decoder
// merge, the COCO size loader and the batch builder.
//
// Every expected value below is worked out by hand in the comment next to
// it (token ranges, LPT buckets, destinations, byte counts, gradients), never
// taken from the code under test. The smart_resize cases were also checked
// against transformers' Python smart_resize.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "diffcomm/autograd.hpp"
#include "diffcomm/dist/collectives.hpp"
#include "diffcomm/encoder_parallel/batch.hpp"
#include "diffcomm/encoder_parallel/contracts.hpp"
#include "diffcomm/encoder_parallel/exchange.hpp"
#include "diffcomm/encoder_parallel/merge.hpp"
#include "diffcomm/encoder_parallel/planner.hpp"
#include "diffcomm/encoder_parallel/qwen2vl.hpp"
#include "diffcomm/encoder_parallel/tokens.hpp"
#include "diffcomm/encoder_parallel/training_step.hpp"
#include "diffcomm/error.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/ops.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor.hpp"

namespace diffcomm {
namespace {

namespace ep = encoder_parallel;
namespace qw = encoder_parallel::qwen2vl;
using ::testing::AllOf;
using ::testing::HasSubstr;
using Ranges = std::vector<std::pair<int64_t, int64_t>>;

// Runs `what` and returns the message of the InvalidArgument it throws
// (fails the test when it throws nothing or something else).
std::string invalid_argument_message(const std::function<void()>& what) {
  try {
    what();
  } catch (const InvalidArgument& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected InvalidArgument, got: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected InvalidArgument, nothing was thrown";
  return "";
}

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

ep::DecoderMesh mesh_of(int cp, int tp, bool sp, ep::CpLayout layout = ep::CpLayout::Contiguous) {
  ep::DecoderMesh m;
  m.cp = cp;
  m.tp = tp;
  m.sp = sp;
  m.layout = layout;
  return m;
}

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

ep::ImageSpan span(int64_t start, int64_t tokens, int64_t patches) {
  ep::ImageSpan s;
  s.token_start = start;
  s.tokens = tokens;
  s.patches = patches;
  return s;
}

ep::Sample sample(int64_t seq_len, std::vector<ep::ImageSpan> images) {
  ep::Sample s;
  s.seq_len = seq_len;
  s.images = std::move(images);
  return s;
}

ep::EncoderLayout encoder_layout(int buckets, int ecp) {
  ep::EncoderLayout e;
  e.buckets = buckets;
  e.encoder_cp = ecp;
  return e;
}

// DESIGN's example: S = 16, one image on tokens 5..10 (6 rows).
ep::Batch design_example() {
  ep::Batch b;
  b.samples.push_back(sample(16, {span(5, 6, 24)}));
  return b;
}

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

// Five images over two samples of 8 tokens (patches 4, 12, 8, 8, 2):
//   sample 0: item 0 at [1,2) (p 4), item 1 at [3,6) (p 12)
//   sample 1: item 2 at [0,2) (p 8), item 3 at [4,6) (p 8), item 4 at [7,8) (p 2)
ep::Batch five_images() {
  ep::Batch b;
  b.samples.push_back(sample(8, {span(1, 1, 4), span(3, 3, 12)}));
  b.samples.push_back(sample(8, {span(0, 2, 8), span(4, 2, 8), span(7, 1, 2)}));
  return b;
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

// Zigzag cp 2 (S = 8, chunks of 2): rank 0 owns [0, 2) ++ [6, 8), rank 1
// [2, 4) ++ [4, 6). One image on tokens 1..6, made on rank 0.
ep::ExchangePlan zigzag_straddle() {
  ep::Batch b;
  b.samples.push_back(sample(8, {span(1, 6, 24)}));
  return ep::plan_exchange(b, mesh_of(2, 1, false, ep::CpLayout::Zigzag), encoder_layout(2, 1));
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

// ============================================================ exchange

constexpr int64_t kHidden = 3;

// Feature value of (item, row, column): distinct and exact in float64.
double cell(int64_t item, int64_t r, int64_t h) {
  return 100.0 * static_cast<double>(item) + static_cast<double>(r) + static_cast<double>(h) / 8.0;
}

Tensor item_rows(const ep::EncoderWorkItem& it) {
  std::vector<double> v;
  for (int64_t r = 0; r < it.output_rows; ++r)
    for (int64_t h = 0; h < kHidden; ++h) v.push_back(cell(it.item_id, r, h));
  return from_vector(v, {it.output_rows, kHidden}, DType::Float64);
}

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

// The records exchange rank e produces: its bucket's items, as leaves.
std::vector<ep::EncoderFeature> records_of(const ep::ExchangePlan& plan, int e) {
  std::vector<ep::EncoderFeature> out;
  if (e % plan.encoder.encoder_cp != 0) return out;
  for (int64_t id : plan.buckets[static_cast<std::size_t>(e / plan.encoder.encoder_cp)]) {
    const auto& it = plan.items[static_cast<std::size_t>(id)];
    Tensor rows = item_rows(it);
    rows.set_requires_grad(true);
    out.push_back({it, rows});
  }
  return out;
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
  auto rethrows_invalid = [](const std::exception_ptr& p) {
    if (!p) return false;
    try {
      std::rethrow_exception(p);
    } catch (const InvalidArgument&) {
      return true;
    } catch (...) {
      return false;
    }
  };
  // Rank 0 swaps its records; rank 1 is fine: rank 0 refuses, rank 1 gets a
  // RankFailure (not a hang).
  {
    auto w = run_with([&](int q) {
      auto r = records_of(plan, q);
      if (q == 0) std::swap(r[0], r[1]);
      return r;
    });
    EXPECT_TRUE(rethrows_invalid(w->errors()[0]));
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
    EXPECT_TRUE(rethrows_invalid(w->errors()[0]));
    EXPECT_TRUE(rethrows_invalid(w->errors()[1]));
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
    EXPECT_TRUE(rethrows_invalid(world.errors()[1]));
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

// ============================================================ data

TEST(ImageSizes, ShippedCocoVal2017) {
  const std::string path = ep::default_image_sizes_path();
  ASSERT_FALSE(path.empty()) << "data/coco_val2017/image_sizes.csv not found";
  const auto sizes = ep::load_image_sizes(path);
  ASSERT_EQ(sizes.size(), 5000u);
  // The first two data rows of the CSV: 139,640,426 and 285,586,640.
  EXPECT_EQ(sizes[0].image_id, 139);
  EXPECT_EQ(sizes[0].width, 640);
  EXPECT_EQ(sizes[0].height, 426);
  EXPECT_EQ(sizes[1].image_id, 285);
  EXPECT_EQ(sizes[1].width, 586);
  EXPECT_EQ(sizes[1].height, 640);
  std::set<int64_t> ids;
  for (const auto& s : sizes) {
    EXPECT_GT(s.width, 0);
    EXPECT_GT(s.height, 0);
    ids.insert(s.image_id);
  }
  EXPECT_EQ(ids.size(), 5000u);  // COCO ids are unique
  // Every COCO size has a token count (no aspect ratio beyond 200).
  for (const auto& s : sizes) EXPECT_GT(qw::image_tokens(s.height, s.width), 0);
}

class TempCsv : public ::testing::Test {
 protected:
  std::string write(const std::string& text) {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = (std::filesystem::temp_directory_path() / (std::string("diffcomm_ep_") + info->name() +
                                                       "_" + std::to_string(::getpid()) + ".csv"))
                .string();
    std::ofstream(path_) << text;
    return path_;
  }
  void TearDown() override {
    if (!path_.empty()) std::filesystem::remove(path_);
  }
  std::string path_;
};

TEST_F(TempCsv, ReordersColumnsIgnoresExtrasAndBlankLines) {
  const auto p = write("height,note,image_id,width\r\n10,x,1,20\r\n\n30,y,2,40\n");
  const auto s = ep::load_image_sizes(p);
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].image_id, 1);
  EXPECT_EQ(s[0].width, 20);
  EXPECT_EQ(s[0].height, 10);
  EXPECT_EQ(s[1].image_id, 2);
  EXPECT_EQ(s[1].width, 40);
  EXPECT_EQ(s[1].height, 30);
}

TEST_F(TempCsv, MissingColumnIsNamed) {
  const auto p = write("image_id,width\n1,20\n");
  EXPECT_THAT(invalid_argument_message([&] { ep::load_image_sizes(p); }), HasSubstr("height"));
}

TEST_F(TempCsv, BadRowGivesItsLineNumber) {
  // Line 1 is the header; the bad row is line 3.
  const auto p = write("image_id,width,height\n1,20,10\n2,abc,10\n3,5,5\n");
  EXPECT_THAT(invalid_argument_message([&] { ep::load_image_sizes(p); }), HasSubstr("line 3"));
}

TEST_F(TempCsv, ShortAndNonPositiveRowsRejected) {
  const auto p = write("image_id,width,height\n1,20,10\n2,20\n");
  EXPECT_THAT(invalid_argument_message([&] { ep::load_image_sizes(p); }), HasSubstr("line 3"));
  const auto q = write("image_id,width,height\n1,0,10\n");
  EXPECT_THAT(invalid_argument_message([&] { ep::load_image_sizes(q); }), HasSubstr("line 2"));
}

TEST_F(TempCsv, TrailingGarbageInACellRejected) {
  // "640.5" and "20px" are not integer sizes; the row must not be read as 640 / 20.
  const auto p = write("image_id,width,height\n1,20,10\n2,640.5,480\n");
  EXPECT_THAT(invalid_argument_message([&] { ep::load_image_sizes(p); }), HasSubstr("line 3"));
  const auto q = write("image_id,width,height\n1,20px,10\n");
  EXPECT_THAT(invalid_argument_message([&] { ep::load_image_sizes(q); }), HasSubstr("line 2"));
}

TEST_F(TempCsv, EmptyAndMissingFiles) {
  const auto p = write("");
  EXPECT_THROW(ep::load_image_sizes(p), InvalidArgument);
  EXPECT_THROW(ep::load_image_sizes("/nonexistent/diffcomm/sizes.csv"), InvalidArgument);
  const auto header_only = write("image_id,width,height\n");
  EXPECT_TRUE(ep::load_image_sizes(header_only).empty());
}

TEST(LoadImageSizes, EndlessDevicesAreRefusedNotRead) {
  // Found by fuzz_cli (`step --images /dev/full`): reading a device that never
  // ends filled memory until the fuzzer's 4 GiB limit.
  for (const char* dev : {"/dev/zero", "/dev/full"}) {
    EXPECT_THAT(invalid_argument_message([&] { ep::load_image_sizes(dev); }),
                AllOf(HasSubstr(dev), HasSubstr("larger than 268435456 bytes")))
        << dev;
  }
}

// ============================================================ batches

TEST(BuildBatches, HandComputedLayoutAndPadding) {
  // One 42 x 42 image (4 tokens, 16 patches); text exactly 3 tokens before
  // each image and at the end; pad to multiples of 8:
  //   text [0,3), image [3,7), text [7,10), image [10,14), text to 17 -> 24.
  const std::vector<ep::ImageSize> one = {{77, 42, 42}};
  ep::BatchOptions o;
  o.samples = 3;
  o.images_per_sample = 2;
  o.text_min = 3;
  o.text_max = 3;
  o.seq_multiple = 8;
  o.seed = 5;
  const auto batches = ep::build_batches(one, 2, o);
  ASSERT_EQ(batches.size(), 2u);
  for (const auto& b : batches) {
    ASSERT_EQ(b.samples.size(), 3u);
    for (const auto& s : b.samples) {
      EXPECT_EQ(s.seq_len, 24);
      ASSERT_EQ(s.images.size(), 2u);
      EXPECT_EQ(s.images[0].token_start, 3);
      EXPECT_EQ(s.images[1].token_start, 10);
      for (const auto& im : s.images) {
        EXPECT_EQ(im.tokens, 4);
        EXPECT_EQ(im.patches, 16);
        EXPECT_EQ(im.source_id, 77);
      }
    }
  }
  // seq_multiple 1: 17 exactly; no images: text only, 3 tokens.
  o.seq_multiple = 1;
  EXPECT_EQ(ep::build_batches(one, 1, o)[0].samples[0].seq_len, 17);
  o.images_per_sample = 0;
  const auto text_only = ep::build_batches({}, 1, o);
  EXPECT_EQ(text_only[0].samples[0].seq_len, 3);
  EXPECT_TRUE(text_only[0].samples[0].images.empty());
}

TEST(BuildBatches, DrawsWithoutReplacementThenWraps) {
  // Three distinct images, four draws: the first three are a permutation, the
  // fourth starts the same order again.
  const std::vector<ep::ImageSize> three = {{1, 42, 42}, {2, 98, 98}, {3, 480, 640}};
  ep::BatchOptions o;
  o.samples = 1;
  o.images_per_sample = 4;
  o.text_min = 0;
  o.text_max = 5;
  o.seed = 11;
  const auto b = ep::build_batches(three, 1, o);
  const auto& ims = b[0].samples[0].images;
  ASSERT_EQ(ims.size(), 4u);
  std::set<int64_t> first{ims[0].source_id, ims[1].source_id, ims[2].source_id};
  EXPECT_EQ(first, (std::set<int64_t>{1, 2, 3}));
  EXPECT_EQ(ims[3].source_id, ims[0].source_id);
  // Tokens follow the Qwen2-VL rule: 4, 16, 391 (see Qwen2VL tests).
  const std::map<int64_t, int64_t> tokens = {{1, 4}, {2, 16}, {3, 391}};
  for (const auto& im : ims) {
    EXPECT_EQ(im.tokens, tokens.at(im.source_id));
    EXPECT_EQ(im.patches, 4 * im.tokens);
  }
}

TEST(BuildBatches, DeterministicPaddedAndPlannable) {
  const auto sizes = ep::load_image_sizes(ep::default_image_sizes_path());
  ep::BatchOptions o;
  o.samples = 3;
  o.images_per_sample = 2;
  o.text_min = 1;
  o.text_max = 40;
  o.seq_multiple = 12;  // cp 2 zigzag x tp 3 SP
  o.seed = 2024;
  const auto a = ep::build_batches(sizes, 2, o);
  const auto b = ep::build_batches(sizes, 2, o);
  ASSERT_EQ(a.size(), 2u);
  auto key = [](const std::vector<ep::Batch>& v) {
    std::vector<int64_t> k;
    for (const auto& batch : v)
      for (const auto& s : batch.samples) {
        k.push_back(s.seq_len);
        for (const auto& im : s.images) {
          k.push_back(im.token_start);
          k.push_back(im.tokens);
          k.push_back(im.patches);
          k.push_back(im.source_id);
        }
      }
    return k;
  };
  EXPECT_EQ(key(a), key(b));
  o.seed = 2025;
  EXPECT_NE(key(a), key(ep::build_batches(sizes, 2, o)));
  std::set<int64_t> used;
  for (const auto& batch : a)
    for (const auto& s : batch.samples) {
      EXPECT_EQ(s.seq_len % 12, 0);
      int64_t end = 0;
      for (const auto& im : s.images) {
        // Text gap of 1..40 tokens before each image.
        EXPECT_GE(im.token_start - end, 1);
        EXPECT_LE(im.token_start - end, 40);
        end = im.token_start + im.tokens;
        EXPECT_TRUE(used.insert(im.source_id).second) << "image drawn twice";
      }
      // Final text 1..40, then padding below 12.
      EXPECT_GE(s.seq_len - end, 1);
      EXPECT_LT(s.seq_len - end, 40 + 12);
    }
  // The batch plans on the mesh it was padded for.
  EXPECT_NO_THROW(
      ep::plan_exchange(a[0], mesh_of(2, 3, true, ep::CpLayout::Zigzag), encoder_layout(3, 2)));
}

TEST(BuildBatches, RejectsBadOptions) {
  const std::vector<ep::ImageSize> one = {{1, 42, 42}};
  ep::BatchOptions o;
  EXPECT_THROW(ep::build_batches(one, 0, o), InvalidArgument);
  EXPECT_THROW(ep::build_batches({}, 1, o), InvalidArgument);  // images needed, none given
  o.seq_multiple = 0;
  EXPECT_THROW(ep::build_batches(one, 1, o), InvalidArgument);
  o.seq_multiple = 1;
  o.text_min = 5;
  o.text_max = 4;
  EXPECT_THROW(ep::build_batches(one, 1, o), InvalidArgument);
  o.text_min = 0;
  o.samples = -1;
  EXPECT_THROW(ep::build_batches(one, 1, o), InvalidArgument);
}

// ============================================================ training step

std::vector<ep::StepRankResult> run_steps(const ep::StepConfig& cfg,
                                          const std::vector<ep::Batch>& per_dp,
                                          uint64_t world_seed = 3) {
  std::vector<ep::StepRankResult> out(static_cast<std::size_t>(cfg.world_size()));
  sim::WorldOptions o;
  o.ranks = cfg.world_size();
  o.seed = world_seed;
  sim::World world(o);
  world.run([&](sim::Rank& rk) {
    out[static_cast<std::size_t>(rk.rank())] = ep::run_step(rk.world(), cfg, per_dp);
  });
  return out;
}

ep::StepConfig step_config(int dp, const ep::DecoderMesh& m, const ep::EncoderLayout& e) {
  ep::StepConfig cfg;
  cfg.dp = dp;
  cfg.decoder = m;
  cfg.encoder = e;
  cfg.hidden = 4;
  cfg.in_features = 3;
  cfg.ffn = 12;
  cfg.seed = 99;
  return cfg;
}

TEST(TrainingStep, DesignExampleMatchesReferenceInEveryMode) {
  struct Case {
    ep::DecoderMesh mesh;
    ep::EncoderLayout enc;
    ep::FeatureExchangeMode mode;
  };
  const std::vector<Case> cases = {
      {mesh_of(1, 1, false), encoder_layout(1, 1), ep::FeatureExchangeMode::Local},
      {mesh_of(1, 2, false), encoder_layout(2, 1), ep::FeatureExchangeMode::TpVariableAllGather},
      {mesh_of(1, 4, true), encoder_layout(2, 2), ep::FeatureExchangeMode::TpVariableA2A},
      {mesh_of(2, 2, true), encoder_layout(4, 1), ep::FeatureExchangeMode::ParentVariableA2A},
      {mesh_of(2, 2, false), encoder_layout(1, 4), ep::FeatureExchangeMode::ParentVariableA2A},
      {mesh_of(2, 2, true, ep::CpLayout::Zigzag), encoder_layout(2, 2),
       ep::FeatureExchangeMode::ParentVariableA2A},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(ep::mode_name(c.mode) + " cp " + std::to_string(c.mesh.cp) + " tp " +
                 std::to_string(c.mesh.tp) + (c.mesh.sp ? " sp" : "") + " " +
                 ep::cp_layout_name(c.mesh.layout));
    const auto cfg = step_config(2, c.mesh, c.enc);
    const std::vector<ep::Batch> per_dp = {design_example(), five_images()};
    const auto ranks = run_steps(cfg, per_dp);
    const auto ref = ep::reference_step(cfg, per_dp);
    const auto chk = ep::check_step(cfg, per_dp, ranks, ref);
    EXPECT_TRUE(chk.passed);
    EXPECT_EQ(chk.forward_max_abs_diff, 0.0);
    EXPECT_LE(chk.grad_max_rel_diff, 1e-12);
    for (const auto& r : ranks) {
      EXPECT_EQ(r.mode, c.mode);
      EXPECT_EQ(
          r.plan_fingerprint,
          ranks[static_cast<std::size_t>(r.dp_rank * c.mesh.cp * c.mesh.tp)].plan_fingerprint);
    }
  }
}

TEST(TrainingStep, DegenerateBatches) {
  // An empty micro-batch, a sample of length 0, a zero-token image, and an
  // image filling its whole sample, on meshes of every mode.
  ep::Batch empty;
  ep::Batch odd;
  odd.samples.push_back(sample(0, {}));
  odd.samples.push_back(sample(8, {span(2, 0, 0), span(4, 4, 16)}));
  odd.samples.push_back(sample(8, {span(0, 8, 32)}));
  for (const auto& m : {mesh_of(1, 1, false), mesh_of(1, 2, false), mesh_of(1, 4, true),
                        mesh_of(2, 2, true, ep::CpLayout::Zigzag), mesh_of(4, 1, false)}) {
    SCOPED_TRACE("cp " + std::to_string(m.cp) + " tp " + std::to_string(m.tp));
    const int n = m.cp > 1 ? m.cp * m.tp : m.tp;
    const auto cfg = step_config(2, m, encoder_layout(n, 1));
    const std::vector<ep::Batch> per_dp = {empty, odd};
    const auto ranks = run_steps(cfg, per_dp);
    const auto chk = ep::check_step(cfg, per_dp, ranks, ep::reference_step(cfg, per_dp));
    EXPECT_TRUE(chk.passed) << chk.forward_max_abs_diff << " " << chk.grad_max_rel_diff;
  }
}

TEST(TrainingStep, CheckStepDetectsAWrongGradientAndForward) {
  // check_step is the oracle of the properties: it must be able to fail.
  const auto cfg = step_config(1, mesh_of(1, 2, false), encoder_layout(2, 1));
  const std::vector<ep::Batch> per_dp = {five_images()};
  auto ranks = run_steps(cfg, per_dp);
  const auto ref = ep::reference_step(cfg, per_dp);
  ASSERT_TRUE(ep::check_step(cfg, per_dp, ranks, ref).passed);
  auto doubled = ranks;
  doubled[1].encoder_grad = scale(doubled[1].encoder_grad, 2.0);
  const auto bad = ep::check_step(cfg, per_dp, doubled, ref);
  EXPECT_FALSE(bad.passed);
  EXPECT_NEAR(bad.grad_max_rel_diff, 1.0, 1e-12);  // |2g - g| / max|g| on the worst element
  // Forward must be exact: one ulp off in one element fails.
  auto shifted = ranks;
  std::vector<double> v = ranks[0].decoder_input.to_vector();
  v[0] = std::nextafter(v[0], 1e300);
  shifted[0].decoder_input = from_vector(v, ranks[0].decoder_input.shape(), DType::Float64);
  EXPECT_FALSE(ep::check_step(cfg, per_dp, shifted, ref).passed);
}

TEST(TrainingStep, InconsistentConfigurationsRejected) {
  auto cfg = step_config(1, mesh_of(1, 2, false), encoder_layout(2, 1));
  const std::vector<ep::Batch> per_dp = {five_images()};
  // World of 3 ranks for dp 1 x cp 1 x tp 2.
  sim::WorldOptions o;
  o.ranks = 3;
  sim::World world(o);
  EXPECT_THROW(world.run([&](sim::Rank& rk) { ep::run_step(rk.world(), cfg, per_dp); }),
               InvalidArgument);
  cfg.ffn = 7;  // not a multiple of tp
  EXPECT_THROW(ep::reference_step(cfg, per_dp), InvalidArgument);
  cfg.ffn = 8;
  EXPECT_THROW(ep::reference_step(cfg, {}), InvalidArgument);  // 0 micro-batches for dp 1
}

// ============================================================ negative control
//
// A minimal distributed step written here, independent of run_step, in
// which the gradient convention can be chosen wrongly. Decoder without SP
// (Megatron): every TP rank of CP rank c holds the same shard E_c, enters
// the TP region by "copy to TP region" (identity forward, all-reduce of the
// input gradient over TP backward) and adds <E_c, U_t> to the loss, where
// U_t(b, tok, h) = (1 + t) (tok + 1 + h/4 + 10 b) depends on the TP rank t
// (a column-parallel term). The single-rank reference loss is
// sum_t <E, U_t>, so the gradient of the feature row of token tok is, in
// closed form,
//   dX(b, tok, h) = sum_t (1 + t) (tok + 1 + h/4 + 10 b)
//                 = tp (tp + 1) / 2 * (tok + 1 + h/4 + 10 b).
// After the copy's all-reduce every TP replica already holds this full
// gradient; summing the replicas again in the exchange (Partial) counts it
// tp times. ReplicatedOverTp (what receiver_grad_for says) gives it once.

double u_value(int t, int64_t b, int64_t tok, int64_t h) {
  return (1.0 + t) * (static_cast<double>(tok) + 1.0 + static_cast<double>(h) / 4.0 +
                      10.0 * static_cast<double>(b));
}

// Runs the step with the given convention; returns the gradient of every
// item's feature rows (by item id).
std::map<int64_t, std::vector<double>> replica_step(int cp, int tp, const ep::Batch& batch,
                                                    std::optional<ep::ReceiverGrad> convention) {
  const auto mesh = mesh_of(cp, tp, false);
  const int n = cp * tp;
  const auto plan = ep::plan_exchange(batch, mesh, encoder_layout(n, 1));
  std::vector<std::vector<ep::EncoderFeature>> recs(static_cast<std::size_t>(n));
  sim::WorldOptions o;
  o.ranks = n;
  o.seed = 17;
  sim::World world(o);
  world.run([&](sim::Rank& rk) {
    dist::DeviceMesh dm = rk.mesh({{"cp", cp}, {"tp", tp}});
    const int c = dm.coordinate("cp"), t = dm.coordinate("tp");
    const dist::ProcessGroup exchange =
        cp > 1 ? dm.group(std::vector<std::string>{"cp", "tp"}) : dm.group("tp");
    const int e = exchange.rank();
    auto& mine = recs[static_cast<std::size_t>(rk.rank())];
    mine = records_of(plan, e);
    Tensor proto = zeros({0, kHidden}, DType::Float64);
    proto.set_requires_grad(true);
    const auto grad_kind = convention.value_or(ep::receiver_grad_for(mesh.context(c, t)));
    const auto routed = ep::route_features(plan.mode, mine, proto, e, plan, exchange, grad_kind);
    const auto received = ep::unpack_records(routed.rows, routed.items);
    const ep::ShardLayout layout(plan, e);
    Tensor base = zeros({layout.rows(), kHidden}, DType::Float64);
    base.set_requires_grad(true);
    const Tensor E = ep::merge_into_decoder(base, received, layout, routed.rows);
    const Tensor X = nn::copy_to_tp_region(E, dm.group("tp"));
    std::vector<double> u;
    for (const auto& [b, tok] : layout.tokens())
      for (int64_t h = 0; h < kHidden; ++h) u.push_back(u_value(t, b, tok, h));
    const Tensor U = from_vector(u, {layout.rows(), kHidden}, DType::Float64);
    backward({dot(X, U)});
  });
  std::map<int64_t, std::vector<double>> g;
  for (const auto& mine : recs)
    for (const auto& f : mine) g[f.item.item_id] = f.rows.grad().to_vector();
  return g;
}

// Largest |got - factor * reference| / max |reference| over every item.
double rel_error(const std::map<int64_t, std::vector<double>>& got, const ep::Batch& batch, int tp,
                 double factor) {
  const auto plan = ep::plan_exchange(batch, mesh_of(1, 1, false), encoder_layout(1, 1));
  double worst = 0, ref_max = 0;
  for (const auto& it : plan.items) {
    const auto& g = got.at(it.item_id);
    EXPECT_EQ(static_cast<int64_t>(g.size()), it.output_rows * kHidden);
    for (int64_t r = 0; r < it.output_rows; ++r)
      for (int64_t h = 0; h < kHidden; ++h) {
        const double ref =
            tp * (tp + 1) / 2.0 *
            (static_cast<double>(it.decoder_token_start + r) + 1.0 + static_cast<double>(h) / 4.0 +
             10.0 * static_cast<double>(it.batch_index));
        ref_max = std::max(ref_max, std::abs(ref));
        worst =
            std::max(worst, std::abs(g[static_cast<std::size_t>(r * kHidden + h)] - factor * ref));
      }
  }
  return worst / ref_max;
}

TEST(NegativeControl, PartialOverTpReplicasCountsTheGradientTpTimes) {
  const ep::Batch batch = five_images();  // item 1 straddles the CP boundary at token 4
  struct Mesh {
    int cp, tp;
  };
  for (const Mesh m : {Mesh{1, 2}, Mesh{1, 3}, Mesh{2, 2}}) {
    SCOPED_TRACE("cp " + std::to_string(m.cp) + " tp " + std::to_string(m.tp));
    // The convention receiver_grad_for picks (ReplicatedOverTp): the reference.
    ASSERT_EQ(ep::receiver_grad_for(mesh_of(m.cp, m.tp, false).context(0, 0)),
              ep::ReceiverGrad::ReplicatedOverTp);
    const auto right = replica_step(m.cp, m.tp, batch, std::nullopt);
    EXPECT_LE(rel_error(right, batch, m.tp, 1.0), 1e-12);
    // The wrong one (Partial, the plain adjoint over replicas): tp times the
    // reference, so "equal to the reference within 1e-12" fails.
    const auto wrong = replica_step(m.cp, m.tp, batch, ep::ReceiverGrad::Partial);
    EXPECT_LE(rel_error(wrong, batch, m.tp, static_cast<double>(m.tp)), 1e-12);
    EXPECT_GE(rel_error(wrong, batch, m.tp, 1.0), 0.5);
  }
}

// ============================================================ issue 13: inputs
// Expected token values come from the Python reference (transformers'
// Qwen2VLImageProcessor.smart_resize, whose first step qwen-vl-utils writes as
// max(factor, round(x / factor) * factor)), evaluated by hand / in Python:
//   smart_resize(639, 31, 28, 3136, 15680)            -> (560, 28)
//   smart_resize(3037000500, 3037000500, 28, qwen2vl) -> (3584, 3584)
//   smart_resize(480, 640, 32, 65536, 16777216)       -> (480, 640)
//   smart_resize(56, 56, 32, 65536, 16777216)         -> (256, 256)
//   smart_resize(10, 2000, 32, 65536, 16777216)       -> (32, 3648)
//   smart_resize(41, 8200, 28, qwen2vl)               -> (28, 8204)

ep::VisionModel qwen2vl_bounds(int64_t min_pixels, int64_t max_pixels) {
  ep::VisionModel m = ep::qwen2vl_model();
  m.min_pixels = min_pixels;
  m.max_pixels = max_pixels;
  return m;
}

TEST(Tokens, DownScaledThinSideIsClampedToTheFactor) {
  // CASES.md 10. 639 x 31: round -> 644 x 28 = 18032 > 15680; beta =
  // sqrt(19809 / 15680) = 1.12398; 639 / beta / 28 = 20.30 -> 560; 31 / beta /
  // 28 = 0.985 -> 0 -> clamped to 28. 20 x 1 tokens, 80 patches.
  const qw::Resized r = qw::smart_resize(639, 31, 3136, 15680);
  EXPECT_EQ(r.height, 560);
  EXPECT_EQ(r.width, 28);
  const qw::Resized t = qw::smart_resize(31, 639, 3136, 15680);
  EXPECT_EQ(t.height, 28);
  EXPECT_EQ(t.width, 560);
  const ep::MediaTokens m = ep::image_tokens(qwen2vl_bounds(3136, 15680), 639, 31);
  EXPECT_EQ(m.grid_t, 1);
  EXPECT_EQ(m.grid_h, 40);
  EXPECT_EQ(m.grid_w, 2);
  EXPECT_EQ(m.patches, 80);
  EXPECT_EQ(m.tokens, 20);
}

TEST(Tokens, PixelBoundsAreValidated) {
  // max_pixels below one 28 x 28 block (784), min > max, min < 1.
  EXPECT_THAT(invalid_argument_message([] { qw::smart_resize(100, 100, 1, 783); }),
              HasSubstr("max_pixels = 783"));
  EXPECT_THAT(invalid_argument_message([] { qw::smart_resize(100, 100, 5000, 4000); }),
              HasSubstr("min_pixels = 5000"));
  EXPECT_THAT(invalid_argument_message([] { qw::smart_resize(100, 100, 0, 4000); }),
              HasSubstr("min_pixels = 0"));
  // Exactly one block is allowed: everything becomes 28 x 28 (1 token).
  EXPECT_EQ(qw::smart_resize(500, 400, 784, 784).height, 28);
  EXPECT_EQ(qw::smart_resize(500, 400, 784, 784).width, 28);
  ep::VisionModel bad = ep::qwen2vl_model();
  bad.patch_size = 0;
  EXPECT_THAT(invalid_argument_message([&] { ep::image_tokens(bad, 10, 10); }),
              HasSubstr("patch_size"));
  // Sides beyond 2^40 are refused instead of overflowing.
  EXPECT_THROW(qw::smart_resize(int64_t{1} << 41, int64_t{1} << 41), InvalidArgument);
}

TEST(Tokens, HugeImagesDoNotOverflow) {
  // 3037000500^2 > 2^63: the rounded area overflows int64; the rule still
  // scales to 3584 x 3584 = max_pixels: 128 x 128 = 16384 tokens.
  EXPECT_EQ(qw::image_tokens(3037000500, 3037000500), 16384);
  const qw::Resized r = qw::smart_resize(3037000500, 3037000500);
  EXPECT_EQ(r.height, 3584);
  EXPECT_EQ(r.width, 3584);
}

TEST(Tokens, AspectRatioOfTheResultStaysWithinTwoRPlusOne) {
  // Input ratio exactly 200 (allowed); output 28 x 8204 has ratio 293 <= 401.
  const qw::Resized r = qw::smart_resize(41, 8200);
  EXPECT_EQ(r.height, 28);
  EXPECT_EQ(r.width, 8204);
}

TEST(Tokens, PresetsAndFactors) {
  EXPECT_EQ(ep::qwen2vl_model().factor(), 28);
  EXPECT_EQ(ep::qwen25vl_model().factor(), 28);
  EXPECT_EQ(ep::qwen3vl_model().factor(), 32);
  EXPECT_EQ(ep::vision_model("qwen2.5vl").max_pixels, 12845056);
  EXPECT_EQ(ep::vision_model("qwen3vl").min_pixels, 65536);
  EXPECT_THAT(invalid_argument_message([] { ep::vision_model("llava"); }), HasSubstr("qwen3vl"));
  // Qwen2.5-VL has Qwen2-VL's rule: 480 x 640 -> 476 x 644, 17 x 23 = 391 tokens.
  EXPECT_EQ(ep::image_tokens(ep::qwen25vl_model(), 480, 640).tokens, 391);
  // Qwen3-VL: 480 x 640 is already a multiple of 32 and within bounds: grid
  // 30 x 40 = 1200 patches, 300 tokens.
  const ep::MediaTokens a = ep::image_tokens(ep::qwen3vl_model(), 480, 640);
  EXPECT_EQ(a.grid_h, 30);
  EXPECT_EQ(a.grid_w, 40);
  EXPECT_EQ(a.patches, 1200);
  EXPECT_EQ(a.tokens, 300);
  // 56 x 56 -> 64 x 64 = 4096 < 65536: beta = sqrt(65536 / 3136) = 4.571;
  // 56 * beta = 256 -> 256 x 256: 16 x 16 patches, 64 tokens.
  const ep::MediaTokens b = ep::image_tokens(ep::qwen3vl_model(), 56, 56);
  EXPECT_EQ(b.patches, 256);
  EXPECT_EQ(b.tokens, 64);
  // 10 x 2000: round(0.3125) = 0 -> 32, round(62.5) = 62 -> 1984; 63488 <
  // 65536: beta = 1.8102; ceil(18.1 / 32) = 1 -> 32, ceil(3620.4 / 32) = 114 ->
  // 3648: 2 x 228 = 456 patches, 114 tokens.
  const ep::MediaTokens c = ep::image_tokens(ep::qwen3vl_model(), 10, 2000);
  EXPECT_EQ(c.grid_h, 2);
  EXPECT_EQ(c.grid_w, 228);
  EXPECT_EQ(c.tokens, 114);
}

TEST(Tokens, VideoFramesArePaddedToTheTemporalPatch) {
  // 3 frames of 56 x 56 in Qwen2-VL: padded to 4 frames = 2 temporal patches
  // of 4 x 4 spatial patches: 32 patches, 8 tokens (per-frame images: 12).
  const ep::MediaTokens v = ep::video_tokens(ep::qwen2vl_model(), 3, 56, 56);
  EXPECT_EQ(v.grid_t, 2);
  EXPECT_EQ(v.grid_h, 4);
  EXPECT_EQ(v.grid_w, 4);
  EXPECT_EQ(v.patches, 32);
  EXPECT_EQ(v.tokens, 8);
  EXPECT_EQ(ep::video_tokens(ep::qwen2vl_model(), 4, 56, 56).tokens, 8);
  EXPECT_EQ(ep::video_tokens(ep::qwen2vl_model(), 5, 56, 56).tokens, 12);
  // A 1-frame video is an image: 2 x 2 tokens.
  EXPECT_EQ(ep::video_tokens(ep::qwen2vl_model(), 1, 56, 56).tokens, 4);
  EXPECT_EQ(ep::image_tokens(ep::qwen2vl_model(), 56, 56).tokens, 4);
  EXPECT_THAT(invalid_argument_message([] { ep::video_tokens(ep::qwen2vl_model(), 0, 56, 56); }),
              HasSubstr("0 frames"));
}

TEST(BuildBatches, MixesImagesAndVideos) {
  // A 3-frame 56 x 56 video (8 tokens, 32 patches) and a 56 x 56 image (4
  // tokens, 16 patches), no text: one sample holds both, 12 tokens.
  const std::vector<ep::ImageSize> media = {{1, 56, 56, 3}, {2, 56, 56, 1}};
  ep::BatchOptions o;
  o.samples = 1;
  o.images_per_sample = 2;
  o.text_min = 0;
  o.text_max = 0;
  const auto batches = ep::build_batches(media, 1, o);
  const ep::Sample& s = batches[0].samples[0];
  ASSERT_EQ(s.images.size(), 2u);
  EXPECT_EQ(s.seq_len, 12);
  std::map<int64_t, std::pair<int64_t, int64_t>> by_id;  // id -> (tokens, patches)
  for (const auto& im : s.images) by_id[im.source_id] = {im.tokens, im.patches};
  EXPECT_EQ(by_id.at(1), (std::pair<int64_t, int64_t>{8, 32}));
  EXPECT_EQ(by_id.at(2), (std::pair<int64_t, int64_t>{4, 16}));
  const auto plan = ep::plan_exchange(batches[0], mesh_of(1, 2, true), encoder_layout(2, 1));
  EXPECT_EQ(plan.items.size(), 2u);
  // Qwen3-VL on the same clip: the clip rule (Qwen3VLVideoProcessor) rounds
  // 56 -> 64, 4 (padded frames) x 64 x 64 = 16384 lies in [4096, 25165824]:
  // grid 2 x 4 x 4 = 32 patches, 8 tokens, written as two timestamped groups
  // of 4 tokens (16 patches) each: "<0.2 seconds>" (6 tokens), start, 4,
  // end, "<1.0 seconds>", start, 4, end -> spans at 7 and 19 of a 24-token block.
  o.model = ep::qwen3vl_model();
  o.images_per_sample = 1;
  const auto q3 = ep::build_batches({{1, 56, 56, 3}}, 1, o);
  ASSERT_EQ(q3[0].samples[0].images.size(), 2u);
  EXPECT_EQ(q3[0].samples[0].images[0].patches, 16);
  EXPECT_EQ(q3[0].samples[0].images[0].tokens, 4);
  EXPECT_EQ(q3[0].samples[0].images[0].token_start, 7);
  EXPECT_EQ(q3[0].samples[0].images[1].token_start, 19);
  EXPECT_EQ(q3[0].samples[0].seq_len, 24);
  // An entry the model refuses is named by its id.
  EXPECT_THAT(invalid_argument_message([&] {
                ep::build_batches({{42, 1, 500, 1}}, 1, o);
              }),
              HasSubstr("image 42"));
}

TEST(ImageSizesCsv, QuotedFieldsWithCommasAndEscapes) {
  const auto s = ep::parse_image_sizes(
      "image_id,file_name,width,height\n"
      "1,\"a,b.jpg\",640,480\n"
      "2,\"say \\\"hi\\\", ok\",20,10\n",
      "mem");
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0], (ep::ImageSize{1, 640, 480, 1}));
  EXPECT_EQ(s[1], (ep::ImageSize{2, 20, 10, 1}));
}

TEST(ImageSizesCsv, ErrorsNameSourceLineAndColumn) {
  EXPECT_THAT(invalid_argument_message([] {
                ep::parse_image_sizes("image_id,width,height\n1,20,10\n2,20,abc\n", "sizes.csv");
              }),
              HasSubstr("'sizes.csv' line 3: column 3 (height): 'abc' is not an integer"));
  EXPECT_THAT(invalid_argument_message(
                  [] { ep::parse_image_sizes("image_id,width,height\n1,\"20,10\n", "s.csv"); }),
              HasSubstr("'s.csv' line 2: column 3 (character): unterminated quote"));
  EXPECT_THAT(invalid_argument_message([] {
                ep::parse_image_sizes("image_id,width,height\n1,99999999999999999999,10\n", "s");
              }),
              HasSubstr("line 2: column 2 (width): '99999999999999999999' is outside"));
  EXPECT_THAT(invalid_argument_message(
                  [] { ep::parse_image_sizes("image_id,width,height\n1,\\q,10\n", "s"); }),
              HasSubstr("line 2: bad escape"));
  EXPECT_THAT(
      invalid_argument_message([] { ep::parse_image_sizes("image_id,width,width,height\n", "s"); }),
      HasSubstr("column 'width' appears 2 times"));
  EXPECT_THAT(invalid_argument_message([] { ep::parse_image_sizes("", "s"); }),
              HasSubstr("no header"));
  EXPECT_THAT(invalid_argument_message([] { ep::load_image_sizes("/tmp"); }),
              HasSubstr("'/tmp' is a directory"));
}

TEST(ImageSizesCsv, OptionalFramesColumn) {
  const auto s = ep::parse_image_sizes(
      "\xEF\xBB\xBFimage_id,width,height,frames\r\n7,56,56,3\r\n8,56,56,1\r\n", "v.csv");
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0], (ep::ImageSize{7, 56, 56, 3}));
  EXPECT_EQ(s[1], (ep::ImageSize{8, 56, 56, 1}));
  EXPECT_THAT(invalid_argument_message([] {
                ep::parse_image_sizes("image_id,width,height,frames\n7,56,56,0\n", "v.csv");
              }),
              HasSubstr("line 2: column 4 (frames): '0' is outside [1, 65536]"));
  EXPECT_THAT(invalid_argument_message([] {
                ep::parse_image_sizes("image_id,width,height,frames\n7,56,8,556201\n", "v.csv");
              }),
              HasSubstr("line 2: column 4 (frames): '556201' is outside [1, 65536]"));
}

// A plan of one image (S = 16, tokens 5..10) for tp 2 + SP: destinations
// (0, 1), one bucket per rank; every corruption below names its field.
ep::ExchangePlan small_plan() {
  return ep::plan_exchange(design_example(), mesh_of(1, 2, true), encoder_layout(2, 1));
}

TEST(PlanValidation, HandBuiltPlansAreRejectedByField) {
  EXPECT_NO_THROW(small_plan().validate());
  auto msg = [](const std::function<void(ep::ExchangePlan&)>& edit) {
    ep::ExchangePlan p = small_plan();
    edit(p);
    return invalid_argument_message([&] { p.validate(); });
  };
  EXPECT_THAT(msg([](auto& p) { p.items[0].item_id = 100; }), HasSubstr("items[0].item_id is 100"));
  EXPECT_THAT(msg([](auto& p) {
                p.destinations[0] = {0, 7};
              }),
              HasSubstr("item 0 has destination 7 outside [0, 2)"));
  EXPECT_THAT(msg([](auto& p) { p.destinations[0] = {1, 1}; }), HasSubstr("not ascending"));
  EXPECT_THAT(msg([](auto& p) { p.destinations.clear(); }),
              HasSubstr("destinations has 0 lists for 1 items"));
  EXPECT_THAT(msg([](auto& p) { p.buckets[1].push_back(5); }),
              HasSubstr("bucket 1 lists item 5 outside [0, 1)"));
  EXPECT_THAT(msg([](auto& p) { p.buckets[1].push_back(0); }),
              HasSubstr("item 0 appears more than once"));
  EXPECT_THAT(msg([](auto& p) { p.bucket_of[0] = 1; }), HasSubstr("bucket_of[0] = 1"));
  EXPECT_THAT(msg([](auto& p) { p.buckets.pop_back(); }),
              HasSubstr("1 bucket lists for encoder.buckets = 2"));
  EXPECT_THAT(msg([](auto& p) { p.exchange_size = 4; }), HasSubstr("exchange_size 4"));
  EXPECT_THAT(msg([](auto& p) { p.mode = ep::FeatureExchangeMode::Local; }),
              HasSubstr("needs tp_variable_a2a"));
  EXPECT_THAT(msg([](auto& p) { p.items[0].output_rows = 12; }),
              HasSubstr("item 0 spans tokens [5, 5 + 12) outside sample 0 of 16 tokens"));
  EXPECT_THAT(msg([](auto& p) { p.items[0].batch_index = 3; }),
              HasSubstr("batch_index 3 outside the 1 sample(s)"));
  EXPECT_THAT(msg([](auto& p) { p.seq_lens[0] = 15; }), HasSubstr("seq_lens[0]"));
  EXPECT_THAT(msg([](auto& p) { p.encoder.encoder_cp = 0; }), HasSubstr("encoder_cp"));
}

TEST(PlanValidation, OverlappingSpansInASampleAreRejectedNamingBothItems) {
  // five_images on tp 2 + SP: sample 0 has item 0 at [1,2) and item 1 at
  // [3,6). Moving item 0 to [3,4) makes both write token 3; its destinations
  // ({0}, the owner of [0,4)) stay right, so only the overlap is wrong.
  ep::ExchangePlan p = ep::plan_exchange(five_images(), mesh_of(1, 2, true), encoder_layout(2, 1));
  p.items[0].decoder_token_start = 3;
  const std::string m = invalid_argument_message([&] { p.validate(); });
  EXPECT_THAT(m,
              HasSubstr("item 0 (tokens [3, 4)) and item 1 (tokens [3, 6)) of sample 0 overlap"));
  // The same spans in different samples, touching spans and a zero-row item
  // inside another's span overlap nothing.
  ep::ExchangePlan other =
      ep::plan_exchange(five_images(), mesh_of(1, 2, true), encoder_layout(2, 1));
  other.items[2].decoder_token_start = 3;  // sample 1: [3,5) next to [4,6): overlaps
  EXPECT_THAT(invalid_argument_message([&] { other.validate(); }),
              HasSubstr("item 2 (tokens [3, 5)) and item 3 (tokens [4, 6)) of sample 1"));
  ep::ExchangePlan touching =
      ep::plan_exchange(five_images(), mesh_of(1, 2, true), encoder_layout(2, 1));
  touching.items[0].decoder_token_start = 2;  // [2,3) touches [3,6)
  EXPECT_NO_THROW(touching.validate());
  touching.items[0].decoder_token_start = 4;
  touching.items[0].output_rows = 0;  // [4,4) inside [3,6); destinations {0} now an extra
  EXPECT_NO_THROW(touching.validate());
}

TEST(PlanValidation, DestinationsMustIncludeEveryOwnerOfTheSpan) {
  // cp 2, tp 2, no SP: item 1 at [3,6) of sample 0 goes to {0,1,2,3}; CP 1
  // (ranks 2, 3) owns [4,8), so without rank 2 tokens 4, 5 keep their text.
  ep::ExchangePlan p = ep::plan_exchange(five_images(), mesh_of(2, 2, false), encoder_layout(4, 1));
  p.destinations[1] = {0, 1, 3};
  EXPECT_THAT(invalid_argument_message([&] { p.validate(); }),
              HasSubstr("item 1 (sample 0, tokens [3, 6)) has destinations [0,1,3] but leaves "
                        "out exchange rank 2, which owns tokens [4, 6) of it"));
  // Zigzag cp 2, S = 8 (chunks of 2): rank 0 owns [0,2) ++ [6,8), so of an
  // image at [1,8) it owns two pieces, both named.
  ep::Batch b;
  b.samples.push_back(sample(8, {span(1, 7, 28)}));
  ep::ExchangePlan z =
      ep::plan_exchange(b, mesh_of(2, 1, false, ep::CpLayout::Zigzag), encoder_layout(2, 1));
  ASSERT_EQ(z.destinations, (std::vector<std::vector<int>>{{0, 1}}));
  z.destinations[0] = {1};
  EXPECT_THAT(invalid_argument_message([&] { z.validate(); }),
              HasSubstr("leaves out exchange rank 0, which owns tokens [1, 2) [6, 8) of it"));
  z.destinations[0] = {};
  EXPECT_THAT(invalid_argument_message([&] { z.validate(); }),
              HasSubstr("item 0 (sample 0, tokens [1, 8)) has destinations [] but leaves out "
                        "exchange rank 0"));
}

TEST(PlanValidation, AnExtraDestinationIsAllowedAndMergesNothing) {
  // tp 2 + SP: item 0 at [1,2) is owned by rank 0 only. Sending it to rank 1
  // as well is valid: rank 1 owns none of its tokens, so the merge writes
  // none of its rows and its record gets zero gradient there.
  ep::ExchangePlan p = ep::plan_exchange(five_images(), mesh_of(1, 2, true), encoder_layout(2, 1));
  p.destinations[0] = {0, 1};
  EXPECT_NO_THROW(p.validate());
  const ep::ShardLayout layout(p, 1);  // tokens 4..7 of both samples: 8 rows
  ASSERT_EQ(layout.rows(), 8);
  Tensor base = full({8, 2}, -1.0, DType::Float64);
  Tensor rec = from_vector({9, 9}, {1, 2}, DType::Float64);
  rec.set_requires_grad(true);
  base.set_requires_grad(true);
  const Tensor out = ep::merge_into_decoder(base, {{p.items[0], rec}}, layout);
  EXPECT_EQ(out.to_vector(), base.to_vector());
  const auto grads = grad({out}, {rec}, {full({8, 2}, 1.0, DType::Float64)});
  EXPECT_EQ(grads[0].to_vector(), (std::vector<double>{0, 0}));
}

TEST(PlanValidation, RouteFeaturesAndStatsRefuseABadPlanOnEveryRank) {
  ep::ExchangePlan plan = small_plan();
  plan.items[0].item_id = 100;  // what the reference Python code would accept, keyed by id
  EXPECT_THAT(invalid_argument_message([&] { (void)plan.stats(8, DType::Float32); }),
              HasSubstr("item_id is 100"));
  EXPECT_THAT(invalid_argument_message([&] { (void)plan.fingerprint(); }),
              HasSubstr("item_id is 100"));
  EXPECT_THAT(invalid_argument_message([] { (void)small_plan().stats(-1, DType::Float32); }),
              HasSubstr("hidden -1"));
  sim::WorldOptions o;
  o.ranks = 2;
  sim::World world(o);
  EXPECT_THROW(world.run([&](sim::Rank& rk) {
    ep::route_features(plan.mode, {}, zeros({0, kHidden}, DType::Float64), rk.rank(), plan,
                       rk.world(), ep::ReceiverGrad::Partial);
  }),
               InvalidArgument);
  for (const auto& m : world.error_messages())
    EXPECT_THAT(m, HasSubstr("route_features: ExchangePlan: items[0].item_id is 100"));
}

TEST(PlanValidation, UnpackRefusesOverflowingRowCounts) {
  ep::EncoderWorkItem big;
  big.output_rows = INT64_MAX;
  EXPECT_THAT(invalid_argument_message([&] {
                ep::unpack_records(zeros({0, kHidden}, DType::Float64), {big, big});
              }),
              HasSubstr("exceed 2^63"));
}

}  // namespace
}  // namespace diffcomm
