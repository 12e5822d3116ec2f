#include "diffcomm/encoder_parallel/contracts.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "diffcomm/encoder_parallel/qwen2vl.hpp"
#include "diffcomm/encoder_parallel/tokens.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::encoder_parallel {

FeatureExchangeMode select_feature_exchange(const MeshContext& mesh) {
  if (mesh.cp_size < 1 || mesh.tp_size < 1)
    raise("select_feature_exchange",
          fmt::format("cp {} and tp {} must be >= 1", mesh.cp_size, mesh.tp_size));
  if (mesh.cp_size > 1) return FeatureExchangeMode::ParentVariableA2A;
  if (mesh.tp_size == 1) return FeatureExchangeMode::Local;
  return mesh.sequence_parallel ? FeatureExchangeMode::TpVariableA2A
                                : FeatureExchangeMode::TpVariableAllGather;
}

std::string mode_name(FeatureExchangeMode mode) {
  switch (mode) {
    case FeatureExchangeMode::Local: return "local";
    case FeatureExchangeMode::TpVariableAllGather: return "tp_variable_all_gather";
    case FeatureExchangeMode::TpVariableA2A: return "tp_variable_a2a";
    case FeatureExchangeMode::ParentVariableA2A: return "parent_variable_a2a";
  }
  return "?";
}

ReceiverGrad receiver_grad_for(const MeshContext& mesh) {
  return mesh.tp_size > 1 && !mesh.sequence_parallel ? ReceiverGrad::ReplicatedOverTp
                                                     : ReceiverGrad::Partial;
}

namespace qwen2vl {

Resized smart_resize(int64_t height, int64_t width, int64_t min_pixels, int64_t max_pixels) {
  VisionModel model = qwen2vl_model();
  model.min_pixels = min_pixels;
  model.max_pixels = max_pixels;
  const ResizedImage r = encoder_parallel::smart_resize(model, height, width);
  return {r.height, r.width};
}

int64_t image_tokens(int64_t height, int64_t width) {
  return encoder_parallel::image_tokens(qwen2vl_model(), height, width).tokens;
}

int64_t image_patches(int64_t height, int64_t width) {
  return encoder_parallel::image_tokens(qwen2vl_model(), height, width).patches;
}

}  // namespace qwen2vl
}  // namespace diffcomm::encoder_parallel
