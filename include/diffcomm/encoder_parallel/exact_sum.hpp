#pragma once
// An exact sum of doubles, rounded once: the training step's loss is this sum
// of its per-token terms, so its bits do not depend on how the terms are
// spread over ranks or in which order they are added.
#include <vector>

namespace diffcomm::encoder_parallel {

/// The exact sum of the doubles added so far, held as non-overlapping
/// partials (Shewchuk's adaptive-precision summation, the method of Python's
/// math.fsum). value() is that exact sum rounded to the nearest double (ties
/// to even), so it depends on the multiset of terms only: any order, any
/// grouping into ExactSums merged with add(const ExactSum&), gives the same
/// bits. A non-finite term makes value() the plain sum of the non-finite
/// terms (inf, -inf or nan). Intermediate overflow (partials beyond
/// DBL_MAX, terms near 1e308) is not handled.
class ExactSum {
 public:
  void add(double x);
  void add(const ExactSum& other);
  double value() const;
  /// The partials, smallest magnitude first; their exact sum is the sum.
  const std::vector<double>& partials() const { return partials_; }
  /// From partials() (e.g. sent by another rank).
  static ExactSum from_partials(const std::vector<double>& partials, double special = 0);
  double special() const { return special_; }

 private:
  std::vector<double> partials_;
  double special_ = 0;  // the sum of the non-finite terms
  bool has_special_ = false;
};

}  // namespace diffcomm::encoder_parallel
