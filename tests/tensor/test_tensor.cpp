// Tensor handles, factories, zero-copy views, borrowed memory and the seeded
// generator. Expected values are closed forms written in the tests.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"
#include "tensor/cuda/device_ops.hpp"

namespace diffcomm {
namespace {

const std::vector<DType> kAllDTypes = {DType::Float32, DType::Float64, DType::BFloat16,
                                       DType::Float16, DType::Int32,   DType::Int64,
                                       DType::UInt8};

std::ptrdiff_t byte_distance(const Tensor& from, const Tensor& to) {
  return static_cast<const char*>(to.data_ptr()) - static_cast<const char*>(from.data_ptr());
}

// ---------------------------------------------------------------- device, shapes

TEST(Device, StrAndEquality) {
  EXPECT_EQ(Device::cpu().str(), "cpu");
  EXPECT_EQ(Device::cuda(3).str(), "cuda:3");
  EXPECT_TRUE(Device::cpu().is_cpu());
  EXPECT_FALSE(Device::cpu().is_cuda());
  EXPECT_TRUE(Device::cuda(0).is_cuda());
  EXPECT_EQ(Device::cuda(1), Device::cuda(1));
  EXPECT_NE(Device::cuda(1), Device::cuda(2));
  EXPECT_NE(Device::cpu(), Device::cuda(0));
}

TEST(Shape, NumelAndStr) {
  EXPECT_EQ(shape_numel({}), 1);
  EXPECT_EQ(shape_numel({5}), 5);
  EXPECT_EQ(shape_numel({2, 3, 4}), 24);
  EXPECT_EQ(shape_numel({2, 0, 4}), 0);
  EXPECT_EQ(shape_str({}), "[]");
  EXPECT_EQ(shape_str({3, 4}), "[3, 4]");
}

// ---------------------------------------------------------------- handles

TEST(Tensor, DefaultIsUndefined) {
  Tensor t;
  EXPECT_FALSE(t.defined());
  EXPECT_EQ(t.str(), "undefined");
  EXPECT_THROW(t.shape(), InvalidArgument);
  EXPECT_THROW(t.dtype(), InvalidArgument);
  EXPECT_THROW(t.data_ptr(), InvalidArgument);
}

TEST(Tensor, Metadata) {
  Tensor t = empty({2, 3, 4}, DType::Float64);
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.dtype(), DType::Float64);
  EXPECT_EQ(t.shape(), (Shape{2, 3, 4}));
  EXPECT_EQ(t.dim(), 3);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 24u * 8u);
  EXPECT_EQ(t.row_numel(), 12);
  EXPECT_EQ(t.size(0), 2);
  EXPECT_EQ(t.size(2), 4);
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_EQ(t.size(-3), 2);
  EXPECT_THROW(t.size(3), InvalidArgument);
  EXPECT_THROW(t.size(-4), InvalidArgument);
  try {
    t.size(-5);
    ADD_FAILURE() << "size(-5) did not throw";
  } catch (const InvalidArgument& e) {
    // The message names the dim the caller passed, not an adjusted one.
    EXPECT_NE(std::string(e.what()).find("dim -5 "), std::string::npos) << e.what();
  }
  EXPECT_TRUE(t.device().is_cpu());
  EXPECT_EQ(t.str(), "float64[2, 3, 4] on cpu");
  EXPECT_TRUE(t.is_leaf());
  EXPECT_FALSE(t.requires_grad());
  EXPECT_FALSE(t.grad().defined());
}

TEST(Tensor, ZeroDimAndEmptyShapes) {
  Tensor s = empty({}, DType::Float32);
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(s.row_numel(), 1);
  EXPECT_EQ(s.nbytes(), 4u);
  Tensor v = empty({7}, DType::Int32);
  EXPECT_EQ(v.row_numel(), 1);
  Tensor z = empty({0, 5}, DType::Float32);
  EXPECT_EQ(z.numel(), 0);
  EXPECT_EQ(z.nbytes(), 0u);
  EXPECT_EQ(z.row_numel(), 5);
  EXPECT_NE(z.data_ptr(), nullptr);
  EXPECT_TRUE(z.to_vector().empty());
}

TEST(Tensor, NegativeDimsRejected) {
  EXPECT_THROW(empty({2, -1}), InvalidArgument);
  EXPECT_THROW(zeros({-3}), InvalidArgument);
  EXPECT_THROW(full({-1}, 1.0), InvalidArgument);
}

