// DType metadata and the 16-bit float storage types. Expected bit patterns are
// worked out by hand from the IEEE 754 layouts (binary32: 1/8/23, bfloat16:
// 1/8/7, binary16: 1/5/10) and written down in the comments.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "diffcomm/tensor/dtype.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm {
namespace {

const std::vector<DType> kAllDTypes = {DType::Float32, DType::Float64, DType::BFloat16,
                                       DType::Float16, DType::Int32,   DType::Int64,
                                       DType::UInt8};

float f32_from_bits(uint32_t bits) { return std::bit_cast<float>(bits); }
uint32_t bits_of(float f) { return std::bit_cast<uint32_t>(f); }

// Reference decoders written from the format definitions, in double.
double ref_bf16_value(uint16_t h) {
  const int sign = (h >> 15) & 1;
  const int exp = (h >> 7) & 0xFF;
  const int mant = h & 0x7F;
  double v;
  if (exp == 0)
    v = std::ldexp(static_cast<double>(mant), -126 - 7);
  else if (exp == 0xFF)
    v = mant == 0 ? std::numeric_limits<double>::infinity()
                  : std::numeric_limits<double>::quiet_NaN();
  else
    v = std::ldexp(1.0 + mant / 128.0, exp - 127);
  return sign ? -v : v;
}

double ref_f16_value(uint16_t h) {
  const int sign = (h >> 15) & 1;
  const int exp = (h >> 10) & 0x1F;
  const int mant = h & 0x3FF;
  double v;
  if (exp == 0)
    v = std::ldexp(static_cast<double>(mant), -24);
  else if (exp == 0x1F)
    v = mant == 0 ? std::numeric_limits<double>::infinity()
                  : std::numeric_limits<double>::quiet_NaN();
  else
    v = std::ldexp(1.0 + mant / 1024.0, exp - 15);
  return sign ? -v : v;
}

// ---------------------------------------------------------------- metadata

TEST(DType, ElementSizes) {
  EXPECT_EQ(element_size(DType::Float32), 4u);
  EXPECT_EQ(element_size(DType::Float64), 8u);
  EXPECT_EQ(element_size(DType::BFloat16), 2u);
  EXPECT_EQ(element_size(DType::Float16), 2u);
  EXPECT_EQ(element_size(DType::Int32), 4u);
  EXPECT_EQ(element_size(DType::Int64), 8u);
  EXPECT_EQ(element_size(DType::UInt8), 1u);
}

TEST(DType, ElementSizeMatchesCppType) {
  EXPECT_EQ(element_size(dtype_of<float>()), sizeof(float));
  EXPECT_EQ(element_size(dtype_of<double>()), sizeof(double));
  EXPECT_EQ(element_size(dtype_of<bfloat16>()), sizeof(bfloat16));
  EXPECT_EQ(element_size(dtype_of<float16>()), sizeof(float16));
  EXPECT_EQ(element_size(dtype_of<int32_t>()), sizeof(int32_t));
  EXPECT_EQ(element_size(dtype_of<int64_t>()), sizeof(int64_t));
  EXPECT_EQ(element_size(dtype_of<uint8_t>()), sizeof(uint8_t));
}

TEST(DType, Names) {
  EXPECT_EQ(dtype_name(DType::Float32), "float32");
  EXPECT_EQ(dtype_name(DType::Float64), "float64");
  EXPECT_EQ(dtype_name(DType::BFloat16), "bfloat16");
  EXPECT_EQ(dtype_name(DType::Float16), "float16");
  EXPECT_EQ(dtype_name(DType::Int32), "int32");
  EXPECT_EQ(dtype_name(DType::Int64), "int64");
  EXPECT_EQ(dtype_name(DType::UInt8), "uint8");
}

TEST(DType, ParseRoundTripsEveryName) {
  EXPECT_EQ(parse_dtype("float32"), DType::Float32);
  EXPECT_EQ(parse_dtype("float64"), DType::Float64);
  EXPECT_EQ(parse_dtype("bfloat16"), DType::BFloat16);
  EXPECT_EQ(parse_dtype("float16"), DType::Float16);
  EXPECT_EQ(parse_dtype("int32"), DType::Int32);
  EXPECT_EQ(parse_dtype("int64"), DType::Int64);
  EXPECT_EQ(parse_dtype("uint8"), DType::UInt8);
  for (DType d : kAllDTypes) EXPECT_EQ(parse_dtype(dtype_name(d)), d);
}

TEST(DType, ParseRejectsUnknownNames) {
  for (const std::string bad : {"", "float", "Float32", "FLOAT32", "fp16", "bf16", "half", "double",
                                "int8", "uint16", " float32", "float32 ", "float32\n"}) {
    EXPECT_THROW(parse_dtype(bad), InvalidArgument) << "name '" << bad << "'";
  }
  // The message names the offending input, and the exception is catchable as
  // the hierarchy root.
  try {
    parse_dtype("complex64");
    FAIL() << "parse_dtype accepted complex64";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("complex64"), std::string::npos) << e.what();
  }
}

