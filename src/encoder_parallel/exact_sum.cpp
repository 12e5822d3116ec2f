// Exact summation of doubles (header: include/diffcomm/encoder_parallel/exact_sum.hpp).
//
// Invariant: partials_ are finite, non-zero, non-overlapping and increasing in
// magnitude, and their exact (real) sum is the sum of the finite terms added.
// Adding x walks the partials with the error-free two-sum (hi + lo == y + x
// exactly), keeping every non-zero rounding error as a partial.
#include "diffcomm/encoder_parallel/exact_sum.hpp"

#include <cmath>
#include <utility>

namespace diffcomm::encoder_parallel {

void ExactSum::add(double x) {
  if (!std::isfinite(x)) {
    special_ = has_special_ ? special_ + x : x;
    has_special_ = true;
    return;
  }
  std::size_t kept = 0;
  for (double y : partials_) {
    if (std::fabs(x) < std::fabs(y)) std::swap(x, y);
    const double hi = x + y;
    const double lo = y - (hi - x);  // exact: |x| >= |y|
    if (lo != 0) partials_[kept++] = lo;
    x = hi;
  }
  partials_.resize(kept);
  if (x != 0) partials_.push_back(x);
}

void ExactSum::add(const ExactSum& other) {
  for (double p : other.partials_) add(p);
  if (other.has_special_) add(other.special_);
}

ExactSum ExactSum::from_partials(const std::vector<double>& partials, double special) {
  ExactSum s;
  for (double p : partials) s.add(p);
  if (special != 0) s.add(special);
  return s;
}

double ExactSum::value() const {
  if (has_special_) return special_;
  std::size_t n = partials_.size();
  if (n == 0) return 0.0;
  // From the largest partial down, until an addition is inexact; the sum of
  // the rest then only decides a tie (lo exactly half an ulp of hi).
  double hi = partials_[--n], lo = 0;
  while (n > 0) {
    const double x = hi, y = partials_[--n];
    hi = x + y;
    lo = y - (hi - x);
    if (lo != 0) break;
  }
  // The partials below n have the sign of lo: the exact sum is past the
  // half-way point, so round away from hi (hi + 2 lo lands on the neighbour
  // when lo is exactly half an ulp).
  if (n > 0 && ((lo < 0 && partials_[n - 1] < 0) || (lo > 0 && partials_[n - 1] > 0))) {
    const double y = lo * 2, x = hi + y;
    if (y == x - hi) hi = x;
  }
  return hi;
}

}  // namespace diffcomm::encoder_parallel
