// diffcomm-sim: the simulated encoder-parallel training step on real image
// sizes, adjoint checks of single ops, seed sweeps, and the token rule.
//
// Exit codes: 0 checks passed; 1 a check failed; 2 bad arguments; 3 an
// injected fault ended the run.
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <optional>
#include <regex>

#include "diffcomm/encoder_parallel/batch.hpp"
#include "diffcomm/encoder_parallel/qwen2vl.hpp"
#include "diffcomm/encoder_parallel/training_step.hpp"
#include "diffcomm/error.hpp"
#include "diffcomm/sim/adjoint.hpp"
#include "diffcomm/sim/report.hpp"
#include "diffcomm/sim/world.hpp"

namespace ep = diffcomm::encoder_parallel;
using diffcomm::DType;

namespace {

constexpr int kPassed = 0, kFailed = 1, kBadArgs = 2, kFault = 3;

struct BadArgs : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// CLI11 2.1 reads "-1" into a uint64_t as 2^64 - 1; seeds take digits only.
const CLI::Validator kSeed(
    [](std::string& v) {
      return !v.empty() && v.find_first_not_of("0123456789") == std::string::npos
                 ? std::string{}
                 : "expected a non-negative integer, got '" + v + "'";
    },
    "", "Seed");

struct StepArgs {
  int ranks = 0;  // 0: dp * cp * tp
  int dp = 0;     // 0: ranks / (cp * tp), or 1
  int cp = 1, tp = 1;
  bool sp = false;
  std::string cp_layout = "contiguous";
  int buckets = 0;  // 0: exchange size / encoder_cp
  int encoder_cp = 1;
  int batch = 4;
  int images_per_sample = 2;
  int64_t hidden = 32;
  int64_t ffn = 32;
  std::string dtype = "float64";
  uint64_t seed = 0;
  std::string images;
  bool json = false;
  std::string fault;
  std::string trace;
  std::string receiver_grad = "auto";
};

void add_step_options(CLI::App& app, StepArgs& a) {
  app.add_option("--ranks", a.ranks, "world size (default dp*cp*tp)")->check(CLI::Range(1, 16384));
  app.add_option("--dp", a.dp, "data-parallel replicas (default ranks/(cp*tp))")
      ->check(CLI::Range(1, 16384));
  app.add_option("--cp", a.cp, "context-parallel size")->check(CLI::Range(1, 1024));
  app.add_option("--tp", a.tp, "tensor-parallel size")->check(CLI::Range(1, 1024));
  app.add_flag("--sp", a.sp, "sequence parallel (TP ranks own distinct token shards)");
  app.add_option("--cp-layout", a.cp_layout, "contiguous or zigzag")
      ->check(CLI::IsMember({"contiguous", "zigzag"}));
  app.add_option("--encoder-buckets", a.buckets,
                 "encoder buckets (default exchange size / encoder_cp)")
      ->check(CLI::Range(1, 16384));
  app.add_option("--encoder-cp", a.encoder_cp, "encoder context-parallel size")
      ->check(CLI::Range(1, 16384));
  app.add_option("--batch", a.batch, "samples per micro-batch")->check(CLI::Range(0, 1 << 20));
  app.add_option("--images-per-sample", a.images_per_sample, "images in each sample")
      ->check(CLI::Range(0, 1 << 16));
  app.add_option("--hidden", a.hidden, "feature width")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--ffn", a.ffn, "columns of the decoder's column-parallel layer (multiple of tp)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--dtype", a.dtype, "float64, float32, bfloat16 or float16")
      ->check(CLI::IsMember({"float64", "float32", "bfloat16", "float16"}));
  app.add_option("--seed", a.seed, "seed of the batch, the weights and the interleaving")
      ->check(kSeed);
  app.add_option("--images", a.images, "CSV of image sizes (default: the shipped COCO val2017)");
  app.add_flag("--json", a.json, "print one JSON object instead of the report");
  app.add_option("--receiver-grad", a.receiver_grad,
                 "exchange gradient convention: auto (the mesh's), partial or replicated-over-tp; "
                 "forcing the wrong one shows the reference check fail")
      ->check(CLI::IsMember({"auto", "partial", "replicated-over-tp"}));
}

struct Fault {
  int rank, at;
};

std::optional<Fault> parse_fault(const std::string& s, int ranks) {
  if (s.empty()) return std::nullopt;
  static const std::regex re(R"(rank:(\d+):at:(\d+))");
  std::smatch m;
  if (!std::regex_match(s, m, re))
    throw BadArgs(fmt::format("--fault '{}': expected rank:R:at:K (e.g. rank:3:at:2)", s));
  int r = 0, k = 0;
  try {
    r = std::stoi(m[1]);
    k = std::stoi(m[2]);
  } catch (const std::out_of_range&) {
    throw BadArgs(fmt::format("--fault '{}': rank or call number out of range", s));
  }
  if (r >= ranks)
    throw BadArgs(fmt::format("--fault: rank {} is outside the world of {} ranks", r, ranks));
  if (k < 1) throw BadArgs("--fault: K counts calls from 1");
  return Fault{r, k};
}

// Resolves defaults and cross-option constraints; throws BadArgs naming the option.
ep::StepConfig make_config(StepArgs& a) {
  const int cptp = a.cp * a.tp;
  if (a.dp == 0) {
    if (a.ranks != 0 && a.ranks % cptp != 0)
      throw BadArgs(fmt::format("--ranks {} is not a multiple of cp*tp = {}", a.ranks, cptp));
    a.dp = a.ranks != 0 ? a.ranks / cptp : 1;
  }
  if (a.ranks == 0) a.ranks = a.dp * cptp;
  if (a.ranks != a.dp * cptp)
    throw BadArgs(fmt::format("--ranks {} != dp*cp*tp = {}*{}*{}", a.ranks, a.dp, a.cp, a.tp));
  ep::StepConfig cfg;
  cfg.dp = a.dp;
  cfg.decoder = {a.cp, a.tp, a.sp,
                 a.cp_layout == "zigzag" ? ep::CpLayout::Zigzag : ep::CpLayout::Contiguous};
  const int exchange = a.cp > 1 ? cptp : a.tp;
  if (a.buckets == 0) {
    if (exchange % a.encoder_cp != 0)
      throw BadArgs(fmt::format("--encoder-cp {} does not divide the exchange group of {} ranks",
                                a.encoder_cp, exchange));
    a.buckets = exchange / a.encoder_cp;
  }
  if (a.buckets * a.encoder_cp != exchange)
    throw BadArgs(fmt::format(
        "--encoder-buckets {} x --encoder-cp {} must equal the exchange group size {} ({})",
        a.buckets, a.encoder_cp, exchange, a.cp > 1 ? "cp*tp" : "tp"));
  if (a.ffn % a.tp != 0)
    throw BadArgs(fmt::format("--ffn {} is not a multiple of --tp {}", a.ffn, a.tp));
  cfg.encoder = {a.buckets, a.encoder_cp};
  cfg.hidden = a.hidden;
  cfg.in_features = 16;
  cfg.ffn = a.ffn;
  cfg.dtype = diffcomm::parse_dtype(a.dtype);
  cfg.seed = a.seed;
  if (a.receiver_grad == "partial") cfg.receiver_grad = ep::ReceiverGrad::Partial;
  if (a.receiver_grad == "replicated-over-tp")
    cfg.receiver_grad = ep::ReceiverGrad::ReplicatedOverTp;
  if (a.images.empty()) {
    a.images = ep::default_image_sizes_path();
    if (a.images.empty())
      throw BadArgs("--images: the shipped COCO sizes were not found; pass a CSV");
  }
  return cfg;
}

// Loads the images and builds the micro-batches (errors name --images), then
// runs the step; the report itself is built by the library (sim/report.hpp).
std::vector<ep::ImageSize> load_images(const std::string& path) {
  try {
    return ep::load_image_sizes(path);
  } catch (const diffcomm::InvalidArgument& e) {
    throw BadArgs(fmt::format("--images: {}", e.what()));
  }
}

diffcomm::sim::StepReport run_step_command(StepArgs a) {
  const ep::StepConfig cfg = make_config(a);
  const auto fault = parse_fault(a.fault, a.ranks);
  const std::vector<ep::ImageSize> images = load_images(a.images);
  std::vector<ep::Batch> per_dp;
  try {
    per_dp = diffcomm::sim::step_batches(cfg, images, a.batch, a.images_per_sample);
  } catch (const diffcomm::InvalidArgument& e) {
    throw BadArgs(fmt::format("--images {}: {}", a.images, e.what()));
  }
  diffcomm::sim::StepRunOptions options;
  if (fault) options.fault = diffcomm::sim::Fault{fault->rank, fault->at};
  options.trace_path = a.trace;
  return diffcomm::sim::run_step_report(cfg, per_dp, options);
}

std::string step_command_line(const StepArgs& a, uint64_t seed) {
  std::string s = fmt::format("diffcomm-sim step --ranks {} --cp {} --tp {}", a.ranks, a.cp, a.tp);
  if (a.sp) s += " --sp";
  s += fmt::format(
      " --cp-layout {} --encoder-buckets {} --encoder-cp {} --batch {} --images-per-sample {} "
      "--hidden {} --ffn {} --dtype {} --seed {}",
      a.cp_layout, a.buckets, a.encoder_cp, a.batch, a.images_per_sample, a.hidden, a.ffn, a.dtype,
      seed);
  if (a.receiver_grad != "auto") s += " --receiver-grad " + a.receiver_grad;
  if (!a.images.empty()) s += fmt::format(" --images {}", a.images);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"diffcomm-sim: simulated encoder-parallel steps, adjoint checks and sweeps"};
  app.require_subcommand(1);

