// Fuzzes the token rule (encoder_parallel/tokens.hpp): any model fields, any
// sizes and frame counts. Either InvalidArgument, or a result that keeps the
// documented guarantees (sides positive multiples of the factor; grids and
// counts consistent; video_layout's groups ascending and summing to the clip).
#include <cstdint>
#include <cstdlib>

#include "diffcomm/encoder_parallel/tokens.hpp"
#include "diffcomm/tensor/error.hpp"
#include "fuzz_input.hpp"

namespace ep = diffcomm::encoder_parallel;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  diffcomm::fuzz::Input in(data, size);
  ep::VisionModel m;
  m.name = "fuzz";
  const bool preset = in.flag();
  if (preset) {
    m = ep::vision_model(ep::vision_model_names()[static_cast<std::size_t>(in.range(0, 2))]);
  } else {
    m.patch_size = in.range(-2, 40);
    m.merge_size = in.range(-2, 6);
    m.temporal_patch_size = in.range(-2, 6);
    m.min_pixels = in.flag() ? in.any() : in.range(-10, 1 << 22);
    m.max_pixels = in.flag() ? in.any() : in.range(-10, 1 << 26);
  }
  const int64_t h = in.flag() ? in.any() : in.range(-2, 100000);
  const int64_t w = in.flag() ? in.any() : in.range(-2, 100000);
  const int64_t frames = in.flag() ? in.any() : in.range(-2, 64);
  if (!preset) {  // the video fields, read last so older inputs keep their sizes
    m.video_clip_bounds = in.flag();
    m.video_min_pixels = in.range(-10, 1 << 22);
    m.video_max_pixels = in.flag() ? in.any() : in.range(-10, 1 << 28);
    m.video_timestamps = in.flag();
    m.video_fps = static_cast<double>(in.range(-2, 240)) / 8.0;
  }
  try {
    const ep::MediaTokens t = ep::video_tokens(m, frames, h, w);
    const int64_t f = m.factor();
    if (!m.video_clip_bounds || frames == 1) {  // the per-frame rule: an image's grid
      const ep::ResizedImage r = ep::smart_resize(m, h, w);
      if (r.height < f || r.width < f || r.height % f || r.width % f) std::abort();
      if (t.grid_h * m.patch_size != r.height || t.grid_w * m.patch_size != r.width) std::abort();
    }
    if ((t.grid_h * m.patch_size) % f || (t.grid_w * m.patch_size) % f || t.grid_h < 1 ||
        t.grid_w < 1)
      std::abort();
    if (t.tokens * m.merge_size * m.merge_size != t.patches || t.tokens < 1) std::abort();
    // The layout: groups ascending inside the block, tokens summing to the clip's.
    const ep::VideoLayout l = ep::video_layout(m, frames, h, w);
    int64_t end = 0, sum = 0;
    for (const auto& g : l.groups) {
      if (g.offset < end || g.tokens < 1) std::abort();
      end = g.offset + g.tokens;
      sum += g.tokens;
    }
    if (sum != t.tokens || end > l.block_tokens) std::abort();
  } catch (const diffcomm::InvalidArgument&) {
  }
  return 0;
}
