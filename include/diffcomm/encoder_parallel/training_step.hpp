#pragma once
// One encoder-parallel training step on synthetic weights, and its
// single-rank reference. Backend-agnostic: the same run_step runs on the
// simulated world (diffcomm-sim, property tests) and on MPI.
//
// Model (float64 by default):
//  - encoder: features of an image = P @ W, P [tokens, in_features] its
//    synthetic merged-patch features, W [in_features, hidden] the encoder
//    parameter (replicated on every rank; its gradient is what we check);
//  - the exchange routes features to decoder owners; merge_into_decoder
//    writes them over the text embeddings of this rank's shard;
//  - decoder (Megatron-style): a column-parallel linear Y = X @ A[:, cols of
//    this TP rank] (nn::canonical_column_parallel_linear): without SP X is
//    the replicated shard, with SP the shard's rows all-gathered over TP, in
//    StepConfig::sp_chunks pieces one after the other (a rank holds one
//    piece's gathered rows, forward, and input gradient, backward, at a
//    time; the bits do not depend on the pieces);
//  - loss = sum over tokens of <E_row, U(sample, token)> + 0.5 |Y|^2.
// Every sum has an order fixed by the data, not the mesh (docs/semantics.md,
// "The training step, exact"), so every rank's result equals the reference
// bit for bit, for every mesh and dtype:
//  - dX = dY A^T: one matmul per block of ffn / ffn_blocks columns, the
//    canonical tree over the blocks;
//  - dE = U + dX on every TP replica (the positional term is in every
//    replica's graph; the reported loss counts it once);
//  - dW: per block of grad_block_rows rows of an image (one matmul), the
//    canonical tree over a micro-batch's blocks in item order, then over the
//    dp micro-batches;
//  - the reported loss: the exact sum of its terms, rounded once (ExactSum).
// Reference: one rank, the same values with plain float64 loops, each
// rounded to the dtype where a tensor of the step holds it.
#include <cstdint>
#include <optional>
#include <vector>

#include "diffcomm/distributed/group.hpp"
#include "diffcomm/encoder_parallel/exchange.hpp"
#include "diffcomm/encoder_parallel/planner.hpp"

namespace diffcomm::encoder_parallel {

/// StepConfig::sp_chunks's default, and the most pieces it may split an SP
/// shard into.
inline constexpr int kDefaultSpChunks = 4;
inline constexpr int kMaxSpChunks = 1 << 16;

struct StepConfig {
  int dp = 1;
  DecoderMesh decoder;
  EncoderLayout encoder;
  int64_t hidden = 16;
  int64_t in_features = 8;
  int64_t ffn = 8;  ///< columns of A; divisible by tp
  DType dtype = DType::Float64;
  uint64_t seed = 0;
  /// With SP (tp > 1): all-gathers of the shard's rows per step, in
  /// [1, kMaxSpChunks] (fewer when the shard has fewer rows). More pieces:
  /// less memory held at the SP collectives, more calls; same gradients.
  int sp_chunks = kDefaultSpChunks;
  /// Rows per block of an image's feature rows for the encoder gradient: dW
  /// is summed per block (one matmul over the block's rows), then over the
  /// blocks by the canonical tree (docs/semantics.md, "The training step,
  /// exact"). Part of the result's definition, like the seed: every mesh
  /// gives the same bits for one value. Encoder-CP slices hold whole blocks.
  int64_t grad_block_rows = 64;
  /// Column blocks of the decoder's ffn columns for its input gradient: dX
  /// is one matmul per block of ffn / ffn_blocks columns, combined by the
  /// canonical tree over the blocks. Every tp dividing ffn_blocks gives the
  /// same bits (each TP rank holds whole blocks); more blocks admit more tp
  /// sizes, and a TP rank sends ffn_blocks / tp partials of dX instead of one.
  int64_t ffn_blocks = 4;
  /// The exchange's receiver-gradient convention. Unset: receiver_grad_for
  /// the mesh (the correct one). Set, it is forced on every rank — a way to
  /// watch the wrong convention fail the reference check (tp x the gradient).
  std::optional<ReceiverGrad> receiver_grad;
  /// world ranks = dp * cp * tp (mesh {dp, cp, tp}, TP fastest)
  int world_size() const { return dp * decoder.cp * decoder.tp; }
};

/// What one rank observed in run_step.
struct StepRankResult {
  int rank = 0, dp_rank = 0, cp_rank = 0, tp_rank = 0, exchange_rank = 0;
  FeatureExchangeMode mode = FeatureExchangeMode::Local;
  Tensor decoder_input;  ///< merged shard [layout rows, hidden] (detached)
  std::vector<std::pair<int64_t, int64_t>> shard_tokens;  ///< (sample, token) per shard row
  Tensor routed_rows;  ///< rows the exchange delivered (detached); undefined unless kept
  std::vector<EncoderWorkItem> received_items;
  Tensor encoder_grad;  ///< dL/dW summed over the world (same on every rank)
  double loss = 0;      ///< this rank's loss terms' exact sum, rounded once (float64, every dtype)
  /// The exact sum of this rank's loss terms (ExactSum::limbs, special):
  /// check_step adds every rank's exactly, so the step's loss is one
  /// rounding of the exact total, whatever the mesh.
  std::vector<int64_t> loss_limbs;
  double loss_special = 0;
  std::string plan_fingerprint;
};

/// Runs the step on this rank of `world` (world.size() == cfg.world_size()).
/// per_dp[d] is the micro-batch of DP replica d (replicated metadata). Calls
/// collectives on world and on mesh groups it creates: every rank must call.
/// Throws InvalidArgument for inconsistent configurations.
/// keep_routed_rows: fill StepRankResult::routed_rows. It is the largest
/// buffer of a rank's step (every image a rank owns tokens of, whole), and
/// only tests that inspect the exchange read it; the check does not.
StepRankResult run_step(const dist::ProcessGroup& world, const StepConfig& cfg,
                        const std::vector<Batch>& per_dp, bool keep_routed_rows = true);

/// The single-rank reference.
struct StepReference {
  /// embeddings[d][b]: the full decoder input [seq_len, hidden] (float64).
  std::vector<std::vector<std::vector<double>>> embeddings;
  std::vector<double> encoder_grad;  ///< [in_features * hidden], row-major
  double loss = 0;
  /// Sum of the magnitudes of the loss's terms (|e.u| and 0.5 y^2): the
  /// scale float64 rounding of the loss is relative to.
  double loss_scale = 0;
};
StepReference reference_step(const StepConfig& cfg, const std::vector<Batch>& per_dp);

/// Result of comparing every rank's result with the reference.
struct StepCheck {
  double forward_max_abs_diff = 0;  ///< over every shard row of every rank
  double grad_max_rel_diff = 0;     ///< max |dW - dW_ref| / max |dW_ref|, worst rank
  /// |sum of rank losses - reference| / max(loss_scale, |reference|)
  double loss_rel_diff = 0;
  bool passed = false;  ///< within the dtype's tolerance (see tolerance())
};
StepCheck check_step(const StepConfig& cfg, const std::vector<Batch>& per_dp,
                     const std::vector<StepRankResult>& ranks, const StepReference& ref);

/// Tolerances of check_step: float64 forward exact and gradients 1e-12;
/// float32 1e-5 / 1e-4; bfloat16 and float16 1e-2 / 5e-2.
std::pair<double, double> tolerance(DType dtype);

}  // namespace diffcomm::encoder_parallel
