// The differentiable ops: forward values and gradients in closed form, plus a
// float64 central-difference gradcheck for each; the non-differentiable
// helpers; and 16-bit floats computed in float32 then rounded.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"
#include "tensor/cuda/device_ops.hpp"

namespace diffcomm {
namespace {

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;
constexpr double kGradTol = 1e-6;

Tensor f64(const std::vector<double>& v, const Shape& shape) {
  return from_vector(v, shape, DType::Float64);
}
Tensor leaf(const std::vector<double>& v, const Shape& shape) {
  Tensor t = f64(v, shape);
  t.set_requires_grad(true);
  return t;
}
std::vector<double> vec(const Tensor& t) { return t.to_vector(); }

Tensor randn(const Shape& shape, uint64_t seed) {
  Generator g(seed);
  return rand_normal(shape, g, 0.0, 1.0, DType::Float64);
}
// Values in [lo, hi) (e.g. divisors kept away from zero).
Tensor randu(const Shape& shape, uint64_t seed, double lo, double hi) {
  Generator g(seed);
  return rand_uniform(shape, g, lo, hi, DType::Float64);
}

// Nearest value with `mant_bits` stored mantissa bits, minimum normal
// exponent `min_exp` and largest finite `max_finite`, ties to even: an
// independent reference rounding in double arithmetic.
double ref_round(double v, int mant_bits, int min_exp, double max_finite) {
  if (v == 0.0 || !std::isfinite(v)) return v;
  int e = std::ilogb(v);
  if (e < min_exp) e = min_exp;  // subnormal spacing
  const double ulp = std::ldexp(1.0, e - mant_bits);
  const double r = std::nearbyint(v / ulp) * ulp;  // default mode: half to even
  if (std::abs(r) > max_finite) return std::copysign(std::numeric_limits<double>::infinity(), v);
  return r;
}
double ref_bf16(double v) { return ref_round(v, 7, -126, 0x1.FEp127); }
double ref_f16(double v) { return ref_round(v, 10, -14, 65504.0); }

// ---------------------------------------------------------------- add, sub

TEST(OpsAdd, ValuesAndGradients) {
  Tensor a = leaf({1, 2, 3}, {3});
  Tensor b = leaf({10, 20, 30}, {3});
  Tensor y = add(a, b);
  EXPECT_EQ(vec(y), (std::vector<double>{11, 22, 33}));
  EXPECT_EQ(y.grad_fn()->name(), "AddBackward");
  backward({y}, {f64({1, -1, 2}, {3})});
  EXPECT_EQ(vec(a.grad()), (std::vector<double>{1, -1, 2}));
  EXPECT_EQ(vec(b.grad()), (std::vector<double>{1, -1, 2}));
}

TEST(OpsAdd, SameTensorTwice) {
  Tensor a = leaf({1, 2}, {2});
  backward({sum(add(a, a))});
  EXPECT_EQ(vec(a.grad()), (std::vector<double>{2, 2}));
}

TEST(OpsAdd, Gradcheck) {
  EXPECT_LT(gradcheck_max_error([](const auto& x) { return add(x[0], x[1]); },
                                {randn({2, 3}, 1), randn({2, 3}, 2)}),
            kGradTol);
}

TEST(OpsSub, ValuesAndGradients) {
  Tensor a = leaf({1, 2, 3}, {3});
  Tensor b = leaf({10, 20, 30}, {3});
  Tensor y = sub(a, b);
  EXPECT_EQ(vec(y), (std::vector<double>{-9, -18, -27}));
  backward({y}, {f64({1, -1, 2}, {3})});
  EXPECT_EQ(vec(a.grad()), (std::vector<double>{1, -1, 2}));
  EXPECT_EQ(vec(b.grad()), (std::vector<double>{-1, 1, -2}));
}

TEST(OpsSub, Gradcheck) {
  EXPECT_LT(gradcheck_max_error([](const auto& x) { return sub(x[0], x[1]); },
                                {randn({4}, 3), randn({4}, 4)}),
            kGradTol);
}

// ---------------------------------------------------------------- mul, div, scale

TEST(OpsMul, ValuesAndGradients) {
  Tensor a = leaf({1, 2, 3}, {3});
  Tensor b = leaf({10, 20, 30}, {3});
  Tensor y = mul(a, b);
  EXPECT_EQ(vec(y), (std::vector<double>{10, 40, 90}));
  backward({y}, {f64({1, -1, 2}, {3})});
  EXPECT_EQ(vec(a.grad()), (std::vector<double>{10, -20, 60}));  // g * b
  EXPECT_EQ(vec(b.grad()), (std::vector<double>{1, -2, 6}));     // g * a
}

TEST(OpsMul, Gradcheck) {
  EXPECT_LT(gradcheck_max_error([](const auto& x) { return mul(x[0], x[1]); },
                                {randn({3, 2}, 5), randn({3, 2}, 6)}),
            kGradTol);
}

TEST(OpsDiv, ValuesAndGradients) {
  Tensor a = leaf({1, 2, 3}, {3});
  Tensor b = leaf({2, 4, -8}, {3});
  Tensor y = div(a, b);
  EXPECT_EQ(vec(y), (std::vector<double>{0.5, 0.5, -0.375}));
  backward({y}, {f64({1, -1, 2}, {3})});
  EXPECT_EQ(vec(a.grad()), (std::vector<double>{0.5, -0.25, -0.25}));       // g / b
  EXPECT_EQ(vec(b.grad()), (std::vector<double>{-0.25, 0.125, -0.09375}));  // -g a / b^2
}

TEST(OpsDiv, Gradcheck) {
  EXPECT_LT(gradcheck_max_error([](const auto& x) { return div(x[0], x[1]); },
                                {randn({5}, 7), randu({5}, 8, 0.5, 2.0)}),
            kGradTol);
}

TEST(OpsScale, ValuesAndGradients) {
  Tensor x = leaf({1, -2}, {2});
  Tensor y = scale(x, -2.5);
  EXPECT_EQ(vec(y), (std::vector<double>{-2.5, 5}));
  backward({y}, {f64({2, 4}, {2})});
  EXPECT_EQ(vec(x.grad()), (std::vector<double>{-5, -10}));
}

TEST(OpsScale, Gradcheck) {
  EXPECT_LT(gradcheck_max_error([](const auto& x) { return scale(x[0], 0.75); }, {randn({3}, 9)}),
            kGradTol);
}

// ---------------------------------------------------------------- reductions

TEST(OpsSum, ValuesAndGradients) {
  Tensor x = leaf({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor y = sum(x);
  EXPECT_EQ(y.dim(), 0);
  EXPECT_EQ(y.item(), 21.0);
  backward({y}, {full({}, 2.0, DType::Float64)});
  EXPECT_EQ(x.grad().shape(), (Shape{2, 3}));
  EXPECT_EQ(vec(x.grad()), std::vector<double>(6, 2.0));
}

TEST(OpsSum, EmptyAndIntegerInputs) {
  EXPECT_EQ(sum(zeros({0, 4}, DType::Float64)).item(), 0.0);
  EXPECT_EQ(sum(arange(1, 101, 1, DType::Int32)).item(), 5050.0);
  EXPECT_EQ(sum(arange(1, 101, 1, DType::Int64)).dtype(), DType::Int64);
}

TEST(OpsSum, Gradcheck) {
  EXPECT_LT(gradcheck_max_error([](const auto& x) { return sum(x[0]); }, {randn({3, 4}, 10)}),
            kGradTol);
}

TEST(OpsDot, ValuesAndGradients) {
  Tensor a = leaf({1, 2, 3}, {3});
  Tensor b = leaf({4, 5, 6}, {3});
  Tensor y = dot(a, b);
  EXPECT_EQ(y.dim(), 0);
  EXPECT_EQ(y.item(), 32.0);
  backward({y}, {full({}, 2.0, DType::Float64)});
  EXPECT_EQ(vec(a.grad()), (std::vector<double>{8, 10, 12}));
  EXPECT_EQ(vec(b.grad()), (std::vector<double>{2, 4, 6}));
  EXPECT_THROW(dot(a, f64({1, 2}, {2})), InvalidArgument);
}

TEST(OpsDot, Gradcheck) {
  EXPECT_LT(gradcheck_max_error([](const auto& x) { return dot(x[0], x[1]); },
                                {randn({2, 3}, 11), randn({2, 3}, 12)}),
            kGradTol);
}

// ---------------------------------------------------------------- matmul, transpose

TEST(OpsMatmul, ValuesAndGradients) {
  Tensor a = leaf({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = leaf({7, 8, 9, 10, 11, 12}, {3, 2});
  Tensor c = matmul(a, b);
  EXPECT_EQ(c.shape(), (Shape{2, 2}));
  // [1 2 3; 4 5 6] [7 8; 9 10; 11 12] = [58 64; 139 154]
  EXPECT_EQ(vec(c), (std::vector<double>{58, 64, 139, 154}));
  backward({c}, {f64({1, 2, 3, 4}, {2, 2})});
  // dA = G B^T = [1 2; 3 4] [7 9 11; 8 10 12]
  EXPECT_EQ(vec(a.grad()), (std::vector<double>{23, 29, 35, 53, 67, 81}));
  // dB = A^T G = [1 4; 2 5; 3 6] [1 2; 3 4]
  EXPECT_EQ(vec(b.grad()), (std::vector<double>{13, 18, 17, 24, 21, 30}));
}

TEST(OpsMatmul, EdgeShapesAndErrors) {
  // Inner dimension 0: the product is all zeros.
  EXPECT_EQ(vec(matmul(zeros({2, 0}, DType::Float64), zeros({0, 3}, DType::Float64))),
            std::vector<double>(6, 0.0));
  EXPECT_EQ(matmul(zeros({0, 3}), zeros({3, 2})).shape(), (Shape{0, 2}));
  EXPECT_EQ(vec(matmul(from_vector({1, 2}, {1, 2}, DType::Int32),
                       from_vector({3, 4}, {2, 1}, DType::Int32))),
            (std::vector<double>{11}));
  EXPECT_THROW(matmul(zeros({2, 3}), zeros({2, 3})), InvalidArgument);
  EXPECT_THROW(matmul(zeros({3}), zeros({3, 1})), InvalidArgument);
  EXPECT_THROW(matmul(zeros({2, 3}), zeros({3, 1}, DType::Float64)), InvalidArgument);
}

TEST(OpsMatmul, Gradcheck) {
  EXPECT_LT(gradcheck_max_error([](const auto& x) { return matmul(x[0], x[1]); },
                                {randn({3, 4}, 13), randn({4, 2}, 14)}),
            kGradTol);
}

TEST(OpsTranspose, ValuesAndGradients) {
  Tensor x = leaf({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor t = transpose(x);
  EXPECT_EQ(t.shape(), (Shape{3, 2}));
  EXPECT_EQ(vec(t), (std::vector<double>{1, 4, 2, 5, 3, 6}));
  EXPECT_NE(t.data_ptr(), x.data_ptr());  // a copy
  backward({t}, {f64({1, 2, 3, 4, 5, 6}, {3, 2})});
  EXPECT_EQ(x.grad().shape(), (Shape{2, 3}));
  EXPECT_EQ(vec(x.grad()), (std::vector<double>{1, 3, 5, 2, 4, 6}));
  EXPECT_THROW(transpose(zeros({3})), InvalidArgument);
  EXPECT_THROW(transpose(zeros({2, 2, 2})), InvalidArgument);
}

TEST(OpsTranspose, Gradcheck) {
  EXPECT_LT(gradcheck_max_error([](const auto& x) { return transpose(x[0]); }, {randn({2, 5}, 15)}),
            kGradTol);
}

// ---------------------------------------------------------------- cat, narrow

TEST(OpsCat, ValuesAndGradientsWithAZeroRowPiece) {
  Tensor a = leaf({1, 2, 3, 4}, {2, 2});
  Tensor e = leaf({}, {0, 2});
  Tensor b = leaf({5, 6}, {1, 2});
  Tensor y = cat({a, e, b});
  EXPECT_EQ(y.shape(), (Shape{3, 2}));
  EXPECT_EQ(vec(y), (std::vector<double>{1, 2, 3, 4, 5, 6}));
  backward({y}, {f64({10, 20, 30, 40, 50, 60}, {3, 2})});
  EXPECT_EQ(vec(a.grad()), (std::vector<double>{10, 20, 30, 40}));
  ASSERT_TRUE(e.grad().defined());
  EXPECT_EQ(e.grad().shape(), (Shape{0, 2}));
  EXPECT_EQ(vec(b.grad()), (std::vector<double>{50, 60}));
}

TEST(OpsCat, MixedRequiresGradAndOneDimensional) {
  Tensor a = leaf({1, 2}, {2});
  Tensor c = f64({3}, {1});  // a constant
  Tensor y = cat({c, a, c});
  EXPECT_EQ(vec(y), (std::vector<double>{3, 1, 2, 3}));
  backward({dot(y, f64({1, 2, 3, 4}, {4}))});
  EXPECT_EQ(vec(a.grad()), (std::vector<double>{2, 3}));
  EXPECT_EQ(vec(cat({a})), (std::vector<double>{1, 2}));
}

TEST(OpsCat, AllPiecesEmpty) {
  Tensor y = cat({zeros({0, 3}), zeros({0, 3})});
  EXPECT_EQ(y.shape(), (Shape{0, 3}));
}

TEST(OpsCat, Errors) {
  EXPECT_THROW(cat({}), InvalidArgument);
  EXPECT_THROW(cat({zeros({2, 3}), zeros({2, 4})}), InvalidArgument);  // trailing dims
  EXPECT_THROW(cat({zeros({2, 3}), zeros({2, 3, 1})}), InvalidArgument);
  EXPECT_THROW(cat({zeros({2}), zeros({2}, DType::Float64)}), InvalidArgument);  // dtype
  EXPECT_THROW(cat({zeros({}), zeros({})}), InvalidArgument);                    // 0-d
  EXPECT_THROW(cat({zeros({2}), zeros({})}), InvalidArgument);
}

TEST(OpsCat, Gradcheck) {
  EXPECT_LT(gradcheck_max_error(
                [](const auto& x) {
                  return cat({x[0], x[1], x[2], x[3]});
                },
                {randn({2, 3}, 16), randn({0, 3}, 17), randn({1, 3}, 18), randn({0, 3}, 19)}),
            kGradTol);
}

TEST(OpsNarrow, ZeroCopyValuesAndGradients) {
  Tensor x = leaf({0, 1, 2, 3, 4, 5, 6, 7}, {4, 2});
  Tensor y = narrow(x, 1, 2);
  EXPECT_EQ(y.shape(), (Shape{2, 2}));
  EXPECT_EQ(vec(y), (std::vector<double>{2, 3, 4, 5}));
  EXPECT_EQ(static_cast<const char*>(y.data_ptr()) - static_cast<const char*>(x.data_ptr()),
            1 * 2 * 8);
  EXPECT_EQ(y.grad_fn()->name(), "NarrowBackward");
  backward({y}, {f64({1, 2, 3, 4}, {2, 2})});
  EXPECT_EQ(vec(x.grad()), (std::vector<double>{0, 0, 1, 2, 3, 4, 0, 0}));
}

TEST(OpsNarrow, EmptyRangeAndErrors) {
  Tensor x = leaf({0, 1, 2, 3}, {4});
  Tensor y = narrow(x, 4, 0);
  EXPECT_EQ(y.numel(), 0);
  EXPECT_THROW(narrow(x, 3, 2), InvalidArgument);
  EXPECT_THROW(narrow(x, -1, 1), InvalidArgument);
  EXPECT_THROW(narrow(zeros({}), 0, 1), InvalidArgument);
  EXPECT_THROW(narrow(Tensor(), 0, 0), InvalidArgument);
}

TEST(OpsNarrow, Gradcheck) {
  EXPECT_LT(
      gradcheck_max_error([](const auto& x) { return narrow(x[0], 2, 3); }, {randn({6, 2}, 20)}),
      kGradTol);
}

// ---------------------------------------------------------------- reshape, clone

TEST(OpsReshape, SharesDataAndReshapesTheGradientBack) {
  Tensor x = leaf({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor y = reshape(x, {3, 2});
  EXPECT_EQ(y.shape(), (Shape{3, 2}));
  EXPECT_EQ(y.data_ptr(), x.data_ptr());
  EXPECT_EQ(vec(y), vec(x));
  backward({y}, {f64({6, 5, 4, 3, 2, 1}, {3, 2})});
  EXPECT_EQ(x.grad().shape(), (Shape{2, 3}));
  EXPECT_EQ(vec(x.grad()), (std::vector<double>{6, 5, 4, 3, 2, 1}));
  EXPECT_THROW(reshape(x, {4}), InvalidArgument);
  EXPECT_THROW(reshape(x, {-1, -6}), InvalidArgument);
  EXPECT_THROW(reshape(Tensor(), {1}), InvalidArgument);
}

TEST(OpsReshape, Gradcheck) {
  EXPECT_LT(gradcheck_max_error(
                [](const auto& x) {
                  return reshape(x[0], {2, 2, 3});
                },
                {randn({4, 3}, 21)}),
            kGradTol);
}

TEST(OpsClone, DeepCopyAndIdentityGradient) {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor y = clone(x);
  EXPECT_NE(y.data_ptr(), x.data_ptr());
  EXPECT_EQ(vec(y), (std::vector<double>{1, 2, 3}));
  y.detach().fill_(0);
  EXPECT_EQ(vec(x), (std::vector<double>{1, 2, 3}));
  backward({y}, {f64({4, 5, 6}, {3})});
  EXPECT_EQ(vec(x.grad()), (std::vector<double>{4, 5, 6}));
}

TEST(OpsClone, Gradcheck) {
  EXPECT_LT(gradcheck_max_error([](const auto& x) { return clone(x[0]); }, {randn({2, 2}, 22)}),
            kGradTol);
}

// ---------------------------------------------------------------- compositions

TEST(OpsComposite, ChainRuleClosedForm) {
  // y = sum(a*a / b): dy/da = 2a/b, dy/db = -a^2/b^2.
  Tensor a = leaf({1, 2, -3}, {3});
  Tensor b = leaf({2, 4, 0.5}, {3});
  backward({sum(div(mul(a, a), b))});
  EXPECT_EQ(vec(a.grad()), (std::vector<double>{1, 1, -12}));
  EXPECT_EQ(vec(b.grad()), (std::vector<double>{-0.25, -0.25, -36}));
}

TEST(OpsComposite, Gradcheck) {
  const Fn f = [](const std::vector<Tensor>& x) {
    // A small layer: rows of x through W, a few rows selected and concatenated
    // with a reshaped copy, weighted and reduced.
    Tensor h = matmul(x[0], x[1]);                              // [4, 3]
    Tensor top = narrow(h, 0, 2);                               // [2, 3]
    Tensor rest = reshape(transpose(narrow(h, 2, 2)), {2, 3});  // [2, 3]
    Tensor both = cat({top, clone(rest)});                      // [4, 3]
    Tensor w = div(mul(both, both), x[2]);
    return add(scale(sum(sub(w, both)), 0.5), dot(both, x[3]));
  };
  EXPECT_LT(gradcheck_max_error(f, {randn({4, 5}, 23), randn({5, 3}, 24),
                                    randu({4, 3}, 25, 1.0, 2.0), randn({4, 3}, 26)}),
            kGradTol);
}

// ---------------------------------------------------------------- elementwise errors

TEST(OpsErrors, ElementwiseOperandsMustAgree) {
  const Tensor a = zeros({2, 3});
  for (const auto& op : {add, sub, mul, div}) {
    EXPECT_THROW(op(a, zeros({3, 2})), InvalidArgument);                  // shape
    EXPECT_THROW(op(a, zeros({6})), InvalidArgument);                     // no broadcasting
    EXPECT_THROW(op(a, zeros({2, 3}, DType::Float64)), InvalidArgument);  // dtype
    EXPECT_THROW(op(a, Tensor()), InvalidArgument);
  }
}

// ---------------------------------------------------------------- non-differentiable

TEST(OpsNonDiff, MasksAndExtrema) {
  Tensor a = leaf({1, 5, 3, -2}, {4});
  Tensor b = f64({1, 2, 3, 4}, {4});
  Tensor m = eq_mask(a, b);
  EXPECT_EQ(vec(m), (std::vector<double>{1, 0, 1, 0}));
  EXPECT_EQ(m.dtype(), DType::Float64);
  EXPECT_FALSE(m.requires_grad());
  EXPECT_EQ(vec(maximum(a, b)), (std::vector<double>{1, 5, 3, 4}));
  EXPECT_EQ(vec(minimum(a, b)), (std::vector<double>{1, 2, 3, -2}));
  EXPECT_FALSE(maximum(a, b).requires_grad());
  Tensor i = from_vector({7, -1}, {2}, DType::Int32);
  Tensor j = from_vector({7, 3}, {2}, DType::Int32);
  EXPECT_EQ(vec(eq_mask(i, j)), (std::vector<double>{1, 0}));
  EXPECT_EQ(eq_mask(i, j).dtype(), DType::Int32);
  EXPECT_EQ(vec(maximum(i, j)), (std::vector<double>{7, 3}));
  EXPECT_THROW(eq_mask(a, zeros({4})), InvalidArgument);
}

TEST(OpsNonDiff, ToDType) {
  Tensor x = f64({1.75, -2.5, 257, 0.1}, {2, 2});
  Tensor i = to_dtype(x, DType::Int32);
  EXPECT_EQ(i.dtype(), DType::Int32);
  EXPECT_EQ(i.shape(), (Shape{2, 2}));
  EXPECT_EQ(vec(i), (std::vector<double>{1, -2, 257, 0}));  // toward zero
  // bfloat16: 257 -> 256 (tie, even), 0.1 -> 0x3DCD = 0.10009765625.
  EXPECT_EQ(vec(to_dtype(x, DType::BFloat16)),
            (std::vector<double>{1.75, -2.5, 256, 0.10009765625}));
  Tensor back = to_dtype(to_dtype(x, DType::Float32), DType::Float64);
  EXPECT_EQ(vec(back)[3], static_cast<double>(0.1f));
}

TEST(OpsNonDiff, MaxAbsDiff) {
  EXPECT_EQ(max_abs_diff(f64({1, 2, 3}, {3}), f64({1, -2, 3.5}, {3})), 4.0);
  EXPECT_EQ(max_abs_diff(f64({1, 2}, {2}), from_vector({1, 2}, {1, 2}, DType::Int64)), 0.0);
  EXPECT_EQ(max_abs_diff(zeros({0}), zeros({0})), 0.0);
  EXPECT_THROW(max_abs_diff(zeros({2}), zeros({3})), InvalidArgument);
}

// ---------------------------------------------------------------- integer dtypes

TEST(OpsIntegers, ElementwiseAndReductions) {
  Tensor a = from_vector({1, 2, 3}, {3}, DType::Int64);
  Tensor b = from_vector({4, 5, 6}, {3}, DType::Int64);
  EXPECT_EQ(vec(add(a, b)), (std::vector<double>{5, 7, 9}));
  EXPECT_EQ(vec(sub(a, b)), (std::vector<double>{-3, -3, -3}));
  EXPECT_EQ(vec(mul(a, b)), (std::vector<double>{4, 10, 18}));
  EXPECT_EQ(vec(div(b, a)), (std::vector<double>{4, 2, 2}));  // integer division
  EXPECT_EQ(vec(scale(a, 3.0)), (std::vector<double>{3, 6, 9}));
  EXPECT_EQ(dot(a, b).item(), 32.0);
  EXPECT_EQ(add(a, b).dtype(), DType::Int64);
  Tensor u = from_vector({200, 7}, {2}, DType::UInt8);
  EXPECT_EQ(vec(sub(u, from_vector({100, 7}, {2}, DType::UInt8))), (std::vector<double>{100, 0}));
}

// ---------------------------------------------------------------- 16-bit floats

TEST(OpsReducedPrecision, BFloat16AddRoundsTheFloat32Sum) {
  // Hand-worked: bfloat16 keeps 7 mantissa bits, ties to even.
  //  1 + 2^-8            = tie between 1 (even) and 1 + 2^-7        -> 1
  //  (1 + 2^-7) + 2^-8   = tie between 1 + 2^-7 (odd) and 1 + 2^-6 -> 1.015625
  //  256 + 1             = tie between 256 (even) and 258          -> 256
  //  1 - 2^-8            = 0.99609375, representable                -> itself
  Tensor a = from_vector({1, 1.0078125, 256, 1}, {4}, DType::BFloat16);
  Tensor b = from_vector({0.00390625, 0.00390625, 1, -0.00390625}, {4}, DType::BFloat16);
  Tensor y = add(a, b);
  EXPECT_EQ(y.dtype(), DType::BFloat16);
  EXPECT_EQ(vec(y), (std::vector<double>{1, 1.015625, 256, 0.99609375}));
  // 1 - 2^-9 = tie between 1 - 2^-8 (odd) and 1 (even) -> 1.
  EXPECT_EQ(vec(sub(from_vector({1}, {1}, DType::BFloat16),
                    from_vector({0.001953125}, {1}, DType::BFloat16))),
            (std::vector<double>{1}));
}

TEST(OpsReducedPrecision, BFloat16MulDivScale) {
  //  (1 + 2^-4)^2        = 1 + 2^-3 + 2^-8: tie, 1 + 2^-3 is even   -> 1.125
  //  (1 + 2^-7) * 1.5    = 1.51171875: tie, 1.5078125 is odd        -> 1.515625
  //  (1 + 2^-7)^2        = 1 + 2^-6 + 2^-14: below the tie          -> 1.015625
  Tensor a = from_vector({1.0625, 1.0078125, 1.0078125}, {3}, DType::BFloat16);
  Tensor b = from_vector({1.0625, 1.5, 1.0078125}, {3}, DType::BFloat16);
  EXPECT_EQ(vec(mul(a, b)), (std::vector<double>{1.125, 1.515625, 1.015625}));
  // 1/3 in float32 is 0x3EAAAAAB; rounded to bfloat16 0x3EAB = 171/512.
  EXPECT_EQ(
      div(from_vector({1}, {1}, DType::BFloat16), from_vector({3}, {1}, DType::BFloat16)).item(),
      171.0 / 512.0);
  EXPECT_EQ(scale(from_vector({1.0078125}, {1}, DType::BFloat16), 1.5).item(), 1.515625);
}

TEST(OpsReducedPrecision, Float16AddRoundsTheFloat32Sum) {
  //  1 + 2^-11           = tie between 1 (even) and 1 + 2^-10       -> 1
  //  (1 + 2^-10) + 2^-11 = tie, 1 + 2^-10 odd                       -> 1 + 2^-9
  //  2048 + 1            = tie between 2048 (even) and 2050         -> 2048
  //  2050 + 1            = tie between 2050 (odd) and 2052          -> 2052
  //  60000 + 10000       = 70000 > 65520                            -> inf
  Tensor a = from_vector({1, 1.0009765625, 2048, 2050, 60000}, {5}, DType::Float16);
  Tensor b = from_vector({0.00048828125, 0.00048828125, 1, 1, 10000}, {5}, DType::Float16);
  const std::vector<double> y = vec(add(a, b));
  EXPECT_EQ(y[0], 1.0);
  EXPECT_EQ(y[1], 1.001953125);
  EXPECT_EQ(y[2], 2048.0);
  EXPECT_EQ(y[3], 2052.0);
  EXPECT_EQ(y[4], std::numeric_limits<double>::infinity());
}

TEST(OpsReducedPrecision, MatchesAReferenceRoundingOfFloat32Results) {
  // Random 16-bit operands; the expected value rounds the float32 result with
  // an independent ties-to-even rounding in double.
  Generator g(42);
  const int n = 4096;
  for (DType d : {DType::BFloat16, DType::Float16}) {
    SCOPED_TRACE(dtype_name(d));
    auto ref = d == DType::BFloat16 ? ref_bf16 : ref_f16;
    Tensor a = rand_uniform({n}, g, -100.0, 100.0, d);
    Tensor b = rand_uniform({n}, g, 0.5, 50.0, d);
    const auto va = vec(a), vb = vec(b);
    const auto add_y = vec(add(a, b)), sub_y = vec(sub(a, b)), mul_y = vec(mul(a, b)),
               div_y = vec(div(a, b)), scale_y = vec(scale(a, 0.3));
    for (int i = 0; i < n; ++i) {
      const auto fa = static_cast<float>(va[i]), fb = static_cast<float>(vb[i]);
      ASSERT_EQ(add_y[i], ref(fa + fb)) << fa << " + " << fb;
      ASSERT_EQ(sub_y[i], ref(fa - fb)) << fa << " - " << fb;
      ASSERT_EQ(mul_y[i], ref(fa * fb)) << fa << " * " << fb;
      ASSERT_EQ(div_y[i], ref(fa / fb)) << fa << " / " << fb;
      ASSERT_EQ(scale_y[i], ref(0.3f * fa)) << "0.3 * " << fa;
    }
  }
}

TEST(OpsReducedPrecision, ReductionsAccumulateInFloat64) {
  // 1 + 4 * 2^-9 = 1 + 2^-7 exactly; adding in bfloat16 would stay at 1.
  Tensor x =
      from_vector({1, 0.001953125, 0.001953125, 0.001953125, 0.001953125}, {5}, DType::BFloat16);
  EXPECT_EQ(sum(x).dtype(), DType::BFloat16);
  EXPECT_EQ(sum(x).item(), 1.0078125);
  EXPECT_EQ(dot(x, ones({5}, DType::BFloat16)).item(), 1.0078125);
  EXPECT_EQ(matmul(x.view_as_shape({1, 5}), ones({5, 1}, DType::BFloat16)).item(), 1.0078125);
  // float32: 1e8 + 1 is 1e8 in float32 (ulp 8); in float64 the 16 ones survive.
  std::vector<double> v = {1e8};
  for (int i = 0; i < 16; ++i) v.push_back(1.0);
  v.push_back(-1e8);
  EXPECT_EQ(sum(from_vector(v, {18}, DType::Float32)).item(), 16.0);
  // float16: 60000 + 60000 would overflow on the way; the total 60000 does not.
  EXPECT_EQ(sum(from_vector({60000, 60000, -60000}, {3}, DType::Float16)).item(), 60000.0);
}

TEST(OpsReducedPrecision, BackwardInBFloat16) {
  Tensor x = from_vector({1, 2, 3}, {3}, DType::BFloat16);
  x.set_requires_grad(true);
  Tensor w = from_vector({0.5, -1, 4}, {3}, DType::BFloat16);
  backward({sum(mul(x, w))});
  EXPECT_EQ(x.grad().dtype(), DType::BFloat16);
  EXPECT_EQ(vec(x.grad()), (std::vector<double>{0.5, -1, 4}));
}

// ---------------------------------------------------------------- CUDA
// The ops the autograd engine needs run on CUDA tensors (add, sub, scale,
// fill, copy, cat, narrow, reshape, clone). Skipped without a CUDA device.

TEST(OpsCuda, EngineOpsOnCudaTensors) {
  if (!detail::cuda_available()) GTEST_SKIP() << "no CUDA device";
  const Device dev = Device::cuda(0);
  for (DType d : {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16}) {
    SCOPED_TRACE(dtype_name(d));
    Tensor a = from_vector({1, 2, 3, 4}, {2, 2}, d).to(dev);
    Tensor b = from_vector({0.5, -1, 2, 8}, {2, 2}, d).to(dev);
    ASSERT_EQ(a.device(), dev);
    EXPECT_EQ(add(a, b).device(), dev);
    EXPECT_EQ(vec(add(a, b)), (std::vector<double>{1.5, 1, 5, 12}));
    EXPECT_EQ(vec(sub(a, b)), (std::vector<double>{0.5, 3, 1, -4}));
    EXPECT_EQ(vec(scale(a, -2.0)), (std::vector<double>{-2, -4, -6, -8}));
    EXPECT_EQ(vec(cat({a, b})), (std::vector<double>{1, 2, 3, 4, 0.5, -1, 2, 8}));
    EXPECT_EQ(vec(narrow(a, 1, 1)), (std::vector<double>{3, 4}));
    EXPECT_EQ(reshape(a, {4}).data_ptr(), a.data_ptr());
    Tensor c = clone(a);
    EXPECT_NE(c.data_ptr(), a.data_ptr());
    EXPECT_EQ(vec(c), (std::vector<double>{1, 2, 3, 4}));
    EXPECT_EQ(vec(full({3}, 2.5, d, dev)), std::vector<double>(3, 2.5));
    EXPECT_THROW(mul(a, b), InvalidArgument);  // CPU-only op: a clear error
  }
}

TEST(OpsCuda, BackwardOnCuda) {
  if (!detail::cuda_available()) GTEST_SKIP() << "no CUDA device";
  const Device dev = Device::cuda(0);
  for (DType d : {DType::Float32, DType::Float64, DType::BFloat16}) {
    SCOPED_TRACE(dtype_name(d));
    Tensor x = from_vector({1, 2, 3}, {3}, d).to(dev);
    x.set_requires_grad(true);
    // y = [2x, x[0]]: dy/dx against ones = [2 + 1, 2, 2].
    Tensor y = cat({scale(x, 2.0), narrow(x, 0, 1)});
    backward({y}, {ones({4}, d, dev)}, /*retain_graph=*/true);
    ASSERT_TRUE(x.grad().defined());
    EXPECT_EQ(x.grad().device(), dev);
    EXPECT_EQ(vec(x.grad()), (std::vector<double>{3, 2, 2}));
    backward({y}, {ones({4}, d, dev)});  // accumulates on the device
    EXPECT_EQ(vec(x.grad()), (std::vector<double>{6, 4, 4}));
  }
}

}  // namespace
}  // namespace diffcomm
