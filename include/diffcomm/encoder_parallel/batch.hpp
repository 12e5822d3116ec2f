#pragma once
// Realistic multimodal micro-batches from real image sizes (e.g. the shipped
// COCO val2017 sizes) and video clips, with tokens by a vision model's rule
// (encoder_parallel/tokens.hpp; Qwen2-VL by default).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "diffcomm/encoder_parallel/planner.hpp"
#include "diffcomm/encoder_parallel/tokens.hpp"

namespace diffcomm::encoder_parallel {

/// One image (frames == 1) or video clip (frames > 1) of a data set.
struct ImageSize {
  int64_t image_id = 0;
  int64_t width = 0;   ///< px
  int64_t height = 0;  ///< px
  int64_t frames = 1;  ///< 1: a still image; > 1: a video of that many frames
  friend bool operator==(const ImageSize&, const ImageSize&) = default;
};

/// Parses CSV text (RFC 4180-style lines: comma-separated, fields may be
/// quoted with '"', a backslash escapes '"', ',' or '\\' inside a field;
/// a record is one line, CRLF accepted, blank lines skipped). The header names
/// the columns image_id, width, height and optionally frames (default 1);
/// other columns are ignored. Cells are whole integers; width and height >= 1,
/// frames >= 1. Parsing is boost::tokenizer's escaped_list_separator.
/// Throws InvalidArgument naming `source`, the line and the column (number and
/// header name) of the first bad cell: missing or duplicated columns, an
/// unterminated quote, a bad escape, too few cells, a non-integer or
/// out-of-range value. Empty text is an error ("no header").
std::vector<ImageSize> parse_image_sizes(std::string_view text, const std::string& source);

/// The largest file load_image_sizes reads: 256 MiB, about 8 million rows
/// (COCO val2017's 5000 rows are 100 KB).
inline constexpr std::size_t kMaxImageSizesBytes = std::size_t{256} << 20;

/// parse_image_sizes of a file's content, `source` = the path (a pipe or
/// /dev/stdin works too). Throws InvalidArgument when the path is a directory,
/// cannot be read, or holds more than kMaxImageSizesBytes (so /dev/zero fails
/// instead of filling memory), and as parse_image_sizes.
std::vector<ImageSize> load_image_sizes(const std::string& path);

/// The path of the shipped COCO val2017 sizes: the copy installed beside the
/// running program (<prefix>/share/diffcomm/data), the configured install
/// prefix's, else the source tree's data/ (where diffcomm was built from).
/// Empty if none exists.
std::string default_image_sizes_path();

struct BatchOptions {
  int samples = 4;            ///< samples per micro-batch
  int images_per_sample = 2;  ///< images in each sample (0 allowed)
  int64_t text_min = 0;       ///< text tokens before each image and at the end: uniform in
  int64_t text_max = 64;      ///< [text_min, text_max]
  int64_t seq_multiple = 1;   ///< pad each sample's length up to a multiple of this
  uint64_t seed = 0;
  VisionModel model = qwen2vl_model();  ///< token rule of images and videos
};

/// dp micro-batches. Images are drawn without replacement in a seeded order
/// (wrapping around when exhausted); each sample is text, image, text,
/// image, ..., text, padded with text to seq_multiple. An entry with
/// frames > 1 is a video: its tokens and patches follow video_tokens, an
/// image's image_tokens, both with options.model (ImageSpan::patches = encoder
/// patches, ImageSpan::tokens = decoder tokens). Each entry occupies the block
/// of video_layout and gives one ImageSpan (one encoder work item) per group:
/// an image or a Qwen2-VL / Qwen2.5-VL video one span filling its block; a
/// Qwen3-VL video (VisionModel::video_timestamps) one span per temporal group,
/// at the group's offset in the block, the timestamp and vision start/end
/// tokens between them counted as text. All spans of an entry carry its
/// image_id as source_id.
/// Throws InvalidArgument on empty image lists (when images are needed),
/// negative options, sequence lengths above 2^62, or an entry the model
/// refuses (its image_id named).
std::vector<Batch> build_batches(const std::vector<ImageSize>& images, int dp,
                                 const BatchOptions& options);

}  // namespace diffcomm::encoder_parallel
