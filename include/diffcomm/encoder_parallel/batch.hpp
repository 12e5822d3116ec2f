#pragma once
// Realistic multimodal micro-batches from real image sizes (e.g. the shipped
// COCO val2017 sizes), with image tokens by the Qwen2-VL rule.
#include <cstdint>
#include <string>
#include <vector>

#include "diffcomm/encoder_parallel/planner.hpp"

namespace diffcomm::encoder_parallel {

struct ImageSize {
  int64_t image_id = 0;
  int64_t width = 0;
  int64_t height = 0;
};

/// Reads a CSV whose header names the columns image_id, width and height
/// (others are ignored). Throws InvalidArgument when the file cannot be
/// read, a column is missing, or a row is malformed (line number given).
std::vector<ImageSize> load_image_sizes(const std::string& path);

/// The path of the shipped COCO val2017 sizes: the copy installed beside the
/// running program (<prefix>/share/diffcomm/data), the configured install
/// prefix's, else the source tree's data/ (where diffcomm was built from).
/// Empty if none exists.
std::string default_image_sizes_path();

/// Sequence lengths must be multiples of this for the decoder mesh:
/// cp (contiguous) or 2*cp (zigzag), times tp with SP.
int64_t required_seq_multiple(const DecoderMesh& mesh);

struct BatchOptions {
  int samples = 4;            ///< samples per micro-batch
  int images_per_sample = 2;  ///< images in each sample (0 allowed)
  int64_t text_min = 0;       ///< text tokens before each image and at the end: uniform in
  int64_t text_max = 64;      ///< [text_min, text_max]
  int64_t seq_multiple = 1;   ///< pad each sample's length up to a multiple of this
  uint64_t seed = 0;
};

/// dp micro-batches. Images are drawn without replacement in a seeded order
/// (wrapping around when exhausted); each sample is text, image, text,
/// image, ..., text, padded with text to seq_multiple. Image tokens and
/// patches follow qwen2vl::image_tokens / image_patches.
/// Throws InvalidArgument on empty image lists (when images are needed) or
/// negative options.
std::vector<Batch> build_batches(const std::vector<ImageSize>& images, int dp,
                                 const BatchOptions& options);

}  // namespace diffcomm::encoder_parallel
