#pragma once
// What the training step (training_step.cpp) and its single-rank reference
// (reference_step.cpp) share: the synthetic data both draw, value for value,
// and the check of a configuration.
#include <cstdint>
#include <memory>
#include <vector>

#include "diffcomm/encoder_parallel/training_step.hpp"

namespace diffcomm::encoder_parallel::detail {

/// count values scale * N(0, 1) from a generator seeded with seed, rounded to
/// dtype (as from_vector rounds).
std::vector<double> draw_fresh(uint64_t seed, std::size_t count, double scale, DType dtype);

/// draw_fresh, memoised process-wide (bounded): every rank of a simulated
/// world asks for the same draws.
using Drawn = std::shared_ptr<const std::vector<double>>;
Drawn draw(uint64_t seed, std::size_t count, double scale, DType dtype);

/// The step's synthetic weights and inputs, from (seed, purpose, indices).
struct Synthetic {
  const StepConfig& cfg;
  Drawn W() const;
  Drawn A() const;
  Drawn patches(int d, int64_t item_id, int64_t tokens) const;
  Drawn text(int d, int64_t b, int64_t seq_len) const;
  /// Row t of sample b's positional table U, [hidden] values.
  std::vector<double> u_row(int d, int64_t b, int64_t t) const;
  /// Sample b's whole table [seq_len, hidden], row by row (the reference).
  std::vector<double> u(int d, int64_t b, int64_t seq_len) const;
};

/// Throws InvalidArgument ("training step: ...") for an inconsistent
/// configuration or per_dp.size() != cfg.dp.
void validate_step(const StepConfig& cfg, const std::vector<Batch>& per_dp);

}  // namespace diffcomm::encoder_parallel::detail
