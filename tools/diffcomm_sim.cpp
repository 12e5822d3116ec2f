// diffcomm-sim: the simulated encoder-parallel training step on real image
// sizes, adjoint checks of single ops, seed sweeps, and the token rule.
//
// Exit codes: 0 checks passed; 1 a check failed; 2 bad arguments; 3 an
// injected fault ended the run.
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>

#include "diffcomm/encoder_parallel/batch.hpp"
#include "diffcomm/encoder_parallel/tokens.hpp"
#include "diffcomm/encoder_parallel/training_step.hpp"
#include "diffcomm/error.hpp"
#include "diffcomm/sim/adjoint.hpp"
#include "diffcomm/sim/world.hpp"

namespace ep = diffcomm::encoder_parallel;
using diffcomm::DType;
using nlohmann::json;

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

// Resource limits of one step: the simulated world's size and a memory
// estimate (see check_budget).
constexpr int64_t kMaxRanks = 16384;
constexpr double kMemoryBudgetBytes = 4.0 * (1ull << 30);
constexpr int64_t kMaxImagesPerStep = int64_t{1} << 20;

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
  std::string model = "qwen2vl";
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
  app.add_option("--images", a.images, "CSV of image sizes (default: the shipped COCO val2017)");
  app.add_flag("--json", a.json, "print one JSON object instead of the report");
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

// Resolves defaults and cross-option constraints; throws BadArgs naming the option.
ep::StepConfig make_config(StepArgs& a) {
  // cp, tp <= 1024 and dp, ranks <= 16384 (validators): products fit int64.
  const int64_t cptp = int64_t{a.cp} * a.tp;
  if (cptp > kMaxRanks)
    throw BadArgs(
        fmt::format("--cp {} x --tp {} = {} ranks exceeds the simulated world's limit "
                    "of {}",
                    a.cp, a.tp, cptp, kMaxRanks));
  if (a.dp != 0 && a.dp * cptp > kMaxRanks)
    throw BadArgs(
        fmt::format("--dp {} x --cp {} x --tp {} = {} ranks exceeds the simulated "
                    "world's limit of {}",
                    a.dp, a.cp, a.tp, a.dp * cptp, kMaxRanks));
  if (a.dp == 0) {
    if (a.ranks != 0 && a.ranks % cptp != 0)
      throw BadArgs(fmt::format("--ranks {} is not a multiple of cp*tp = {}", a.ranks, cptp));
    a.dp = a.ranks != 0 ? static_cast<int>(a.ranks / cptp) : 1;
  }
  if (a.ranks == 0) a.ranks = static_cast<int>(a.dp * cptp);
  if (a.ranks != a.dp * cptp)
    throw BadArgs(fmt::format("--ranks {} != dp*cp*tp = {}*{}*{}", a.ranks, a.dp, a.cp, a.tp));
  ep::StepConfig cfg;
  cfg.dp = a.dp;
  cfg.decoder = {a.cp, a.tp, a.sp,
                 a.cp_layout == "zigzag" ? ep::CpLayout::Zigzag : ep::CpLayout::Contiguous};
  const int exchange = a.cp > 1 ? static_cast<int>(cptp) : a.tp;
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
  if (int64_t{a.dp} * a.batch * a.images_per_sample > kMaxImagesPerStep)
    throw BadArgs(
        fmt::format("--batch {} x --images-per-sample {} x dp {} images exceed the limit "
                    "of {} per step",
                    a.batch, a.images_per_sample, a.dp, kMaxImagesPerStep));
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
  if (bytes > kMemoryBudgetBytes)
    throw BadArgs(fmt::format(
        "--hidden {} --ffn {} --batch {} --images-per-sample {}: the step would need about "
        "{:.1f} GiB ({:.0f} tokens), above the limit of {:.0f} GiB; lower one of them",
        a.hidden, a.ffn, a.batch, a.images_per_sample, bytes / (1ull << 30), tokens,
        kMemoryBudgetBytes / (1ull << 30)));
}

