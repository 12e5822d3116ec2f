// ExactSum: the exact sum of doubles rounded once, whatever the order.
//
// Expected values are worked out by hand (the comments) or computed exactly
// in 128-bit integers (values that are integers times 2^-40, so their sum is
// exact in fixed point and one correctly rounded conversion gives the answer).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "diffcomm/encoder_parallel/exact_sum.hpp"

namespace diffcomm {
namespace {

using encoder_parallel::ExactSum;
__extension__ using Int128 = __int128;  // GCC and Clang

double exact_sum(const std::vector<double>& v) {
  ExactSum s;
  for (double x : v) s.add(x);
  return s.value();
}

TEST(ExactSum, HandWorkedCases) {
  EXPECT_EQ(exact_sum({}), 0.0);
  // 1e100 + 1 - 1e100: a float64 loop gives 0, the exact sum is 1.
  EXPECT_EQ(exact_sum({1e100, 1.0, -1e100}), 1.0);
  // Ten 0.1s: a float64 loop gives 0.9999999999999999; the exact sum of the
  // ten doubles nearest 0.1 rounds to 1.0.
  EXPECT_EQ(exact_sum(std::vector<double>(10, 0.1)), 1.0);
  // 1 + 2^-53 is exactly half-way between 1 and 1 + 2^-52: ties to even, 1.
  EXPECT_EQ(exact_sum({1.0, std::ldexp(1.0, -53)}), 1.0);
  // Past the half-way point by 2^-100: rounds up to 1 + 2^-52.
  EXPECT_EQ(exact_sum({1.0, std::ldexp(1.0, -53), std::ldexp(1.0, -100)}),
            1.0 + std::ldexp(1.0, -52));
  // Short of it by 2^-100: stays at 1.
  EXPECT_EQ(exact_sum({1.0, std::ldexp(1.0, -53), -std::ldexp(1.0, -100)}), 1.0);
  // Non-finite terms: their plain sum.
  EXPECT_EQ(exact_sum({1.0, INFINITY, 2.0}), INFINITY);
  EXPECT_TRUE(std::isnan(exact_sum({INFINITY, -INFINITY})));
}

TEST(ExactSum, AnyOrderAndAnyGroupingGiveTheFixedPointSum) {
  std::mt19937_64 gen(7);
  for (int trial = 0; trial < 200; ++trial) {
    // Integers of up to 40 bits times 2^-40..2^0, both signs: exact in
    // __int128 at scale 2^40.
    std::vector<double> v(1 + gen() % 60);
    Int128 fixed = 0;
    for (double& x : v) {
      const auto mant = static_cast<int64_t>(gen() % (int64_t{1} << 40)) * (gen() % 2 ? 1 : -1);
      const int shift = static_cast<int>(gen() % 41);  // x = mant * 2^-shift
      x = std::ldexp(static_cast<double>(mant), -shift);
      fixed += static_cast<Int128>(mant) << (40 - shift);
    }
    const double want = std::ldexp(static_cast<double>(fixed), -40);  // one rounding
    EXPECT_EQ(exact_sum(v), want) << "trial " << trial;
    std::shuffle(v.begin(), v.end(), gen);
    EXPECT_EQ(exact_sum(v), want) << "trial " << trial << ", shuffled";
    // Split among three partial sums (as ranks do), merged through partials().
    ExactSum parts[3];
    for (std::size_t i = 0; i < v.size(); ++i) parts[gen() % 3].add(v[i]);
    ExactSum total;
    for (const ExactSum& p : parts) total.add(ExactSum::from_partials(p.partials(), p.special()));
    EXPECT_EQ(total.value(), want) << "trial " << trial << ", merged";
  }
}

}  // namespace
}  // namespace diffcomm