TEST(DType, IsFloating) {
  EXPECT_TRUE(is_floating(DType::Float32));
  EXPECT_TRUE(is_floating(DType::Float64));
  EXPECT_TRUE(is_floating(DType::BFloat16));
  EXPECT_TRUE(is_floating(DType::Float16));
  EXPECT_FALSE(is_floating(DType::Int32));
  EXPECT_FALSE(is_floating(DType::Int64));
  EXPECT_FALSE(is_floating(DType::UInt8));
}

TEST(DType, DispatchPicksTheMatchingCppType) {
  for (DType d : kAllDTypes) {
    const DType seen = dispatch_dtype(d, [](auto tag) {
      using T = typename decltype(tag)::type;
      return dtype_of<T>();
    });
    EXPECT_EQ(seen, d) << dtype_name(d);
  }
}

TEST(DType, ComputeTypes) {
  static_assert(std::is_same_v<compute_t<bfloat16>, float>);
  static_assert(std::is_same_v<compute_t<float16>, float>);
  static_assert(std::is_same_v<compute_t<float>, float>);
  static_assert(std::is_same_v<compute_t<double>, double>);
  static_assert(std::is_same_v<compute_t<int32_t>, int32_t>);
  static_assert(std::is_same_v<compute_t<int64_t>, int64_t>);
  static_assert(std::is_same_v<compute_t<uint8_t>, uint8_t>);
  SUCCEED();
}

TEST(DType, MismatchMessageNamesBothTypes) {
  try {
    throw_dtype_mismatch("here", DType::Float32, DType::Int64);
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("here"), std::string::npos) << msg;
    EXPECT_NE(msg.find("float32"), std::string::npos) << msg;
    EXPECT_NE(msg.find("int64"), std::string::npos) << msg;
    return;
  }
  FAIL() << "throw_dtype_mismatch did not throw InvalidArgument";
}

// ---------------------------------------------------------------- bfloat16

TEST(BFloat16, ExactValues) {
  EXPECT_EQ(bfloat16::from_float(1.0f), 0x3F80);   // 0x3F800000
  EXPECT_EQ(bfloat16::from_float(-2.0f), 0xC000);  // 0xC0000000
  EXPECT_EQ(bfloat16::from_float(0.5f), 0x3F00);   // 0x3F000000
  EXPECT_EQ(bfloat16::from_float(3.0f), 0x4040);   // 0x40400000
  EXPECT_EQ(bfloat16::from_float(0.0f), 0x0000);
  EXPECT_EQ(bfloat16::from_float(-0.0f), 0x8000);
  EXPECT_EQ(bfloat16::from_float(1.0078125f), 0x3F81);  // 1 + 2^-7: last mantissa bit
  EXPECT_EQ(static_cast<float>(bfloat16(1.0f)), 1.0f);
  bfloat16 b;
  b.bits = 0x4049;  // 2 * (1 + 73/128) = 3.140625
  EXPECT_EQ(static_cast<float>(b), 3.140625f);
}

TEST(BFloat16, RoundsToNearestEven) {
  // 0x3F808000 = 1 + 2^-8: exactly between 0x3F80 (even) and 0x3F81.
  EXPECT_EQ(bfloat16::from_float(f32_from_bits(0x3F808000u)), 0x3F80);
  // 0x3F818000: between 0x3F81 (odd) and 0x3F82 (even) -> up.
  EXPECT_EQ(bfloat16::from_float(f32_from_bits(0x3F818000u)), 0x3F82);
  // One ulp (of float32) either side of a tie decides by distance.
  EXPECT_EQ(bfloat16::from_float(f32_from_bits(0x3F808001u)), 0x3F81);
  EXPECT_EQ(bfloat16::from_float(f32_from_bits(0x3F807FFFu)), 0x3F80);
  EXPECT_EQ(bfloat16::from_float(f32_from_bits(0x3F817FFFu)), 0x3F81);
  // Negative ties mirror the positive ones.
  EXPECT_EQ(bfloat16::from_float(f32_from_bits(0xBF808000u)), 0xBF80);
  EXPECT_EQ(bfloat16::from_float(f32_from_bits(0xBF818000u)), 0xBF82);
  // A tie whose round-up carries into the exponent: 0x3FFF8000 = 2 - 2^-8
  // lies between 0x3FFF (odd) and 0x4000 = 2.0.
  EXPECT_EQ(bfloat16::from_float(f32_from_bits(0x3FFF8000u)), 0x4000);
  // Decimal spelling: 1.00390625 = 1 + 2^-8 (tie, down); 1.01171875 = 1 + 3*2^-8 (tie, up).
  EXPECT_EQ(static_cast<float>(bfloat16(1.00390625f)), 1.0f);
  EXPECT_EQ(static_cast<float>(bfloat16(1.01171875f)), 1.015625f);
}

