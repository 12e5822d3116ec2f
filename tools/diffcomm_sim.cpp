// diffcomm-sim: the simulated encoder-parallel training step on real image
// sizes, adjoint checks of single ops, seed sweeps, and the token rule.
//
// Exit codes: 0 checks passed; 1 a check failed; 2 bad arguments; 3 an
// injected fault ended the run. `replay DIR` (production flight recorder
// dumps): 0 ok, 3 mismatch or deadlock, 4 incomplete, 2 bad input.
#include <fmt/format.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string_view>

#include "diffcomm/encoder_parallel/batch.hpp"
#include "diffcomm/encoder_parallel/tokens.hpp"
#include "diffcomm/encoder_parallel/training_step.hpp"
#include "diffcomm/sim/adjoint.hpp"
#include "diffcomm/sim/replay.hpp"
#include "diffcomm/sim/replay_edit.hpp"
#include "diffcomm/sim/report.hpp"
#include "diffcomm/sim/step_options.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"

namespace ep = diffcomm::encoder_parallel;
using diffcomm::DType;

namespace {

constexpr int kPassed = 0, kFailed = 1, kBadArgs = 2, kFault = 3;

struct BadArgs : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The whole of `s` as an unsigned integer, or nullopt (empty, a sign, other
// characters, or above 2^64 - 1: CLI11 2.1 would read "-1" as 2^64 - 1 and
// saturate 2^64 to 2^64 - 1).
std::optional<uint64_t> parse_u64(std::string_view s) {
  uint64_t v = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc{} || ptr != s.data() + s.size()) return std::nullopt;
  return v;
}

const CLI::Validator kSeed(
    [](std::string& v) {
      return parse_u64(v) ? std::string{}
                          : "expected an integer in [0, 18446744073709551615], got '" + v + "'";
    },
    "", "Seed");

// --seeds A..B: both seeds as --seed, A <= B, at most kMaxSweep seeds.
constexpr uint64_t kMaxSweep = 1000000;
struct SeedRange {
  uint64_t lo = 0, hi = 0;
};
std::optional<SeedRange> parse_seed_range(std::string_view s, std::string* why) {
  const auto dots = s.find("..");
  if (dots == std::string_view::npos) {
    *why = "expected A..B";
    return std::nullopt;
  }
  const auto lo = parse_u64(s.substr(0, dots)), hi = parse_u64(s.substr(dots + 2));
  if (!lo || !hi) {
    *why = "A and B must be integers in [0, 18446744073709551615]";
    return std::nullopt;
  }
  if (*hi < *lo) {
    *why = "B < A";
    return std::nullopt;
  }
  if (*hi - *lo >= kMaxSweep) {
    *why = fmt::format("at most {} seeds per sweep", kMaxSweep);
    return std::nullopt;
  }
  return SeedRange{*lo, *hi};
}
const CLI::Validator kSeedRange(
    [](std::string& v) {
      std::string why;
      return parse_seed_range(v, &why) ? std::string{} : fmt::format("'{}': {}", v, why);
    },
    "A..B", "SeedRange");

// --fault rank:R:at:K with R >= 0 and K >= 1 (R < ranks is checked once the
// world size is known).
struct Fault {
  int rank, at;
};
std::optional<Fault> parse_fault_spec(std::string_view s) {
  constexpr std::string_view kRank = "rank:", kAt = ":at:";
  if (s.substr(0, kRank.size()) != kRank) return std::nullopt;
  const auto at = s.find(kAt, kRank.size());
  if (at == std::string_view::npos) return std::nullopt;
  const auto r = parse_u64(s.substr(kRank.size(), at - kRank.size()));
  const auto k = parse_u64(s.substr(at + kAt.size()));
  if (!r || !k || *r > 16383 || *k < 1 || *k > 2147483647) return std::nullopt;
  return Fault{static_cast<int>(*r), static_cast<int>(*k)};
}
const CLI::Validator kFaultSpec(
    [](std::string& v) {
      return parse_fault_spec(v) ? std::string{}
                                 : "'" + v +
                                       "': expected rank:R:at:K with R in [0, 16383] and K in "
                                       "[1, 2147483647] (e.g. rank:3:at:2)";
    },
    "rank:R:at:K", "Fault");

// A finite number: CLI::Range alone lets "nan" through (every comparison with
// NaN is false), which switched --memory-limit's guard off.
const CLI::Validator kFinite(
    [](std::string& v) {
      char* end = nullptr;
      const double x = std::strtod(v.c_str(), &end);
      return end != v.c_str() && *end == '\0' && std::isfinite(x)
                 ? std::string{}
                 : "Value " + v + " is not a finite number";
    },
    "NUMBER", "Finite");

// A path option given as "": without this check an empty value reads as
// "not given" (--images "" used the shipped sizes, --trace "" wrote nothing).
CLI::Validator non_empty_path(const std::string& hint) {
  return CLI::Validator(
      [hint](std::string& v) { return v.empty() ? "is empty; " + hint : std::string{}; }, "PATH",
      "NonEmptyPath");
}
const CLI::Validator kImagesPath =
    non_empty_path("pass a CSV of image sizes, or leave --images out for the shipped COCO sizes");

// The memory estimate's default limit (see check_budget); the other limits
// of a step are StepOptions::resolved()'s.
constexpr double kDefaultMemoryLimitGiB = 4.0;

// The step's options (diffcomm::sim::StepOptions, shared with Python) and
// the CLI's own.
struct StepArgs : diffcomm::sim::StepOptions {
  bool json = false;
  double memory_limit_gib = kDefaultMemoryLimitGiB;  // --memory-limit
  std::string fault;
  std::string trace;
  bool equivalence = false;  // --equivalence (step only)
};

void add_step_options(CLI::App& app, StepArgs& a) {
  app.add_option("--ranks", a.ranks, "world size (default dp*cp*tp)")->check(CLI::Range(1, 16384));
  app.add_option("--dp", a.dp, "data-parallel replicas (default ranks/(cp*tp))")
      ->check(CLI::Range(1, 16384));
  app.add_option("--cp", a.cp, "context-parallel size")->check(CLI::Range(1, 1024));
  app.add_option("--tp", a.tp, "tensor-parallel size")->check(CLI::Range(1, 1024));
  app.add_flag("--sp", a.sp, "sequence parallel (TP ranks own distinct token shards)");
  app.add_option("--sp-chunks", a.sp_chunks,
                 "with --sp: all-gathers of each shard's rows per step (default 4; more: less "
                 "memory at the SP collectives, more calls, the same gradients)")
      ->check(CLI::Range(1, ep::kMaxSpChunks));
  app.add_option("--grad-block-rows", a.grad_block_rows,
                 "rows per block of an image for the encoder gradient's canonical sum (default "
                 "64; part of the result's definition: every mesh gives the same bits for one "
                 "value)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--ffn-blocks", a.ffn_blocks,
                 "column blocks of the decoder's input gradient's canonical sum (default 4; "
                 "must divide --ffn and be a multiple of --tp; one value gives one result for "
                 "every such tp)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--cp-layout", a.cp_layout, "contiguous or zigzag")
      ->check(CLI::IsMember({"contiguous", "zigzag"}));
  app.add_option("--encoder-buckets", a.encoder_buckets,
                 "encoder buckets (default exchange size / encoder_cp)")
      ->check(CLI::Range(1, 16384));
  app.add_option("--encoder-cp", a.encoder_cp, "encoder context-parallel size")
      ->check(CLI::Range(1, 16384));
  app.add_option("--batch", a.batch, "samples per micro-batch")->check(CLI::Range(1, 1 << 20));
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
  app.add_option("--images", a.images, "CSV of image sizes (default: the shipped COCO val2017)")
      ->check(kImagesPath);
  app.add_flag("--json", a.json, "print one JSON object instead of the report");
  app.add_option("--memory-limit", a.memory_limit_gib,
                 "GiB the step's estimate may reach before it is refused (default 4)")
      ->check(kFinite)
      ->check(CLI::Range(0.001, 1.0e6));
  app.add_option("--receiver-grad", a.receiver_grad,
                 "exchange gradient convention: auto (the mesh's), partial or replicated-over-tp; "
                 "forcing the wrong one shows the reference check fail")
      ->check(CLI::IsMember({"auto", "partial", "replicated-over-tp"}));
  app.add_option("--model", a.model, "token rule of the images: qwen2vl, qwen2.5vl or qwen3vl")
      ->check(CLI::IsMember(ep::vision_model_names()));
}

std::optional<Fault> parse_fault(const std::string& s, int ranks) {
  if (s.empty()) return std::nullopt;
  const auto f = parse_fault_spec(s);  // the validator accepted it
  if (!f) throw BadArgs(fmt::format("--fault '{}': expected rank:R:at:K", s));
  if (f->rank >= ranks)
    throw BadArgs(fmt::format("--fault: rank {} is outside the world of {} ranks", f->rank, ranks));
  return f;
}

// Resolves defaults and cross-option constraints (StepOptions::resolved());
// throws BadArgs naming the option.
ep::StepConfig make_config(StepArgs& a) {
  try {
    static_cast<diffcomm::sim::StepOptions&>(a) = a.resolved();
  } catch (const diffcomm::InvalidArgument& e) {
    throw BadArgs(e.what());
  }
  return a.config();
}

// Refuses a step whose tensors would not fit comfortably in memory (instead of
// a bad_alloc mid-run): about 16 [tokens, hidden + ffn] float64 buffers (the
// rank shards, their gradients and the single-rank reference) plus every
// rank's [hidden, ffn] weights.
void check_budget(const StepArgs& a, const std::vector<ep::Batch>& per_dp) {
  double tokens = 0;
  for (const auto& b : per_dp)
    for (const auto& s : b.samples) tokens += static_cast<double>(s.seq_len);
  const double bytes = 16.0 * 8.0 * tokens * static_cast<double>(a.hidden + a.ffn + 16) +
                       8.0 * static_cast<double>(a.ranks) * static_cast<double>(a.hidden) *
                           static_cast<double>(a.ffn);
  const double limit = a.memory_limit_gib * static_cast<double>(1ull << 30);
  if (bytes > limit)
    throw BadArgs(fmt::format(
        "--hidden {} --ffn {} --batch {} --images-per-sample {}: the step would need about "
        "{:.3g} GiB ({:.0f} tokens), above the limit of {:.3g} GiB; lower one of them, or raise "
        "--memory-limit if this machine has the memory (the estimate is an upper bound: "
        "measured use is 4-10x lower, bench/RESULTS.md)",
        a.hidden, a.ffn, a.batch, a.images_per_sample, bytes / (1ull << 30), tokens,
        a.memory_limit_gib));
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

// Opens an output file for writing as the run will, so that a bad path
// (a missing directory, a directory, no permission) is refused before the
// run instead of after it. Append mode leaves an existing file as it is; the
// run rewrites it. Returns whether the file was created here.
bool check_output_path(const std::string& option, const std::string& path) {
  std::error_code ec;
  const bool existed = std::filesystem::exists(path, ec);
  std::FILE* f = std::fopen(path.c_str(), "a");
  if (f == nullptr)
    throw BadArgs(
        fmt::format("{} '{}': cannot open for writing: {}", option, path, std::strerror(errno)));
  std::fclose(f);
  return !existed;
}

diffcomm::sim::StepReport run_configured_step(const StepArgs& a, const ep::StepConfig& cfg,
                                              const std::optional<Fault>& fault) {
  const std::vector<ep::ImageSize> images = load_images(a.images);
  std::vector<ep::Batch> per_dp;
  try {
    per_dp = diffcomm::sim::step_batches(cfg, images, a.batch, a.images_per_sample,
                                         ep::vision_model(a.model));
  } catch (const diffcomm::InvalidArgument& e) {
    throw BadArgs(fmt::format("--images {}: {}", a.images, e.what()));
  }
  check_budget(a, per_dp);
  diffcomm::sim::StepRunOptions options;
  if (fault) options.fault = diffcomm::sim::Fault{fault->rank, fault->at};
  options.trace_path = a.trace;
  options.equivalence = a.equivalence;
  try {
    return diffcomm::sim::run_step_report(cfg, per_dp, options);
  } catch (const diffcomm::InvalidArgument& e) {
    // A plan the library refuses, or a trace it cannot write (a full disk,
    // /dev/full; the message names --trace): bad arguments, exit 2.
    throw BadArgs(e.what());
  }
}

diffcomm::sim::StepReport run_step_command(StepArgs a) {
  const ep::StepConfig cfg = make_config(a);
  const auto fault = parse_fault(a.fault, a.ranks);
  const bool created = !a.trace.empty() && check_output_path("--trace", a.trace);
  try {
    return run_configured_step(a, cfg, fault);
  } catch (...) {
    // No trace was written: leave no empty file behind either.
    std::error_code ec;
    if (created) std::filesystem::remove(a.trace, ec);
    throw;
  }
}

// `s` as one POSIX shell word: bare when it is only safe characters, else in
// single quotes (a ' inside becomes '\'').
std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                        "0123456789_-./=:,+@%") == std::string::npos)
    return s;
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// A sweep builds and frees the same step's working set once per seed. With
// glibc's defaults the freed top of the heap goes back to the kernel after
// every seed and is faulted in again by the next one (about 5 % of a 16-rank
// sweep's CPU time); keep it for the next seed instead. Setting the trim
// threshold turns glibc's adaptive mmap threshold off, so that one is set
// too: buffers below 32 MiB come from the heap, as the adaptive threshold
// has them after the first seed anyway. No value changes.
void keep_freed_memory_between_seeds() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
#endif
}

