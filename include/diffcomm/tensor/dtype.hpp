#pragma once
// Element types. bfloat16 and float16 are storage types: every kernel
// converts them to float32, computes, and rounds back (nearest even).
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

namespace diffcomm {

enum class DType : uint8_t { Float32, Float64, BFloat16, Float16, Int32, Int64, UInt8 };

/// Bytes per element (0 for a value outside the enum). Inline: every
/// collective call asks it several times.
constexpr std::size_t element_size(DType dtype) {
  switch (dtype) {
    case DType::Float32: return 4;
    case DType::Float64: return 8;
    case DType::BFloat16: return 2;
    case DType::Float16: return 2;
    case DType::Int32: return 4;
    case DType::Int64: return 8;
    case DType::UInt8: return 1;
  }
  return 0;
}
/// "float32", "float64", "bfloat16", "float16", "int32", "int64", "uint8".
std::string dtype_name(DType dtype);
/// Parses a dtype_name; throws InvalidArgument on an unknown name.
DType parse_dtype(const std::string& name);
bool is_floating(DType dtype);

/// Brain float 16: the top 16 bits of an IEEE float32.
struct bfloat16 {
  uint16_t bits = 0;
  bfloat16() = default;
  bfloat16(float f) : bits(from_float(f)) {}  // NOLINT: implicit by design
  operator float() const { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }
  static uint16_t from_float(float f) {
    uint32_t x = std::bit_cast<uint32_t>(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN stays NaN
    x += 0x7FFFu + ((x >> 16) & 1u);                     // round to nearest even
    return static_cast<uint16_t>(x >> 16);
  }
};

/// IEEE 754 binary16.
struct float16 {
  uint16_t bits = 0;
  float16() = default;
  float16(float f) : bits(from_float(f)) {}  // NOLINT: implicit by design
  operator float() const { return to_float(bits); }
  static uint16_t from_float(float f);
  static float to_float(uint16_t h);
};

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::Float32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::Float64;
}
template <>
constexpr DType dtype_of<bfloat16>() {
  return DType::BFloat16;
}
template <>
constexpr DType dtype_of<float16>() {
  return DType::Float16;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::Int32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::Int64;
}
template <>
constexpr DType dtype_of<uint8_t>() {
  return DType::UInt8;
}

/// Throws InvalidArgument "<where>: expected dtype X, got Y".
[[noreturn]] void throw_dtype_mismatch(const char* where, DType expected, DType got);

/// The type arithmetic is done in: float for the 16-bit floats, else T.
template <class T>
struct compute_type {
  using type = T;
};
template <>
struct compute_type<bfloat16> {
  using type = float;
};
template <>
struct compute_type<float16> {
  using type = float;
};
template <class T>
using compute_t = typename compute_type<T>::type;

template <class T>
struct type_tag {
  using type = T;
};

/// Calls f(type_tag<T>{}) with T the C++ type of dtype.
template <class F>
decltype(auto) dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Float32: return f(type_tag<float>{});
    case DType::Float64: return f(type_tag<double>{});
    case DType::BFloat16: return f(type_tag<bfloat16>{});
    case DType::Float16: return f(type_tag<float16>{});
    case DType::Int32: return f(type_tag<int32_t>{});
    case DType::Int64: return f(type_tag<int64_t>{});
    case DType::UInt8: return f(type_tag<uint8_t>{});
  }
  return f(type_tag<float>{});  // unreachable
}

}  // namespace diffcomm
