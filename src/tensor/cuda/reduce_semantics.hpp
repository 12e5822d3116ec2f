#pragma once
// The element-level arithmetic of diffcomm's reductions, written once for the
// host and the device (nvcc compiles it into the CUDA kernels of
// device_ops.cu; the host compiler into tests/tensor/test_device_memory.cpp, which
// checks it against dist::reduce_into and the CPU 16-bit conversions).
//
// The rule (the CPU reduce_into's, src/distributed/reduce.cpp):
//  - out[i] = inputs[0][i] op inputs[1][i] op ... in list order;
//  - bfloat16/float16 accumulate in float32 and are rounded once at the end
//    (round to nearest even; NaN becomes the CPU types' quiet NaN: bfloat16
//    0x7FC0, float16 sign|0x7E00), other dtypes accumulate in their own type;
//  - Avg = the sum, then one division by the count, then the one rounding;
//  - PremulSum = Σ (factor · x_j) in list order, each product and each sum
//    one rounding in the accumulator type (floats only);
//  - every float operation is a single correctly rounded IEEE operation (the
//    _rn intrinsics on the device: no FMA contraction, no fast math);
//  - Max/Min propagate NaN (either operand NaN gives the first NaN met, in
//    list order); otherwise max(a, v) = a < v ? v : a and
//    min(a, v) = v < a ? v : a (std::max/std::min: on ties, e.g. -0 and +0,
//    the earlier input wins);
//  - integer Sum and Product wrap around (computed in the unsigned type).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#define DIFFCOMM_HD __host__ __device__
#else
#define DIFFCOMM_HD
#endif

namespace diffcomm::detail::rs {

/// Storage types of the 16-bit floats: raw bits, distinct types.
struct Bf16Bits {
  uint16_t bits;
};
struct F16Bits {
  uint16_t bits;
};

DIFFCOMM_HD inline uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint32_t>(__float_as_uint(f));
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}
DIFFCOMM_HD inline float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

/// float -> bfloat16 bits, exactly as diffcomm::bfloat16::from_float.
DIFFCOMM_HD inline uint16_t bf16_from_float(float f) {
  uint32_t x = float_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  x += 0x7FFFu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}
DIFFCOMM_HD inline float bf16_to_float(uint16_t b) {
  return bits_float(static_cast<uint32_t>(b) << 16);
}

/// float -> float16 bits, exactly as diffcomm::float16::from_float.
DIFFCOMM_HD inline uint16_t f16_from_float(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u)
    return static_cast<uint16_t>(sign | (abs > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);
  if (abs < 0x38800000u) {
    // Subnormal half: units of 2^-24 (exact scaling), rounded half to even.
#if defined(__CUDA_ARCH__)
    const float scaled = __fmul_rn(bits_float(abs), 16777216.0f);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(rintf(scaled)));
#else
    const float scaled = bits_float(abs) * 16777216.0f;
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
#endif
  }
  uint32_t h = (abs >> 13) - (112u << 10);
  const uint32_t rem = abs & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

/// float16 bits -> float, exactly as diffcomm::float16::to_float.
DIFFCOMM_HD inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {
#if defined(__CUDA_ARCH__)
    const float v = __fmul_rn(static_cast<float>(mant), 1.0f / 16777216.0f);
#else
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
#endif
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7F800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

/// Accumulator type and conversions of each storage type.
template <class T>
struct Traits {
  using Acc = T;
  DIFFCOMM_HD static Acc load(T v) { return v; }
  DIFFCOMM_HD static T store(Acc a) { return a; }
};
template <>
struct Traits<Bf16Bits> {
  using Acc = float;
  DIFFCOMM_HD static Acc load(Bf16Bits v) { return bf16_to_float(v.bits); }
  DIFFCOMM_HD static Bf16Bits store(Acc a) { return {bf16_from_float(a)}; }
};
template <>
struct Traits<F16Bits> {
  using Acc = float;
  DIFFCOMM_HD static Acc load(F16Bits v) { return f16_to_float(v.bits); }
  DIFFCOMM_HD static F16Bits store(Acc a) { return {f16_from_float(a)}; }
};

// Single, correctly rounded operations (never contracted into an FMA).
DIFFCOMM_HD inline float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
DIFFCOMM_HD inline double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
DIFFCOMM_HD inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
DIFFCOMM_HD inline double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
DIFFCOMM_HD inline float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
DIFFCOMM_HD inline double div_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
// Integers wrap around: computed in the unsigned type of the same width.
template <class I>
DIFFCOMM_HD I add_rn(I a, I b) {
  using U = std::make_unsigned_t<I>;
  return static_cast<I>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
}
template <class I>
DIFFCOMM_HD I mul_rn(I a, I b) {
  using U = std::make_unsigned_t<I>;
  // uint8/uint16 promote to int: multiply in unsigned int to stay defined.
  using W = std::conditional_t<(sizeof(U) < sizeof(unsigned)), unsigned, U>;
  return static_cast<I>(
      static_cast<U>(static_cast<W>(static_cast<U>(a)) * static_cast<W>(static_cast<U>(b))));
}

template <class A>
DIFFCOMM_HD bool is_nan(A a) {
  if constexpr (std::is_floating_point_v<A>)
    return a != a;
  else
    return false;
}

/// The reduce operations, numbered as dist::ReduceOp.
enum class Op : int { Sum = 0, Avg = 1, Product = 2, Min = 3, Max = 4, PremulSum = 5 };

template <class A>
DIFFCOMM_HD A combine(Op op, A a, A v) {
  switch (op) {
    case Op::Sum:
    case Op::Avg:
    case Op::PremulSum: return add_rn(a, v);  // PremulSum: v already premultiplied
    case Op::Product: return mul_rn(a, v);
    case Op::Min:
      if (is_nan(a)) return a;
      if (is_nan(v)) return v;
      return v < a ? v : a;
    case Op::Max:
      if (is_nan(a)) return a;
      if (is_nan(v)) return v;
      return a < v ? v : a;
  }
  return a;
}

/// Element i of the reduction of k inputs (input(j) returns the j-th
/// element value in storage type T); `factor` is PremulSum's.
template <class T, class Input>
DIFFCOMM_HD T reduce_element(Op op, int k, Input input, double factor = 1.0) {
  using Tr = Traits<T>;
  using A = typename Tr::Acc;
  if constexpr (std::is_floating_point_v<A>) {
    if (op == Op::PremulSum) {
      const auto f = static_cast<A>(factor);
      A acc = mul_rn(f, Tr::load(input(0)));
      for (int j = 1; j < k; ++j) acc = add_rn(acc, mul_rn(f, Tr::load(input(j))));
      return Tr::store(acc);
    }
  }
  A acc = Tr::load(input(0));
  for (int j = 1; j < k; ++j) acc = combine(op, acc, Tr::load(input(j)));
  if (op == Op::Avg) {
    if constexpr (std::is_floating_point_v<A>) acc = div_rn(acc, static_cast<A>(k));
  }
  return Tr::store(acc);
}

}  // namespace diffcomm::detail::rs