std::string step_command_line(const StepArgs& a, uint64_t seed) {
  std::string s = fmt::format("diffcomm-sim step --ranks {} --cp {} --tp {}", a.ranks, a.cp, a.tp);
  if (a.sp) s += " --sp";
  if (a.sp && a.sp_chunks != ep::kDefaultSpChunks) s += fmt::format(" --sp-chunks {}", a.sp_chunks);
  if (a.grad_block_rows != 64) s += fmt::format(" --grad-block-rows {}", a.grad_block_rows);
  if (a.ffn_blocks != 4) s += fmt::format(" --ffn-blocks {}", a.ffn_blocks);
  s += fmt::format(
      " --cp-layout {} --encoder-buckets {} --encoder-cp {} --batch {} --images-per-sample {} "
      "--hidden {} --ffn {} --dtype {} --seed {}",
      a.cp_layout, a.encoder_buckets, a.encoder_cp, a.batch, a.images_per_sample, a.hidden, a.ffn,
      a.dtype, seed);
  if (a.receiver_grad != "auto") s += " --receiver-grad " + a.receiver_grad;
  if (a.model != "qwen2vl") s += " --model " + a.model;
  if (!a.images.empty()) s += " --images " + shell_quote(a.images);
  return s;
}

struct ReplayArgs {
  std::string dir;
  uint64_t seed = 0;
  std::string seeds;  // A..B: one replay per seed
  std::vector<std::string> drops, barriers;
  bool json = false;
};

