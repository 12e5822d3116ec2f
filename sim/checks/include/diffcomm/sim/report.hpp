#pragma once
// The reports of `diffcomm-sim step`, `sweep` and `check` as library structs,
// built here once and only printed by the CLI and the Python binding
// (DESIGN.md, "one home for each cross-backend concern").
//
//  - run_step_report: one seeded encoder-parallel step in a sim::World, its
//    traffic, cost-model time and the check against the single-rank
//    reference (or the error that ended it).
//  - run_sweep: run_step_report over a range of seeds.
//  - to_json / to_text: the exact `--json` object and the human report.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "diffcomm/encoder_parallel/batch.hpp"
#include "diffcomm/encoder_parallel/tokens.hpp"
#include "diffcomm/encoder_parallel/training_step.hpp"
#include "diffcomm/sim/adjoint.hpp"
#include "diffcomm/sim/equivalence.hpp"
#include "diffcomm/sim/world.hpp"

namespace diffcomm::sim {

/// Options of one step run besides its configuration.
struct StepRunOptions {
  std::optional<Fault> fault;  ///< inject a failure (rank R fails at its K-th call)
  /// Write a Chrome trace-event JSON there when non-empty (InvalidArgument
  /// "--trace: write_trace: ..." when it cannot be written).
  std::string trace_path;
  /// Also compare the ranks' encoder gradients with the reference through the
  /// mesh-equivalence oracle (StepReport::equivalence).
  bool equivalence = false;
};

/// One rank's line of the step report.
struct StepRankReport {
  int rank = 0, dp = 0, cp = 0, tp = 0;
  int64_t rows_sent = 0;      ///< forward exchange rows to other ranks (plan statistics)
  int64_t rows_received = 0;  ///< forward exchange rows from other ranks
  uint64_t bytes_sent = 0;    ///< all collectives of the step (world Stats)
  uint64_t bytes_received = 0;
  uint64_t calls = 0;
};

/// What happened to an injected fault.
struct StepFaultReport {
  int rank = 0;
  int at_call = 1;
  bool triggered = false;
  std::string call;  ///< the failing rank's message when triggered
};

/// The report of one step (the fields of `diffcomm-sim step --json`).
struct StepReport {
  encoder_parallel::StepConfig config;
  int samples = 0;  ///< samples per micro-batch
  std::string mode;
  int64_t images = 0, tokens = 0, image_tokens = 0;
  uint64_t bytes_total = 0;              ///< feature bytes crossing ranks, summed over DP
  uint64_t bytes_padded_all_gather = 0;  ///< what a pad-to-max all-gather would move
  uint64_t bytes_owner_minimum =
      0;                           ///< each token's row once per owner (PlanStats), summed over DP
  double encoder_imbalance = 1.0;  ///< max/mean bucket patches, worst DP replica
  double sim_time_us = 0, wall_ms = 0;
  CostModel cost;
  std::vector<StepRankReport> per_rank;
  /// Set when the run finished without error: the comparison with the reference.
  std::optional<encoder_parallel::StepCheck> check;
  double forward_tolerance = 0, grad_tolerance = 0;
  std::optional<StepFaultReport> fault;  ///< set when a fault was requested
  std::string error;                     ///< first failure of the run; "" when none
  int failed_ranks = 0;                  ///< ranks that ended with an error
  std::string trace_path;
  /// With StepRunOptions::equivalence, when the run finished: the oracle's
  /// findings on mesh {dp, cp, tp}: "encoder.w" (Replicate) and
  /// "decoder.input" (the forward's decoder input, [dp, tokens, hidden]:
  /// [Shard(0, dp), Partial(cp)], Partial(tp) too with SP); rtol the dtype's
  /// gradient tolerance, factor_rtol the larger of 1e-9 and that.
  std::optional<MeshFindings> equivalence;

  bool passed() const {
    return error.empty() && check && check->passed && (!equivalence || equivalence->ok());
  }
  /// `diffcomm-sim` exit code: 0 passed, 1 a check failed or an error ended
  /// the run, 3 an injected fault ended it.
  int exit_code() const;
};

/// The micro-batches of a step: encoder_parallel::build_batches of `images`
/// for cfg.dp replicas, `samples` samples of `images_per_sample` images,
/// sequence lengths a multiple of the decoder mesh's requirement, seeded
/// with cfg.seed, token counts from `model`'s rule. Throws InvalidArgument
/// (see build_batches).
std::vector<encoder_parallel::Batch> step_batches(
    const encoder_parallel::StepConfig& cfg, const std::vector<encoder_parallel::ImageSize>& images,
    int samples, int images_per_sample,
    const encoder_parallel::VisionModel& model = encoder_parallel::qwen2vl_model());

/// Plans the exchange of every replica, runs encoder_parallel::run_step on a
/// sim::World of cfg.world_size() ranks seeded with cfg.seed, and compares
/// the ranks' results with reference_step. A run that ends with an error
/// (injected fault, mismatch, deadlock) is reported, not thrown.
/// Throws InvalidArgument for inconsistent configurations (plan_exchange).
StepReport run_step_report(const encoder_parallel::StepConfig& cfg,
                           const std::vector<encoder_parallel::Batch>& per_dp,
                           const StepRunOptions& options = {});

/// The `--json` object (one line); with the oracle's findings, an
/// "equivalence" object (see to_json(const MeshFindings&)).
std::string to_json(const StepReport& report);
/// The oracle's findings as JSON: {"mesh": {dim: size}, "ok", "params": [{"name",
/// "placement", "ok", "max_rel_error", "divergent_ranks", "factor" (null
/// when the gradients match), "factor_residual", "factor_fits",
/// "expressions", "differing_shards", "line"}]}.
std::string to_json(const MeshFindings& findings);
/// The human report `diffcomm-sim step` prints.
std::string to_text(const StepReport& report);
/// The `check` object of the JSON report alone (what a sweep prints for a
/// failing seed that finished).
std::string check_json(const StepReport& report);

/// One failing seed of a sweep.
struct SweepFailure {
  uint64_t seed = 0;
  int exit_code = 1;
  std::string what;  ///< the error, or the check object as JSON
};

struct SweepReport {
  uint64_t first = 0, last = 0;  ///< inclusive
  uint64_t passed = 0;
  std::vector<SweepFailure> failures;
  uint64_t count() const { return last - first + 1; }
};

/// run_step_report for every seed in [first, last] (cfg.seed and the batch
/// seed set to each). on_seed, when given, sees every seed's report as it
/// finishes (progress, printing). Throws InvalidArgument when last < first
/// or for a configuration step_batches/run_step_report rejects.
SweepReport run_sweep(
    const encoder_parallel::StepConfig& cfg, const std::vector<encoder_parallel::ImageSize>& images,
    int samples, int images_per_sample, uint64_t first, uint64_t last,
    const std::function<void(uint64_t, const StepReport&)>& on_seed = {},
    const encoder_parallel::VisionModel& model = encoder_parallel::qwen2vl_model());

/// {"seeds", "passed", "failed", "failures": [{"seed", "exit_code", "what"}]}.
std::string to_json(const SweepReport& report);

/// The `diffcomm-sim check --json` object.
std::string to_json(const AdjointReport& report);
/// The human report `diffcomm-sim check` prints.
std::string to_text(const AdjointReport& report);

}  // namespace diffcomm::sim
