#pragma once
// Small random SPMD programs for the differential test (sim vs production):
// a RapidCheck generator of programs over every primitive, sub-groups made by
// new_group and split, uneven and zero splits, in-place (aliased) calls,
// float64/float32/bfloat16/float16/int32 and every reduce op, and sometimes
// one deliberately mismatched call at the end. Running a program on a
// backend yields, for one rank, the bytes of every output after every step
// and the error (kind and message) that ended it. A backend keeps the
// simulated world's promises when those outcomes are bit-identical.
#include <cstdint>
#include <string>
#include <vector>

#include "diffcomm/distributed/backend/call.hpp"
#include "diffcomm/distributed/group.hpp"
#include "diffcomm/distributed/reduce_op.hpp"
#include "diffcomm/tensor/dtype.hpp"

namespace diffcomm::differential {

enum class GroupKind { World, Subset, Halves };  ///< world; new_group(subset); split by parity

struct Step {
  dist::OpType op = dist::OpType::Barrier;
  GroupKind group = GroupKind::World;
  DType dtype = DType::Float32;
  dist::ReduceOp reduce_op = dist::ReduceOp::Sum;
  int root = 0;  ///< group rank (taken modulo the group's size)
  int64_t rows = 1;
  int64_t cols = 1;
  /// Rows from group rank i to group rank j (all_to_all*), or rows of
  /// member i (the _v ops: row 0 only), sized for the largest group.
  std::vector<std::vector<int64_t>> splits;
  bool in_place = false;
  /// Deliberate mismatch on one rank (world group, last step): 0 none,
  /// 1 root, 2 reduce op, 3 dtype, 4 shape, 5 split, 6 op (calls barrier).
  int mismatch = 0;
  int mismatch_rank = 0;
};

struct Program {
  int world = 1;
  std::vector<int> subset;  ///< world ranks of the new_group sub-group
  std::vector<Step> steps;
};

/// The program of `seed` for a world of `world` ranks (RapidCheck's
/// generator driven by rc::Random(seed): the same seed gives the same
/// program on every process).
Program make_program(int world, uint64_t seed);

/// One line per step, for failure reports.
std::string describe(const Program& program);

struct Outcome {
  std::vector<uint8_t> bytes;  ///< every output of every step, in order
  std::string error_kind;      ///< "" when the program ran to its end
  std::string error;           ///< the error's message
  int failed_step = -1;
};

/// Runs `program` on this rank's `world` group (all ranks call it).
/// `seed` fixes the input values. Never throws a diffcomm::Error: the error
/// that ends the program is the outcome's.
Outcome run_program(const Program& program, uint64_t seed, const dist::ProcessGroup& world);

/// "" when a and b are identical, else what differs.
std::string compare(const Outcome& a, const Outcome& b);

}  // namespace diffcomm::differential
