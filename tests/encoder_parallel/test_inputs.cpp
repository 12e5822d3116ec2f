// Unit tests of the encoder-parallel layer (DESIGN.md "Encoder-parallel
// feature exchange"): defined behaviour on edge inputs (issue 13): smart_resize bounds, token
// counts, plan validation, unpack of overflowing row counts.
//
// Every expected value below is worked out by hand in the comment next to it,
// never taken from the code under test (fixtures.hpp: the shared inputs).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/encoder_parallel/batch.hpp"
#include "diffcomm/encoder_parallel/exchange.hpp"
#include "diffcomm/encoder_parallel/merge.hpp"
#include "diffcomm/encoder_parallel/planner.hpp"
#include "diffcomm/encoder_parallel/qwen2vl.hpp"
#include "diffcomm/encoder_parallel/tokens.hpp"
#include "diffcomm/sim/world.hpp"
#include "fixtures.hpp"

namespace diffcomm {
namespace {

using namespace ep_testing;  // NOLINT(google-build-using-namespace)
using ::testing::HasSubstr;
using ::testing::StartsWith;

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
  for (const std::exception_ptr& err : world.errors()) {
    ASSERT_TRUE(err);
    try {
      std::rethrow_exception(err);
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.site().op, "route_features");
      EXPECT_THAT(std::string(e.detail()), StartsWith("ExchangePlan: items[0].item_id is 100"));
    } catch (const std::exception& e) {
      ADD_FAILURE() << "expected InvalidArgument, got: " << e.what();
    }
  }
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
