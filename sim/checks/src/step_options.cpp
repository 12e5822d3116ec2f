#include "diffcomm/sim/step_options.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "diffcomm/encoder_parallel/batch.hpp"
#include "diffcomm/encoder_parallel/tokens.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::sim {
namespace {

namespace ep = encoder_parallel;

// What the CLI's validators check per flag, for callers without them
// (Python): each value in its range, each name one of its choices.
void check_each(const StepOptions& o) {
  auto range = [](const char* flag, int64_t v, int64_t lo, int64_t hi) {
    if (v < lo || v > hi)
      throw InvalidArgument(fmt::format("--{} {} is outside [{}, {}]", flag, v, lo, hi));
  };
  range("ranks", o.ranks, 0, kMaxStepRanks);
  range("dp", o.dp, 0, kMaxStepRanks);
  range("cp", o.cp, 1, 1024);
  range("tp", o.tp, 1, 1024);
  range("encoder-buckets", o.encoder_buckets, 0, kMaxStepRanks);
  range("encoder-cp", o.encoder_cp, 1, kMaxStepRanks);
  range("batch", o.batch, 1, 1 << 20);
  range("images-per-sample", o.images_per_sample, 0, 1 << 16);
  range("hidden", o.hidden, 1, int64_t{1} << 20);
  range("ffn", o.ffn, 1, int64_t{1} << 20);
  range("sp-chunks", o.sp_chunks, 1, ep::kMaxSpChunks);
  range("grad-block-rows", o.grad_block_rows, 1, int64_t{1} << 20);
  range("ffn-blocks", o.ffn_blocks, 1, int64_t{1} << 20);
  auto one_of = [](const char* flag, const std::string& v, std::initializer_list<const char*> ok) {
    if (std::none_of(ok.begin(), ok.end(), [&](const char* k) { return v == k; }))
      throw InvalidArgument(
          fmt::format("--{} '{}': expected one of {}", flag, v, fmt::join(ok, ", ")));
  };
  one_of("cp-layout", o.cp_layout, {"contiguous", "zigzag"});
  one_of("dtype", o.dtype, {"float64", "float32", "bfloat16", "float16"});
  one_of("receiver-grad", o.receiver_grad, {"auto", "partial", "replicated-over-tp"});
  (void)ep::vision_model(o.model);  // throws naming the known models
}

}  // namespace

StepOptions StepOptions::resolved() const {
  StepOptions a = *this;
  check_each(a);
  // cp, tp <= 1024 and dp, ranks <= 16384: the products fit int64.
  const int64_t cptp = int64_t{a.cp} * a.tp;
  if (cptp > kMaxStepRanks)
    throw InvalidArgument(
        fmt::format("--cp {} x --tp {} = {} ranks exceeds the simulated world's limit of {}", a.cp,
                    a.tp, cptp, kMaxStepRanks));
  if (a.dp != 0 && a.dp * cptp > kMaxStepRanks)
    throw InvalidArgument(
        fmt::format("--dp {} x --cp {} x --tp {} = {} ranks exceeds the simulated world's limit "
                    "of {}",
                    a.dp, a.cp, a.tp, a.dp * cptp, kMaxStepRanks));
  if (a.dp == 0) {
    if (a.ranks != 0 && a.ranks % cptp != 0)
      throw InvalidArgument(
          fmt::format("--ranks {} is not a multiple of cp*tp = {}", a.ranks, cptp));
    a.dp = a.ranks != 0 ? static_cast<int>(a.ranks / cptp) : 1;
  }
  if (a.ranks == 0) a.ranks = static_cast<int>(a.dp * cptp);
  if (a.ranks != a.dp * cptp)
    throw InvalidArgument(
        fmt::format("--ranks {} != dp*cp*tp = {}*{}*{}", a.ranks, a.dp, a.cp, a.tp));
  const auto exchange = static_cast<int>(ep::DecoderMesh{a.cp, a.tp}.exchange_size());
  if (a.encoder_buckets == 0) {
    if (exchange % a.encoder_cp != 0)
      throw InvalidArgument(
          fmt::format("--encoder-cp {} does not divide the exchange group of {} ranks",
                      a.encoder_cp, exchange));
    a.encoder_buckets = exchange / a.encoder_cp;
  }
  if (int64_t{a.encoder_buckets} * a.encoder_cp != exchange)
    throw InvalidArgument(fmt::format(
        "--encoder-buckets {} x --encoder-cp {} must equal the exchange group size {} ({})",
        a.encoder_buckets, a.encoder_cp, exchange, a.cp > 1 ? "cp*tp" : "tp"));
  if (a.ffn % a.tp != 0)
    throw InvalidArgument(fmt::format("--ffn {} is not a multiple of --tp {}", a.ffn, a.tp));
  if (a.ffn % a.ffn_blocks != 0 || a.ffn_blocks % a.tp != 0)
    throw InvalidArgument(fmt::format(
        "--ffn-blocks {} must divide --ffn {} and be a multiple of --tp {} (dX is the canonical "
        "sum of that many column blocks and each TP rank holds whole blocks)",
        a.ffn_blocks, a.ffn, a.tp));
  if (int64_t{a.dp} * a.batch * a.images_per_sample > kMaxImagesPerStep)
    throw InvalidArgument(
        fmt::format("--batch {} x --images-per-sample {} x dp {} images exceed the limit of {} "
                    "per step",
                    a.batch, a.images_per_sample, a.dp, kMaxImagesPerStep));
  if (a.images.empty()) {
    a.images = ep::default_image_sizes_path();
    if (a.images.empty())
      throw InvalidArgument("--images: the shipped COCO sizes were not found; pass a CSV");
  }
  return a;
}

ep::StepConfig StepOptions::config() const {
  ep::StepConfig cfg;
  cfg.dp = dp;
  cfg.decoder = {cp, tp, sp,
                 cp_layout == "zigzag" ? ep::CpLayout::Zigzag : ep::CpLayout::Contiguous};
  cfg.encoder = {encoder_buckets, encoder_cp};
  cfg.hidden = hidden;
  cfg.in_features = 16;
  cfg.ffn = ffn;
  cfg.sp_chunks = sp_chunks;
  cfg.grad_block_rows = grad_block_rows;
  cfg.ffn_blocks = ffn_blocks;
  cfg.dtype = parse_dtype(dtype);
  cfg.seed = seed;
  if (receiver_grad == "partial") cfg.receiver_grad = ep::ReceiverGrad::Partial;
  if (receiver_grad == "replicated-over-tp") cfg.receiver_grad = ep::ReceiverGrad::ReplicatedOverTp;
  return cfg;
}

}  // namespace diffcomm::sim
