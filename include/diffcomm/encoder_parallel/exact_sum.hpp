#pragma once
// An exact sum of doubles, rounded once: the training step's loss is this sum
// of its per-token terms, so its bits do not depend on how the terms are
// spread over ranks or in which order they are added.
#include <array>
#include <cstdint>
#include <vector>

namespace diffcomm::encoder_parallel {

/// The exact sum of the doubles added so far, held in fixed point: every
/// finite double is an integer multiple of 2^-1074, so the sum is an integer
/// number of 2^-1074, kept in 32-bit limbs with room for carries (a "small
/// superaccumulator", R. Neal 2015). value() is that exact sum rounded to the
/// nearest double (ties to even), so it depends on the multiset of terms
/// only: any order, any grouping into ExactSums merged with add(const
/// ExactSum&) or sent as limbs(), gives the same bits. A non-finite term
/// makes value() the plain sum of the non-finite terms (inf, -inf or nan); an
/// exact sum beyond the largest double gives +-inf.
class ExactSum {
 public:
  static constexpr int kLimbs =
      67;  ///< 32 bits each from 2^-1074: past 2^1024 with room for carries

  void add(double x);
  void add(const ExactSum& other);
  double value() const;
  /// The exact sum's limbs: sum of limbs()[i] * 2^(32 i - 1074).
  std::vector<int64_t> limbs() const;
  double special() const { return special_; }
  /// From limbs() and special() (e.g. sent by another rank).
  static ExactSum from_limbs(const std::vector<int64_t>& limbs, double special = 0);

 private:
  void carry();  // every limb but the top one into [0, 2^32)
  std::array<int64_t, kLimbs> limb_{};
  int64_t adds_ = 0;    // additions since the last carry()
  double special_ = 0;  // the sum of the non-finite terms
  bool has_special_ = false;
};

}  // namespace diffcomm::encoder_parallel
