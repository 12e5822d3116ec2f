// diffcomm-sim: the simulated encoder-parallel training step on real image
// sizes, adjoint checks of single ops, seed sweeps, and the token rule.
//
// Exit codes: 0 checks passed; 1 a check failed; 2 bad arguments; 3 an
// injected fault ended the run.
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>

#include "diffcomm/encoder_parallel/batch.hpp"
#include "diffcomm/encoder_parallel/qwen2vl.hpp"
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
  std::vector<ep::Batch> per_dp;
  try {
    per_dp = ep::build_batches(images, cfg.dp, bo);
  } catch (const diffcomm::InvalidArgument& e) {
    throw BadArgs(fmt::format("--images {}: {}", a.images, e.what()));
  }
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
  if (!a.trace.empty()) world.write_trace(a.trace);

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
      make_config(sweep);  // validate once, resolve defaults for the repro line
      const bool tty = isatty(fileno(stdout)) != 0;
      int failures = 0;
      const uint64_t count = hi - lo + 1;
      for (uint64_t s = lo; s <= hi; ++s) {
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
          const uint64_t done = s - lo + 1;
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