TEST(Tensor, EveryDTypeHasItsElementSize) {
  for (DType d : kAllDTypes) {
    Tensor t = empty({3, 5}, d);
    EXPECT_EQ(t.dtype(), d);
    EXPECT_EQ(t.nbytes(), 15u * element_size(d)) << dtype_name(d);
  }
}

TEST(Tensor, TypedDataChecksDType) {
  Tensor t = zeros({4}, DType::Float32);
  EXPECT_EQ(t.data<float>(), t.data_ptr());
  EXPECT_THROW(t.data<double>(), InvalidArgument);
  EXPECT_THROW(t.data<int32_t>(), InvalidArgument);
  Tensor b = zeros({4}, DType::BFloat16);
  EXPECT_NO_THROW(b.data<bfloat16>());
  EXPECT_THROW(b.data<float16>(), InvalidArgument);
}

TEST(Tensor, CopyingTheHandleSharesData) {
  Tensor a = zeros({3}, DType::Float64);
  Tensor b = a;  // NOLINT: the copy is the point
  EXPECT_TRUE(a.same(b));
  b.data<double>()[1] = 5.0;
  EXPECT_EQ(a.to_vector(), (std::vector<double>{0.0, 5.0, 0.0}));
}

// ---------------------------------------------------------------- factories

TEST(Factories, ZerosOnesFullForEveryDType) {
  for (DType d : kAllDTypes) {
    SCOPED_TRACE(dtype_name(d));
    EXPECT_EQ(zeros({2, 3}, d).to_vector(), std::vector<double>(6, 0.0));
    EXPECT_EQ(ones({2, 3}, d).to_vector(), std::vector<double>(6, 1.0));
    EXPECT_EQ(full({5}, 3.0, d).to_vector(), std::vector<double>(5, 3.0));
    EXPECT_EQ(full({}, 7.0, d).item(), 7.0);
    EXPECT_EQ(zeros({0, 3}, d).numel(), 0);
  }
  EXPECT_EQ(full({2}, -1.5, DType::Float32).to_vector(), (std::vector<double>{-1.5, -1.5}));
  EXPECT_EQ(full({2}, -1.5, DType::Float16).to_vector(), (std::vector<double>{-1.5, -1.5}));
  // 0.1 is not representable: the stored value is the nearest of each dtype.
  EXPECT_EQ(full({1}, 0.1, DType::Float32).item(), static_cast<double>(0.1f));
  EXPECT_EQ(full({1}, 0.1, DType::Float64).item(), 0.1);
  // bfloat16 nearest to 0.1: 0x3DCD = 2^-4 * (1 + 77/128) = 0.10009765625.
  EXPECT_EQ(full({1}, 0.1, DType::BFloat16).item(), 0.10009765625);
  // float16 nearest to 0.1: 0x2E66 = 2^-4 * (1 + 614/1024) = 0.0999755859375.
  EXPECT_EQ(full({1}, 0.1, DType::Float16).item(), 0.0999755859375);
}

TEST(Factories, LikeFactories) {
  Tensor a = ones({2, 2}, DType::Int64);
  Tensor z = zeros_like(a);
  EXPECT_EQ(z.shape(), a.shape());
  EXPECT_EQ(z.dtype(), DType::Int64);
  EXPECT_EQ(z.to_vector(), std::vector<double>(4, 0.0));
  EXPECT_FALSE(z.same(a));
  Tensor e = empty_like(a);
  EXPECT_EQ(e.shape(), a.shape());
  EXPECT_EQ(e.dtype(), a.dtype());
  EXPECT_NE(e.data_ptr(), a.data_ptr());
}

TEST(Factories, Arange) {
  EXPECT_EQ(arange(0, 5).to_vector(), (std::vector<double>{0, 1, 2, 3, 4}));
  EXPECT_EQ(arange(0, 5).dtype(), DType::Float32);
  EXPECT_EQ(arange(0, 5).shape(), (Shape{5}));
  EXPECT_EQ(arange(1, 2, 0.25, DType::Float64).to_vector(),
            (std::vector<double>{1.0, 1.25, 1.5, 1.75}));
  // ceil((10 - 0) / 3) = 4 elements.
  EXPECT_EQ(arange(0, 10, 3, DType::Int32).to_vector(), (std::vector<double>{0, 3, 6, 9}));
  EXPECT_EQ(arange(5, 0, -2, DType::Int64).to_vector(), (std::vector<double>{5, 3, 1}));
  EXPECT_EQ(arange(3, 3).numel(), 0);
  EXPECT_EQ(arange(3, 1).numel(), 0);  // empty, not negative
  EXPECT_EQ(arange(0, 4, 1, DType::UInt8).to_vector(), (std::vector<double>{0, 1, 2, 3}));
  EXPECT_THROW(arange(0, 1, 0), InvalidArgument);
}

