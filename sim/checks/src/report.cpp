#include "diffcomm/sim/report.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>

#include "diffcomm/encoder_parallel/planner.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::sim {

namespace ep = encoder_parallel;
using nlohmann::json;

namespace {

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (b >= 1024 && u < 3) {
    b /= 1024;
    ++u;
  }
  return fmt::format("{:.1f} {}", b, units[u]);
}

json check_object(const StepReport& r) {
  if (!r.check) return {{"passed", false}};
  return {{"forward_max_abs_diff", r.check->forward_max_abs_diff},
          {"grad_max_rel_diff", r.check->grad_max_rel_diff},
          {"loss_rel_diff", r.check->loss_rel_diff},
          {"forward_tolerance", r.forward_tolerance},
          {"grad_tolerance", r.grad_tolerance},
          {"passed", r.check->passed}};
}

// Images, tokens and plan statistics of the step (before it runs).
void describe_batches(StepReport& rep, const std::vector<ep::Batch>& per_dp,
                      const std::vector<ep::ExchangePlan>& plans,
                      std::vector<ep::PlanStats>& stats) {
  for (const auto& b : per_dp)
    for (const auto& s : b.samples) {
      rep.tokens += s.seq_len;
      for (const auto& im : s.images) {
        ++rep.images;
        rep.image_tokens += im.tokens;
      }
    }
  for (const auto& p : plans) {
    stats.push_back(p.stats(rep.config.hidden, rep.config.dtype));
    rep.bytes_total += stats.back().total_bytes;
    rep.bytes_padded_all_gather += stats.back().padded_all_gather_bytes;
    rep.bytes_owner_minimum += stats.back().owner_minimum_bytes;
    rep.encoder_imbalance = std::max(rep.encoder_imbalance, stats.back().encoder_imbalance);
  }
}

json findings_object(const MeshFindings& m) {
  json mesh = json::object(), params = json::array();
  for (const auto& d : m.mesh) mesh[d.name] = d.size;
  for (const auto& f : m.params)
    params.push_back({{"name", f.name},
                      {"placement", placement_str(f.placement, f.inner)},
                      {"ok", f.ok},
                      {"max_rel_error", f.max_rel_error},
                      {"divergent_ranks", f.divergent_ranks},
                      {"factor", f.has_factor ? json(f.factor) : json(nullptr)},
                      {"factor_residual", f.factor_residual},
                      {"factor_fits", f.factor_fits},
                      {"expressions", f.expressions},
                      {"differing_shards", f.differing_shards},
                      {"missing_ranks", f.missing_ranks},
                      {"line", f.str(m.mesh)}});
  return {{"mesh", mesh}, {"ok", m.ok()}, {"params", params}};
}

/// Where each (dp, sample, token) of the decoder input lies in the flat
/// [dp, tokens, hidden] tensor: samples one after another, dp rows padded
/// to the longest dp's token count.
struct TokenIndex {
  std::vector<std::vector<int64_t>> offset;  ///< offset[d][b]: sample b's first token
  int64_t tokens = 0;                        ///< the longest dp's token count
};

TokenIndex token_index(const ep::StepReference& ref, int64_t hidden) {
  TokenIndex ix;
  for (const auto& samples : ref.embeddings) {
    int64_t at = 0;
    ix.offset.emplace_back();
    for (const auto& sample : samples) {
      ix.offset.back().push_back(at);
      at += static_cast<int64_t>(sample.size()) / hidden;
    }
    ix.tokens = std::max(ix.tokens, at);
  }
  return ix;
}

/// Rank r's decoder-input rows placed in a [1, tokens, hidden] tensor of
/// zeros (its dp row of the global [dp, tokens, hidden] input).
Tensor decoder_rows(const ep::StepRankResult& r, const TokenIndex& ix, int64_t hidden) {
  std::vector<double> out(static_cast<std::size_t>(ix.tokens * hidden), 0.0);
  const std::vector<double> got = r.decoder_input.to_vector();
  const auto& offset = ix.offset.at(static_cast<std::size_t>(r.dp_rank));
  for (std::size_t k = 0; k < r.shard_tokens.size(); ++k) {
    const auto [b, t] = r.shard_tokens[k];
    const int64_t row = offset.at(static_cast<std::size_t>(b)) + t;
    std::copy_n(got.begin() + static_cast<int64_t>(k) * hidden, hidden, out.begin() + row * hidden);
  }
  return from_vector(out, {1, ix.tokens, hidden});
}