  StepArgs step;
  auto* step_cmd =
      app.add_subcommand("step", "one seeded encoder-parallel training step vs its reference");
  add_step_options(*step_cmd, step);
  step_cmd->add_option("--fault", step.fault,
                       "inject a failure: rank:R:at:K (rank R fails at its K-th call)");
  step_cmd->add_option("--trace", step.trace, "write a Chrome trace-event JSON file");

  std::string op = "all_reduce", check_dtype = "float64";
  int check_ranks = 4;
  uint64_t check_seed = 0;
  bool check_json = false;
  auto* check_cmd =
      app.add_subcommand("check", "adjoint identity of one differentiable op on a random world");
  check_cmd->add_option("--op", op, "op name")
      ->required()
      ->check(CLI::IsMember(diffcomm::sim::differentiable_ops()));
  check_cmd->add_option("--ranks", check_ranks, "world size")
      ->required()
      ->check(CLI::Range(1, 4096));
  check_cmd->add_option("--seed", check_seed, "seed")->required()->check(kSeed);
  check_cmd->add_option("--dtype", check_dtype, "float64, float32, bfloat16 or float16")
      ->check(CLI::IsMember({"float64", "float32", "bfloat16", "float16"}));
  check_cmd->add_flag("--json", check_json, "print JSON");