// `replay DIR`: the (edited) dumps' verdict, as text or JSON, and its exit
// code; with --seeds one line per seed and the worst exit code.
int run_replay(const ReplayArgs& a) {
  namespace sim = diffcomm::sim;
  const sim::Recording recording = sim::read_edited(a.dir, a.drops, a.barriers);
  sim::ReplayOptions options;
  if (a.seeds.empty()) {
    options.seed = a.seed;
    const auto report = sim::replay(recording, options);
    std::cout << (a.json ? sim::replay_json(report) : sim::replay_text(report));
    return report.exit_code();
  }
  std::string why;
  const auto range = parse_seed_range(a.seeds, &why);  // the validator accepted it
  if (!range) throw BadArgs(fmt::format("--seeds '{}': {}", a.seeds, why));
  int worst = 0;
  for (uint64_t s = range->lo;; ++s) {
    options.seed = s;
    const auto report = sim::replay(recording, options);
    std::cout << fmt::format("seed {}: {}", s, sim::verdict_name(report.verdict));
    if (!report.op.empty())
      std::cout << fmt::format(" ({} #{} on '{}')", report.op, report.call.value_or(0),
                               report.group);
    std::cout << "\n";
    worst = std::max(worst, report.exit_code());
    if (s == range->hi) break;
  }
  return worst;
}

