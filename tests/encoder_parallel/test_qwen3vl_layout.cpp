// Qwen3-VL video layouts (issue 23, item 3): encoder_parallel::video_layout
// and build_batches against transformers' real Qwen3VLProcessor, token for
// token (tests/data/qwen3vl_video_layout.json, written by
// tests/data/gen_qwen3vl_layout.py with transformers 5.24.0), the issue's case by
// hand, and Qwen2-VL / Qwen2.5-VL layouts unchanged (one span per clip, the
// same batches for the same seed as the one-span builder had).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "diffcomm/encoder_parallel/batch.hpp"
#include "diffcomm/encoder_parallel/planner.hpp"
#include "diffcomm/encoder_parallel/tokens.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm {
namespace {

namespace ep = encoder_parallel;
using ::testing::HasSubstr;
using Runs = std::vector<std::pair<int64_t, int64_t>>;  // (offset, tokens)

Runs runs_of(const ep::VideoLayout& l) {
  Runs r;
  for (const auto& g : l.groups) r.emplace_back(g.offset, g.tokens);
  return r;
}

// The issue's case: one 4-frame 256 x 256 clip after 10 text tokens. The clip
// rule keeps 256 x 256 (4 x 256 x 256 = 262144 in [4096, 25165824]): grid
// 2 x 16 x 16, 64 tokens per group. Timestamps: frames 0..3 at 0, 0.5, 1, 1.5
// s; groups (0 + 0.5) / 2 = 0.25 -> "<0.2 seconds>" (half to even) and
// (1 + 1.5) / 2 = 1.25 -> "<1.2 seconds>", 6 tokens each ('<', '0', '.', '2',
// ' seconds', '>'). Block: 6 + 1 (<|vision_start|>) + 64 + 1 (<|vision_end|>)
// = 72 per group, groups at 7 and 72 + 7 = 79, 144 tokens.
TEST(Qwen3VLLayout, IssueCaseTwoRunsSeparatedByText) {
  const ep::VideoLayout l = ep::video_layout(ep::qwen3vl_model(), 4, 256, 256);
  EXPECT_EQ(l.media.grid_t, 2);
  EXPECT_EQ(l.media.grid_h, 16);
  EXPECT_EQ(l.media.grid_w, 16);
  EXPECT_EQ(l.media.tokens, 128);
  EXPECT_EQ(runs_of(l), (Runs{{7, 64}, {79, 64}}));
  EXPECT_EQ(l.block_tokens, 144);
  ASSERT_EQ(l.groups.size(), 2u);
  EXPECT_EQ(l.groups[0].timestamp_tokens, 6);
  EXPECT_EQ(l.groups[1].timestamp_tokens, 6);
  EXPECT_DOUBLE_EQ(l.groups[0].seconds, 0.25);
  EXPECT_DOUBLE_EQ(l.groups[1].seconds, 1.25);
  EXPECT_EQ(l.groups[0].patches, 256);

  // In a batch: 10 text tokens, the block [10, 154), 10 text tokens: spans
  // [17, 81) and [89, 153), one encoder work item each, length 164.
  ep::BatchOptions o;
  o.model = ep::qwen3vl_model();
  o.samples = 1;
  o.images_per_sample = 1;
  o.text_min = o.text_max = 10;
  const auto batches = ep::build_batches({{5, 256, 256, 4}}, 1, o);
  const ep::Sample& s = batches.at(0).samples.at(0);
  EXPECT_EQ(s.seq_len, 164);
  ASSERT_EQ(s.images.size(), 2u);
  EXPECT_EQ(s.images[0].token_start, 17);
  EXPECT_EQ(s.images[1].token_start, 89);
  for (const auto& im : s.images) {
    EXPECT_EQ(im.tokens, 64);
    EXPECT_EQ(im.patches, 256);
    EXPECT_EQ(im.source_id, 5);
  }
  const auto plan = ep::plan_exchange(batches[0], ep::DecoderMesh{2, 2, true}, {4, 1});
  EXPECT_EQ(plan.items.size(), 2u);
  // Contiguous CP 2 x TP 2 with SP on 164 tokens: parts of 41; [17, 81) lies
  // in parts 0 and 1, [89, 153) in parts 2 and 3.
  EXPECT_EQ(plan.destinations[0], (std::vector<int>{0, 1}));
  EXPECT_EQ(plan.destinations[1], (std::vector<int>{2, 3}));
}

// Timestamps: an odd clip pads its indices with the last; two-digit seconds
// are one token longer. 3 frames: indices 0, 1, 2, 2 -> 0.25 and (1 + 1) / 2
// = 1.0 -> "<0.2 seconds>", "<1.0 seconds>". 22 frames: group 10 holds
// frames 20, 21 -> 10.25 -> "<10.2 seconds>", 7 tokens.
TEST(Qwen3VLLayout, TimestampsPadTheLastFrameAndCountDigits) {
  const ep::VideoLayout odd = ep::video_layout(ep::qwen3vl_model(), 3, 56, 56);
  ASSERT_EQ(odd.groups.size(), 2u);
  EXPECT_DOUBLE_EQ(odd.groups[1].seconds, 1.0);
  // 56 x 56, 3 frames: round(56 / 32) = 2 -> 64 x 64, t = round(1.5) * 2 = 4,
  // 4 x 64 x 64 = 16384 in bounds: grid 2 x 4 x 4, 4 tokens per group.
  EXPECT_EQ(runs_of(odd), (Runs{{7, 4}, {19, 4}}));
  EXPECT_EQ(odd.block_tokens, 24);
  const ep::VideoLayout long_clip = ep::video_layout(ep::qwen3vl_model(), 22, 56, 56);
  ASSERT_EQ(long_clip.groups.size(), 11u);
  EXPECT_DOUBLE_EQ(long_clip.groups[10].seconds, 10.25);
  EXPECT_EQ(long_clip.groups[9].timestamp_tokens, 6);   // 9.25 -> "9.2"
  EXPECT_EQ(long_clip.groups[10].timestamp_tokens, 7);  // 10.25 -> "10.2"
  // Another fps: 4 frames at 1 fps: 0.5 and 2.5 -> "<0.5 seconds>", "<2.5 seconds>".
  ep::VisionModel slow = ep::qwen3vl_model();
  slow.video_fps = 1.0;
  const ep::VideoLayout s = ep::video_layout(slow, 4, 256, 256);
  EXPECT_DOUBLE_EQ(s.groups[0].seconds, 0.5);
  EXPECT_DOUBLE_EQ(s.groups[1].seconds, 2.5);
  slow.video_fps = 0;
  EXPECT_THROW(ep::video_layout(slow, 4, 256, 256), InvalidArgument);
}

// Every clip of the golden file: grid, block length and each run of video
// tokens, as the real processor wrote them.
TEST(Qwen3VLLayout, MatchesTransformersTokenForToken) {
  std::ifstream in(DIFFCOMM_QWEN3VL_LAYOUT_JSON);
  ASSERT_TRUE(in) << DIFFCOMM_QWEN3VL_LAYOUT_JSON;
  const nlohmann::json doc = nlohmann::json::parse(in);
  const ep::VisionModel m = ep::qwen3vl_model();
  EXPECT_EQ(doc.at("fps").get<double>(), m.video_fps);
  const auto& cfg = doc.at("video_preprocessor_config");
  EXPECT_EQ(cfg.at("size").at("shortest_edge").get<int64_t>(), m.video_min_pixels);
  EXPECT_EQ(cfg.at("size").at("longest_edge").get<int64_t>(), m.video_max_pixels);
  EXPECT_EQ(cfg.at("patch_size").get<int64_t>(), m.patch_size);
  EXPECT_EQ(cfg.at("merge_size").get<int64_t>(), m.merge_size);
  EXPECT_EQ(cfg.at("temporal_patch_size").get<int64_t>(), m.temporal_patch_size);
  int compared = 0, refused = 0, multi_digit = 0;
  for (const auto& c : doc.at("clips")) {
    const int64_t frames = c.at("frames"), h = c.at("height"), w = c.at("width");
    SCOPED_TRACE(::testing::Message() << frames << " frames of " << h << " x " << w);
    const ep::VideoLayout l = ep::video_layout(m, frames, h, w);
    if (c.contains("error")) {
      // Qwen3VLVideoProcessor refuses a clip shorter than temporal_patch_size;
      // diffcomm reads a 1-frame entry as a still image (one span, no text).
      EXPECT_LT(frames, m.temporal_patch_size);
      EXPECT_EQ(runs_of(l), (Runs{{0, ep::image_tokens(m, h, w).tokens}}));
      ++refused;
      continue;
    }
    const auto grid = c.at("grid_thw").get<std::vector<int64_t>>();
    EXPECT_EQ(grid, (std::vector<int64_t>{l.media.grid_t, l.media.grid_h, l.media.grid_w}));
    EXPECT_EQ(c.at("block_tokens").get<int64_t>(), l.block_tokens);
    Runs want;
    for (const auto& r : c.at("runs")) want.emplace_back(r.at(0), r.at(1));
    EXPECT_EQ(runs_of(l), want);
    const auto stamps = c.at("timestamps").get<std::vector<std::string>>();
    ASSERT_EQ(stamps.size(), l.groups.size());
    for (std::size_t g = 0; g < stamps.size(); ++g) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "<%.1f seconds>", l.groups[g].seconds);
      EXPECT_EQ(stamps[g], buf);
      if (l.groups[g].timestamp_tokens > 6) ++multi_digit;
    }
    ++compared;
  }
  // 9 sizes x 9 frame counts + 2 long clips; the 1-frame clips are refused.
  EXPECT_EQ(compared, 74);
  EXPECT_EQ(refused, 9);
  EXPECT_GT(multi_digit, 0);
}