  StepArgs sweep;
  std::string seeds;
  auto* sweep_cmd = app.add_subcommand("sweep", "run step over a range of seeds");
  sweep_cmd->add_option("--seeds", seeds, "A..B (inclusive)")->required();
  add_step_options(*sweep_cmd, sweep);

  std::string tokens_images, model = "qwen2vl";
  auto* tokens_cmd = app.add_subcommand("tokens", "image_id,tokens for every image of a CSV");
  tokens_cmd->add_option("--images", tokens_images,
                         "CSV of image sizes (default: the shipped COCO val2017)");
  tokens_cmd->add_option("--model", model, "token rule")->check(CLI::IsMember({"qwen2vl"}));

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : kBadArgs;
  }

  try {
    if (*step_cmd) {
      const auto report = run_step_command(step);
      std::cout << (step.json ? diffcomm::sim::to_json(report) + "\n"
                              : diffcomm::sim::to_text(report));
      return report.exit_code();
    }
    if (*check_cmd) {
      const auto rep = diffcomm::sim::check_adjoint(op, check_ranks, check_seed,
                                                    diffcomm::parse_dtype(check_dtype));
      std::cout << (check_json ? diffcomm::sim::to_json(rep) + "\n" : diffcomm::sim::to_text(rep));
      return rep.passed ? kPassed : kFailed;
    }
    if (*sweep_cmd) {
      static const std::regex re(R"((\d+)\.\.(\d+))");
      std::smatch m;
      if (!std::regex_match(seeds, m, re))
        throw BadArgs(fmt::format("--seeds '{}': expected A..B", seeds));
      uint64_t lo = 0, hi = 0;
      try {
        lo = std::stoull(m[1]);
        hi = std::stoull(m[2]);
      } catch (const std::out_of_range&) {
        throw BadArgs(fmt::format("--seeds {}: a seed is out of range", seeds));
      }
      if (hi < lo) throw BadArgs(fmt::format("--seeds {}: B < A", seeds));
      if (hi - lo >= 1000000)
        throw BadArgs(fmt::format("--seeds {}: at most 1000000 seeds per sweep", seeds));
      const ep::StepConfig cfg = make_config(sweep);  // validate once, resolve defaults
      const std::vector<ep::ImageSize> images = load_images(sweep.images);
      const bool tty = isatty(fileno(stdout)) != 0;
      const uint64_t count = hi - lo + 1;
      int failures = 0;
      diffcomm::sim::run_sweep(
          cfg, images, sweep.batch, sweep.images_per_sample, lo, hi,
          [&](uint64_t s, const diffcomm::sim::StepReport& rep) {
            if (rep.exit_code() != kPassed) {
              ++failures;
              if (tty) std::cout << "\r";
              std::cout << fmt::format(
                  "seed {} FAILED: {}\n  reproduce: {}\n", s,
                  rep.error.empty() ? diffcomm::sim::check_json(rep) : rep.error,
                  step_command_line(sweep, s));
            }
            if (tty) {
              const uint64_t done = s - lo + 1;
              const int width = 30;
              const int filled = static_cast<int>(width * done / count);
              std::cout << fmt::format("\r[{}{}] {}/{} seeds, {} failed",
                                       std::string(static_cast<std::size_t>(filled), '#'),
                                       std::string(static_cast<std::size_t>(width - filled), '.'),
                                       done, count, failures)
                        << std::flush;
            }
          });
      if (tty) std::cout << "\n";
      std::cout << fmt::format("sweep: {} seeds, {} passed, {} failed\n", count,
                               count - static_cast<uint64_t>(failures), failures);
      return failures ? kFailed : kPassed;
    }
    if (*tokens_cmd) {
      if (tokens_images.empty()) tokens_images = ep::default_image_sizes_path();
      if (tokens_images.empty())
        throw BadArgs("--images: the shipped COCO sizes were not found; pass a CSV");
      std::vector<ep::ImageSize> images;
      try {
        images = ep::load_image_sizes(tokens_images);
      } catch (const diffcomm::InvalidArgument& e) {
        throw BadArgs(fmt::format("--images: {}", e.what()));
      }
      std::cout << "image_id,tokens\n";
      for (const auto& im : images)
        std::cout << im.image_id << "," << ep::qwen2vl::image_tokens(im.height, im.width) << "\n";
      return kPassed;
    }
  } catch (const BadArgs& e) {
    std::cerr << "diffcomm-sim: bad argument: " << e.what() << "\n";
    return kBadArgs;
  } catch (const diffcomm::InvalidArgument& e) {
    std::cerr << "diffcomm-sim: bad argument: " << e.what() << "\n";
    return kBadArgs;
  } catch (const std::exception& e) {
    std::cerr << "diffcomm-sim: error: " << e.what() << "\n";
    return kFailed;
  }
  return kBadArgs;
}