// ---- the subcommands: each declares its options and runs -------------------
CLI::App* add_step_command(CLI::App& app, StepArgs& step) {
  auto* cmd =
      app.add_subcommand("step", "one seeded encoder-parallel training step vs its reference");
  add_step_options(*cmd, step);
  cmd->add_option("--fault", step.fault,
                  "inject a failure: rank:R:at:K (rank R fails at its K-th call)")
      ->check(kFaultSpec);
  cmd->add_flag("--equivalence", step.equivalence,
                "report the mesh-equivalence oracle's findings on the encoder gradient "
                "(factor, mesh expression, divergent replicas)");
  cmd->add_option("--trace", step.trace, "write a Chrome trace-event JSON file")
      ->check(non_empty_path("pass a file to write the trace to, or leave --trace out"));
  return cmd;
}

int run_step_subcommand(StepArgs& step) {
  const auto report = run_step_command(step);
  std::cout << (step.json ? diffcomm::sim::to_json(report) + "\n" : diffcomm::sim::to_text(report));
  return report.exit_code();
}

struct CheckArgs {
  std::string op = "all_reduce";
  std::string dtype = "float64";
  int ranks = 4;
  uint64_t seed = 0;
  bool json = false;
};

CLI::App* add_check_command(CLI::App& app, CheckArgs& check) {
  auto* cmd =
      app.add_subcommand("check", "adjoint identity of one differentiable op on a random world");
  cmd->add_option("--op", check.op, "op name")
      ->required()
      ->check(CLI::IsMember(diffcomm::sim::differentiable_ops()));
  cmd->add_option("--ranks", check.ranks, "world size")->required()->check(CLI::Range(1, 4096));
  cmd->add_option("--seed", check.seed, "seed")->required()->check(kSeed);
  cmd->add_option("--dtype", check.dtype, "float64, float32, bfloat16 or float16")
      ->check(CLI::IsMember({"float64", "float32", "bfloat16", "float16"}));
  cmd->add_flag("--json", check.json, "print JSON");
  return cmd;
}

