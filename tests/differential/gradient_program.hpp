#pragma once
// Random programs of differentiable collectives for the participation rule
// (issue [4/8], item 4): 2-6 ops (all_reduce Sum/Avg, broadcast,
// all_gather_single, reduce_scatter_single, uneven all_to_all_single) on
// random sub-groups, each op's input a rank-specific multiple of the rank's
// leaf x, and each rank's loss a weighted sum of a random subset of the
// outputs it received (possibly none). The summed loss is linear in the
// leaves, so its exact gradient comes from an independent reference: the
// ops' forward semantics written here on plain vectors (no diffcomm code),
// evaluated at unit vectors.
#include <cstdint>
#include <string>
#include <vector>

#include "diffcomm/distributed/group.hpp"

namespace diffcomm::differential {

enum class GradOp {
  AllReduceSum,
  AllReduceAvg,
  Broadcast,
  AllGatherSingle,
  ReduceScatterSingle,
  AllToAllSingle
};

struct GradStep {
  GradOp op = GradOp::AllReduceSum;
  std::vector<int> members;  ///< world ranks, in group order
  int root = 0;              ///< group-local (broadcast)
  /// all_to_all_single: rows from group rank i to group rank j.
  std::vector<std::vector<int64_t>> splits;
  std::vector<double> coeff;  ///< per world rank: input = coeff[r] * x
  /// per world rank: whether its loss uses this op's output, and the weight
  /// of output element e (weight(seed, step, rank, e)).
  std::vector<bool> used;
};

struct GradProgram {
  int world = 1;
  uint64_t seed = 0;
  std::vector<GradStep> steps;
};

/// Every leaf has kLeafRows elements (divisible by every group size 1..6).
inline constexpr int64_t kLeafRows = 60;

/// The program of `seed` for `world` ranks (the same on every process).
GradProgram make_grad_program(int world, uint64_t seed);
std::string describe(const GradProgram& p);

/// Runs the program as world rank `rank` on `world_group` (all ranks call
/// this) and returns d(summed loss)/dx for this rank, as computed by
/// diffcomm's autograd with the participation rule.
std::vector<double> run_grad_program(const GradProgram& p, const dist::ProcessGroup& world_group);

/// The reference: the exact gradient of the summed loss for every rank
/// (reference[r] has kLeafRows entries), from the forward semantics alone.
std::vector<std::vector<double>> reference_gradients(const GradProgram& p);

}  // namespace diffcomm::differential
