#include "diffcomm/encoder_parallel/tokens.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::encoder_parallel {
namespace {

constexpr int64_t kMaxModelPixels = int64_t{1} << 53;  // exact in a double
constexpr int64_t kMaxPatch = 4096;

// Python's round(x / f) * f: half to even (nearbyint in the default rounding mode).
int64_t round_by_factor(int64_t v, int64_t f) {
  return static_cast<int64_t>(std::nearbyint(static_cast<double>(v) / static_cast<double>(f))) * f;
}
int64_t floor_by_factor(double v, int64_t f) {
  return static_cast<int64_t>(std::floor(v / static_cast<double>(f))) * f;
}
int64_t ceil_by_factor(double v, int64_t f) {
  return static_cast<int64_t>(std::ceil(v / static_cast<double>(f))) * f;
}
// a * b, or INT64_MAX when that overflows (only compared against bounds <= 2^53).
int64_t saturating_mul(int64_t a, int64_t b) {
  int64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? INT64_MAX : r;
}
// a / b for exact integers as Python's true division does it (the product is
// formed in long double: exact up to 2^64).
double ratio(long double num, long double den) { return static_cast<double>(num / den); }

// smart_resize's bound step, shared by the image and the clip rule: `pixels`
// (of the rounded sides hb x wb) above max_pixels scales the input sides h, w
// down by beta = sqrt(amount / max_pixels) and floors them to the factor (a
// side thinner than one factor clamps to f); below min_pixels scales them up
// by sqrt(min_pixels / amount) and ceils. `amount`: the input's pixels
// (height x width, or frames x height x width for a clip).
ResizedImage bound_pixels(double h, double w, long double amount, int64_t pixels, int64_t hb,
                          int64_t wb, int64_t min_pixels, int64_t max_pixels, int64_t f) {
  if (pixels > max_pixels) {
    const double beta = std::sqrt(ratio(amount, static_cast<long double>(max_pixels)));
    return {std::max(f, floor_by_factor(h / beta, f)), std::max(f, floor_by_factor(w / beta, f))};
  }
  if (pixels < min_pixels) {
    const double beta = std::sqrt(ratio(static_cast<long double>(min_pixels), amount));
    return {ceil_by_factor(h * beta, f), ceil_by_factor(w * beta, f)};
  }
  return {hb, wb};
}

}  // namespace

void VisionModel::validate() const {
  auto check = [&](bool ok, const char* field, int64_t value, const std::string& need) {
    if (!ok)
      throw InvalidArgument(
          fmt::format("VisionModel '{}': {} = {} (need {})", name, field, value, need));
  };
  check(patch_size >= 1 && patch_size <= kMaxPatch, "patch_size", patch_size, "1..4096");
  check(merge_size >= 1 && merge_size <= kMaxPatch, "merge_size", merge_size, "1..4096");
  check(temporal_patch_size >= 1 && temporal_patch_size <= kMaxPatch, "temporal_patch_size",
        temporal_patch_size, "1..4096");
  check(max_pixels <= kMaxModelPixels, "max_pixels", max_pixels, "<= 2^53");
  check(factor() * factor() <= max_pixels, "max_pixels", max_pixels,
        fmt::format(">= one factor x factor block, {} x {} = {}", factor(), factor(),
                    factor() * factor()));
  check(min_pixels >= 1, "min_pixels", min_pixels, ">= 1");
  check(min_pixels <= max_pixels, "min_pixels", min_pixels,
        fmt::format("<= max_pixels = {}", max_pixels));
  if (video_clip_bounds) {
    check(video_max_pixels <= kMaxModelPixels, "video_max_pixels", video_max_pixels, "<= 2^53");
    check(temporal_patch_size * factor() * factor() <= video_max_pixels, "video_max_pixels",
          video_max_pixels,
          fmt::format(">= one temporal x factor x factor block, {} x {} x {} = {}",
                      temporal_patch_size, factor(), factor(),
                      temporal_patch_size * factor() * factor()));
    check(video_min_pixels >= 1, "video_min_pixels", video_min_pixels, ">= 1");
    check(video_min_pixels <= video_max_pixels, "video_min_pixels", video_min_pixels,
          fmt::format("<= video_max_pixels = {}", video_max_pixels));
  }
  if (!(std::isfinite(video_fps) && video_fps >= 1e-3 && video_fps <= 1e6))
    throw InvalidArgument(
        fmt::format("VisionModel '{}': video_fps = {} (need 1e-3..1e6)", name, video_fps));
}