// Qwen2-VL and Qwen2.5-VL: one run at offset 0 filling its block, for images
// and videos alike.
TEST(Qwen3VLLayout, Qwen2VideosStayOneRun) {
  for (const auto& m : {ep::qwen2vl_model(), ep::qwen25vl_model()}) {
    const ep::VideoLayout l = ep::video_layout(m, 4, 256, 256);
    const ep::MediaTokens t = ep::video_tokens(m, 4, 256, 256);
    EXPECT_EQ(runs_of(l), (Runs{{0, t.tokens}}));
    EXPECT_EQ(l.block_tokens, t.tokens);
    EXPECT_EQ(l.groups.at(0).patches, t.patches);
  }
  // A Qwen3-VL image is one run too.
  const ep::VideoLayout img = ep::video_layout(ep::qwen3vl_model(), 1, 480, 640);
  EXPECT_EQ(runs_of(img), (Runs{{0, 300}}));
  EXPECT_EQ(img.block_tokens, 300);
}

// The batch builder before issue 23 (one span per entry, video_tokens), kept
// here as the reference: Qwen2-VL batches must not change for any seed.
std::vector<ep::Batch> one_span_builder(const std::vector<ep::ImageSize>& images, int dp,
                                        const ep::BatchOptions& o) {
  Generator gen(o.seed);
  std::vector<std::size_t> order(images.size());
  std::iota(order.begin(), order.end(), 0);
  for (std::size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[gen.next_u64() % i]);
  std::size_t cursor = 0;
  auto text = [&] {
    return o.text_min + static_cast<int64_t>(gen.next_u64() %
                                             (static_cast<uint64_t>(o.text_max - o.text_min) + 1));
  };
  std::vector<ep::Batch> out(static_cast<std::size_t>(dp));
  for (auto& batch : out)
    for (int s = 0; s < o.samples; ++s) {
      ep::Sample sample;
      int64_t pos = 0;
      for (int k = 0; k < o.images_per_sample; ++k) {
        pos += text();
        const ep::ImageSize& im = images[order[cursor++ % order.size()]];
        const ep::MediaTokens t = ep::video_tokens(o.model, im.frames, im.height, im.width);
        sample.images.push_back({pos, t.tokens, t.patches, im.image_id});
        pos += t.tokens;
      }
      pos += text();
      sample.seq_len = (pos + o.seq_multiple - 1) / o.seq_multiple * o.seq_multiple;
      batch.samples.push_back(std::move(sample));
    }
  return out;
}

