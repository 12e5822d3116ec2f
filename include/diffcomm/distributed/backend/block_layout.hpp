#pragma once
// BlockLayout: where each member's block lies in one flat buffer of a call —
// the offsets and lengths every backend (MPI, NCCL, the simulated world's
// data moves, the composed reductions) reads instead of re-deriving them per
// op. Units are whatever the caller scales by: elements (unit = elements per
// row) or bytes (unit = bytes per row). Built once per call; even splits stay
// O(1) in memory and time, others keep one prefix-sum table.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "diffcomm/distributed/backend/call.hpp"

namespace diffcomm::dist {

class BlockLayout {
 public:
  /// n blocks of `block` units each. Throws InvalidArgument for a negative
  /// block or when n x block overflows int64.
  static BlockLayout uniform(std::size_t n, int64_t block);
  /// Block p holds splits[p] x unit units (splits: rows per member, as in
  /// Call::input_splits / output_splits). A uniform SplitList gives a
  /// uniform layout. Throws InvalidArgument for a negative split or unit, or
  /// when a block or the total overflows int64.
  static BlockLayout of(const SplitList& splits, int64_t unit);

  /// Number of blocks (members).
  std::size_t size() const { return n_; }
  /// Start of block p, in units.
  int64_t offset(std::size_t p) const {
    return offsets_.empty() ? static_cast<int64_t>(p) * block_ : offsets_[p];
  }
  /// Length of block p, in units.
  int64_t length(std::size_t p) const {
    return offsets_.empty() ? block_ : offsets_[p + 1] - offsets_[p];
  }
  /// Sum of every block's length.
  int64_t total() const { return offset(n_); }
  /// Every length, in member order (for APIs that take a count array).
  std::vector<int64_t> lengths() const;
  /// Every offset, in member order.
  std::vector<int64_t> offsets() const;

 private:
  std::size_t n_ = 0;
  int64_t block_ = 0;             // uniform layouts
  std::vector<int64_t> offsets_;  // n + 1 prefix sums otherwise
};

}  // namespace diffcomm::dist