// Writes the world's trace to `path`, failing on any write error (a full
// disk, /dev/full): the trace goes to a temporary file first, then is copied
// with a checked stream.
void write_trace_checked(const diffcomm::sim::World& world, const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path tmp =
      fs::temp_directory_path() / fmt::format("diffcomm-sim-trace-{}.json", ::getpid());
  world.write_trace(tmp.string());
  std::ifstream in(tmp, std::ios::binary);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const bool ok = in && out && (out << in.rdbuf()) && out.flush();
  in.close();
  std::error_code ec;
  fs::remove(tmp, ec);
  if (!ok) throw BadArgs(fmt::format("--trace: cannot write '{}'", path));
}

struct StepOutcome {
  int code = kPassed;
  json report;
  std::string text;
};

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (b >= 1024 && u < 3) {
    b /= 1024;
    ++u;
  }
  return fmt::format("{:.1f} {}", b, units[u]);
}

StepOutcome run_step_command(StepArgs a) {
  const ep::StepConfig cfg = make_config(a);
  const auto fault = parse_fault(a.fault, a.ranks);
  std::vector<ep::ImageSize> images;
  try {
    images = ep::load_image_sizes(a.images);
  } catch (const diffcomm::InvalidArgument& e) {
    throw BadArgs(fmt::format("--images: {}", e.what()));
  }
  ep::BatchOptions bo;
  bo.samples = a.batch;
  bo.images_per_sample = a.images_per_sample;
  bo.seq_multiple = ep::required_seq_multiple(cfg.decoder);
  bo.seed = a.seed;
  bo.model = ep::vision_model(a.model);
  std::vector<ep::Batch> per_dp;
  try {
    per_dp = ep::build_batches(images, cfg.dp, bo);
  } catch (const diffcomm::InvalidArgument& e) {
    throw BadArgs(fmt::format("--images {}: {}", a.images, e.what()));
  }
  check_budget(a, per_dp);
  std::vector<ep::ExchangePlan> plans;
  try {
    for (const auto& b : per_dp) plans.push_back(ep::plan_exchange(b, cfg.decoder, cfg.encoder));
  } catch (const diffcomm::InvalidArgument& e) {
    throw BadArgs(e.what());
  }

  diffcomm::sim::WorldOptions wo;
  wo.ranks = a.ranks;
  wo.seed = a.seed;
  if (fault) wo.fault = diffcomm::sim::Fault{fault->rank, fault->at};
  diffcomm::sim::World world(wo);
  std::vector<ep::StepRankResult> results(static_cast<std::size_t>(a.ranks));
  const auto t0 = std::chrono::steady_clock::now();
  StepOutcome out;
  std::string failure;
  try {
    world.run([&](diffcomm::sim::Rank& r) {
      results[static_cast<std::size_t>(r.rank())] = ep::run_step(r.world(), cfg, per_dp);
    });
  } catch (const diffcomm::Error& e) {
    failure = e.what();
  }
  const double wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!a.trace.empty()) write_trace_checked(world, a.trace);

  json j;
  j["mode"] = ep::mode_name(plans[0].mode);
  j["mesh"] = {{"ranks", a.ranks}, {"dp", cfg.dp}, {"cp", a.cp},
               {"tp", a.tp},       {"sp", a.sp},   {"cp_layout", a.cp_layout}};
  j["encoder"] = {{"buckets", a.buckets}, {"encoder_cp", a.encoder_cp}};
  j["seed"] = a.seed;
  j["dtype"] = a.dtype;
  j["hidden"] = a.hidden;
  int64_t n_images = 0, tokens = 0, image_tokens = 0;
  for (const auto& b : per_dp)
    for (const auto& s : b.samples) {
      tokens += s.seq_len;
      for (const auto& im : s.images) {
        ++n_images;
        image_tokens += im.tokens;
      }
    }
  j["images"] = n_images;
  j["tokens"] = tokens;
  j["image_tokens"] = image_tokens;
  uint64_t total = 0, padded = 0;
  double imbalance = 1.0;
  std::vector<ep::PlanStats> stats;
  for (const auto& p : plans) {
    stats.push_back(p.stats(cfg.hidden, cfg.dtype));
    total += stats.back().total_bytes;
    padded += stats.back().padded_all_gather_bytes;
    imbalance = std::max(imbalance, stats.back().encoder_imbalance);
  }
  j["bytes"] = {{"total", total}, {"padded_all_gather", padded}};
  j["encoder_imbalance"] = imbalance;
  j["sim_time_us"] = world.sim_time_us();
  j["wall_ms"] = wall_ms;
  json per_rank = json::array();
  for (int r = 0; r < a.ranks; ++r) {
    const int cptp = a.cp * a.tp;
    const int d = r / cptp, e = a.cp > 1 ? r % cptp : r % a.tp;
    const auto& st = stats[static_cast<std::size_t>(d)];
    const auto all = world.stats(r).total();
    per_rank.push_back({{"rank", r},
                        {"dp", d},
                        {"cp", (r % cptp) / a.tp},
                        {"tp", r % a.tp},
                        {"rows_sent", st.rows_sent[static_cast<std::size_t>(e)]},
                        {"rows_received", st.rows_received[static_cast<std::size_t>(e)]},
                        {"bytes_sent", all.bytes_sent},
                        {"bytes_received", all.bytes_received},
                        {"calls", all.calls}});
  }
  j["per_rank"] = per_rank;

  std::string text = fmt::format(
      "diffcomm-sim step — {} ranks, mesh dp={} cp={} tp={} sp={} cp_layout={}, mode {}\n"
      "batch: {} micro-batch(es) x {} samples, {} images ({} image tokens of {} tokens), "
      "hidden {} {}, seed {}\n"
      "encoder: {} buckets x encoder_cp {}, imbalance {:.3f} (max/mean patches)\n"
      "exchange: {} moved across ranks vs {} for a pad-to-max all-gather ({:.2f}x)\n",
      a.ranks, cfg.dp, a.cp, a.tp, a.sp ? "on" : "off", a.cp_layout, ep::mode_name(plans[0].mode),
      cfg.dp, a.batch, n_images, image_tokens, tokens, a.hidden, a.dtype, a.seed, a.buckets,
      a.encoder_cp, imbalance, human_bytes(static_cast<double>(total)),
      human_bytes(static_cast<double>(padded)),
      padded ? static_cast<double>(total) / static_cast<double>(padded) : 0.0);
  text += fmt::format("{:>5} {:>3} {:>3} {:>3} {:>10} {:>10} {:>12} {:>12} {:>6}\n", "rank", "dp",
                      "cp", "tp", "rows_sent", "rows_recv", "bytes_sent", "bytes_recv", "calls");
  for (const auto& pr : per_rank)
    text += fmt::format("{:>5} {:>3} {:>3} {:>3} {:>10} {:>10} {:>12} {:>12} {:>6}\n",
                        pr["rank"].get<int>(), pr["dp"].get<int>(), pr["cp"].get<int>(),
                        pr["tp"].get<int>(), pr["rows_sent"].get<int64_t>(),
                        pr["rows_received"].get<int64_t>(), pr["bytes_sent"].get<uint64_t>(),
                        pr["bytes_received"].get<uint64_t>(), pr["calls"].get<uint64_t>());
  text += fmt::format("simulated time: {:.1f} us (alpha {} us/step, {} GB/s)\n",
                      world.sim_time_us(), wo.cost.alpha_us, wo.cost.bandwidth_gbps);

  if (!failure.empty()) {
    const auto messages = world.error_messages();
    const bool injected = fault && messages[static_cast<std::size_t>(fault->rank)].find(
                                       "injected fault") != std::string::npos;
    j["check"] = {{"passed", false}};
    j["error"] = failure;
    if (injected) {
      const std::string& what = messages[static_cast<std::size_t>(fault->rank)];
      j["fault"] = {
          {"rank", fault->rank}, {"at_call", fault->at}, {"triggered", true}, {"call", what}};
      text += fmt::format("injected fault: {}\n", what);
      int affected = 0;
      for (const auto& msg : messages)
        if (!msg.empty()) ++affected;
      text +=
          fmt::format("{} of {} ranks ended with an error (RankFailure on the others), none hung\n",
                      affected, a.ranks);
    } else {
      text += fmt::format("run ended: {}\n", failure);
    }
    out.code = injected ? kFault : kFailed;
  } else {
    const auto ref = ep::reference_step(cfg, per_dp);
    const auto chk = ep::check_step(cfg, per_dp, results, ref);
    const auto [ftol, gtol] = ep::tolerance(cfg.dtype);
    j["check"] = {{"forward_max_abs_diff", chk.forward_max_abs_diff},
                  {"grad_max_rel_diff", chk.grad_max_rel_diff},
                  {"loss_rel_diff", chk.loss_rel_diff},
                  {"forward_tolerance", ftol},
                  {"grad_tolerance", gtol},
                  {"passed", chk.passed}};
    if (fault) {
      j["fault"] = {{"rank", fault->rank}, {"at_call", fault->at}, {"triggered", false}};
      text +=
          fmt::format("note: --fault rank:{}:at:{} never triggered (that rank made fewer calls)\n",
                      fault->rank, fault->at);
    }
    text += fmt::format(
        "check vs single-rank reference: forward max |diff| = {:.3g} (tol {:.0e}), encoder grad "
        "max "
        "rel diff = {:.3g} (tol {:.0e}), loss rel diff = {:.3g} -> {}\n",
        chk.forward_max_abs_diff, ftol, chk.grad_max_rel_diff, gtol, chk.loss_rel_diff,
        chk.passed ? "PASSED" : "FAILED");
    out.code = chk.passed ? kPassed : kFailed;
  }
  text += fmt::format("wall time: {:.1f} ms\n", wall_ms);
  if (!a.trace.empty()) text += fmt::format("trace: {} (open in Perfetto)\n", a.trace);
  out.report = j;
  out.text = text;
  return out;
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

