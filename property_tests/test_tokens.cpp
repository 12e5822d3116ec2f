// Properties of the token rule (encoder_parallel/tokens.hpp) over random
// models, pixel bounds and image sizes: both sides are positive multiples of
// the factor; the aspect ratio of the result is at most 2 r + 1 for an input
// ratio r <= 200; with max_pixels >= 4 min_pixels the pixels lie in
// [min_pixels, max_pixels], except that a side clamped to the factor may
// leave them above max_pixels, up to 2 f sqrt(200 max_pixels) (the
// documented exception); tokens * merge^2 == patches; videos have
// ceil(frames / temporal) times an image's patches (per-frame rule); video
// layouts (VideoLayout.*): Qwen3-VL groups ascend without overlap and sum to
// the clip, Qwen2-VL clips stay one span.
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>

#include "diffcomm/encoder_parallel/tokens.hpp"
#include "diffcomm/tensor/error.hpp"

namespace ep = diffcomm::encoder_parallel;

namespace {

// A model with random patch/merge sizes and bounds; wide = max >= 4 min.
ep::VisionModel random_model(bool wide) {
  ep::VisionModel m;
  m.name = "random";
  m.patch_size = *rc::gen::inRange<int64_t>(1, 33);
  m.merge_size = *rc::gen::inRange<int64_t>(1, 5);
  m.temporal_patch_size = *rc::gen::inRange<int64_t>(1, 5);
  const int64_t block = m.factor() * m.factor();
  m.max_pixels = block * *rc::gen::inRange<int64_t>(1, 20000);
  m.min_pixels = wide ? *rc::gen::inRange<int64_t>(1, m.max_pixels / 4 + 1)
                      : *rc::gen::inRange<int64_t>(1, m.max_pixels + 1);
  return m;
}

// A side in [1, 2^40] with small and huge values both likely, and an aspect
// ratio within 200.
std::pair<int64_t, int64_t> random_size() {
  const int64_t h = *rc::gen::oneOf(rc::gen::inRange<int64_t>(1, 5000),
                                    rc::gen::inRange<int64_t>(1, ep::kMaxImageSide + 1));
  const int64_t lo = std::max<int64_t>(1, (h + 199) / 200);
  const int64_t hi = std::min<int64_t>(ep::kMaxImageSide, h * 200);
  const int64_t w = *rc::gen::inRange<int64_t>(lo, hi + 1);
  return *rc::gen::element(std::pair{h, w}, std::pair{w, h});
}

void check_sides(const ep::VisionModel& m, int64_t h, int64_t w, const ep::ResizedImage& r) {
  const int64_t f = m.factor();
  RC_ASSERT(r.height >= f);
  RC_ASSERT(r.width >= f);
  RC_ASSERT(r.height % f == 0);
  RC_ASSERT(r.width % f == 0);
  const double in_ratio = static_cast<double>(std::max(h, w)) / static_cast<double>(std::min(h, w));
  const double out_ratio = static_cast<double>(std::max(r.height, r.width)) /
                           static_cast<double>(std::min(r.height, r.width));
  RC_ASSERT(out_ratio <= 2 * in_ratio + 1);
}

}  // namespace

RC_GTEST_PROP(TokenRule, SidesAreMultiplesOfTheFactorWithinTheAspectLimit, ()) {
  const bool wide = *rc::gen::arbitrary<bool>();
  const ep::VisionModel m = random_model(wide);
  const auto [h, w] = random_size();
  check_sides(m, h, w, ep::smart_resize(m, h, w));
}

RC_GTEST_PROP(TokenRule, PixelsWithinBoundsOrTheDocumentedException, ()) {
  const ep::VisionModel m = random_model(true);
  const auto [h, w] = random_size();
  const ep::ResizedImage r = ep::smart_resize(m, h, w);
  check_sides(m, h, w, r);
  const int64_t f = m.factor();
  const int64_t pixels = r.height * r.width;
  RC_ASSERT(pixels >= m.min_pixels);
  if (pixels > m.max_pixels) {
    RC_TAG("clamped side above max_pixels");
    RC_ASSERT(r.height == f || r.width == f);
    RC_ASSERT(static_cast<double>(pixels) <=
              2.0 * static_cast<double>(f) * std::sqrt(200.0 * static_cast<double>(m.max_pixels)));
  }
}

RC_GTEST_PROP(TokenRule, PresetsKeepEveryImageWithinBounds, ()) {
  const ep::VisionModel m = ep::vision_model(*rc::gen::elementOf(ep::vision_model_names()));
  const auto [h, w] = random_size();
  const ep::ResizedImage r = ep::smart_resize(m, h, w);
  check_sides(m, h, w, r);
  const int64_t pixels = r.height * r.width;
  RC_ASSERT(pixels >= m.min_pixels);
  RC_ASSERT(pixels <= m.max_pixels || r.height == m.factor() || r.width == m.factor());
}

