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
  // The extremes: the smallest subnormal, twice (exact: 2^-1073); the
  // largest double minus itself plus the smallest subnormal; two largest
  // doubles overflow; the largest minus half an ulp of it stays.
  const double tiny = std::ldexp(1.0, -1074), big = 1.7976931348623157e308;
  EXPECT_EQ(exact_sum({tiny, tiny}), std::ldexp(1.0, -1073));
  EXPECT_EQ(exact_sum({big, tiny, -big}), tiny);
  EXPECT_EQ(exact_sum({big, big}), INFINITY);
  EXPECT_EQ(exact_sum({-big, -big}), -INFINITY);
  EXPECT_EQ(exact_sum({big, big, -big}), big);
  // Negative totals.
  EXPECT_EQ(exact_sum({-1.0, std::ldexp(-1.0, -53), std::ldexp(-1.0, -100)}),
            -1.0 - std::ldexp(1.0, -52));
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
    for (const ExactSum& p : parts) total.add(ExactSum::from_limbs(p.limbs(), p.special()));
    EXPECT_EQ(total.value(), want) << "trial " << trial << ", merged";
  }
}

// A second exact method, written here: Shewchuk's non-overlapping partials
// with the round-half-even correction at the end (the method of Python's
// math.fsum). Over terms of any exponent the two must agree bit for bit.
double partials_sum(const std::vector<double>& terms) {
  std::vector<double> p;
  for (double x : terms) {
    std::size_t kept = 0;
    for (double y : p) {
      if (std::fabs(x) < std::fabs(y)) std::swap(x, y);
      const double hi = x + y, lo = y - (hi - x);
      if (lo != 0) p[kept++] = lo;
      x = hi;
    }
    p.resize(kept);
    if (x != 0) p.push_back(x);
  }
  std::size_t n = p.size();
  if (n == 0) return 0.0;
  double hi = p[--n], lo = 0;
  while (n > 0) {
    const double x = hi, y = p[--n];
    hi = x + y;
    lo = y - (hi - x);
    if (lo != 0) break;
  }
  if (n > 0 && ((lo < 0 && p[n - 1] < 0) || (lo > 0 && p[n - 1] > 0))) {
    const double y = lo * 2, x = hi + y;
    if (y == x - hi) hi = x;
  }
  return hi;
}

TEST(ExactSum, AgreesWithShewchukPartialsOverEveryExponent) {
  std::mt19937_64 gen(11);
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<double> v(1 + gen() % 20);
    const int spread = 1 + static_cast<int>(gen() % 2000);  // exponents within [lo, lo + spread)
    const int lo = -1074 + static_cast<int>(gen() % static_cast<uint64_t>(2000 - spread + 1));
    for (double& x : v) {
      const double mant = 1.0 + static_cast<double>(gen() >> 12) * 0x1.0p-52;
      x = std::ldexp(gen() % 2 ? mant : -mant, lo + static_cast<int>(gen() % spread));
    }
    if (gen() % 4 == 0) v.push_back(-v[0]);  // cancellations
    EXPECT_EQ(exact_sum(v), partials_sum(v)) << "trial " << trial;
  }
}

TEST(ExactSum, ManyEqualTermsGiveTheRoundedProduct) {
  // n copies of x: the exact sum is n * x, which the float64 product rounds
  // once, as value() must (x has every mantissa bit set, so the limbs carry).
  ExactSum s;
  const double x = std::ldexp(static_cast<double>((uint64_t{1} << 53) - 1), -40);
  const int64_t n = (int64_t{1} << 20) + 7;
  for (int64_t i = 0; i < n; ++i) s.add(x);
  EXPECT_EQ(s.value(), x * static_cast<double>(n));
  ExactSum back = ExactSum::from_limbs(s.limbs());
  back.add(-x);
  EXPECT_EQ(back.value(), x * static_cast<double>(n - 1));
}

}  // namespace
}  // namespace diffcomm
