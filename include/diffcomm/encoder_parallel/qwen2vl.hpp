#pragma once
// Image size -> decoder tokens by Qwen2-VL's rule, with explicit pixel
// bounds: the Qwen2-VL preset of encoder_parallel/tokens.hpp (which also has
// Qwen2.5-VL, Qwen3-VL and videos). Kept for callers of the fixed-factor API.
#include <cstdint>

namespace diffcomm::encoder_parallel::qwen2vl {

inline constexpr int64_t kFactor = 28;
inline constexpr int64_t kMinPixels = 3136;      // 56 * 56
inline constexpr int64_t kMaxPixels = 12845056;  // the processor's default

struct Resized {
  int64_t height = 0;
  int64_t width = 0;
};

/// smart_resize(qwen2vl_model() with these bounds, height, width): see
/// encoder_parallel::smart_resize for the formula, the clamp of a side to 28
/// after the down-scaling floor, and the guarantees. (639, 31, 3136, 15680)
/// -> 560 x 28. Throws InvalidArgument for sizes outside [1, 2^40], an aspect
/// ratio > 200, max_pixels below one 28 x 28 block or min_pixels outside
/// [1, max_pixels].
Resized smart_resize(int64_t height, int64_t width, int64_t min_pixels = kMinPixels,
                     int64_t max_pixels = kMaxPixels);

/// Decoder image tokens: (H/28) * (W/28) of the resized image (default bounds).
int64_t image_tokens(int64_t height, int64_t width);

/// Encoder patches (14 px): 4 * image_tokens.
int64_t image_patches(int64_t height, int64_t width);

}  // namespace diffcomm::encoder_parallel::qwen2vl
