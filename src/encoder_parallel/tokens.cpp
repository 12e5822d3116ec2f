#include "diffcomm/encoder_parallel/tokens.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "diffcomm/error.hpp"

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
}

VisionModel qwen2vl_model() { return {"qwen2vl", 14, 2, 2, 56 * 56, 28 * 28 * 16384}; }
VisionModel qwen25vl_model() { return {"qwen2.5vl", 14, 2, 2, 56 * 56, 28 * 28 * 16384}; }
VisionModel qwen3vl_model() { return {"qwen3vl", 16, 2, 2, 65536, 16777216}; }

std::vector<std::string> vision_model_names() { return {"qwen2vl", "qwen2.5vl", "qwen3vl"}; }

VisionModel vision_model(std::string_view name) {
  if (name == "qwen2vl") return qwen2vl_model();
  if (name == "qwen2.5vl") return qwen25vl_model();
  if (name == "qwen3vl") return qwen3vl_model();
  throw InvalidArgument(fmt::format("vision_model: unknown model '{}' (known: {})", name,
                                    fmt::join(vision_model_names(), ", ")));
}

ResizedImage smart_resize(const VisionModel& model, int64_t height, int64_t width) {
  model.validate();
  if (height < 1 || width < 1 || height > kMaxImageSide || width > kMaxImageSide)
    throw InvalidArgument(
        fmt::format("smart_resize: size {}x{} (height x width) must be in [1, "
                    "2^40] on each side",
                    height, width));
  // Integer form of max/min > 200: exact, unlike the division.
  if (std::max(height, width) > kMaxAspectRatio * std::min(height, width))
    throw InvalidArgument(fmt::format("smart_resize: aspect ratio of {}x{} exceeds {}", height,
                                      width, kMaxAspectRatio));
  const int64_t f = model.factor();
  const double h = static_cast<double>(height), w = static_cast<double>(width);
  const long double area = static_cast<long double>(height) * static_cast<long double>(width);
  int64_t hb = std::max(f, round_by_factor(height, f));
  int64_t wb = std::max(f, round_by_factor(width, f));
  const int64_t pixels = saturating_mul(hb, wb);
  if (pixels > model.max_pixels) {
    const double beta = std::sqrt(ratio(area, static_cast<long double>(model.max_pixels)));
    // The clamp: a side thinner than one factor after scaling floors to 0.
    hb = std::max(f, floor_by_factor(h / beta, f));
    wb = std::max(f, floor_by_factor(w / beta, f));
  } else if (pixels < model.min_pixels) {
    const double beta = std::sqrt(ratio(static_cast<long double>(model.min_pixels), area));
    hb = ceil_by_factor(h * beta, f);
    wb = ceil_by_factor(w * beta, f);
  }
  return {hb, wb};
}

MediaTokens image_tokens(const VisionModel& model, int64_t height, int64_t width) {
  return video_tokens(model, 1, height, width);
}

MediaTokens video_tokens(const VisionModel& model, int64_t frames, int64_t height, int64_t width) {
  if (frames < 1 || frames > kMaxFrames)
    throw InvalidArgument(fmt::format("video_tokens: {} frames (need 1..{})", frames, kMaxFrames));
  const ResizedImage r = smart_resize(model, height, width);
  MediaTokens t;
  t.grid_t = (frames + model.temporal_patch_size - 1) / model.temporal_patch_size;
  t.grid_h = r.height / model.patch_size;
  t.grid_w = r.width / model.patch_size;
  int64_t per_frame = 0;
  if (__builtin_mul_overflow(t.grid_h, t.grid_w, &per_frame) ||
      __builtin_mul_overflow(per_frame, t.grid_t, &t.patches))
    throw InvalidArgument(fmt::format(
        "video_tokens: {} frames of {}x{} give more than 2^63 patches", frames, height, width));
  t.tokens = t.patches / (model.merge_size * model.merge_size);
  return t;
}

}  // namespace diffcomm::encoder_parallel