/// The oracle on the step: the encoder gradient dW (Replicate over {dp, cp,
/// tp}) and the decoder input (dp row d of [dp, tokens, hidden]; each rank
/// holds its tokens, zeros elsewhere: summed over cp, and over tp with SP,
/// i.e. [Shard(0, dp), Partial(cp)(, Partial(tp))]; TP replicas without SP).
MeshFindings step_equivalence(const ep::StepConfig& cfg,
                              const std::vector<ep::StepRankResult>& results,
                              const ep::StepReference& ref, double rtol) {
  const MeshDims mesh{{"dp", cfg.dp}, {"cp", cfg.decoder.cp}, {"tp", cfg.decoder.tp}};
  const int64_t hidden = cfg.hidden;
  const TokenIndex ix = token_index(ref, hidden);
  std::vector<Placement> inner{Placement::partial("cp")};
  if (cfg.decoder.sp) inner.push_back(Placement::partial("tp"));
  std::vector<RankGrads> per_rank(results.size());
  for (const auto& r : results) {  // in mesh coordinate order (tp fastest)
    const auto at = static_cast<std::size_t>(
        (r.dp_rank * cfg.decoder.cp + r.cp_rank) * cfg.decoder.tp + r.tp_rank);
    per_rank.at(at) = {
        {"encoder.w", {r.encoder_grad, {}}},
        {"decoder.input", {decoder_rows(r, ix, hidden), Placement::shard(0, "dp"), inner}}};
  }
  std::vector<double> full(static_cast<std::size_t>(cfg.dp * ix.tokens * hidden), 0.0);
  for (std::size_t d = 0; d < ref.embeddings.size(); ++d)
    for (std::size_t b = 0; b < ref.embeddings[d].size(); ++b)
      std::copy(ref.embeddings[d][b].begin(), ref.embeddings[d][b].end(),
                full.begin() + (static_cast<int64_t>(d) * ix.tokens + ix.offset[d][b]) * hidden);
  const std::map<std::string, Tensor> reference{
      {"encoder.w", from_vector(ref.encoder_grad, {cfg.in_features, cfg.hidden})},
      {"decoder.input", from_vector(full, {cfg.dp, ix.tokens, hidden})}};
  EquivalenceOptions options;
  options.rtol = rtol;
  options.factor_rtol = std::max(options.factor_rtol, rtol);  // float32 and 16-bit steps
  return check_mesh(mesh, per_rank, reference, options);
}

}  // namespace