RC_GTEST_PROP(TokenRule, TokensPatchesAndVideoFrames, ()) {
  const ep::VisionModel m = random_model(*rc::gen::arbitrary<bool>());
  const auto [h, w] = random_size();
  const int64_t frames = *rc::gen::inRange<int64_t>(1, 1000);
  const ep::MediaTokens img = ep::image_tokens(m, h, w);
  const ep::MediaTokens vid = ep::video_tokens(m, frames, h, w);
  const ep::ResizedImage r = ep::smart_resize(m, h, w);
  RC_ASSERT(img.grid_t == 1);
  RC_ASSERT(img.grid_h * m.patch_size == r.height);
  RC_ASSERT(img.grid_w * m.patch_size == r.width);
  RC_ASSERT(img.patches == img.grid_h * img.grid_w);
  RC_ASSERT(img.tokens * m.merge_size * m.merge_size == img.patches);
  RC_ASSERT(vid.grid_t == (frames + m.temporal_patch_size - 1) / m.temporal_patch_size);
  RC_ASSERT(vid.patches == vid.grid_t * img.patches);
  RC_ASSERT(vid.tokens == vid.grid_t * img.tokens);
}

RC_GTEST_PROP(TokenRule, InvalidBoundsAndSizesAreRefused, ()) {
  ep::VisionModel m = random_model(false);
  const int64_t block = m.factor() * m.factor();
  switch (*rc::gen::inRange(0, 4)) {
    case 0: m.max_pixels = *rc::gen::inRange<int64_t>(-5, block); break;
    case 1: m.min_pixels = m.max_pixels + *rc::gen::inRange<int64_t>(1, 1000); break;
    case 2: m.min_pixels = *rc::gen::inRange<int64_t>(-1000, 1); break;
    default: {
      const int64_t h = *rc::gen::inRange<int64_t>(1, 1000);
      RC_ASSERT_THROWS_AS(ep::smart_resize(m, h, h * 201 + *rc::gen::inRange<int64_t>(0, 10)),
                          diffcomm::InvalidArgument);
      return;
    }
  }
  RC_ASSERT_THROWS_AS(ep::smart_resize(m, 100, 100), diffcomm::InvalidArgument);
}

// video_layout (issue 23): for Qwen3-VL (timestamped blocks) at any frame
// rate, the groups ascend without overlap, one per temporal group, each after
// its "<t seconds>" (5 + integer digits tokens) and <|vision_start|>; their
// tokens and patches sum to video_tokens'; the block is sum (ts + 2 + tokens).
// Qwen2-VL / Qwen2.5-VL: one group at 0 filling the block.
RC_GTEST_PROP(VideoLayout, GroupsAscendAndSumToTheClip, ()) {
  const auto [h, w] = random_size();
  const int64_t frames = *rc::gen::inRange<int64_t>(1, 2000);
  ep::VisionModel q3 = ep::qwen3vl_model();
  q3.video_fps = *rc::gen::element(2.0, 1.0, 0.5, 24.0, 29.97, 0.001);
  ep::VideoLayout l;
  ep::MediaTokens t;
  try {
    l = ep::video_layout(q3, frames, h, w);
    t = ep::video_tokens(q3, frames, h, w);
  } catch (const diffcomm::InvalidArgument&) {
    // Only the clip rule's upscaling of a side below the factor can push the
    // aspect ratio past 200.
    RC_ASSERT(frames > 1 && std::min(h, w) < q3.factor());
    return;
  }
  RC_ASSERT(l.media.tokens == t.tokens);
  RC_ASSERT(l.groups.size() == static_cast<std::size_t>(frames == 1 ? 1 : t.grid_t));
  int64_t pos = 0, tokens = 0, patches = 0;
  for (const auto& g : l.groups) {
    if (frames == 1) {
      RC_ASSERT(g.offset == 0 && g.timestamp_tokens == 0);
    } else {
      char buf[64];
      const int n = std::snprintf(buf, sizeof buf, "%.1f", g.seconds);
      RC_ASSERT(g.timestamp_tokens == 5 + (n - 2));
      RC_ASSERT(g.offset == pos + g.timestamp_tokens + 1);
    }
    RC_ASSERT(g.offset >= pos);
    RC_ASSERT(g.tokens > 0);
    RC_ASSERT(g.tokens * q3.merge_size * q3.merge_size == g.patches);
    pos = g.offset + g.tokens + (frames == 1 ? 0 : 1);
    tokens += g.tokens;
    patches += g.patches;
  }
  RC_ASSERT(pos == l.block_tokens);
  RC_ASSERT(tokens == t.tokens);
  RC_ASSERT(patches == t.patches);
  // The clip rule's sides are positive multiples of the factor too.
  RC_ASSERT(t.grid_h * q3.patch_size % q3.factor() == 0 && t.grid_h > 0);
  RC_ASSERT(t.grid_w * q3.patch_size % q3.factor() == 0 && t.grid_w > 0);

  for (const auto& m : {ep::qwen2vl_model(), ep::qwen25vl_model()}) {
    const ep::VideoLayout one = ep::video_layout(m, frames, h, w);
    const ep::MediaTokens mt = ep::video_tokens(m, frames, h, w);
    RC_ASSERT(one.groups.size() == 1u);
    RC_ASSERT(one.groups[0].offset == 0);
    RC_ASSERT(one.groups[0].tokens == mt.tokens);
    RC_ASSERT(one.groups[0].patches == mt.patches);
    RC_ASSERT(one.block_tokens == mt.tokens);
    // The per-frame rule: an image's tokens per temporal group.
    RC_ASSERT(mt.tokens == mt.grid_t * ep::image_tokens(m, h, w).tokens);
  }
}
