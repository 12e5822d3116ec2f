#pragma once
// Image and video size -> vision-encoder patches and decoder tokens, for the
// Qwen2-VL family of vision encoders (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).
//
// Source of the semantics: `smart_resize` of qwen-vl-utils (vision_process.py)
// and of transformers' Qwen2VLImageProcessor, with the clamp transformers
// applies after the down-scaling floor; the video grid follows
// Qwen2VLImageProcessor._preprocess (frames padded by repeating the last one
// up to a multiple of temporal_patch_size). Qwen3-VL videos follow
// transformers' Qwen3VLVideoProcessor (the clip's pixel bound) and
// Qwen3VLProcessor.replace_video_token (one timestamped block per temporal
// group), checked token for token against transformers 5.24.0 by
// tests/data/qwen3vl_video_layout.json (tests/data/gen_qwen3vl_layout.py).
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace diffcomm::encoder_parallel {

/// What the token rule needs to know about a vision encoder. Pixel bounds are
/// per image (per frame for videos, unless video_clip_bounds), as in the
/// model's preprocessor_config.json (`min_pixels` / `max_pixels`, or
/// `size.shortest_edge` / `size.longest_edge`).
struct VisionModel {
  std::string name;
  int64_t patch_size = 14;          ///< ViT patch side (px)
  int64_t merge_size = 2;           ///< spatial merge: merge_size^2 patches -> 1 decoder token
  int64_t temporal_patch_size = 2;  ///< frames per temporal patch
  int64_t min_pixels = 56 * 56;     ///< lower pixel bound of the resized image
  int64_t max_pixels = 12845056;    ///< upper pixel bound (28 * 28 * 16384)

  /// Videos: false (Qwen2-VL, Qwen2.5-VL): each frame is resized like an image
  /// (min_pixels / max_pixels per frame, Qwen2VLImageProcessor). true
  /// (Qwen3-VL): the clip is resized as a whole by Qwen3VLVideoProcessor's
  /// smart_resize, frames x height x width bounded by video_min_pixels /
  /// video_max_pixels (video_preprocessor_config.json `size.shortest_edge` /
  /// `size.longest_edge`); see video_tokens.
  bool video_clip_bounds = false;
  int64_t video_min_pixels = 0;  ///< lower bound of t x h x w (only with video_clip_bounds)
  int64_t video_max_pixels = 0;  ///< upper bound of t x h x w (only with video_clip_bounds)
  /// Videos: false: the clip's decoder tokens are one contiguous run (Qwen2-VL,
  /// Qwen2.5-VL). true (Qwen3-VL): Qwen3VLProcessor writes one block per
  /// temporal group, "<t seconds>" text, <|vision_start|>, the group's tokens,
  /// <|vision_end|>; see video_layout.
  bool video_timestamps = false;
  /// Frame rate of a clip's frames (frames per second) for the timestamps:
  /// frame k is at k / video_fps seconds. 2: Qwen3VLVideoProcessor samples
  /// videos at fps = 2, so a clip of sampled frames is 0.5 s apart.
  double video_fps = 2.0;

  /// Side granularity of a resized image: patch_size * merge_size (px).
  int64_t factor() const { return patch_size * merge_size; }
  /// Throws InvalidArgument unless 1 <= patch_size, merge_size,
  /// temporal_patch_size <= 4096, factor()^2 <= max_pixels,
  /// 1 <= min_pixels <= max_pixels and max_pixels <= 2^53; with
  /// video_clip_bounds also 1 <= video_min_pixels <= video_max_pixels <= 2^53
  /// and temporal_patch_size * factor()^2 <= video_max_pixels; and unless
  /// video_fps is finite and in [1e-3, 1e6] (the message names the field and
  /// the model).
  void validate() const;
};

/// Qwen2-VL (Qwen/Qwen2-VL-*): 14 px patches, merge 2, temporal 2,
/// pixels in [3136, 12845056].
VisionModel qwen2vl_model();
/// Qwen2.5-VL (Qwen/Qwen2.5-VL-*): the same rule and bounds as Qwen2-VL.
VisionModel qwen25vl_model();
/// Qwen3-VL (Qwen/Qwen3-VL-*): 16 px patches, merge 2 (factor 32), temporal 2,
/// image pixels in [65536, 16777216] (size.shortest_edge / longest_edge);
/// videos: clip bounds [4096, 25165824] (video_preprocessor_config.json),
/// timestamped blocks per temporal group, 2 frames per second.
VisionModel qwen3vl_model();
/// The presets by name: "qwen2vl", "qwen2.5vl", "qwen3vl".
/// Throws InvalidArgument naming the known names otherwise.
VisionModel vision_model(std::string_view name);
/// The preset names accepted by vision_model(), in that order.
std::vector<std::string> vision_model_names();

/// Largest accepted image side (px): 2^40. Larger sides are refused (the
/// arithmetic below stays exact and free of overflow up to there).
inline constexpr int64_t kMaxImageSide = int64_t{1} << 40;
/// Largest accepted number of video frames: 2^16 (9 hours at 2 fps;
/// qwen-vl-utils samples at most 768). A Qwen3-VL video is one work item per
/// temporal group, so this also bounds a video's items at 2^15: planning a
/// batch stays linear and fast for any accepted CSV (a 556201-frame line
/// made 1.1 M items and a 28 s plan under ASAN).
inline constexpr int64_t kMaxFrames = int64_t{1} << 16;
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

/// A video of `frames` frames of height x width: grid_t = ceil(frames /
/// temporal_patch_size) (frames padded by repeating the last). A 1-frame video
/// is an image (image_tokens) for every model.
///  - Per-frame rule (video_clip_bounds false; Qwen2VLImageProcessor): each
///    frame resized by smart_resize with the model's image bounds. Qwen2-VL,
///    3 frames of 56 x 56: grid 2 x 4 x 4, 32 patches, 8 tokens.
///  - Clip rule (video_clip_bounds true; Qwen3VLVideoProcessor.smart_resize,
///    transformers 5.24.0, without its opt-in cap_pixels_per_frame): a side
///    below the factor first scales both sides by max(f / h, f / w)
///    (truncated to integers); then h = round(h / f) * f, likewise w, and
///    t = round(frames / temporal) * temporal (half to even); if t*h*w >
///    video_max_pixels: beta = sqrt(frames*height*width / video_max_pixels),
///    sides floored as smart_resize does; else if below video_min_pixels:
///    beta = sqrt(video_min_pixels / (frames*height*width)), sides ceiled.
///    Qwen3-VL, 3 frames of 56 x 56: 64 x 64, grid 2 x 4 x 4, 8 tokens.
/// Throws InvalidArgument for frames < 1 or > kMaxFrames, and as smart_resize
/// (sides, aspect ratio above 200 after the scaling, invalid model).
MediaTokens video_tokens(const VisionModel& model, int64_t frames, int64_t height, int64_t width);

/// One temporal group of a video block (or the whole of an image or of an
/// untimestamped video).
struct VideoGroup {
  int64_t offset = 0;  ///< first decoder token of the group, from the block's start
  int64_t tokens = 0;  ///< decoder tokens: grid_h * grid_w / merge_size^2 (one group: media.tokens)
  int64_t patches = 0;           ///< encoder patches: grid_h * grid_w (one group: media.patches)
  int64_t timestamp_tokens = 0;  ///< text tokens of "<t seconds>" before it (0 untimestamped)
  double seconds = 0;            ///< t: the group's timestamp (0 untimestamped)
};

/// The decoder layout of one image or video clip: the block of tokens that
/// replaces its placeholder in the text, and where the media tokens lie in it.
struct VideoLayout {
  MediaTokens media;               ///< video_tokens(model, frames, height, width)
  std::vector<VideoGroup> groups;  ///< ascending offsets, non-overlapping
  int64_t block_tokens = 0;        ///< length of the block (media and separator tokens)
};

/// The layout of `frames` frames of height x width.
///  - An image (frames == 1), or a video of a model without video_timestamps
///    (Qwen2-VL, Qwen2.5-VL): one group at offset 0 of media.tokens tokens,
///    block_tokens = media.tokens (the surrounding text, vision start/end
///    included, is the caller's).
///  - A video of a model with video_timestamps (Qwen3-VL), as
///    Qwen3VLProcessor.replace_video_token writes it (transformers 5.24.0):
///    for each temporal group g in [0, grid_t): "<t_g seconds>" (t_g with one
///    decimal, Python's f"{t:.1f}": the exact binary value rounded half to
///    even), <|vision_start|>, grid_h * grid_w / merge^2 tokens,
///    <|vision_end|>. Timestamps (Qwen3VLProcessor._calculate_timestamps):
///    frame k at k / video_fps s, the frame indices padded by repeating the
///    last up to a multiple of temporal_patch_size, t_g = (first + last) / 2
///    of the group's chunk. "<t seconds>" is 5 + (integer digits of t) Qwen
///    BPE tokens ('<', one per digit, '.', the decimal, ' seconds', '>'; the
///    Qwen2/Qwen3 vocabulary), assuming the text before it ends in a special
///    token, as the chat template's <|vision_start|> does. So group g starts
///    at offset sum_{j<g}(ts_j + 2 + tokens_j) + ts_g + 1 and block_tokens =
///    sum_g (ts_g + 2 + tokens_g). Qwen3-VL, 4 frames of 256 x 256: t = 0.25,
///    1.25 -> "<0.2 seconds>", "<1.2 seconds>" (6 tokens each); groups at 7
///    and 79 of 64 tokens each, block 144.
/// Throws as video_tokens, and InvalidArgument for a block of 2^63 tokens or
/// more.
VideoLayout video_layout(const VisionModel& model, int64_t frames, int64_t height, int64_t width);

}  // namespace diffcomm::encoder_parallel
