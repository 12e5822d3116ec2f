#pragma once
// Image size -> decoder tokens, by Qwen2-VL's rule (transformers'
// Qwen2VLImageProcessor.smart_resize): resize so height and width are
// multiples of 28 px (14 px patches, 2x2 merge) with the pixel count in
// [min_pixels, max_pixels], keeping the aspect ratio.
#include <cstdint>

namespace diffcomm::encoder_parallel::qwen2vl {

inline constexpr int64_t kFactor = 28;
inline constexpr int64_t kMinPixels = 3136;      // 56 * 56
inline constexpr int64_t kMaxPixels = 12845056;  // the processor's default

struct Resized {
  int64_t height = 0;
  int64_t width = 0;
};

/// smart_resize: h = max(28, round(height/28)*28) (Python round: half to
/// even), likewise w; if h*w > max_pixels, beta = sqrt(height*width /
/// max_pixels) and h, w = floor(height/beta/28)*28, floor(width/beta/28)*28;
/// if h*w < min_pixels, beta = sqrt(min_pixels / (height*width)) and h, w =
/// ceil(height*beta/28)*28, ceil(width*beta/28)*28.
/// Throws InvalidArgument for non-positive sizes or an aspect ratio > 200.
Resized smart_resize(int64_t height, int64_t width, int64_t min_pixels = kMinPixels,
                     int64_t max_pixels = kMaxPixels);

/// Decoder image tokens: (H/28) * (W/28) of the resized image.
int64_t image_tokens(int64_t height, int64_t width);

/// Encoder patches (14 px): 4 * image_tokens.
int64_t image_patches(int64_t height, int64_t width);

}  // namespace diffcomm::encoder_parallel::qwen2vl
