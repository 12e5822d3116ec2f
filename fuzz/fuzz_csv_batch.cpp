// Fuzzes CSV text -> image sizes -> micro-batches -> a plan: parse_image_sizes
// on arbitrary text, then build_batches (Qwen2-VL or Qwen3-VL) and
// plan_exchange on a 2 x 2 mesh. Any failure must be InvalidArgument.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "diffcomm/encoder_parallel/batch.hpp"
#include "diffcomm/encoder_parallel/planner.hpp"
#include "diffcomm/tensor/error.hpp"

namespace ep = diffcomm::encoder_parallel;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<ep::ImageSize> sizes;
  try {
    sizes = ep::parse_image_sizes(text, "fuzz.csv");
  } catch (const diffcomm::InvalidArgument&) {
    return 0;
  }
  for (const auto& s : sizes)
    if (s.width < 1 || s.height < 1 || s.frames < 1) std::abort();
  try {
    ep::DecoderMesh mesh;
    mesh.cp = 2;
    mesh.tp = 2;
    mesh.sp = size % 2 == 0;
    mesh.layout = size % 3 == 0 ? ep::CpLayout::Zigzag : ep::CpLayout::Contiguous;
    ep::BatchOptions o;
    o.samples = 2;
    o.images_per_sample = 2;
    o.text_max = 8;
    o.seq_multiple = ep::required_seq_multiple(mesh);
    o.seed = size;
    if (size % 5 == 0) o.model = ep::qwen3vl_model();
    const auto batches = ep::build_batches(sizes, 1, o);
    const auto plan = ep::plan_exchange(batches[0], mesh, {4, 1});
    plan.validate();
    (void)plan.stats(4, diffcomm::DType::Float32);
  } catch (const diffcomm::InvalidArgument&) {
  }
  return 0;
}
