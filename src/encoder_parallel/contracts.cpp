#include "diffcomm/encoder_parallel/contracts.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "diffcomm/encoder_parallel/qwen2vl.hpp"
#include "diffcomm/error.hpp"

namespace diffcomm::encoder_parallel {

FeatureExchangeMode select_feature_exchange(const MeshContext& mesh) {
  if (mesh.cp_size < 1 || mesh.tp_size < 1)
    throw InvalidArgument(fmt::format("select_feature_exchange: cp {} and tp {} must be >= 1",
                                      mesh.cp_size, mesh.tp_size));
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
namespace {
// Python's round(): half to even (nearbyint in the default rounding mode).
int64_t round_by_factor(double v, int64_t f) {
  return static_cast<int64_t>(std::nearbyint(v / static_cast<double>(f))) * f;
}
int64_t floor_by_factor(double v, int64_t f) {
  return static_cast<int64_t>(std::floor(v / static_cast<double>(f))) * f;
}
int64_t ceil_by_factor(double v, int64_t f) {
  return static_cast<int64_t>(std::ceil(v / static_cast<double>(f))) * f;
}
}  // namespace

Resized smart_resize(int64_t height, int64_t width, int64_t min_pixels, int64_t max_pixels) {
  if (height <= 0 || width <= 0)
    throw InvalidArgument(fmt::format("smart_resize: size {}x{} must be positive", height, width));
  const double h = static_cast<double>(height), w = static_cast<double>(width);
  if (std::max(h, w) / std::min(h, w) > 200)
    throw InvalidArgument(
        fmt::format("smart_resize: aspect ratio of {}x{} exceeds 200", height, width));
  int64_t hb = std::max(kFactor, round_by_factor(h, kFactor));
  int64_t wb = std::max(kFactor, round_by_factor(w, kFactor));
  if (hb * wb > max_pixels) {
    const double beta = std::sqrt(h * w / static_cast<double>(max_pixels));
    hb = floor_by_factor(h / beta, kFactor);
    wb = floor_by_factor(w / beta, kFactor);
  } else if (hb * wb < min_pixels) {
    const double beta = std::sqrt(static_cast<double>(min_pixels) / (h * w));
    hb = ceil_by_factor(h * beta, kFactor);
    wb = ceil_by_factor(w * beta, kFactor);
  }
  return {hb, wb};
}

int64_t image_tokens(int64_t height, int64_t width) {
  const Resized r = smart_resize(height, width);
  return (r.height / kFactor) * (r.width / kFactor);
}

int64_t image_patches(int64_t height, int64_t width) { return 4 * image_tokens(height, width); }

}  // namespace qwen2vl
}  // namespace diffcomm::encoder_parallel