VisionModel qwen2vl_model() { return {"qwen2vl", 14, 2, 2, 56 * 56, 28 * 28 * 16384}; }
VisionModel qwen25vl_model() { return {"qwen2.5vl", 14, 2, 2, 56 * 56, 28 * 28 * 16384}; }
VisionModel qwen3vl_model() {
  VisionModel m{"qwen3vl", 16, 2, 2, 65536, 16777216};
  m.video_clip_bounds = true;  // video_preprocessor_config.json size
  m.video_min_pixels = 4096;
  m.video_max_pixels = 25165824;
  m.video_timestamps = true;
  m.video_fps = 2.0;  // Qwen3VLVideoProcessor.fps
  return m;
}

std::vector<std::string> vision_model_names() { return {"qwen2vl", "qwen2.5vl", "qwen3vl"}; }

VisionModel vision_model(std::string_view name) {
  if (name == "qwen2vl") return qwen2vl_model();
  if (name == "qwen2.5vl") return qwen25vl_model();
  if (name == "qwen3vl") return qwen3vl_model();
  raise("vision_model",
        fmt::format("unknown model '{}' (known: {})", name, fmt::join(vision_model_names(), ", ")));
}

namespace {
// Both resize rules accept sides in [1, kMaxImageSide].
void check_sides(int64_t height, int64_t width) {
  if (height < 1 || width < 1 || height > kMaxImageSide || width > kMaxImageSide)
    raise("smart_resize", fmt::format("size {}x{} (height x width) must be in [1, "
                                      "2^40] on each side",
                                      height, width));
}
}  // namespace

ResizedImage smart_resize(const VisionModel& model, int64_t height, int64_t width) {
  model.validate();
  check_sides(height, width);
  // Integer form of max/min > 200: exact, unlike the division.
  if (std::max(height, width) > kMaxAspectRatio * std::min(height, width))
    raise("smart_resize",
          fmt::format("aspect ratio of {}x{} exceeds {}", height, width, kMaxAspectRatio));
  const int64_t f = model.factor();
  const double h = static_cast<double>(height), w = static_cast<double>(width);
  const long double area = static_cast<long double>(height) * static_cast<long double>(width);
  const int64_t hb = std::max(f, round_by_factor(height, f));
  const int64_t wb = std::max(f, round_by_factor(width, f));
  return bound_pixels(h, w, area, saturating_mul(hb, wb), hb, wb, model.min_pixels,
                      model.max_pixels, f);
}

namespace {

// Qwen3VLVideoProcessor's smart_resize (transformers 5.24.0
// video_processing_qwen3_vl.py), the same floating-point operations in the same
// order: frames x height x width bounded by the video pixel bounds.
ResizedImage clip_resize(const VisionModel& model, int64_t frames, int64_t height, int64_t width) {
  model.validate();
  check_sides(height, width);
  const int64_t f = model.factor();
  if (height < f || width < f) {
    // Python: scale = max(f / h, f / w); height = int(height * scale).
    const double scale = std::max(static_cast<double>(f) / static_cast<double>(height),
                                  static_cast<double>(f) / static_cast<double>(width));
    const double hs = static_cast<double>(height) * scale;
    const double ws = static_cast<double>(width) * scale;
    // The thin side becomes about f <= 2^24, so a side above 2^53 means a
    // ratio far above 200 (refused below); this keeps the casts defined.
    constexpr double kTwo53 = 9007199254740992.0;
    if (hs > kTwo53 || ws > kTwo53)
      raise("smart_resize",
            fmt::format("aspect ratio of {}x{} exceeds {}", height, width, kMaxAspectRatio));
    height = static_cast<int64_t>(hs);
    width = static_cast<int64_t>(ws);
  }
  // Python compares max / min > 200 in floating point; the integer form is the
  // same for sides below 2^46 (a ratio just above 200 differs from 200 by more
  // than half an ulp).
  if (height < 1 || width < 1 ||
      std::max(height, width) > kMaxAspectRatio * std::min(height, width))
    raise("smart_resize",
          fmt::format("aspect ratio of {}x{} exceeds {}", height, width, kMaxAspectRatio));
  const int64_t tf = model.temporal_patch_size;
  const double h = static_cast<double>(height), w = static_cast<double>(width);
  const long double volume = static_cast<long double>(frames) * static_cast<long double>(height) *
                             static_cast<long double>(width);
  const int64_t hb = round_by_factor(height, f);
  const int64_t wb = round_by_factor(width, f);
  const int64_t tb = round_by_factor(frames, tf);
  return bound_pixels(h, w, volume, saturating_mul(saturating_mul(tb, hb), wb), hb, wb,
                      model.video_min_pixels, model.video_max_pixels, f);
}

// Python's len(f"{t:.1f}".split(".")[0]) for t >= 0: glibc's %.1f rounds the
// exact binary value half to even, as Python's float formatting does.
int64_t integer_digits(double t) {
  char buf[64];
  const int n = std::snprintf(buf, sizeof buf, "%.1f", t);
  if (n < 3 || static_cast<std::size_t>(n) >= sizeof buf)
    raise("video_layout", fmt::format("timestamp {} s cannot be formatted", t));
  return n - 2;
}

}  // namespace