int run_check(const CheckArgs& check) {
  const auto rep = diffcomm::sim::check_adjoint(check.op, check.ranks, check.seed,
                                                diffcomm::parse_dtype(check.dtype));
  std::cout << (check.json ? diffcomm::sim::to_json(rep) + "\n" : diffcomm::sim::to_text(rep));
  return rep.passed ? kPassed : kFailed;
}

struct SweepArgs {
  StepArgs step;
  std::string seeds;
};

CLI::App* add_sweep_command(CLI::App& app, SweepArgs& sweep) {
  auto* cmd = app.add_subcommand("sweep", "run step over a range of seeds");
  cmd->add_option("--seeds", sweep.seeds, "A..B (inclusive)")->required()->check(kSeedRange);
  add_step_options(*cmd, sweep.step);
  return cmd;
}

// The sweep's progress bar on a terminal: "[####......] done/count seeds, F failed".
void print_progress(uint64_t done, uint64_t count, int failures) {
  const int width = 30;
  const int filled = static_cast<int>(width * done / count);
  std::cout << fmt::format("\r[{}{}] {}/{} seeds, {} failed",
                           std::string(static_cast<std::size_t>(filled), '#'),
                           std::string(static_cast<std::size_t>(width - filled), '.'), done, count,
                           failures)
            << std::flush;
}