std::string step_command_line(const StepArgs& a, uint64_t seed) {
  std::string s = fmt::format("diffcomm-sim step --ranks {} --cp {} --tp {}", a.ranks, a.cp, a.tp);
  if (a.sp) s += " --sp";
  s += fmt::format(
      " --cp-layout {} --encoder-buckets {} --encoder-cp {} --batch {} --images-per-sample {} "
      "--hidden {} --ffn {} --dtype {} --seed {}",
      a.cp_layout, a.buckets, a.encoder_cp, a.batch, a.images_per_sample, a.hidden, a.ffn, a.dtype,
      seed);
  if (a.receiver_grad != "auto") s += " --receiver-grad " + a.receiver_grad;
  if (a.model != "qwen2vl") s += " --model " + a.model;
  if (!a.images.empty()) s += " --images " + shell_quote(a.images);
  return s;
}

int run_main(int argc, char** argv) {
  CLI::App app{"diffcomm-sim: simulated encoder-parallel steps, adjoint checks and sweeps"};
  app.require_subcommand(1);

  StepArgs step;
  auto* step_cmd =
      app.add_subcommand("step", "one seeded encoder-parallel training step vs its reference");
  add_step_options(*step_cmd, step);
  step_cmd
      ->add_option("--fault", step.fault,
                   "inject a failure: rank:R:at:K (rank R fails at its K-th call)")
      ->check(kFaultSpec);
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
  sweep_cmd->add_option("--seeds", seeds, "A..B (inclusive)")->required()->check(kSeedRange);
  add_step_options(*sweep_cmd, sweep);

  std::string tokens_images, model = "qwen2vl";
  auto* tokens_cmd = app.add_subcommand("tokens", "image_id,tokens for every image of a CSV");
  tokens_cmd->add_option("--images", tokens_images,
                         "CSV of image sizes (default: the shipped COCO val2017)");
  tokens_cmd->add_option("--model", model, "token rule: qwen2vl, qwen2.5vl or qwen3vl")
      ->check(CLI::IsMember(ep::vision_model_names()));

  // CLI11 reports a first word that is no subcommand as "A subcommand is
  // required": name it instead.
  if (argc > 1 && argv[1][0] != '-') {
    const std::string first = argv[1];
    const auto subs = app.get_subcommands([&](CLI::App* sub) { return sub->check_name(first); });
    if (subs.empty()) {
      std::cerr << fmt::format(
          "diffcomm-sim: bad argument: unknown subcommand '{}' (expected step, check, sweep or "
          "tokens; see --help)\n",
          first);
      return kBadArgs;
    }
  }
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

  try {
    if (*step_cmd) {
      StepOutcome o = run_step_command(step);
      if (step.json)
        std::cout << o.report.dump() << "\n";
      else
        std::cout << o.text;
      return o.code;
    }
    if (*check_cmd) {
      const auto rep = diffcomm::sim::check_adjoint(op, check_ranks, check_seed,
                                                    diffcomm::parse_dtype(check_dtype));
      if (check_json) {
        std::cout
            << json{{"op", rep.op},         {"ranks", rep.ranks},     {"seed", rep.seed},
                    {"dtype", check_dtype}, {"group", rep.group},     {"lhs", rep.lhs},
                    {"rhs", rep.rhs},       {"rel_err", rep.rel_err}, {"tolerance", rep.tolerance},
                    {"passed", rep.passed}}
                   .dump()
            << "\n";
      } else {
        std::cout << fmt::format(
            "check {} on {} ranks, seed {}, {}: group (global ranks) [{}]\n  sum <A x, y>   = "
            "{:.17g}\n  "
            "sum <x, A^T y> = {:.17g}\n  relative error = {:.3g} (tolerance {:.0e}) -> {}\n",
            rep.op, rep.ranks, rep.seed, check_dtype, fmt::join(rep.group, ", "), rep.lhs, rep.rhs,
            rep.rel_err, rep.tolerance, rep.passed ? "PASSED" : "FAILED");
      }
      return rep.passed ? kPassed : kFailed;
    }
    if (*sweep_cmd) {
      std::string why;
      const auto range = parse_seed_range(seeds, &why);  // the validator accepted it
      if (!range) throw BadArgs(fmt::format("--seeds '{}': {}", seeds, why));
      const uint64_t lo = range->lo, hi = range->hi;
      make_config(sweep);  // validate once, resolve defaults for the repro line
      const bool tty = isatty(fileno(stdout)) != 0;
      int failures = 0;
      const uint64_t count = hi - lo + 1;  // <= kMaxSweep
      // Counted by index: `s <= hi` never ends when hi is 2^64 - 1.
      for (uint64_t i = 0; i < count; ++i) {
        const uint64_t s = lo + i;
        StepArgs a = sweep;
        a.seed = s;
        a.json = false;
        const StepOutcome o = run_step_command(a);
        if (o.code != kPassed) {
          ++failures;
          if (tty) std::cout << "\r";
          std::cout << fmt::format("seed {} FAILED: {}\n  reproduce: {}\n", s,
                                   o.report.contains("error") ? o.report["error"].get<std::string>()
                                                              : o.report["check"].dump(),
                                   step_command_line(sweep, s));
        }
        if (tty) {
          const uint64_t done = i + 1;
          const int width = 30;
          const int filled = static_cast<int>(width * done / count);
          std::cout << fmt::format("\r[{}{}] {}/{} seeds, {} failed",
                                   std::string(static_cast<std::size_t>(filled), '#'),
                                   std::string(static_cast<std::size_t>(width - filled), '.'), done,
                                   count, failures)
                    << std::flush;
        }
      }
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
      const ep::VisionModel vm = ep::vision_model(model);
      std::string out = "image_id,tokens\n";
      for (const auto& im : images) {
        int64_t tokens = 0;
        try {
          tokens = ep::video_tokens(vm, im.frames, im.height, im.width).tokens;
        } catch (const diffcomm::InvalidArgument& e) {
          throw BadArgs(
              fmt::format("--images {}: image {}: {}", tokens_images, im.image_id, e.what()));
        }
        out += fmt::format("{},{}\n", im.image_id, tokens);
      }
      std::cout << out;
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