TEST(Factories, FromVector) {
  Tensor t = from_vector({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(t.dtype(), DType::Float64);  // the default
  EXPECT_EQ(t.shape(), (Shape{2, 3}));
  const double* p = t.data<double>();
  for (int i = 0; i < 6; ++i) EXPECT_EQ(p[i], i + 1.0);  // row-major
  EXPECT_EQ(from_vector({42}, {}).item(), 42.0);
  EXPECT_EQ(from_vector({}, {0, 3}).numel(), 0);
  EXPECT_THROW(from_vector({1, 2, 3}, {2, 2}), InvalidArgument);
  EXPECT_THROW(from_vector({1, 2, 3, 4}, {3}), InvalidArgument);
}

TEST(Factories, FromVectorConvertsToEveryDType) {
  const std::vector<double> v = {0, 1, 2, 100, 255};  // exact in every dtype
  for (DType d : kAllDTypes) {
    SCOPED_TRACE(dtype_name(d));
    Tensor t = from_vector(v, {5}, d);
    EXPECT_EQ(t.dtype(), d);
    EXPECT_EQ(t.to_vector(), v);
  }
  // Integer conversion truncates toward zero; 16-bit floats round to nearest even.
  EXPECT_EQ(from_vector({2.9, -2.9}, {2}, DType::Int32).to_vector(), (std::vector<double>{2, -2}));
  EXPECT_EQ(from_vector({1.00390625}, {1}, DType::BFloat16).item(), 1.0);  // 1 + 2^-8: tie
  EXPECT_EQ(from_vector({257.0}, {1}, DType::BFloat16).item(), 256.0);     // 8-bit mantissa
  EXPECT_EQ(from_vector({2049.0}, {1}, DType::Float16).item(), 2048.0);    // 11-bit mantissa
  EXPECT_EQ(from_vector({2051.0}, {1}, DType::Float16).item(), 2052.0);    // tie, up to even
  EXPECT_EQ(from_vector({7e4}, {1}, DType::Float16).item(),
            std::numeric_limits<double>::infinity());
}

TEST(Tensor, ItemNeedsOneElement) {
  EXPECT_EQ(from_vector({3.5}, {1, 1}).item(), 3.5);
  EXPECT_THROW(zeros({2}).item(), InvalidArgument);
  EXPECT_THROW(zeros({0}).item(), InvalidArgument);
}

TEST(Tensor, FillAndCopy) {
  Tensor t = zeros({2, 2}, DType::Int32);
  Tensor& r = t.fill_(9);
  EXPECT_EQ(&r, &t);
  EXPECT_EQ(t.to_vector(), std::vector<double>(4, 9.0));

  Tensor src = from_vector({1, 2, 3, 4}, {4}, DType::Int32);
  t.copy_(src);  // same numel, other shape
  EXPECT_EQ(t.to_vector(), (std::vector<double>{1, 2, 3, 4}));
  EXPECT_EQ(t.shape(), (Shape{2, 2}));
  EXPECT_THROW(t.copy_(from_vector({1, 2, 3, 4}, {4}, DType::Int64)), InvalidArgument);
  EXPECT_THROW(t.copy_(from_vector({1, 2, 3}, {3}, DType::Int32)), InvalidArgument);
}

TEST(Tensor, CopyDataIsDeep) {
  Tensor a = from_vector({1, 2, 3}, {3});
  Tensor b = a.copy_data();
  EXPECT_NE(a.data_ptr(), b.data_ptr());
  EXPECT_EQ(b.to_vector(), a.to_vector());
  b.fill_(0);
  EXPECT_EQ(a.to_vector(), (std::vector<double>{1, 2, 3}));
}

TEST(Tensor, DetachSharesDataButNotHistory) {
  Tensor a = from_vector({1, 2, 3}, {3});
  a.set_requires_grad(true);
  Tensor d = a.detach();
  EXPECT_FALSE(d.same(a));
  EXPECT_EQ(d.data_ptr(), a.data_ptr());
  EXPECT_FALSE(d.requires_grad());
  EXPECT_TRUE(d.is_leaf());
  d.data<double>()[0] = 10;
  EXPECT_EQ(a.to_vector()[0], 10.0);
}

TEST(Tensor, ToSameDeviceIsTheSameHandle) {
  Tensor a = zeros({2});
  EXPECT_TRUE(a.to(Device::cpu()).same(a));
}

TEST(Tensor, CudaWithoutCudaIsAClearError) {
  if (detail::cuda_available()) GTEST_SKIP() << "built with CUDA";
  EXPECT_THROW(empty({2}, DType::Float32, Device::cuda(0)), InvalidArgument);
  EXPECT_THROW(zeros({2}).to(Device::cuda(0)), InvalidArgument);
}

// ---------------------------------------------------------------- views

TEST(RowView, IsZeroCopyAndWritesThrough) {
  Tensor base = from_vector({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {4, 3}, DType::Float32);
  Tensor v = base.row_view(1, 2);
  EXPECT_EQ(v.shape(), (Shape{2, 3}));
  EXPECT_EQ(v.dtype(), DType::Float32);
  EXPECT_EQ(byte_distance(base, v), 1 * 3 * 4);
  EXPECT_EQ(v.impl()->storage, base.impl()->storage);
  EXPECT_EQ(v.to_vector(), (std::vector<double>{3, 4, 5, 6, 7, 8}));

  v.fill_(-1);  // write through the view
  EXPECT_EQ(base.to_vector(), (std::vector<double>{0, 1, 2, -1, -1, -1, -1, -1, -1, 9, 10, 11}));
  base.data<float>()[4] = 42;  // write through the base
  EXPECT_EQ(v.to_vector()[1], 42.0);
  v.copy_(from_vector({1, 1, 1, 2, 2, 2}, {2, 3}, DType::Float32));
  EXPECT_EQ(base.to_vector(), (std::vector<double>{0, 1, 2, 1, 1, 1, 2, 2, 2, 9, 10, 11}));
}

TEST(RowView, ViewsOfViewsComposeOffsets) {
  Tensor base = arange(0, 20, 1, DType::Int64).view_as_shape({10, 2});
  Tensor v1 = base.row_view(3, 6);  // rows 3..8
  Tensor v2 = v1.row_view(2, 3);    // rows 5..7 of base
  EXPECT_EQ(byte_distance(base, v2), 5 * 2 * 8);
  EXPECT_EQ(v2.to_vector(), (std::vector<double>{10, 11, 12, 13, 14, 15}));
  v2.fill_(0);
  EXPECT_EQ(base.row_view(5, 3).to_vector(), std::vector<double>(6, 0.0));
  EXPECT_EQ(base.row_view(4, 1).to_vector(), (std::vector<double>{8, 9}));
  EXPECT_EQ(base.row_view(8, 1).to_vector(), (std::vector<double>{16, 17}));
}

TEST(RowView, OneDimensionalAndEmptyViews) {
  Tensor base = arange(0, 6, 1, DType::Float64);
  EXPECT_EQ(base.row_view(2, 3).to_vector(), (std::vector<double>{2, 3, 4}));
  EXPECT_EQ(byte_distance(base, base.row_view(2, 3)), 2 * 8);
  EXPECT_EQ(base.row_view(6, 0).numel(), 0);  // empty view at the end
  EXPECT_EQ(base.row_view(0, 0).numel(), 0);
  EXPECT_EQ(base.row_view(0, 6).to_vector(), base.to_vector());
}

TEST(RowView, OutOfRangeIsRejected) {
  Tensor base = zeros({4, 3});
  EXPECT_THROW(base.row_view(-1, 1), InvalidArgument);
  EXPECT_THROW(base.row_view(0, -1), InvalidArgument);
  EXPECT_THROW(base.row_view(0, 5), InvalidArgument);
  EXPECT_THROW(base.row_view(3, 2), InvalidArgument);
  EXPECT_THROW(base.row_view(5, 0), InvalidArgument);
  EXPECT_THROW(zeros({}).row_view(0, 1), InvalidArgument);
  EXPECT_THROW(Tensor().row_view(0, 0), InvalidArgument);
}

TEST(ViewAsShape, SharesDataAndChecksNumel) {
  Tensor a = arange(0, 6, 1, DType::Float64);
  Tensor b = a.view_as_shape({2, 3});
  EXPECT_EQ(b.shape(), (Shape{2, 3}));
  EXPECT_EQ(b.data_ptr(), a.data_ptr());
  b.data<double>()[5] = -5;
  EXPECT_EQ(a.to_vector()[5], -5.0);
  EXPECT_THROW(a.view_as_shape({}), InvalidArgument);  // 1 element vs 6
  EXPECT_EQ(zeros({1, 1}).view_as_shape({}).dim(), 0);
  EXPECT_THROW(a.view_as_shape({4}), InvalidArgument);
  EXPECT_THROW(a.view_as_shape({-2, -3}), InvalidArgument);
  // A view of a row view keeps the row offset.
  Tensor r = a.view_as_shape({3, 2}).row_view(1, 2).view_as_shape({4});
  EXPECT_EQ(byte_distance(a, r), 2 * 8);
  EXPECT_EQ(r.to_vector(), (std::vector<double>{2, 3, 4, -5}));
}

// ---------------------------------------------------------------- borrowed memory

TEST(FromBlob, WrapsCallerMemoryWithoutCopying) {
  std::vector<float> buf = {1, 2, 3, 4, 5, 6};
  Tensor t = from_blob(buf.data(), {3, 2}, DType::Float32);
  EXPECT_EQ(t.data_ptr(), buf.data());
  EXPECT_EQ(t.to_vector(), (std::vector<double>{1, 2, 3, 4, 5, 6}));
  t.row_view(1, 1).fill_(0);
  EXPECT_EQ(buf, (std::vector<float>{1, 2, 0, 0, 5, 6}));
  buf[5] = 60;
  EXPECT_EQ(t.to_vector()[5], 60.0);
  EXPECT_THROW(from_blob(buf.data(), {-1}, DType::Float32), InvalidArgument);
}

TEST(FromBlob, DeleterRunsOnceWhenTheLastViewDies) {
  std::vector<double> buf = {1, 2, 3, 4};
  int calls = 0;
  void* seen = nullptr;
  {
    Tensor t = from_blob(buf.data(), {2, 2}, DType::Float64, Device::cpu(), [&](void* p) {
      ++calls;
      seen = p;
    });
    Tensor row = t.row_view(1, 1);
    Tensor flat = t.view_as_shape({4});
    Tensor det = t.detach();
    t = Tensor();  // the original handle goes first
    EXPECT_EQ(calls, 0);
    flat = Tensor();
    det = Tensor();
    EXPECT_EQ(calls, 0);
    EXPECT_EQ(row.to_vector(), (std::vector<double>{3, 4}));  // still valid
  }
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, buf.data());
}

TEST(FromBlob, EmptyDeleterIsAllowed) {
  float x = 2.5f;
  {
    Tensor t = from_blob(&x, {}, DType::Float32);
    EXPECT_EQ(t.item(), 2.5);
  }
  EXPECT_EQ(x, 2.5f);
}

// ---------------------------------------------------------------- generator

TEST(Generator, IsTheStandardMt19937_64) {
  // [rand.predef]: the 10000th invocation of a default-constructed
  // mt19937_64 (seed 5489) produces 9981545732273789042.
  Generator g(5489);
  uint64_t x = 0;
  for (int i = 0; i < 10000; ++i) x = g.next_u64();
  EXPECT_EQ(x, 9981545732273789042ull);
  EXPECT_EQ(g.seed(), 5489u);
}

TEST(Generator, UniformUsesTheTop53Bits) {
  Generator g(77);
  std::mt19937_64 ref(77);
  for (int i = 0; i < 1000; ++i) {
    const double u = g.uniform();
    EXPECT_EQ(u, std::ldexp(static_cast<double>(ref() >> 11), -53));
    EXPECT_GE(u, 0.0);
    EXPECT_LT(u, 1.0);
  }
}

TEST(Generator, SameSeedSameNumbersDifferentSeedsDiffer) {
  Generator a(123), b(123), c(124);
  int differ = 0;
  for (int i = 0; i < 100; ++i) {
    const double na = a.normal(), nb = b.normal(), nc = c.normal();
    EXPECT_EQ(na, nb);
    differ += na != nc;
  }
  EXPECT_GT(differ, 95);
  EXPECT_EQ(a.uniform(), b.uniform());
  EXPECT_EQ(a.next_u64(), b.next_u64());
}

TEST(Generator, MomentsOfManyDraws) {
  Generator g(2024);
  const int n = 200000;
  double su = 0, su2 = 0, sn = 0, sn2 = 0;
  double umin = 1, umax = 0;
  for (int i = 0; i < n; ++i) {
    const double u = g.uniform();
    su += u;
    su2 += u * u;
    umin = std::min(umin, u);
    umax = std::max(umax, u);
    const double z = g.normal();
    sn += z;
    sn2 += z * z;
  }
  const double mu = su / n, vu = su2 / n - mu * mu;
  const double mn = sn / n, vn = sn2 / n - mn * mn;
  // Standard errors: uniform mean sqrt(1/12/n) ~ 6.5e-4; normal mean 1/sqrt(n)
  // ~ 2.2e-3, normal variance sqrt(2/n) ~ 3.2e-3. Bounds are > 5 sigma.
  EXPECT_NEAR(mu, 0.5, 4e-3);
  EXPECT_NEAR(vu, 1.0 / 12.0, 3.5e-3);
  EXPECT_LT(umin, 1e-3);
  EXPECT_GT(umax, 1 - 1e-3);
  EXPECT_NEAR(mn, 0.0, 1.2e-2);
  EXPECT_NEAR(vn, 1.0, 1.7e-2);
}

// ---------------------------------------------------------------- random tensors

TEST(RandomTensors, SameSeedSameTensorDifferentSeedsDiffer) {
  Generator g1(7), g2(7), g3(8);
  Tensor a = rand_uniform({64}, g1, -1, 1, DType::Float64);
  Tensor b = rand_uniform({64}, g2, -1, 1, DType::Float64);
  Tensor c = rand_uniform({64}, g3, -1, 1, DType::Float64);
  EXPECT_EQ(a.to_vector(), b.to_vector());
  EXPECT_NE(a.to_vector(), c.to_vector());
  // The generator advances: the next draw differs from the first.
  Tensor a2 = rand_uniform({64}, g1, -1, 1, DType::Float64);
  EXPECT_NE(a.to_vector(), a2.to_vector());

  Generator n1(9), n2(9), n3(10);
  EXPECT_EQ(rand_normal({3, 5}, n1).to_vector(), rand_normal({3, 5}, n2).to_vector());
  EXPECT_NE(rand_normal({3, 5}, n2).to_vector(), rand_normal({3, 5}, n3).to_vector());
}

TEST(RandomTensors, UniformMatchesItsGenerator) {
  // low + (high - low) * u, element by element in row-major order.
  Generator g(31), ref(31);
  Tensor t = rand_uniform({4, 3}, g, 2.0, 5.0, DType::Float64);
  EXPECT_EQ(t.shape(), (Shape{4, 3}));
  for (double x : t.to_vector()) EXPECT_EQ(x, 2.0 + 3.0 * ref.uniform());
}

TEST(RandomTensors, UniformRangeAndMoments) {
  Generator g(5);
  const int n = 100000;
  const double lo = -2.0, hi = 6.0;
  const std::vector<double> v = rand_uniform({n}, g, lo, hi, DType::Float64).to_vector();
  double s = 0, s2 = 0;
  for (double x : v) {
    ASSERT_GE(x, lo);
    ASSERT_LT(x, hi);
    s += x;
    s2 += x * x;
  }
  const double mean = s / n, var = s2 / n - mean * mean;
  // mean 2, variance (hi - lo)^2 / 12 = 16/3; sigma of the mean ~ 7.3e-3.
  EXPECT_NEAR(mean, 2.0, 0.04);
  EXPECT_NEAR(var, 16.0 / 3.0, 0.1);
}

TEST(RandomTensors, NormalMoments) {
  for (DType d : {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16}) {
    SCOPED_TRACE(dtype_name(d));
    Generator g(11);
    const int n = 100000;
    Tensor t = rand_normal({n}, g, 3.0, 0.5, d);
    EXPECT_EQ(t.dtype(), d);
    double s = 0, s2 = 0;
    for (double x : t.to_vector()) {
      s += x;
      s2 += x * x;
    }
    const double mean = s / n, sd = std::sqrt(s2 / n - mean * mean);
    // sigma of the mean 0.5/sqrt(n) ~ 1.6e-3; 16-bit rounding adds < 1e-2 relative.
    EXPECT_NEAR(mean, 3.0, 0.02);
    EXPECT_NEAR(sd, 0.5, 0.02);
  }
}

TEST(RandomTensors, SixteenBitDrawsAreRoundedDoubleDraws) {
  Generator g(99), ref(99);
  Tensor t = rand_uniform({256}, g, 0.0, 1.0, DType::BFloat16);
  for (double x : t.to_vector()) {
    const double u = ref.uniform();
    // A bfloat16 in [0, 1] is within half an ulp (2^-9 relative) of the draw.
    EXPECT_LE(std::abs(x - u), std::ldexp(std::max(u, 0x1.0p-126), -8));
  }
}

}  // namespace
}  // namespace diffcomm
