#pragma once
// One adjoint-identity check of a differentiable collective on a random
// simulated world, reproducible from (op, ranks, seed, dtype). Used by
// `diffcomm-sim check`; the property tests draw their own cases.
#include <cstdint>
#include <string>
#include <vector>

#include "diffcomm/distributed/group.hpp"
#include "diffcomm/tensor/dtype.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::sim {

struct AdjointReport {
  std::string op;
  int ranks = 0;
  uint64_t seed = 0;
  DType dtype = DType::Float64;
  std::vector<int> group;  ///< global ranks of the random sub-group, in group order
  double lhs = 0;          ///< sum over ranks of <A(x), y>
  double rhs = 0;          ///< sum over ranks of <x, A^T(y)> (A^T(y) from backward)
  double rel_err = 0;      ///< |lhs - rhs| / max(|lhs|, |rhs|, 1e-300)
  double tolerance = 0;    ///< 1e-12 float64, 1e-5 float32, 2e-2 bfloat16/float16
  bool passed = false;
};

/// The op names check_adjoint accepts: all_reduce, broadcast, reduce,
/// all_gather, all_gather_single, all_gather_v, gather, scatter,
/// reduce_scatter, reduce_scatter_single, reduce_scatter_v, all_to_all,
/// all_to_all_single, all_reduce_premul_sum and reduce_scatter_premul_sum
/// (ReduceOp::premul_sum(-0.375)).
const std::vector<std::string>& differentiable_ops();

/// What every rank must agree on, drawn from a seed: the sub-group (global
/// ranks, group order; never starting at global rank 0 when ranks > 1),
/// root, row width, rows per member and the member-to-member row matrix
/// (zeros included).
struct AdjointCase {
  std::vector<int> members;
  int root = 0;
  int64_t width = 1;
  std::vector<int64_t> rows;
  std::vector<std::vector<int64_t>> m;
};
AdjointCase draw_adjoint_case(int ranks, uint64_t seed);

/// This rank's two terms of the identity, <A(x), y> and <x, A^T(y)>, for one
/// op on any backend: builds the case's sub-group from `world` (collective
/// over world), draws x and the cotangent y from gen (small integers, exact
/// in every dtype) on `device`, runs forward and backward. Non-members
/// return {0, 0}. Besides differentiable_ops(), accepts "all_reduce_avg".
std::pair<double, double> adjoint_terms(const std::string& op, const dist::ProcessGroup& world,
                                        const AdjointCase& c, DType dtype, Generator& gen,
                                        Device device = Device::cpu());

/// Draws from seed: a sub-group of 1..ranks members in random order (not
/// starting at global rank 0 when ranks > 1), roots, row counts and splits
/// (zeros included), then per-rank data and cotangents; runs forward and
/// backward in a sim::World and evaluates both sides of the identity.
/// Throws InvalidArgument for an unknown op, ranks outside 1..4096 or a
/// non-floating dtype.
AdjointReport check_adjoint(const std::string& op, int ranks, uint64_t seed, DType dtype);

}  // namespace diffcomm::sim