int run_sweep_subcommand(SweepArgs& args) {
  StepArgs& sweep = args.step;  // make_config resolves its defaults in place
  std::string why;
  const auto range = parse_seed_range(args.seeds, &why);  // the validator accepted it
  if (!range) throw BadArgs(fmt::format("--seeds '{}': {}", args.seeds, why));
  const uint64_t lo = range->lo, hi = range->hi;
  const ep::StepConfig cfg = make_config(sweep);  // validate once, resolve defaults
  const std::vector<ep::ImageSize> images = load_images(sweep.images);
  keep_freed_memory_between_seeds();
  const bool tty = isatty(fileno(stdout)) != 0;
  const uint64_t count = hi - lo + 1;
  int failures = 0;
  diffcomm::sim::run_sweep(
      cfg, images, sweep.batch, sweep.images_per_sample, lo, hi,
      [&](uint64_t s, const diffcomm::sim::StepReport& rep) {
        if (rep.exit_code() != kPassed) {
          ++failures;
          if (tty) std::cout << "\r";
          std::cout << fmt::format("seed {} FAILED: {}\n  reproduce: {}\n", s,
                                   rep.error.empty() ? diffcomm::sim::check_json(rep) : rep.error,
                                   step_command_line(sweep, s));
        }
        if (tty) print_progress(s - lo + 1, count, failures);
      },
      ep::vision_model(sweep.model));
  if (tty) std::cout << "\n";
  std::cout << fmt::format("sweep: {} seeds, {} passed, {} failed\n", count,
                           count - static_cast<uint64_t>(failures), failures);
  return failures ? kFailed : kPassed;
}

struct TokensArgs {
  std::string images;
  std::string model = "qwen2vl";
  bool layout = false;
};

CLI::App* add_tokens_command(CLI::App& app, TokensArgs& tokens) {
  auto* cmd = app.add_subcommand("tokens", "image_id,tokens for every image of a CSV");
  cmd->add_option("--images", tokens.images,
                  "CSV of image sizes (default: the shipped COCO val2017)")
      ->check(kImagesPath);
  cmd->add_option("--model", tokens.model, "token rule: qwen2vl, qwen2.5vl or qwen3vl")
      ->check(CLI::IsMember(ep::vision_model_names()));
  cmd->add_flag("--layout", tokens.layout,
                "also print block_tokens and the spans (offset:tokens in the block; a "
                "Qwen3-VL video has one per temporal group)");
  return cmd;
}

int run_tokens(TokensArgs args) {
  if (args.images.empty()) args.images = ep::default_image_sizes_path();
  if (args.images.empty())
    throw BadArgs("--images: the shipped COCO sizes were not found; pass a CSV");
  std::vector<ep::ImageSize> images;
  try {
    images = ep::load_image_sizes(args.images);
  } catch (const diffcomm::InvalidArgument& e) {
    throw BadArgs(fmt::format("--images: {}", e.what()));
  }
  const ep::VisionModel vm = ep::vision_model(args.model);
  std::string out = args.layout ? "image_id,tokens,block_tokens,spans\n" : "image_id,tokens\n";
  for (const auto& im : images) {
    ep::VideoLayout layout;
    try {
      layout = ep::video_layout(vm, im.frames, im.height, im.width);
    } catch (const diffcomm::InvalidArgument& e) {
      throw BadArgs(fmt::format("--images {}: image {}: {}", args.images, im.image_id, e.what()));
    }
    if (!args.layout) {
      out += fmt::format("{},{}\n", im.image_id, layout.media.tokens);
      continue;
    }
    std::vector<std::string> spans;
    for (const auto& g : layout.groups) spans.push_back(fmt::format("{}:{}", g.offset, g.tokens));
    out += fmt::format("{},{},{},{}\n", im.image_id, layout.media.tokens, layout.block_tokens,
                       fmt::join(spans, " "));
  }
  std::cout << out;
  return kPassed;
}