std::string describe(const std::vector<ep::Batch>& batches) {
  std::string s;
  for (const auto& b : batches)
    for (const auto& smp : b.samples) {
      s += "S" + std::to_string(smp.seq_len) + ":";
      for (const auto& im : smp.images)
        s += " [" + std::to_string(im.token_start) + "+" + std::to_string(im.tokens) + " p" +
             std::to_string(im.patches) + " #" + std::to_string(im.source_id) + "]";
      s += "\n";
    }
  return s;
}

TEST(Qwen3VLLayout, Qwen2BatchesAreUnchangedForEverySeed) {
  // COCO sizes and videos mixed (a frames column), several seeds and options.
  auto media = ep::load_image_sizes(ep::default_image_sizes_path());
  media.resize(200);
  for (int64_t i = 0; i < 40; ++i)
    media.push_back({100000 + i, 64 + 37 * i, 48 + 29 * i, 2 + i % 7});
  for (const auto& model : {ep::qwen2vl_model(), ep::qwen25vl_model()})
    for (uint64_t seed = 0; seed < 20; ++seed) {
      ep::BatchOptions o;
      o.model = model;
      o.seed = seed;
      o.samples = 3;
      o.images_per_sample = 1 + static_cast<int>(seed % 4);
      o.text_min = static_cast<int64_t>(seed % 3);
      o.text_max = 64;
      o.seq_multiple = 1 + static_cast<int64_t>(seed % 8);
      EXPECT_EQ(describe(ep::build_batches(media, 2, o)), describe(one_span_builder(media, 2, o)))
          << model.name << " seed " << seed;
    }
}