TEST(BFloat16, Subnormals) {
  // Smallest bfloat16 subnormal is 2^-133 = float bits 0x00010000.
  EXPECT_EQ(bfloat16::from_float(f32_from_bits(0x00010000u)), 0x0001);
  EXPECT_EQ(static_cast<float>(bfloat16(f32_from_bits(0x00010000u))), std::ldexp(1.0f, -133));
  bfloat16 tiny;
  tiny.bits = 0x0001;
  EXPECT_EQ(static_cast<float>(tiny), std::ldexp(1.0f, -133));
  // Half of it is a tie with zero -> 0 (even); slightly more -> 0x0001.
  EXPECT_EQ(bfloat16::from_float(f32_from_bits(0x00008000u)), 0x0000);
  EXPECT_EQ(bfloat16::from_float(f32_from_bits(0x00008001u)), 0x0001);
  // 1.5 * 2^-133 is a tie between 0x0001 and 0x0002 -> 0x0002.
  EXPECT_EQ(bfloat16::from_float(f32_from_bits(0x00018000u)), 0x0002);
  // Largest subnormal 0x007F rounds up into the smallest normal 0x0080 at a tie.
  EXPECT_EQ(bfloat16::from_float(f32_from_bits(0x007F8000u)), 0x0080);
  EXPECT_EQ(bfloat16::from_float(-std::ldexp(1.0f, -133)), 0x8001);
}

