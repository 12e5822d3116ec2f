// Defined semantics at the edges (issue 13): NaN in Max/Min and its gradient,
// integer wrap-around, PremulSum (values, adjoint, fingerprints), impossible
// sizes refused before allocation, and the simulated world's lifetimes, group
// membership, failure reports and fiber bookkeeping. Expected values are
// worked out by hand in the comments, never taken from the code under test.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/distributed/backend/fingerprint.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"
#include "exception_testing.hpp"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DIFFCOMM_TEST_LSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) && !defined(DIFFCOMM_TEST_LSAN)
#define DIFFCOMM_TEST_LSAN 1
#endif
#if DIFFCOMM_TEST_LSAN
#include <sanitizer/lsan_interface.h>
#endif

// fuzz/fuzz_plan_exchange.cpp, compiled into this test to replay regressions.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size);

namespace diffcomm {
namespace {

using dist::ProcessGroup;
using dist::ReduceOp;
using Values = std::vector<double>;

const double kNaN = std::numeric_limits<double>::quiet_NaN();

sim::World make_world(int ranks, uint64_t seed = 1,
                      sim::Schedule schedule = sim::Schedule::Random) {
  sim::WorldOptions o;
  o.ranks = ranks;
  o.seed = seed;
  o.schedule = schedule;
  return sim::World(o);
}

// Element-wise equality that treats NaN as equal to NaN.
bool same(const Values& a, const Values& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) return false;
  return true;
}
std::string text(const Values& v) {
  std::string s = "[";
  for (double x : v) s += std::to_string(x) + " ";
  return s + "]";
}

using test_util::what_of;

// ---------------------------------------------------------------- NaN (CASES 11)

// World 2, Max of [NaN, 1] and [1, 3] (and with the NaN on rank 1): [NaN, 3]
// on both ranks in both orders; Min: [NaN, 1]. Every dtype with a NaN, every
// reducing primitive.
TEST(NanSemantics, MaxMinPropagateNaNInBothRankOrders) {
  for (DType dt : {DType::Float64, DType::Float32, DType::BFloat16, DType::Float16})
    for (int nan_rank : {0, 1})
      for (uint64_t seed : {1, 2, 3}) {
        sim::World world = make_world(2, seed);
        std::vector<Values> mx(2), mn(2), red(2), rs(2);
        world.run([&](sim::Rank& rk) {
          const auto r = static_cast<std::size_t>(rk.rank());
          const Values mine = rk.rank() == nan_rank ? Values{kNaN, 1} : Values{1, 3};
          Tensor a = from_vector(mine, {2}, dt);
          dist::all_reduce(rk.world(), a, ReduceOp::Max);
          mx[r] = a.to_vector();
          Tensor b = from_vector(mine, {2}, dt);
          dist::all_reduce(rk.world(), b, ReduceOp::Min);
          mn[r] = b.to_vector();
          Tensor c = from_vector(mine, {2}, dt);
          dist::reduce(rk.world(), c, 1, ReduceOp::Max);
          red[r] = c.to_vector();
          // reduce_scatter_single: rank 0 gets element 0, rank 1 element 1.
          Tensor out = empty({1}, dt);
          dist::reduce_scatter_single(rk.world(), out, from_vector(mine, {2}, dt), ReduceOp::Max);
          rs[r] = out.to_vector();
        });
        const std::string ctx =
            std::string(dtype_name(dt)) + " NaN on rank " + std::to_string(nan_rank);
        for (std::size_t r = 0; r < 2; ++r) {
          EXPECT_TRUE(same(mx[r], {kNaN, 3})) << ctx << " max rank " << r << " " << text(mx[r]);
          EXPECT_TRUE(same(mn[r], {kNaN, 1})) << ctx << " min rank " << r << " " << text(mn[r]);
        }
        EXPECT_TRUE(same(red[1], {kNaN, 3})) << ctx << " reduce " << text(red[1]);
        EXPECT_TRUE(same(rs[0], {kNaN})) << ctx << " reduce_scatter " << text(rs[0]);
        EXPECT_TRUE(same(rs[1], {3})) << ctx << " reduce_scatter " << text(rs[1]);
      }
}

// dist::reduce_into directly: NaN anywhere in the list wins, -inf/+inf do not.
TEST(NanSemantics, ReduceIntoIsOrderIndependentForNaN) {
  const Values a = {kNaN, 1, -INFINITY}, b = {2, kNaN, 5}, c = {3, 4, INFINITY};
  for (const auto& order :
       {std::vector<Values>{a, b, c}, std::vector<Values>{c, b, a}, std::vector<Values>{b, c, a}}) {
    std::vector<Tensor> ins;
    for (const auto& v : order) ins.push_back(from_vector(v, {3}, DType::Float64));
    Tensor out = empty({3}, DType::Float64);
    dist::reduce_into(out, ins, ReduceOp::Max);
    EXPECT_TRUE(same(out.to_vector(), {kNaN, kNaN, INFINITY})) << text(out.to_vector());
    dist::reduce_into(out, ins, ReduceOp::Min);
    EXPECT_TRUE(same(out.to_vector(), {kNaN, kNaN, -INFINITY})) << text(out.to_vector());
  }
}

// The gradient rule for a NaN winner: the summed output gradient G goes to
// the ranks holding a NaN at that element, split evenly among them (the ties
// rule, NaN counting as equal to NaN); other ranks get 0 there.
// World 2, all_reduce Max, x as in CASES 11, cotangents [1, 2] on rank 0 and
// [3, 4] on rank 1: G = [4, 6]. NaN on rank 0: dx0 = [4, 0], dx1 = [0, 6];
// NaN on rank 1 (x0 = [1, 3], x1 = [NaN, 1]): dx0 = [0, 6], dx1 = [4, 0].
TEST(NanSemantics, MaxGradientGoesToTheNaNHolder) {
  for (int nan_rank : {0, 1}) {
    sim::World world = make_world(2, 7);
    std::vector<Values> dx(2), y(2);
    world.run([&](sim::Rank& rk) {
      const auto r = static_cast<std::size_t>(rk.rank());
      const Values mine = rk.rank() == nan_rank ? Values{kNaN, 1} : Values{1, 3};
      Tensor x = from_vector(mine, {2}, DType::Float64).set_requires_grad();
      Tensor out = nn::all_reduce(x, rk.world(), ReduceOp::Max);
      y[r] = out.to_vector();
      const Values cot = r == 0 ? Values{1, 2} : Values{3, 4};
      dx[r] = grad({out}, {x}, {from_vector(cot, {2}, DType::Float64)})[0].to_vector();
    });
    const Values holder = {4, 0}, other = {0, 6};
    EXPECT_TRUE(same(y[0], {kNaN, 3}));
    EXPECT_EQ(dx[static_cast<std::size_t>(nan_rank)], holder) << "NaN on rank " << nan_rank;
    EXPECT_EQ(dx[static_cast<std::size_t>(1 - nan_rank)], other) << "NaN on rank " << nan_rank;
  }
}

// Both ranks hold NaN: they tie, G = 1 + 3 = 4 splits as 2 and 2. Same rule
// for Min and for reduce (to dst 0, cotangent 5 on the root: 2.5 each).
TEST(NanSemantics, NaNTiesSplitTheGradient) {
  sim::World world = make_world(2, 3);
  std::vector<Values> dmax(2), dmin(2), dred(2);
  world.run([&](sim::Rank& rk) {
    const auto r = static_cast<std::size_t>(rk.rank());
    const double cot = r == 0 ? 1.0 : 3.0;
    for (auto [op, out] : {std::pair{ReduceOp::Max, &dmax}, std::pair{ReduceOp::Min, &dmin}}) {
      Tensor x = from_vector({kNaN}, {1}, DType::Float64).set_requires_grad();
      Tensor y = nn::all_reduce(x, rk.world(), op);
      (*out)[r] = grad({y}, {x}, {from_vector({cot}, {1}, DType::Float64)})[0].to_vector();
    }
    Tensor x = from_vector({kNaN}, {1}, DType::Float64).set_requires_grad();
    Tensor y = nn::reduce(x, 0, rk.world(), ReduceOp::Max);
    dred[r] =
        grad({y}, {x}, {from_vector({r == 0 ? 5.0 : 7.0}, {1}, DType::Float64)})[0].to_vector();
  });
  for (std::size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(dmax[r], Values{2.0}) << r;
    EXPECT_EQ(dmin[r], Values{2.0}) << r;
    EXPECT_EQ(dred[r], Values{2.5}) << r;
  }
}

// ---------------------------------------------------------------- integer overflow

// int32: 2147483647 + 2147483647 = 2^32 - 2, which wraps to -2; int64:
// INT64_MAX + 1 wraps to INT64_MIN; int32 product 65536 * 65536 = 2^32 wraps
// to 0; uint8 200 + 100 = 300 - 256 = 44. (UBSan checks there is no signed
// overflow on the way: the asan preset runs this test.)
TEST(IntegerOverflow, SumAndProductWrapAround) {
  sim::World world = make_world(2);
  std::vector<Values> s32(2), s64(2), p32(2), u8(2), rs(2);
  world.run([&](sim::Rank& rk) {
    const auto r = static_cast<std::size_t>(rk.rank());
    Tensor a = full({2}, 2147483647.0, DType::Int32);
    dist::all_reduce(rk.world(), a, ReduceOp::Sum);
    s32[r] = a.to_vector();
    Tensor b = zeros({1}, DType::Int64);
    b.data<int64_t>()[0] = r == 0 ? std::numeric_limits<int64_t>::max() : 1;
    dist::all_reduce(rk.world(), b, ReduceOp::Sum);
    s64[r] = {b.data<int64_t>()[0] == std::numeric_limits<int64_t>::min() ? 1.0 : 0.0};
    Tensor c = full({1}, 65536.0, DType::Int32);
    dist::all_reduce(rk.world(), c, ReduceOp::Product);
    p32[r] = c.to_vector();
    Tensor d = full({1}, r == 0 ? 200.0 : 100.0, DType::UInt8);
    dist::all_reduce(rk.world(), d, ReduceOp::Sum);
    u8[r] = d.to_vector();
    Tensor out = empty({1}, DType::Int32);
    dist::reduce_scatter_single(rk.world(), out, full({2}, 2147483647.0, DType::Int32),
                                ReduceOp::Sum);
    rs[r] = out.to_vector();
  });
  for (std::size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(s32[r], (Values{-2, -2})) << r;
    EXPECT_EQ(s64[r], Values{1.0}) << "INT64_MAX + 1 is INT64_MIN on rank " << r;
    EXPECT_EQ(p32[r], Values{0}) << r;
    EXPECT_EQ(u8[r], Values{44}) << r;
    EXPECT_EQ(rs[r], Values{-2}) << r;
  }
}

// ---------------------------------------------------------------- PremulSum

TEST(PremulSum, ApiReadsAsTorch) {
  const ReduceOp half = ReduceOp::premul_sum(0.5);
  EXPECT_EQ(half.kind(), ReduceOp::PremulSum);
  EXPECT_TRUE(half == ReduceOp::PremulSum);
  EXPECT_EQ(half.factor(), 0.5);
  EXPECT_FALSE(half == ReduceOp::premul_sum(0.25));
  EXPECT_TRUE(half == ReduceOp::premul_sum(0.5));
  const ReduceOp sum = ReduceOp::Sum;  // implicit from the kind
  EXPECT_EQ(sum.factor(), 1.0);
  EXPECT_FALSE(sum == half);
  EXPECT_EQ(dist::reduce_op_name(half), "premul_sum(0.5)");
  EXPECT_EQ(dist::reduce_op_name(ReduceOp::Max), "max");
  int n = 0;
  switch (half) {  // switches like the enum it was
    case ReduceOp::PremulSum: n = 1; break;
    default: n = 2; break;
  }
  EXPECT_EQ(n, 1);
  EXPECT_THROW(ReduceOp::premul_sum(std::numeric_limits<double>::quiet_NaN()), InvalidArgument);
  EXPECT_THROW(ReduceOp::premul_sum(INFINITY), InvalidArgument);
}

// W = 2, factor 0.5, x = 2 and 4: 0.5 * 2 + 0.5 * 4 = 3 (all_reduce, reduce
// at dst 1, and reduce_scatter_single of [2, 20] and [4, 40]: 3 and 30).
// Adjoint: all_reduce with cotangents 1 and 3: dx = 0.5 * (1 + 3) = 2 on
// both; reduce to dst 1 with cotangent 5 there: dx = 0.5 * 5 = 2.5 on both.
TEST(PremulSum, CaseFactorHalfGivesThreeAndTheScaledAdjoint) {
  for (DType dt : {DType::Float64, DType::Float32, DType::BFloat16, DType::Float16}) {
    sim::World world = make_world(2, 5);
    std::vector<Values> ar(2), red(2), rs(2), dar(2), dred(2);
    world.run([&](sim::Rank& rk) {
      const auto r = static_cast<std::size_t>(rk.rank());
      const double x = r == 0 ? 2.0 : 4.0;
      const ReduceOp op = ReduceOp::premul_sum(0.5);
      Tensor a = full({1}, x, dt);
      dist::all_reduce(rk.world(), a, op);
      ar[r] = a.to_vector();
      Tensor b = full({1}, x, dt);
      dist::reduce(rk.world(), b, 1, op);
      red[r] = b.to_vector();
      Tensor out = empty({1}, dt);
      dist::reduce_scatter_single(rk.world(), out, from_vector({x, 10 * x}, {2}, dt), op);
      rs[r] = out.to_vector();
      if (dt == DType::Float64) {
        Tensor xl = full({1}, x, dt).set_requires_grad();
        Tensor y = nn::all_reduce(xl, rk.world(), op);
        dar[r] = grad({y}, {xl}, {full({1}, r == 0 ? 1.0 : 3.0, dt)})[0].to_vector();
        Tensor xr = full({1}, x, dt).set_requires_grad();
        Tensor z = nn::reduce(xr, 1, rk.world(), op);
        dred[r] = grad({z}, {xr}, {full({1}, r == 1 ? 5.0 : 11.0, dt)})[0].to_vector();
      }
    });
    for (std::size_t r = 0; r < 2; ++r) {
      EXPECT_EQ(ar[r], Values{3.0}) << dtype_name(dt) << " rank " << r;
      EXPECT_EQ(rs[r], Values{r == 0 ? 3.0 : 30.0}) << dtype_name(dt) << " rank " << r;
      if (dt == DType::Float64) {
        EXPECT_EQ(dar[r], Values{2.0}) << r;
        EXPECT_EQ(dred[r], Values{2.5}) << r;
      }
    }
    EXPECT_EQ(red[1], Values{3.0}) << dtype_name(dt);
    EXPECT_EQ(red[0], Values{2.0}) << dtype_name(dt) << ": off the root the input is unchanged";
  }
}

// Members passing different factors disagree: CollectiveMismatch on both,
// naming the reduce op; the fixed-size fingerprints (checked production mode)
// disagree too. Integer dtypes are refused locally.
TEST(PremulSum, MismatchedFactorsAndIntegersAreRefused) {
  sim::World world = make_world(2);
  try {
    world.run([](sim::Rank& rk) {
      Tensor t = full({2}, 1.0, DType::Float32);
      dist::all_reduce(rk.world(), t, ReduceOp::premul_sum(rk.rank() == 0 ? 0.5 : 0.25));
    });
    ADD_FAILURE() << "no mismatch";
  } catch (const CollectiveMismatch& e) {
    EXPECT_NE(std::string(e.what()).find("reduce op differs"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("premul_sum(0.25)"), std::string::npos) << e.what();
  }
  dist::Call a, b;
  a.op = b.op = dist::OpType::AllReduce;
  a.group_size = b.group_size = 2;
  b.rank = 1;
  a.inputs = a.outputs = b.inputs = b.outputs = {zeros({2})};
  a.reduce_op = ReduceOp::premul_sum(0.5);
  b.reduce_op = ReduceOp::premul_sum(0.5);
  EXPECT_TRUE(dist::fingerprints_agree({dist::fingerprint(a), dist::fingerprint(b)}));
  b.reduce_op = ReduceOp::premul_sum(0.25);
  EXPECT_FALSE(dist::fingerprints_agree({dist::fingerprint(a), dist::fingerprint(b)}));
  b.reduce_op = ReduceOp::Sum;
  EXPECT_FALSE(dist::fingerprints_agree({dist::fingerprint(a), dist::fingerprint(b)}));
  // The serialized description keeps the factor.
  const auto words = dist::serialize(dist::describe(a));
  EXPECT_TRUE(dist::deserialize(words.data(), words.size()).reduce_op == ReduceOp::premul_sum(0.5));
  // A member refusing its own call (Backend::announce_refusal): its
  // fingerprint never agrees, even with another refusal, and its error
  // travels in the description (any length, any byte) and leads the report.
  EXPECT_FALSE(dist::fingerprints_agree({dist::fingerprint(a), dist::refusal_fingerprint(b)}));
  EXPECT_FALSE(
      dist::fingerprints_agree({dist::refusal_fingerprint(a), dist::refusal_fingerprint(b)}));
  dist::CallDesc refusing = dist::describe(b);
  refusing.refused = "input_splits sum to 5 but input has 4 rows \xff\x01";
  const auto refusal_words = dist::serialize(refusing);
  const dist::CallDesc back = dist::deserialize(refusal_words.data(), refusal_words.size());
  EXPECT_EQ(back.refused, refusing.refused);
  const dist::CallDesc plain = dist::describe(a);
  const std::vector<const dist::CallDesc*> both{&plain, &back};
  EXPECT_EQ(dist::compare(both, {0, 5}),
            "rank 1 (global 5) refused its own call all_reduce(float32, in=[2], op=sum): "
            "input_splits sum to 5 but input has 4 rows \xff\x01");
  EXPECT_THROW(dist::deserialize(refusal_words.data(), refusal_words.size() - 1), InvalidArgument);

  sim::World w2 = make_world(2);
  EXPECT_THROW(w2.run([](sim::Rank& rk) {
    Tensor t = full({2}, 1.0, DType::Int32);
    dist::all_reduce(rk.world(), t, ReduceOp::premul_sum(2.0));
  }),
               InvalidArgument);
}

// ---------------------------------------------------------------- impossible sizes

// Splits asking for ~2^53 bytes, and shapes whose byte count overflows,
// raise InvalidArgument naming the op and the size before anything is
// allocated (under ASan an attempted allocation of that size would abort).
TEST(ImpossibleSizes, RefusedBeforeAllocation) {
  const int64_t huge = int64_t{1} << 50;  // rows of 8 bytes: 2^53 bytes
  sim::World world = make_world(2);
  std::vector<std::string> msgs(2 * 6);
  world.run([&](sim::Rank& rk) {
    const auto r = static_cast<std::size_t>(rk.rank());
    const ProcessGroup& g = rk.world();
    auto expect_invalid = [&](std::size_t k, auto&& f) {
      try {
        f();
        msgs[r * 6 + k] = "no error";
      } catch (const InvalidArgument& e) {
        msgs[r * 6 + k] = e.what();
      }
    };
    Tensor x = zeros({1, 1}, DType::Float64);
    expect_invalid(0, [&] { dist::all_to_all_single(g, x, x, {huge, 0}, {1, 0}); });
    expect_invalid(1, [&] {
      dist::all_gather_v(g, x, x, {std::numeric_limits<int64_t>::max(), 1});
    });
    expect_invalid(2, [&] { nn::all_to_all_single(x, {huge, huge}, {1, 0}, g); });
    expect_invalid(3, [&] { nn::all_gather_v(x, {1, std::numeric_limits<int64_t>::max()}, g); });
    expect_invalid(4, [&] { nn::all_gather_v(x, {huge, 1}, g); });
    expect_invalid(5, [&] { dist::reduce_scatter_v(g, x, x, {huge, huge}, ReduceOp::Sum); });
    dist::barrier(g);  // both ranks still agree on what comes next
  });
  for (std::size_t r = 0; r < 2; ++r) {
    const auto& m = msgs;
    EXPECT_NE(m[r * 6 + 0].find("all_to_all_single"), std::string::npos) << m[r * 6 + 0];
    EXPECT_NE(m[r * 6 + 0].find("1125899906842624"), std::string::npos) << m[r * 6 + 0];
    EXPECT_NE(m[r * 6 + 1].find("all_gather_v"), std::string::npos) << m[r * 6 + 1];
    EXPECT_NE(m[r * 6 + 2].find("nn::all_to_all_single"), std::string::npos) << m[r * 6 + 2];
    EXPECT_NE(m[r * 6 + 2].find("2251799813685248"), std::string::npos) << m[r * 6 + 2];
    EXPECT_NE(m[r * 6 + 3].find("nn::all_gather_v"), std::string::npos) << m[r * 6 + 3];
    EXPECT_NE(m[r * 6 + 4].find("bytes"), std::string::npos) << m[r * 6 + 4];
    EXPECT_NE(m[r * 6 + 5].find("reduce_scatter_v"), std::string::npos) << m[r * 6 + 5];
  }
}

TEST(ImpossibleSizes, TensorFactoriesCheckTheByteCount) {
  const int64_t big = int64_t{1} << 40;
  try {
    (void)empty({big, big}, DType::Float32);
    ADD_FAILURE() << "2^82 bytes allocated?";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("empty"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[1099511627776, 1099511627776]"), std::string::npos)
        << e.what();
  }
  // numel * element_size overflows uint64 (2^62 * 8 = 2^65).
  EXPECT_THROW((void)zeros({int64_t{1} << 62}, DType::Float64), InvalidArgument);
  // A zero dim makes any shape empty, whatever the other dims.
  EXPECT_EQ(empty({0, int64_t{1} << 62}, DType::Float64).nbytes(), 0u);
  EXPECT_EQ(checked_nbytes({3, 5}, DType::Float16, "t"), 30u);
  EXPECT_EQ(checked_nbytes({int64_t{1} << 46, 4}, DType::UInt8, "t"), uint64_t{1} << 48);
  EXPECT_THROW(checked_nbytes({(int64_t{1} << 46) + 1, 4}, DType::UInt8, "t"), InvalidArgument);
}

// ---------------------------------------------------------------- lifetimes

// A handle kept past its run (and past its World) refuses calls with
// InvalidArgument instead of reading freed memory (the asan preset runs
// this); so does a handle of an earlier run used inside a later one.
TEST(SimLifetime, HandlesOutlivingTheirRunRefuseCalls) {
  std::optional<ProcessGroup> kept, kept_sub;
  {
    sim::World world = make_world(2);
    world.run([&](sim::Rank& rk) {
      auto sub = rk.world().new_group({0, 1});
      if (rk.rank() == 0) {
        kept = rk.world();
        kept_sub = *sub;
      }
    });
    try {
      dist::barrier(*kept);
      ADD_FAILURE() << "a finished run's handle was usable";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("finished"), std::string::npos) << e.what();
    }
    // Used inside the next run, from the rank it belonged to: still refused.
    std::string inside;
    world.run([&](sim::Rank& rk) {
      if (rk.rank() != 0) return;
      try {
        Tensor t = zeros({1});
        dist::all_reduce(*kept_sub, t);
      } catch (const InvalidArgument& e) {
        inside = e.what();
      }
    });
    EXPECT_NE(inside.find("finished"), std::string::npos) << inside;
  }
  // The World is gone.
  Tensor t = zeros({1});
  EXPECT_THROW(dist::all_reduce(*kept, t), InvalidArgument);
  EXPECT_THROW(dist::barrier(*kept_sub), InvalidArgument);
  EXPECT_EQ(kept->size(), 2);  // local facts stay readable
}

// World::run from inside a rank function raises InvalidArgument on that rank
// (no abort); the outer run reports it.
TEST(SimLifetime, NestedRunIsRefused) {
  sim::World world = make_world(2);
  sim::World other = make_world(1);
  try {
    world.run([&](sim::Rank& rk) {
      if (rk.rank() == 0) world.run([](sim::Rank&) {});
      if (rk.rank() == 1) other.run([](sim::Rank&) {});
    });
    ADD_FAILURE() << "nested run returned";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("inside a fiber"), std::string::npos) << e.what();
    const sim::RunFailures* all = sim::run_failures(e);
    ASSERT_NE(all, nullptr);
    EXPECT_EQ(all->failures().size(), 2u);
  }
  // Both worlds still work afterwards.
  EXPECT_NO_THROW(world.run([](sim::Rank& rk) { dist::barrier(rk.world()); }));
  EXPECT_NO_THROW(other.run([](sim::Rank& rk) { dist::barrier(rk.world()); }));
}

// Every failed rank's error is reachable from the exception run() throws,
// whose type is the first failure's kind.
TEST(SimLifetime, RunErrorCarriesEveryFailedRank) {
  sim::World world = make_world(4, 1, sim::Schedule::RoundRobin);
  try {
    world.run([](sim::Rank& rk) {
      if (rk.rank() == 1) throw InvalidArgument("bad input on one");
      if (rk.rank() == 3) throw std::runtime_error("plain error on three");
    });
    ADD_FAILURE() << "run returned";
  } catch (const InvalidArgument& e) {  // the first failure's kind
    const std::string w = e.what();
    EXPECT_EQ(w.rfind("rank 1: bad input on one", 0), 0u) << w;
    EXPECT_NE(w.find("rank 3: plain error on three"), std::string::npos) << w;
    const sim::RunFailures* all = sim::run_failures(e);
    ASSERT_NE(all, nullptr);
    ASSERT_EQ(all->failures().size(), 2u);
    EXPECT_EQ(all->failures()[0].rank, 1);
    EXPECT_EQ(all->failures()[1].rank, 3);
    EXPECT_EQ(all->failures()[1].message(), "plain error on three");
    EXPECT_EQ(what_of(all->failures()[1].error), "plain error on three");
  }
}

// ---------------------------------------------------------------- membership

// World 3, group {0, 1}. Rank 0 shares its handle; rank 2 (not a member) and
// rank 1 (a member, but not the handle's owner) call all_reduce through it:
// InvalidArgument on each caller, and nothing reaches the members, whose own
// all_reduce sums 1 + 2 = 3 (rank 2's 100 is not in it); no deadlock.
TEST(SimMembership, CallsThroughAnotherRanksHandleAreRefused) {
  for (uint64_t seed : {1, 2, 3, 4}) {
    sim::World world = make_world(3, seed);
    std::optional<ProcessGroup> shared;
    std::vector<std::string> refused(3);
    std::vector<Values> got(3);
    world.run([&](sim::Rank& rk) {
      const auto r = static_cast<std::size_t>(rk.rank());
      auto g = rk.world().new_group({0, 1});
      if (r == 0) shared = *g;
      dist::barrier(rk.world());  // the handle is shared before anyone uses it
      if (r != 0) {
        try {
          Tensor t = full({1}, 100.0);
          dist::all_reduce(*shared, t);
          got[r] = t.to_vector();
        } catch (const InvalidArgument& e) {
          refused[r] = e.what();
        }
      }
      if (g) {
        Tensor t = full({1}, static_cast<double>(r + 1));
        dist::all_reduce(*g, t);
        got[r] = t.to_vector();
      }
    });
    EXPECT_NE(refused[2].find("called from global rank 2"), std::string::npos) << refused[2];
    EXPECT_NE(refused[2].find("global rank 0's"), std::string::npos) << refused[2];
    EXPECT_NE(refused[1].find("called from global rank 1"), std::string::npos) << refused[1];
    EXPECT_EQ(got[0], Values{3.0}) << "seed " << seed;
    EXPECT_EQ(got[1], Values{3.0}) << "seed " << seed;
    EXPECT_TRUE(got[2].empty());
  }
}

// ---------------------------------------------------------------- failures

// World 3: rank 2 fails (injected) in an all_reduce on {1, 2}; rank 1, its
// victim, fails with RankFailure; rank 0 waits for rank 1 in an all_reduce on
// {0, 1}. Rank 0's RankFailure names the root cause, global rank 2, first.
TEST(SimFailures, VictimsNameTheRootCause) {
  for (uint64_t seed : {1, 2, 3, 4, 5}) {
    sim::WorldOptions o;
    o.ranks = 3;
    o.seed = seed;
    o.fault = sim::Fault{2, 3};  // after the two new_group calls
    sim::World world(o);
    try {
      world.run([](sim::Rank& rk) {
        auto g12 = rk.world().new_group({1, 2});
        auto g01 = rk.world().new_group({0, 1});
        Tensor t = zeros({1});
        if (rk.rank() >= 1) dist::all_reduce(*g12, t);
        if (rk.rank() <= 1) dist::all_reduce(*g01, t);
      });
      ADD_FAILURE() << "no failure";
    } catch (const RankFailure& e) {
      const sim::RunFailures* all = sim::run_failures(e);
      ASSERT_NE(all, nullptr);
      ASSERT_EQ(all->failures().size(), 3u) << e.what();
      EXPECT_EQ(all->failures()[0].rank, 2) << e.what();
      for (const auto& f : all->failures()) {
        if (f.rank == 2) {
          EXPECT_EQ(f.root_cause, -1);
          continue;
        }
        EXPECT_EQ(f.root_cause, 2) << "seed " << seed << " rank " << f.rank;
        const auto first = f.message().find("member global rank ");
        ASSERT_NE(first, std::string::npos) << f.message();
        EXPECT_EQ(f.message().compare(first, 20, "member global rank 2"), 0)
            << "seed " << seed << " rank " << f.rank << ": " << f.message();
        EXPECT_NE(f.message().find("injected fault"), std::string::npos) << f.message();
      }
    }
  }
}

// ---------------------------------------------------------------- fiber bookkeeping

// Size of this process's address space, bytes (Linux /proc/self/statm).
uint64_t address_space_bytes() {
  std::ifstream in("/proc/self/statm");
  uint64_t pages = 0;
  in >> pages;
  return pages * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

// Every run releases its fibers (stacks and Boost.Fiber properties) before
// returning. An ended fiber used to wait in Boost's terminated queue for a
// dispatcher the seeded scheduler might never run again, so runs kept their
// fibers: the leak fuzz_plan_exchange found, whose input is replayed here 100
// times (it kept all 4 fibers of every run: 400 stacks of 260 KiB). The
// address space must not grow by those stacks, and under ASan LeakSanitizer
// must find nothing unreachable right after the runs (what libFuzzer checks
// after each input).
TEST(SimFibers, RunsReleaseTheirFibers) {
  std::ifstream in(DIFFCOMM_FUZZ_LEAK_INPUT, std::ios::binary);
  ASSERT_TRUE(in) << DIFFCOMM_FUZZ_LEAK_INPUT;
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  auto replay = [&] {
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  };
  replay();  // warm up allocators
  const uint64_t before = address_space_bytes();
  for (int i = 0; i < 100; ++i) replay();
  const uint64_t after = address_space_bytes();
  EXPECT_LT(after, before + (uint64_t{32} << 20))
      << "address space grew by " << ((after - before) >> 20) << " MiB over 100 runs";
  // And a plain world whose fibers all end in a barrier.
  for (uint64_t seed = 0; seed < 10; ++seed)
    make_world(8, seed).run([](sim::Rank& rk) { dist::barrier(rk.world()); });
#if DIFFCOMM_TEST_LSAN
  EXPECT_EQ(__lsan_do_recoverable_leak_check(), 0) << "LeakSanitizer found unreachable memory";
#endif
}

// The fingerprint of a split prints as what it is.
TEST(SimFailures, SplitAndNewGroupFingerprintsPrintAsWhatTheyAre) {
  sim::World world = make_world(2);
  try {
    world.run([](sim::Rank& rk) {
      rk.world().split(0, rk.rank(), {1, 2, rk.rank() == 0 ? int64_t{4} : int64_t{5}, -2}, "s");
    });
    ADD_FAILURE() << "no mismatch";
  } catch (const CollectiveMismatch& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("split(color=0, key=0, fingerprint=[1,2,4,-2])"), std::string::npos) << w;
    EXPECT_NE(w.find("split(color=0, key=1, fingerprint=[1,2,5,-2])"), std::string::npos) << w;
    EXPECT_NE(w.find("fingerprint differs"), std::string::npos) << w;
    EXPECT_EQ(w.find("members=["), std::string::npos) << w;
  }
}

// reduce_into's list form (the simulated all_reduce): every output gets the
// sum, whatever the aliasing; with partial overlaps the result equals a sum
// into a temporary followed by copies to outs[0], outs[1], ... in order. The
// expected memory is computed here with plain loops over doubles (small
// integers: every float32 sum is exact).
TEST(ReduceIntoList, EveryAliasingMatchesTemporaryThenOrderedCopies) {
  struct Case {
    const char* name;
    std::vector<int64_t> in_at, out_at;  // element offsets for length 1500
  };
  const std::vector<Case> cases = {
      {"distinct", {0, 2000, 4000}, {6000, 8000, 10000}},
      {"in place", {0, 2000, 4000}, {0, 2000, 4000}},
      {"outputs are other members' inputs", {0, 2000, 4000}, {2000, 4000, 0}},
      {"shared output", {0, 2000, 4000}, {6000, 6000, 6000}},
      {"output overlaps an input at an offset", {0, 2000, 4000}, {700, 6000, 8000}},
      {"outputs overlap each other at an offset", {0, 2000, 4000}, {6000, 6300, 6900}},
  };
  // 1500: more than one 512-element block, not a multiple; 300: one block
  // (no overlap check). Offsets scale with the length: the same overlaps.
  for (const int64_t len : {int64_t{1500}, int64_t{300}})
    for (const auto& c : cases) {
      SCOPED_TRACE(std::string(c.name) + ", length " + std::to_string(len));
      auto at_len = [&](int64_t at) { return at * len / 1500; };
      std::vector<float> buf(static_cast<std::size_t>(at_len(12000)));
      for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(i % 97);
      // Reference: read every input first, then write the outputs in order.
      std::vector<double> mem(buf.begin(), buf.end());
      std::vector<double> sum(static_cast<std::size_t>(len), 0.0);
      for (int64_t at : c.in_at)
        for (int64_t i = 0; i < len; ++i) sum[i] += mem[at_len(at) + i];
      for (int64_t at : c.out_at)
        for (int64_t i = 0; i < len; ++i) mem[at_len(at) + i] = sum[i];
      std::vector<Tensor> ins, outs;
      for (int64_t at : c.in_at)
        ins.push_back(from_blob(buf.data() + at_len(at), {len}, DType::Float32));
      for (int64_t at : c.out_at)
        outs.push_back(from_blob(buf.data() + at_len(at), {len}, DType::Float32));
      dist::reduce_into(outs, ins, ReduceOp::Sum);
      for (std::size_t i = 0; i < buf.size(); ++i)
        ASSERT_EQ(static_cast<double>(buf[i]), mem[i]) << "element " << i;
    }
}

TEST(ReduceIntoList, AvgAndMismatchedOutputs) {
  std::vector<float> a{1, 2, 3}, b{3, 4, 6};
  Tensor ta = from_blob(a.data(), {3}, DType::Float32),
         tb = from_blob(b.data(), {3}, DType::Float32);
  dist::reduce_into({ta, tb}, {ta, tb}, ReduceOp::Avg);
  EXPECT_EQ(a, (std::vector<float>{2, 3, 4.5}));
  EXPECT_EQ(b, (std::vector<float>{2, 3, 4.5}));
  Tensor wrong = zeros({2}, DType::Float32);
  EXPECT_THROW(dist::reduce_into({ta, wrong}, {ta, tb}, ReduceOp::Sum), InvalidArgument);
  EXPECT_THROW(dist::reduce_into(std::vector<Tensor>{}, {ta, tb}, ReduceOp::Sum), InvalidArgument);
}

}  // namespace
}  // namespace diffcomm