// build_batches with Qwen3-VL videos: per clip, spans ascend without overlap,
// sum to video_tokens().tokens, and sit at the layout's offsets from the
// clip's block; consecutive blocks leave room for the text between them.
TEST(Qwen3VLLayout, BatchesPlaceEveryGroupAtItsOffset) {
  std::vector<ep::ImageSize> media;
  for (int64_t i = 0; i < 30; ++i)
    media.push_back({i, 40 + 53 * i, 300 + 17 * i, i % 3 == 0 ? 1 : 2 + i % 9});
  ep::BatchOptions o;
  o.model = ep::qwen3vl_model();
  o.samples = 4;
  o.images_per_sample = 3;
  o.seq_multiple = 8;
  for (uint64_t seed = 0; seed < 10; ++seed) {
    o.seed = seed;
    for (const auto& b : ep::build_batches(media, 2, o))
      for (const auto& smp : b.samples) {
        std::map<int64_t, std::vector<ep::ImageSpan>> by_clip;
        for (const auto& im : smp.images) by_clip[im.source_id].push_back(im);
        int64_t end = 0;
        for (const auto& im : smp.images) {
          EXPECT_GE(im.token_start, end);
          end = im.token_start + im.tokens;
        }
        EXPECT_LE(end, smp.seq_len);
        EXPECT_EQ(smp.seq_len % 8, 0);
        for (const auto& [id, spans] : by_clip) {
          const ep::ImageSize& im = media.at(static_cast<std::size_t>(id));
          const ep::VideoLayout l = ep::video_layout(o.model, im.frames, im.height, im.width);
          if (spans.size() != l.groups.size()) continue;  // drawn twice into one sample
          const int64_t block = spans[0].token_start - l.groups[0].offset;
          int64_t sum = 0;
          for (std::size_t g = 0; g < spans.size(); ++g) {
            EXPECT_EQ(spans[g].token_start - block, l.groups[g].offset);
            EXPECT_EQ(spans[g].tokens, l.groups[g].tokens);
            sum += spans[g].tokens;
          }
          EXPECT_EQ(sum, ep::video_tokens(o.model, im.frames, im.height, im.width).tokens);
        }
      }
  }
}

TEST(Qwen3VLLayout, ClipBoundsAreValidated) {
  ep::VisionModel m = ep::qwen3vl_model();
  m.video_max_pixels = 2 * 32 * 32 - 1;  // below one temporal x factor x factor block
  EXPECT_THAT(
      [&] {
        try {
          ep::video_tokens(m, 4, 256, 256);
        } catch (const InvalidArgument& e) {
          return std::string(e.what());
        }
        return std::string();
      }(),
      HasSubstr("video_max_pixels"));
  m = ep::qwen3vl_model();
  m.video_min_pixels = m.video_max_pixels + 1;
  EXPECT_THROW(ep::video_tokens(m, 4, 256, 256), InvalidArgument);
  // The per-frame models ignore the clip bounds (they are 0 there).
  EXPECT_EQ(ep::qwen2vl_model().video_max_pixels, 0);
  EXPECT_NO_THROW(ep::video_tokens(ep::qwen2vl_model(), 4, 256, 256));
  // An aspect ratio above 200 is refused after the upscaling of a thin side:
  // 10 x 2010 -> scale 3.2 -> 32 x 6432, 201.
  EXPECT_THROW(ep::video_tokens(ep::qwen3vl_model(), 4, 10, 2010), InvalidArgument);
}

}  // namespace
}  // namespace diffcomm
