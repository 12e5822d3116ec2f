// Unit tests of the encoder-parallel layer (DESIGN.md "Encoder-parallel
// feature exchange"): the COCO image-size loader (the shipped CSV and malformed ones) and
// the batch builder.
//
// Every expected value below is worked out by hand in the comment next to it,
// never taken from the code under test (fixtures.hpp: the shared inputs).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "diffcomm/encoder_parallel/batch.hpp"
#include "diffcomm/encoder_parallel/qwen2vl.hpp"
#include "diffcomm/encoder_parallel/tokens.hpp"
#include "fixtures.hpp"

namespace diffcomm {
namespace {

using namespace ep_testing;  // NOLINT(google-build-using-namespace)
using ::testing::AllOf;
using ::testing::HasSubstr;

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

}  // namespace
}  // namespace diffcomm
