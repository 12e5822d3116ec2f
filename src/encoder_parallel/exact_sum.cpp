// Exact summation of doubles in fixed point (header:
// include/diffcomm/encoder_parallel/exact_sum.hpp).
//
// Bit position p of the fixed-point number weighs 2^(p - 1074). A finite
// double is m * 2^(p - 1074) with m < 2^53 and p its lowest bit's position
// (0 for subnormals); m << (p % 32) spans at most 85 bits, added as three
// 32-bit pieces to limbs p/32 .. p/32 + 2. Limbs are int64, so 2^30 additions
// of at most 2^32 each fit before carries must be propagated.
#include "diffcomm/encoder_parallel/exact_sum.hpp"

#include <algorithm>
#include <bit>
#include <cmath>

namespace diffcomm::encoder_parallel {
namespace {

__extension__ using U128 = unsigned __int128;  // GCC and Clang
constexpr int64_t kCarryEvery = int64_t{1} << 30;
constexpr uint64_t kLow32 = 0xffffffffull;

int highest_bit(U128 v) {  // v != 0
  const auto hi = static_cast<uint64_t>(v >> 64);
  return hi != 0 ? 127 - std::countl_zero(hi) : 63 - std::countl_zero(static_cast<uint64_t>(v));
}

}  // namespace

void ExactSum::add(double x) {
  if (!std::isfinite(x)) {
    special_ = has_special_ ? special_ + x : x;
    has_special_ = true;
    return;
  }
  const auto bits = std::bit_cast<uint64_t>(x);
  const auto biased = static_cast<int>((bits >> 52) & 0x7ff);
  uint64_t m = bits & ((uint64_t{1} << 52) - 1);
  if (m == 0 && biased == 0) return;  // +-0
  int p = 0;
  if (biased != 0) {
    m |= uint64_t{1} << 52;
    p = biased - 1;
  }
  const U128 v = static_cast<U128>(m) << (p & 31);
  const int i = p >> 5;
  const auto lo = static_cast<int64_t>(static_cast<uint64_t>(v) & kLow32);
  const auto mid = static_cast<int64_t>(static_cast<uint64_t>(v >> 32) & kLow32);
  const auto hi = static_cast<int64_t>(static_cast<uint64_t>(v >> 64));
  if ((bits >> 63) != 0) {
    limb_[i] -= lo, limb_[i + 1] -= mid, limb_[i + 2] -= hi;
  } else {
    limb_[i] += lo, limb_[i + 1] += mid, limb_[i + 2] += hi;
  }
  if (++adds_ == kCarryEvery) carry();
}

void ExactSum::carry() {
  for (int i = 0; i + 1 < kLimbs; ++i) {
    const int64_t c = limb_[i] >> 32;  // floor division by 2^32
    limb_[i] -= c * (int64_t{1} << 32);
    limb_[i + 1] += c;
  }
  adds_ = 0;
}

void ExactSum::add(const ExactSum& other) {
  ExactSum o = other;
  o.carry();
  carry();
  for (int i = 0; i < kLimbs; ++i) limb_[i] += o.limb_[i];
  adds_ = 2;  // each limb below the top < 2^33 now
  if (other.has_special_) add(other.special_);
}

std::vector<int64_t> ExactSum::limbs() const {
  ExactSum c = *this;
  c.carry();
  return {c.limb_.begin(), c.limb_.end()};
}

ExactSum ExactSum::from_limbs(const std::vector<int64_t>& limbs, double special) {
  ExactSum s;
  for (std::size_t i = 0; i < limbs.size() && i < static_cast<std::size_t>(kLimbs); ++i)
    s.limb_[i] = limbs[i];
  s.carry();  // limbs from elsewhere: bring every one below the top into [0, 2^32)
  if (special != 0 || std::isnan(special)) s.add(special);
  return s;
}

double ExactSum::value() const {
  if (has_special_) return special_;
  ExactSum c = *this;
  c.carry();
  const bool negative = c.limb_[kLimbs - 1] < 0;
  if (negative) {  // the magnitude: negate, then carry again
    for (int64_t& l : c.limb_) l = -l;
    c.carry();
  }
  int h = kLimbs - 1;
  while (h >= 0 && c.limb_[h] == 0) --h;
  if (h < 0) return 0.0;
  // The top three limbs exactly, and whether anything below them is set.
  auto at = [&](int i) { return i >= 0 ? static_cast<uint64_t>(c.limb_[i]) : uint64_t{0}; };
  const U128 top =
      (static_cast<U128>(at(h)) << 64) | (static_cast<U128>(at(h - 1)) << 32) | at(h - 2);
  bool sticky = false;
  for (int i = 0; i < h - 2; ++i) sticky = sticky || c.limb_[i] != 0;
  const int base = 32 * (h - 2);  // position of top's bit 0
  const int msb = base + highest_bit(top);
  const int lsb = std::max(msb - 52, 0);  // the result's last bit (subnormals: position 0)
  const int shift = lsb - base;           // >= 12: top holds limb h's nonzero bits above 64
  U128 mant = top >> shift;
  const U128 rem = top & ((U128{1} << shift) - 1), half = U128{1} << (shift - 1);
  if (rem > half || (rem == half && (sticky || (mant & 1) != 0))) ++mant;
  // ldexp is exact here (the result is a double) or overflows to inf.
  const double r = std::ldexp(static_cast<double>(static_cast<uint64_t>(mant)), lsb - 1074);
  return negative ? -r : r;
}

}  // namespace diffcomm::encoder_parallel