std::string to_json(const MeshFindings& findings) {
  return findings_object(findings).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

int StepReport::exit_code() const {
  if (fault && fault->triggered) return 3;
  return passed() ? 0 : 1;
}

std::vector<ep::Batch> step_batches(const ep::StepConfig& cfg,
                                    const std::vector<ep::ImageSize>& images, int samples,
                                    int images_per_sample, const ep::VisionModel& model) {
  ep::BatchOptions bo;
  bo.model = model;
  bo.samples = samples;
  bo.images_per_sample = images_per_sample;
  bo.seq_multiple = ep::required_seq_multiple(cfg.decoder);
  bo.seed = cfg.seed;
  return ep::build_batches(images, cfg.dp, bo);
}

StepReport run_step_report(const ep::StepConfig& cfg, const std::vector<ep::Batch>& per_dp,
                           const StepRunOptions& options) {
  if (per_dp.size() != static_cast<std::size_t>(cfg.dp))
    raise("run_step_report", fmt::format("{} micro-batches for dp = {}", per_dp.size(), cfg.dp));
  StepReport rep;
  rep.config = cfg;
  rep.samples = per_dp.empty() ? 0 : static_cast<int>(per_dp[0].samples.size());
  rep.trace_path = options.trace_path;
  std::vector<ep::ExchangePlan> plans;
  for (const auto& b : per_dp) plans.push_back(ep::plan_exchange(b, cfg.decoder, cfg.encoder));
  rep.mode = ep::mode_name(plans.at(0).mode);
  std::vector<ep::PlanStats> stats;
  describe_batches(rep, per_dp, plans, stats);

  const int ranks = cfg.world_size();
  WorldOptions wo;
  wo.ranks = ranks;
  wo.seed = cfg.seed;
  wo.fault = options.fault;
  rep.cost = wo.cost;
  World world(wo);
  std::vector<ep::StepRankResult> results(static_cast<std::size_t>(ranks));
  const auto t0 = std::chrono::steady_clock::now();
  try {
    world.run([&](Rank& r) {
      // The check reads decoder inputs, gradients and losses; the routed rows
      // (a rank's largest buffer) are not kept.
      results[static_cast<std::size_t>(r.rank())] =
          ep::run_step(r.world(), cfg, per_dp, /*keep_routed_rows=*/false);
    });
  } catch (const Error& e) {
    rep.error = e.what();
  }
  rep.wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!options.trace_path.empty()) {
    try {
      world.write_trace(options.trace_path);
    } catch (const InvalidArgument& e) {  // named as the CLI names the option (StepOptions)
      throw InvalidArgument(fmt::format("--trace: {}", e.what()));
    }
  }
  rep.sim_time_us = world.sim_time_us();
  // The run's tensors went back to the host block cache (up to its limit:
  // 450 MB at 1024 ranks); the reference and the check below work in
  // std::vector, so those pages would only sit beside them (a 1024-rank
  // step peaked at 760 MB with them). What a miss would keep stays: a
  // sweep's next small world reuses it (emptying the cache made a 40-seed
  // sweep of 16 ranks 1.3x slower, in page faults).
  trim_host_cache(kHostCacheKeepOnMiss);

  const int cp = cfg.decoder.cp, tp = cfg.decoder.tp, cptp = cp * tp;
  // A world that could not start its ranks (BackendError: no memory for the
  // fiber stacks) ran nothing and has no per-rank counters: its error is the
  // report (asking for them hid it behind "World::stats: rank 0 out of range").
  const bool ran = static_cast<int>(world.errors().size()) == ranks;
  for (int r = 0; ran && r < ranks; ++r) {
    const int d = r / cptp, e = cfg.decoder.exchange_rank((r % cptp) / tp, r % tp);
    const auto& st = stats[static_cast<std::size_t>(d)];
    const auto all = world.stats(r).total();
    rep.per_rank.push_back({r, d, (r % cptp) / tp, r % tp,
                            st.rows_sent[static_cast<std::size_t>(e)],
                            st.rows_received[static_cast<std::size_t>(e)], all.bytes_sent,
                            all.bytes_received, all.calls});
  }

  if (options.fault)
    rep.fault = StepFaultReport{options.fault->rank, options.fault->at_call, false, {}};
  if (!rep.error.empty()) {
    const auto messages = world.error_messages();
    for (const auto& msg : messages)
      if (!msg.empty()) ++rep.failed_ranks;
    if (options.fault && !world.injected_fault().empty()) {
      rep.fault->triggered = true;
      rep.fault->call = world.injected_fault();
    }
  } else {
    const auto ref = ep::reference_step(cfg, per_dp);
    rep.check = ep::check_step(cfg, per_dp, results, ref);
    std::tie(rep.forward_tolerance, rep.grad_tolerance) = ep::tolerance(cfg.dtype);
    if (options.equivalence)
      rep.equivalence = step_equivalence(cfg, results, ref, rep.grad_tolerance);
  }
  return rep;
}

