#pragma once
// Image and video size -> vision-encoder patches and decoder tokens, for the
// Qwen2-VL family of vision encoders (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).
//
// Source of the semantics: `smart_resize` of qwen-vl-utils (vision_process.py)
// and of transformers' Qwen2VLImageProcessor, with the clamp transformers
// applies after the down-scaling floor; the video grid follows
// Qwen2VLImageProcessor._preprocess (frames padded by repeating the last one
// up to a multiple of temporal_patch_size).
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace diffcomm::encoder_parallel {

/// What the token rule needs to know about a vision encoder. Pixel bounds are
/// per image (per frame for videos), as in the model's preprocessor_config.json
/// (`min_pixels` / `max_pixels`, or `size.shortest_edge` / `size.longest_edge`).
struct VisionModel {
  std::string name;
  int64_t patch_size = 14;          ///< ViT patch side (px)
  int64_t merge_size = 2;           ///< spatial merge: merge_size^2 patches -> 1 decoder token
  int64_t temporal_patch_size = 2;  ///< frames per temporal patch
  int64_t min_pixels = 56 * 56;     ///< lower pixel bound of the resized image
  int64_t max_pixels = 12845056;    ///< upper pixel bound (28 * 28 * 16384)

  /// Side granularity of a resized image: patch_size * merge_size (px).
  int64_t factor() const { return patch_size * merge_size; }
  /// Throws InvalidArgument unless 1 <= patch_size, merge_size,
  /// temporal_patch_size <= 4096, factor()^2 <= max_pixels,
  /// 1 <= min_pixels <= max_pixels and max_pixels <= 2^53 (the message names
  /// the field and the model).
  void validate() const;
};

/// Qwen2-VL (Qwen/Qwen2-VL-*): 14 px patches, merge 2, temporal 2,
/// pixels in [3136, 12845056].
VisionModel qwen2vl_model();
/// Qwen2.5-VL (Qwen/Qwen2.5-VL-*): the same rule and bounds as Qwen2-VL.
VisionModel qwen25vl_model();
/// Qwen3-VL (Qwen/Qwen3-VL-*): 16 px patches, merge 2 (factor 32), temporal 2,
/// image pixels in [65536, 16777216] (size.shortest_edge / longest_edge).
VisionModel qwen3vl_model();
/// The presets by name: "qwen2vl", "qwen2.5vl", "qwen3vl".
/// Throws InvalidArgument naming the known names otherwise.
VisionModel vision_model(std::string_view name);
/// The preset names accepted by vision_model(), in that order.
std::vector<std::string> vision_model_names();

/// Largest accepted image side (px): 2^40. Larger sides are refused (the
/// arithmetic below stays exact and free of overflow up to there).
inline constexpr int64_t kMaxImageSide = int64_t{1} << 40;
/// Largest accepted number of video frames: 2^20.
inline constexpr int64_t kMaxFrames = int64_t{1} << 20;
/// Largest accepted ratio of the longer to the shorter input side
/// (qwen-vl-utils MAX_RATIO).
inline constexpr int64_t kMaxAspectRatio = 200;

struct ResizedImage {
  int64_t height = 0;  ///< px, a positive multiple of the factor
  int64_t width = 0;   ///< px, a positive multiple of the factor
};

/// smart_resize with factor f = model.factor():
///   h = max(f, round(height / f) * f), likewise w (round half to even, as
///   Python's round);
///   if h*w > max_pixels: beta = sqrt(height*width / max_pixels),
///     h = max(f, floor(height / beta / f) * f), likewise w;
///   else if h*w < min_pixels: beta = sqrt(min_pixels / (height*width)),
///     h = ceil(height * beta / f) * f, likewise w.
/// Guarantees (property-tested): both sides are positive multiples of f; the
/// output aspect ratio is at most 2 r + 1 for an input ratio r <= 200; when
/// max_pixels >= 4 * min_pixels (every preset), min_pixels <= h*w <=
/// max_pixels, except that a side clamped to f (an image thinner than one f
/// after scaling) may leave h*w above max_pixels, up to 2 f sqrt(200
/// max_pixels). Example: Qwen2-VL factor, bounds [3136, 15680], 639 x 31 ->
/// 560 x 28.
/// Throws InvalidArgument for a side < 1 or > kMaxImageSide, an aspect ratio
/// above 200, or an invalid model (see VisionModel::validate).
ResizedImage smart_resize(const VisionModel& model, int64_t height, int64_t width);

/// Tokens and encoder patches of one image or video clip.
struct MediaTokens {
  int64_t grid_t = 0;   ///< temporal patches: ceil(frames / temporal_patch_size); 1 for images
  int64_t grid_h = 0;   ///< patch rows: resized height / patch_size
  int64_t grid_w = 0;   ///< patch columns: resized width / patch_size
  int64_t patches = 0;  ///< encoder input rows: grid_t * grid_h * grid_w
  int64_t tokens = 0;   ///< decoder tokens (= feature rows): patches / merge_size^2
};

/// An image: one temporal patch (the image is repeated temporal_patch_size
/// times), grid from smart_resize. Qwen2-VL, 56 x 56: grid 1 x 4 x 4,
/// 16 patches, 4 tokens. Throws as smart_resize.
MediaTokens image_tokens(const VisionModel& model, int64_t height, int64_t width);

/// A video of `frames` frames of height x width (each frame resized by
/// smart_resize with the model's per-frame bounds, as Qwen2VLImageProcessor
/// does for videos): grid_t = ceil(frames / temporal_patch_size) (frames padded
/// by repeating the last). Qwen2-VL, 3 frames of 56 x 56: grid 2 x 4 x 4,
/// 32 patches, 8 tokens. A 1-frame video has an image's tokens.
/// Note: Qwen3-VL's own video processor bounds the whole clip instead of each
/// frame; this function applies the per-frame rule to every model.
/// Throws InvalidArgument for frames < 1 or > kMaxFrames, and as smart_resize.
MediaTokens video_tokens(const VisionModel& model, int64_t frames, int64_t height, int64_t width);

}  // namespace diffcomm::encoder_parallel