TEST(BFloat16, OverflowAndInfinity) {
  // Largest finite bfloat16: 0x7F7F = (2 - 2^-7) * 2^127.
  EXPECT_EQ(bfloat16::from_float(f32_from_bits(0x7F7F0000u)), 0x7F7F);
  EXPECT_EQ(bfloat16::from_float(f32_from_bits(0x7F7F7FFFu)), 0x7F7F);
  // At the tie above it (0x7F7F is odd) and at FLT_MAX it rounds to +inf.
  EXPECT_EQ(bfloat16::from_float(f32_from_bits(0x7F7F8000u)), 0x7F80);
  EXPECT_EQ(bfloat16::from_float(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(bfloat16::from_float(-std::numeric_limits<float>::max()), 0xFF80);
  EXPECT_EQ(bfloat16::from_float(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(bfloat16::from_float(-std::numeric_limits<float>::infinity()), 0xFF80);
  bfloat16 inf;
  inf.bits = 0x7F80;
  EXPECT_TRUE(std::isinf(static_cast<float>(inf)));
}

TEST(BFloat16, NaNStaysNaN) {
  auto is_bf16_nan = [](uint16_t b) { return (b & 0x7F80) == 0x7F80 && (b & 0x007F) != 0; };
  EXPECT_TRUE(is_bf16_nan(bfloat16::from_float(std::numeric_limits<float>::quiet_NaN())));
  // Payload only in the low 16 bits: truncation would give infinity.
  EXPECT_TRUE(is_bf16_nan(bfloat16::from_float(f32_from_bits(0x7F800001u))));
  EXPECT_TRUE(is_bf16_nan(bfloat16::from_float(f32_from_bits(0xFF800001u))));
  // A payload that rounding would carry into the sign bit.
  EXPECT_TRUE(is_bf16_nan(bfloat16::from_float(f32_from_bits(0x7FFFFFFFu))));
  bfloat16 nan;
  nan.bits = 0x7FC0;
  EXPECT_TRUE(std::isnan(static_cast<float>(nan)));
}

TEST(BFloat16, EveryPatternDecodesPerTheFormatAndRoundTrips) {
  for (uint32_t i = 0; i <= 0xFFFFu; ++i) {
    const auto h = static_cast<uint16_t>(i);
    bfloat16 b;
    b.bits = h;
    const float f = b;
    const double ref = ref_bf16_value(h);
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << i;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), ref) << std::hex << i;
    ASSERT_EQ(bfloat16::from_float(f), h) << std::hex << i;
  }
}

TEST(BFloat16, RandomFloatsRoundToANearestNeighbour) {
  // For finite floats inside the bfloat16 range, the result must be at least
  // as close as both adjacent bfloat16 values, and even on a tie.
  uint64_t state = 0x9E3779B97F4A7C15ull;
  for (int n = 0; n < 200000; ++n) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const auto x = static_cast<uint32_t>(state >> 32);
    const float f = f32_from_bits(x);
    if (!std::isfinite(f) || (x & 0x7FFFFFFFu) >= 0x7F7F0000u) continue;
    const uint16_t h = bfloat16::from_float(f);
    const double v = ref_bf16_value(h);
    const double err = std::abs(v - static_cast<double>(f));
    ASSERT_EQ(std::signbit(v), std::signbit(f)) << std::hex << x;
    for (int delta : {-1, 1}) {
      const int mag = (h & 0x7FFF) + delta;
      if (mag < 0 || mag > 0x7F7F) continue;
      const auto nb = static_cast<uint16_t>((h & 0x8000) | mag);
      const double nerr = std::abs(ref_bf16_value(nb) - static_cast<double>(f));
      ASSERT_LE(err, nerr) << std::hex << x;
      if (err == nerr) {
        ASSERT_EQ(h & 1, 0) << "tie not to even at " << std::hex << x;
      }
    }
  }
}

// ---------------------------------------------------------------- float16

TEST(Float16, ExactValues) {
  EXPECT_EQ(float16::from_float(1.0f), 0x3C00);
  EXPECT_EQ(float16::from_float(-2.0f), 0xC000);
  EXPECT_EQ(float16::from_float(0.5f), 0x3800);
  EXPECT_EQ(float16::from_float(0.0f), 0x0000);
  EXPECT_EQ(float16::from_float(-0.0f), 0x8000);
  EXPECT_EQ(float16::from_float(65504.0f), 0x7BFF);               // largest finite
  EXPECT_EQ(float16::from_float(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(float16::to_float(0x3555), 0.333251953125f);          // (1 + 341/1024) / 4
  EXPECT_EQ(float16::to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(float16::to_float(0xC000), -2.0f);
  EXPECT_EQ(static_cast<float>(float16(0.25f)), 0.25f);
}

TEST(Float16, RoundsToNearestEven) {
  // 1 + 2^-11 lies exactly between 0x3C00 (even) and 0x3C01.
  EXPECT_EQ(float16::from_float(1.0f + std::ldexp(1.0f, -11)), 0x3C00);
  // 1 + 3 * 2^-11: between 0x3C01 (odd) and 0x3C02 -> 0x3C02.
  EXPECT_EQ(float16::from_float(1.0f + 3.0f * std::ldexp(1.0f, -11)), 0x3C02);
  // Just above a tie goes up, just below goes down.
  EXPECT_EQ(float16::from_float(1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)), 0x3C01);
  EXPECT_EQ(float16::from_float(1.0f + std::ldexp(1.0f, -11) - std::ldexp(1.0f, -20)), 0x3C00);
  EXPECT_EQ(float16::from_float(-(1.0f + std::ldexp(1.0f, -11))), 0xBC00);
  // Carry into the exponent: 2 - 2^-11 lies between 0x3BFF (odd) and 0x4000.
  EXPECT_EQ(float16::from_float(2.0f - std::ldexp(1.0f, -11)), 0x4000);
}

TEST(Float16, Subnormals) {
  EXPECT_EQ(float16::from_float(std::ldexp(1.0f, -24)), 0x0001);            // smallest subnormal
  EXPECT_EQ(float16::from_float(1023.0f * std::ldexp(1.0f, -24)), 0x03FF);  // largest
  EXPECT_EQ(float16::to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(float16::to_float(0x03FF), 1023.0f * std::ldexp(1.0f, -24));
  EXPECT_EQ(float16::to_float(0x8001), -std::ldexp(1.0f, -24));
  // 2^-25 is a tie between 0 and 0x0001 -> +0; 3 * 2^-25 a tie between 1 and 2 -> 2.
  EXPECT_EQ(float16::from_float(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(float16::from_float(3.0f * std::ldexp(1.0f, -25)), 0x0002);
  EXPECT_EQ(float16::from_float(std::ldexp(1.0f, -25) + std::ldexp(1.0f, -40)), 0x0001);
  EXPECT_EQ(float16::from_float(1.25f * std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(float16::from_float(1.75f * std::ldexp(1.0f, -24)), 0x0002);
  // Underflow keeps the sign; far below the range is zero.
  EXPECT_EQ(float16::from_float(-std::ldexp(1.0f, -26)), 0x8000);
  EXPECT_EQ(float16::from_float(std::ldexp(1.0f, -100)), 0x0000);
  EXPECT_EQ(float16::from_float(f32_from_bits(0x00000001u)), 0x0000);  // float32 subnormal
  // 1023.5 * 2^-24 is a tie between 0x03FF (odd) and 0x0400 -> smallest normal.
  EXPECT_EQ(float16::from_float(1023.5f * std::ldexp(1.0f, -24)), 0x0400);
  // Just below the smallest normal, by one float32 ulp.
  EXPECT_EQ(float16::from_float(std::nextafter(std::ldexp(1.0f, -14), 0.0f)), 0x0400);
}

TEST(Float16, OverflowToInfinity) {
  // 65520 = 65504 + 16 is the tie between 0x7BFF (odd) and 2^16 -> inf.
  EXPECT_EQ(float16::from_float(65519.0f), 0x7BFF);
  EXPECT_EQ(float16::from_float(std::nextafter(65520.0f, 0.0f)), 0x7BFF);
  EXPECT_EQ(float16::from_float(65520.0f), 0x7C00);
  EXPECT_EQ(float16::from_float(65536.0f), 0x7C00);
  EXPECT_EQ(float16::from_float(1.0e6f), 0x7C00);
  EXPECT_EQ(float16::from_float(-1.0e6f), 0xFC00);
  EXPECT_EQ(float16::from_float(std::numeric_limits<float>::max()), 0x7C00);
  EXPECT_EQ(float16::from_float(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(float16::from_float(-std::numeric_limits<float>::infinity()), 0xFC00);
  EXPECT_TRUE(std::isinf(float16::to_float(0x7C00)));
  EXPECT_GT(float16::to_float(0x7C00), 0.0f);
  EXPECT_LT(float16::to_float(0xFC00), 0.0f);
}

TEST(Float16, NaNStaysNaN) {
  auto is_f16_nan = [](uint16_t h) { return (h & 0x7C00) == 0x7C00 && (h & 0x03FF) != 0; };
  EXPECT_TRUE(is_f16_nan(float16::from_float(std::numeric_limits<float>::quiet_NaN())));
  // Payload only in bits a plain shift would drop.
  EXPECT_TRUE(is_f16_nan(float16::from_float(f32_from_bits(0x7F800001u))));
  EXPECT_TRUE(is_f16_nan(float16::from_float(f32_from_bits(0xFF800001u))));
  EXPECT_TRUE(std::isnan(float16::to_float(0x7E00)));
  EXPECT_TRUE(std::isnan(float16::to_float(0x7C01)));
  EXPECT_TRUE(std::isnan(float16::to_float(0xFFFF)));
}

TEST(Float16, EveryPatternDecodesPerTheFormatAndRoundTrips) {
  for (uint32_t i = 0; i <= 0xFFFFu; ++i) {
    const auto h = static_cast<uint16_t>(i);
    const float f = float16::to_float(h);
    const double ref = ref_f16_value(h);
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << i;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), ref) << std::hex << i;
    ASSERT_EQ(bits_of(f) >> 31, static_cast<uint32_t>(h >> 15)) << std::hex << i;
    ASSERT_EQ(float16::from_float(f), h) << std::hex << i;
  }
}

TEST(Float16, RandomFloatsRoundToANearestNeighbour) {
  uint64_t state = 0x243F6A8885A308D3ull;
  int checked = 0;
  for (int n = 0; n < 400000; ++n) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    // Exponents concentrated on the float16 range (and a bit below it).
    const auto r = static_cast<uint32_t>(state >> 32);
    const uint32_t exp = 90u + (r >> 24) % 53u;  // 2^-37 .. 2^15
    const uint32_t x = (r & 0x80000000u) | (exp << 23) | (r & 0x007FFFFFu);
    const float f = f32_from_bits(x);
    if (std::abs(f) >= 65504.0f) continue;
    const uint16_t h = float16::from_float(f);
    const double v = ref_f16_value(h);
    const double err = std::abs(v - static_cast<double>(f));
    for (int delta : {-1, 1}) {
      const int mag = (h & 0x7FFF) + delta;
      if (mag < 0 || mag > 0x7BFF) continue;
      const auto nb = static_cast<uint16_t>((h & 0x8000) | mag);
      const double nerr = std::abs(ref_f16_value(nb) - static_cast<double>(f));
      ASSERT_LE(err, nerr) << std::hex << x;
      if (err == nerr) {
        ASSERT_EQ(h & 1, 0) << "tie not to even at " << std::hex << x;
      }
    }
    ++checked;
  }
  EXPECT_GT(checked, 300000);
}

}  // namespace
}  // namespace diffcomm