CLI::App* add_replay_command(CLI::App& app, ReplayArgs& replay) {
  auto* cmd = app.add_subcommand(
      "replay",
      "replay production flight recorder dumps (DIR/rank-<r>.json) in the simulated world");
  cmd->add_option("dir", replay.dir, "directory of the dumps (DIFFCOMM_FR_DUMP_DIR)")->required();
  auto* seed = cmd->add_option("--seed", replay.seed, "seed of the simulated world")->check(kSeed);
  cmd->add_option("--seeds", replay.seeds, "A..B: replay under each seed")
      ->check(kSeedRange)
      ->excludes(seed);  // one of them would be ignored
  cmd->add_option("--drop", replay.drops,
                  "RANK:GROUP:CALL: what if that rank had not made that call");
  cmd->add_option("--insert-barrier", replay.barriers,
                  "RANK:GROUP:CALL: what if that rank called a barrier there first");
  cmd->add_flag("--json", replay.json, "print JSON");
  return cmd;
}

// CLI11 reports a first word that is no subcommand as "A subcommand is
// required": name it instead. Returns false (after saying so) for such a word.
bool names_a_subcommand(CLI::App& app, int argc, char** argv) {
  if (argc <= 1 || argv[1][0] == '-') return true;
  const std::string first = argv[1];
  const auto subs = app.get_subcommands([&](CLI::App* sub) { return sub->check_name(first); });
  if (!subs.empty()) return true;
  std::cerr << fmt::format(
      "diffcomm-sim: bad argument: unknown subcommand '{}' (expected step, check, sweep, "
      "tokens or replay; see --help)\n",
      first);
  return false;
}

// Runs `command`, mapping its errors to the exit codes: bad arguments 2 with
// one line naming them, any other failure 1.
template <class F>
int with_exit_codes(F&& command) {
  try {
    return command();
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
}

int run_main(int argc, char** argv) {
  CLI::App app{"diffcomm-sim: simulated encoder-parallel steps, adjoint checks and sweeps"};
  app.require_subcommand(1);
  StepArgs step;
  CheckArgs check;
  SweepArgs sweep;
  TokensArgs tokens;
  ReplayArgs replay;
  auto* step_cmd = add_step_command(app, step);
  auto* check_cmd = add_check_command(app, check);
  auto* sweep_cmd = add_sweep_command(app, sweep);
  auto* tokens_cmd = add_tokens_command(app, tokens);
  auto* replay_cmd = add_replay_command(app, replay);
  if (!names_a_subcommand(app, argc, argv)) return kBadArgs;
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // One line naming the flag (CLI11's messages start with it).
    std::cerr << "diffcomm-sim: bad argument: " << e.what() << "\n";
    return kBadArgs;
  }
  return with_exit_codes([&] {
    if (*step_cmd) return run_step_subcommand(step);
    if (*check_cmd) return run_check(check);
    if (*sweep_cmd) return run_sweep_subcommand(sweep);
    if (*replay_cmd) return run_replay(replay);
    if (*tokens_cmd) return run_tokens(tokens);
    return kBadArgs;
  });
}

}  // namespace

int main(int argc, char** argv) {
  const int rc = run_main(argc, argv);
  // A report that could not be written (stdout on a full disk, a closed
  // pipe) is a failed command, not a success.
  if (!std::cout.flush()) {
    std::cerr << "diffcomm-sim: error: cannot write the report to standard output\n";
    return rc == kPassed ? kFailed : rc;
  }
  return rc;
}