std::string check_json(const StepReport& r) {
  return check_object(r).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string to_json(const StepReport& r) {
  const auto& c = r.config;
  json j;
  j["mode"] = r.mode;
  j["mesh"] = {{"ranks", c.world_size()},
               {"dp", c.dp},
               {"cp", c.decoder.cp},
               {"tp", c.decoder.tp},
               {"sp", c.decoder.sp},
               {"sp_chunks", c.sp_chunks},
               {"cp_layout", ep::cp_layout_name(c.decoder.layout)}};
  j["encoder"] = {{"buckets", c.encoder.buckets}, {"encoder_cp", c.encoder.encoder_cp}};
  j["seed"] = c.seed;
  j["dtype"] = dtype_name(c.dtype);
  j["hidden"] = c.hidden;
  j["images"] = r.images;
  j["tokens"] = r.tokens;
  j["image_tokens"] = r.image_tokens;
  j["bytes"] = {{"total", r.bytes_total},
                {"padded_all_gather", r.bytes_padded_all_gather},
                {"owner_minimum", r.bytes_owner_minimum}};
  j["encoder_imbalance"] = r.encoder_imbalance;
  j["sim_time_us"] = r.sim_time_us;
  j["wall_ms"] = r.wall_ms;
  json per_rank = json::array();
  for (const auto& p : r.per_rank)
    per_rank.push_back({{"rank", p.rank},
                        {"dp", p.dp},
                        {"cp", p.cp},
                        {"tp", p.tp},
                        {"rows_sent", p.rows_sent},
                        {"rows_received", p.rows_received},
                        {"bytes_sent", p.bytes_sent},
                        {"bytes_received", p.bytes_received},
                        {"calls", p.calls}});
  j["per_rank"] = per_rank;
  j["check"] = check_object(r);
  if (r.equivalence) j["equivalence"] = findings_object(*r.equivalence);
  if (!r.error.empty()) j["error"] = r.error;
  if (r.fault) {
    j["fault"] = {
        {"rank", r.fault->rank}, {"at_call", r.fault->at_call}, {"triggered", r.fault->triggered}};
    if (r.fault->triggered) j["fault"]["call"] = r.fault->call;
  }
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string to_text(const StepReport& r) {
  const auto& c = r.config;
  const std::string layout = ep::cp_layout_name(c.decoder.layout);
  const std::string dtype = dtype_name(c.dtype);
  std::string text = fmt::format(
      "diffcomm-sim step — {} ranks, mesh dp={} cp={} tp={} sp={} cp_layout={}, mode {}\n"
      "batch: {} micro-batch(es) x {} samples, {} images ({} image tokens of {} tokens), "
      "hidden {} {}, seed {}\n"
      "encoder: {} buckets x encoder_cp {}, imbalance {:.3f} (max/mean patches)\n"
      "exchange: {} moved across ranks vs {} for a pad-to-max all-gather ({:.2f}x); owner "
      "minimum {}\n",
      c.world_size(), c.dp, c.decoder.cp, c.decoder.tp, c.decoder.sp ? "on" : "off", layout, r.mode,
      c.dp, r.samples, r.images, r.image_tokens, r.tokens, c.hidden, dtype, c.seed,
      c.encoder.buckets, c.encoder.encoder_cp, r.encoder_imbalance,
      human_bytes(static_cast<double>(r.bytes_total)),
      human_bytes(static_cast<double>(r.bytes_padded_all_gather)),
      r.bytes_padded_all_gather
          ? static_cast<double>(r.bytes_total) / static_cast<double>(r.bytes_padded_all_gather)
          : 0.0,
      human_bytes(static_cast<double>(r.bytes_owner_minimum)));
  text += fmt::format("{:>5} {:>3} {:>3} {:>3} {:>10} {:>10} {:>12} {:>12} {:>6}\n", "rank", "dp",
                      "cp", "tp", "rows_sent", "rows_recv", "bytes_sent", "bytes_recv", "calls");
  for (const auto& p : r.per_rank)
    text += fmt::format("{:>5} {:>3} {:>3} {:>3} {:>10} {:>10} {:>12} {:>12} {:>6}\n", p.rank, p.dp,
                        p.cp, p.tp, p.rows_sent, p.rows_received, p.bytes_sent, p.bytes_received,
                        p.calls);
  text += fmt::format("simulated time: {:.1f} us (alpha {} us/step, {} GB/s)\n", r.sim_time_us,
                      r.cost.alpha_us, r.cost.bandwidth_gbps);
  if (!r.error.empty()) {
    if (r.fault && r.fault->triggered) {
      text += fmt::format("injected fault: {}\n", r.fault->call);
      text +=
          fmt::format("{} of {} ranks ended with an error (RankFailure on the others), none hung\n",
                      r.failed_ranks, c.world_size());
    } else {
      text += fmt::format("run ended: {}\n", r.error);
    }
  } else {
    if (r.fault)
      text +=
          fmt::format("note: --fault rank:{}:at:{} never triggered (that rank made fewer calls)\n",
                      r.fault->rank, r.fault->at_call);
    if (r.equivalence)
      text += fmt::format(
          "check vs single-rank reference: forward max |diff| = {:.3g} (tol {:.0e}), loss rel "
          "diff = {:.3g}\nequivalence (rtol {:.0e}):\n  {}\n-> {}\n",
          r.check->forward_max_abs_diff, r.forward_tolerance, r.check->loss_rel_diff,
          r.grad_tolerance, r.equivalence->str(), r.passed() ? "PASSED" : "FAILED");
    else
      text += fmt::format(
          "check vs single-rank reference: forward max |diff| = {:.3g} (tol {:.0e}), encoder "
          "grad max rel diff = {:.3g} (tol {:.0e}), loss rel diff = {:.3g} -> {}\n",
          r.check->forward_max_abs_diff, r.forward_tolerance, r.check->grad_max_rel_diff,
          r.grad_tolerance, r.check->loss_rel_diff, r.check->passed ? "PASSED" : "FAILED");
  }
  text += fmt::format("wall time: {:.1f} ms\n", r.wall_ms);
  if (!r.trace_path.empty()) text += fmt::format("trace: {} (open in Perfetto)\n", r.trace_path);
  return text;
}

SweepReport run_sweep(const ep::StepConfig& cfg, const std::vector<ep::ImageSize>& images,
                      int samples, int images_per_sample, uint64_t first, uint64_t last,
                      const std::function<void(uint64_t, const StepReport&)>& on_seed,
                      const ep::VisionModel& model) {
  if (last < first) raise("run_sweep", fmt::format("last seed {} < first seed {}", last, first));
  SweepReport out;
  out.first = first;
  out.last = last;
  for (uint64_t s = first;; ++s) {
    ep::StepConfig c = cfg;
    c.seed = s;
    const StepReport rep =
        run_step_report(c, step_batches(c, images, samples, images_per_sample, model));
    if (rep.exit_code() == 0)
      ++out.passed;
    else
      out.failures.push_back({s, rep.exit_code(), rep.error.empty() ? check_json(rep) : rep.error});
    if (on_seed) on_seed(s, rep);
    if (s == last) break;
  }
  return out;
}

std::string to_json(const SweepReport& r) {
  json failures = json::array();
  for (const auto& f : r.failures)
    failures.push_back({{"seed", f.seed}, {"exit_code", f.exit_code}, {"what", f.what}});
  return json{{"first", r.first},
              {"last", r.last},
              {"seeds", r.count()},
              {"passed", r.passed},
              {"failed", r.failures.size()},
              {"failures", failures}}
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string to_json(const AdjointReport& r) {
  return json{{"op", r.op},
              {"ranks", r.ranks},
              {"seed", r.seed},
              {"dtype", dtype_name(r.dtype)},
              {"group", r.group},
              {"lhs", r.lhs},
              {"rhs", r.rhs},
              {"rel_err", r.rel_err},
              {"tolerance", r.tolerance},
              {"passed", r.passed}}
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string to_text(const AdjointReport& r) {
  return fmt::format(
      "check {} on {} ranks, seed {}, {}: group (global ranks) [{}]\n  sum <A x, y>   = "
      "{:.17g}\n  "
      "sum <x, A^T y> = {:.17g}\n  relative error = {:.3g} (tolerance {:.0e}) -> {}\n",
      r.op, r.ranks, r.seed, dtype_name(r.dtype), fmt::join(r.group, ", "), r.lhs, r.rhs, r.rel_err,
      r.tolerance, r.passed ? "PASSED" : "FAILED");
}

}  // namespace diffcomm::sim
