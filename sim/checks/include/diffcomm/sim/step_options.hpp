#pragma once
// The options of one simulated encoder-parallel training step, as
// `diffcomm-sim step` and diffcomm.sim.step take them, and the one place
// their defaults are filled in and their cross-option rules checked.
#include <cstdint>
#include <string>

#include "diffcomm/encoder_parallel/training_step.hpp"

namespace diffcomm::sim {

/// Largest simulated world of a step (ranks).
inline constexpr int64_t kMaxStepRanks = 16384;
/// Largest number of images (spans drawn) in one step: dp x batch x images_per_sample.
inline constexpr int64_t kMaxImagesPerStep = int64_t{1} << 20;

/// One step's options; 0 / empty means "the default" where noted. Field names
/// follow the CLI's flags (--encoder-buckets -> encoder_buckets).
struct StepOptions {
  int ranks = 0;  ///< world size; 0: dp * cp * tp
  int dp = 0;     ///< data-parallel replicas; 0: ranks / (cp * tp), or 1
  int cp = 1;
  int tp = 1;
  bool sp = false;
  int sp_chunks = encoder_parallel::kDefaultSpChunks;  ///< StepConfig::sp_chunks
  int64_t grad_block_rows = 64;                        ///< StepConfig::grad_block_rows
  int64_t ffn_blocks = 4;                              ///< StepConfig::ffn_blocks
  std::string cp_layout = "contiguous";                ///< or "zigzag"
  int encoder_buckets = 0;                             ///< 0: exchange group size / encoder_cp
  int encoder_cp = 1;
  int batch = 4;  ///< samples per micro-batch
  int images_per_sample = 2;
  int64_t hidden = 32;
  int64_t ffn = 32;  ///< multiple of tp
  std::string dtype = "float64";
  uint64_t seed = 0;
  std::string images;                  ///< CSV of image sizes; empty: the shipped COCO sizes
  std::string receiver_grad = "auto";  ///< "auto", "partial" or "replicated-over-tp"
  std::string model = "qwen2vl";       ///< token rule (encoder_parallel::vision_model)

  /// These options with every default filled in: dp and ranks from each
  /// other, encoder_buckets = exchange group size (cp*tp when cp > 1, else
  /// tp) / encoder_cp, images = encoder_parallel::default_image_sizes_path().
  /// Throws InvalidArgument naming the option as the CLI spells it ("--ranks
  /// 6 is not a multiple of cp*tp = 4") when: cp*tp or dp*cp*tp exceeds
  /// kMaxStepRanks; ranks != dp*cp*tp; encoder_cp does not divide the
  /// exchange group or encoder_buckets x encoder_cp differs from it; ffn is
  /// not a multiple of tp; dp x batch x images_per_sample exceeds
  /// kMaxImagesPerStep; cp_layout, dtype, receiver_grad or model is unknown;
  /// a count is out of range; no image sizes are found.
  StepOptions resolved() const;

  /// The step's configuration (call on resolved() options).
  encoder_parallel::StepConfig config() const;
};

}  // namespace diffcomm::sim