MediaTokens image_tokens(const VisionModel& model, int64_t height, int64_t width) {
  return video_tokens(model, 1, height, width);
}

MediaTokens video_tokens(const VisionModel& model, int64_t frames, int64_t height, int64_t width) {
  if (frames < 1 || frames > kMaxFrames)
    raise("video_tokens", fmt::format("{} frames (need 1..{})", frames, kMaxFrames));
  const ResizedImage r = model.video_clip_bounds && frames > 1
                             ? clip_resize(model, frames, height, width)
                             : smart_resize(model, height, width);
  MediaTokens t;
  t.grid_t = (frames + model.temporal_patch_size - 1) / model.temporal_patch_size;
  t.grid_h = r.height / model.patch_size;
  t.grid_w = r.width / model.patch_size;
  int64_t per_frame = 0;
  if (__builtin_mul_overflow(t.grid_h, t.grid_w, &per_frame) ||
      __builtin_mul_overflow(per_frame, t.grid_t, &t.patches))
    raise("video_tokens",
          fmt::format("{} frames of {}x{} give more than 2^63 patches", frames, height, width));
  t.tokens = t.patches / (model.merge_size * model.merge_size);
  return t;
}

VideoLayout video_layout(const VisionModel& model, int64_t frames, int64_t height, int64_t width) {
  VideoLayout out;
  out.media = video_tokens(model, frames, height, width);
  const MediaTokens& m = out.media;
  if (frames == 1 || !model.video_timestamps) {
    out.groups.push_back({0, m.tokens, m.patches, 0, 0.0});
    out.block_tokens = m.tokens;
    return out;
  }
  const int64_t per_group_patches = m.grid_h * m.grid_w;
  const int64_t per_group_tokens = per_group_patches / (model.merge_size * model.merge_size);
  const int64_t tp = model.temporal_patch_size;
  int64_t pos = 0;
  out.groups.reserve(static_cast<std::size_t>(m.grid_t));
  for (int64_t g = 0; g < m.grid_t; ++g) {
    // Indices 0..frames-1 padded with the last: the chunk [g*tp, g*tp + tp).
    const int64_t first = g * tp;
    const int64_t last = std::min(first + tp - 1, frames - 1);
    const double a = static_cast<double>(first) / model.video_fps;
    const double b = static_cast<double>(last) / model.video_fps;
    VideoGroup grp;
    grp.seconds = (a + b) / 2;
    grp.timestamp_tokens = 5 + integer_digits(grp.seconds);
    grp.tokens = per_group_tokens;
    grp.patches = per_group_patches;
    // "<t seconds>", <|vision_start|>, the tokens, <|vision_end|>. Each term is
    // bounded (tokens < 2^63 / grid_t), so the sums below cannot overflow
    // before the check.
    int64_t next = 0;
    if (__builtin_add_overflow(pos, grp.timestamp_tokens + 1, &grp.offset) ||
        __builtin_add_overflow(grp.offset, grp.tokens + 1, &next))
      raise("video_layout", fmt::format("{} frames of {}x{} give a block longer than 2^63 tokens",
                                        frames, height, width));
    pos = next;
    out.groups.push_back(grp);
  }
  out.block_tokens = pos;
  return out;
}

}  // namespace diffcomm::encoder_parallel
