// The MPI backend under mpirun: the backend conformance suite (the same case
// bodies as the simulated world), the adjoint identity of every
// differentiable op, the large-count paths, and the encoder-parallel step
// compared with the simulated world on the same seed and plan.
//
// Run: mpirun -np 4 --oversubscribe --allow-run-as-root --mca btl self,vader
//      ./diffcomm_mpi_tests
// Every process runs every test in the same order; the exit code is the
// worst over all processes.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <thread>

#include "conformance/backend_fixture.hpp"
#include "conformance/conformance_suite.hpp"
#include "conformance/promises_suite.hpp"
#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/backends/mpi.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/encoder_parallel/training_step.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/sim/adjoint.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm {
namespace {

int mpi_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int mpi_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
// Sums with raw MPI, independent of diffcomm's collectives.
double raw_sum(double v) {
  double out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return out;
}

}  // namespace

// ---------------------------------------------------------------- conformance
namespace conformance {
namespace {
class MpiRunner final : public BackendRunner {
 public:
  std::string name() const override { return "mpi"; }
  int max_world() const override { return mpi_size(); }
  void run(int world_size, RankFn fn) override {
    if (world_size != mpi_size()) {
      ADD_FAILURE() << "mpi runner: world " << world_size << " requested under mpirun -np "
                    << mpi_size();
      return;
    }
    // Checked mode on whatever the build type: the promises suite's
    // mismatch cases need it (without it MPI's behaviour is undefined).
    dist::Options options;
    options.check = true;
    fn(mpi::world(options), mpi_rank());
  }
};

std::vector<ConformanceParam> mpi_params() {
  std::vector<ConformanceParam> out;
  for (DType dt : {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16, DType::Int32,
                   DType::Int64, DType::UInt8})
    out.push_back({mpi_size(), dt, 0});
  return out;
}
}  // namespace

std::unique_ptr<BackendRunner> make_backend_runner(const ConformanceParam&) {
  return std::make_unique<MpiRunner>();
}

INSTANTIATE_TEST_SUITE_P(Mpi, ConformanceTest, testing::ValuesIn(mpi_params()),
                         conformance_param_name);
}  // namespace conformance

// ---------------------------------------------------------------- adjoints
// The adjoint identity of every differentiable op on random sub-groups and
// splits (zeros included); both sides summed over processes with raw MPI.
TEST(MpiAdjoint, EveryOpOnRandomCases) {
  const auto world = mpi::world();
  for (const std::string& op : sim::differentiable_ops())
    for (uint64_t seed = 0; seed < 25; ++seed)
      for (DType dt : {DType::Float64, DType::Float32}) {
        const sim::AdjointCase c = sim::draw_adjoint_case(mpi_size(), seed);
        Generator gen(seed * 7919 + static_cast<uint64_t>(mpi_rank()));
        const auto [l, r] = sim::adjoint_terms(op, world, c, dt, gen);
        const double lhs = raw_sum(l), rhs = raw_sum(r);
        const double rel = std::abs(lhs - rhs) / std::max({std::abs(lhs), std::abs(rhs), 1e-300});
        EXPECT_LE(rel, dt == DType::Float64 ? 1e-12 : 1e-5)
            << op << " seed " << seed << " " << dtype_name(dt) << ": lhs " << lhs << " rhs " << rhs;
      }
}

// ---------------------------------------------------------------- large counts
// With the per-call count limit lowered to 7 elements, every primitive takes
// its chunked / point-to-point path; results must equal the closed forms.
TEST(MpiLargeCount, ChunkedPathsMatchClosedForms) {
  const auto g = mpi::world();
  const int n = g.size(), r = g.rank();
  const int64_t saved = mpi::max_count();
  mpi::set_max_count(7);
  // all_reduce of 30 elements: chunks of 7.
  {
    std::vector<double> v(30);
    for (int i = 0; i < 30; ++i) v[static_cast<std::size_t>(i)] = r * 100 + i;
    Tensor t = from_vector(v, {30});
    dist::all_reduce(g, t);
    const auto got = t.to_vector();
    for (int i = 0; i < 30; ++i)
      EXPECT_EQ(got[static_cast<std::size_t>(i)],
                100.0 * n * (n - 1) / 2 + static_cast<double>(n) * i);
  }
  // all_to_all_single with uneven splits: rank i sends (i + j) % 3 + 4 rows of width 2 to j.
  {
    auto rows = [](int i, int j) { return static_cast<int64_t>((i + j) % 3 + 4); };
    std::vector<int64_t> in_s, out_s;
    for (int j = 0; j < n; ++j) {
      in_s.push_back(rows(r, j));
      out_s.push_back(rows(j, r));
    }
    const int64_t in_rows = std::accumulate(in_s.begin(), in_s.end(), int64_t{0});
    const int64_t out_rows = std::accumulate(out_s.begin(), out_s.end(), int64_t{0});
    std::vector<double> v;
    for (int j = 0; j < n; ++j)
      for (int64_t k = 0; k < rows(r, j) * 2; ++k)
        v.push_back(1000.0 * r + 10.0 * j + static_cast<double>(k));
    Tensor in = from_vector(v, {in_rows, 2}), out = zeros({out_rows, 2}, DType::Float64);
    dist::all_to_all_single(g, out, in, out_s, in_s);
    const auto got = out.to_vector();
    std::size_t at = 0;
    for (int s = 0; s < n; ++s)
      for (int64_t k = 0; k < rows(s, r) * 2; ++k)
        EXPECT_EQ(got[at++], 1000.0 * s + 10.0 * r + static_cast<double>(k));
  }
  // all_gather_v and reduce_scatter_v with rows s + 3 from member s.
  {
    std::vector<int64_t> splits;
    for (int s = 0; s < n; ++s) splits.push_back(s + 3);
    const int64_t total = std::accumulate(splits.begin(), splits.end(), int64_t{0});
    Tensor in = full({splits[static_cast<std::size_t>(r)], 3}, r + 1.0, DType::Float64);
    Tensor out = zeros({total, 3}, DType::Float64);
    dist::all_gather_v(g, out, in, splits);
    const auto got = out.to_vector();
    std::size_t at = 0;
    for (int s = 0; s < n; ++s)
      for (int64_t k = 0; k < splits[static_cast<std::size_t>(s)] * 3; ++k)
        EXPECT_EQ(got[at++], s + 1.0);
    Tensor rs_in = full({total, 3}, r + 1.0, DType::Float64);
    Tensor rs_out = zeros({splits[static_cast<std::size_t>(r)], 3}, DType::Float64);
    dist::reduce_scatter_v(g, rs_out, rs_in, splits);
    for (double x : rs_out.to_vector()) EXPECT_EQ(x, n * (n + 1) / 2.0);
  }
  // broadcast, reduce, gather, scatter, send/recv of 20 elements.
  {
    Tensor t = full({20}, r == 1 % n ? 5.0 : 0.0, DType::Float64);
    dist::broadcast(g, t, 1 % n);
    for (double x : t.to_vector()) EXPECT_EQ(x, 5.0);
    Tensor s = full({20}, r + 1.0, DType::Float64);
    dist::reduce(g, s, 0);
    if (r == 0) {
      for (double x : s.to_vector()) EXPECT_EQ(x, n * (n + 1) / 2.0);
    }
    std::vector<Tensor> outs;
    if (r == 0)
      for (int k = 0; k < n; ++k) outs.push_back(zeros({20}, DType::Float64));
    dist::gather(g, outs, full({20}, r * 2.0, DType::Float64), 0);
    for (int k = 0; k < static_cast<int>(outs.size()); ++k)
      for (double x : outs[static_cast<std::size_t>(k)].to_vector()) EXPECT_EQ(x, k * 2.0);
    std::vector<Tensor> ins;
    if (r == 0)
      for (int k = 0; k < n; ++k) ins.push_back(full({20}, k * 3.0, DType::Float64));
    Tensor sc = zeros({20}, DType::Float64);
    dist::scatter(g, sc, ins, 0);
    for (double x : sc.to_vector()) EXPECT_EQ(x, r * 3.0);
    if (n >= 2) {
      if (r == 0) dist::send(g, full({20}, 9.0, DType::Float64), 1, 3);
      if (r == 1) {
        Tensor got = zeros({20}, DType::Float64);
        dist::recv(g, got, 0, 3);
        for (double x : got.to_vector()) EXPECT_EQ(x, 9.0);
      }
    }
  }
  mpi::set_max_count(saved);
}

TEST(MpiErrors, BadArgumentsAreRefusedLocally) {
  EXPECT_THROW(mpi::from_comm(MPI_COMM_NULL), InvalidArgument);
  EXPECT_THROW(mpi::set_max_count(0), InvalidArgument);
  const auto g = mpi::world();
  // Local validation happens before any communication, so one rank may fail alone.
  Tensor t = zeros({4}, DType::Float32);
  EXPECT_THROW(dist::broadcast(g, t, g.size()), InvalidArgument);
  EXPECT_THROW(dist::all_to_all_single(g, zeros({3, 1}), zeros({5, 1}), {3}, {5}), InvalidArgument);
}

// dist::all_reduce_into on a real transport: the composed path reduces out
// of place (reads the input directly), the native one is sent a copy; both
// give all_reduce's values and leave the input as it was.
TEST(MpiSemantics, AllReduceIntoOnTheComposedAndNativePaths) {
  for (bool native : {false, true}) {
    dist::Options opts;
    opts.native_reduction = native;
    const auto world = mpi::world(opts);
    EXPECT_EQ(world.backend().all_reduce_out_of_place(), !native);
    const int r = world.rank(), n = world.size();
    std::vector<double> v(1000);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.5 * (r + 1) + static_cast<double>(i);
    const Tensor in = from_vector(v, {1000}, DType::Float64);
    Tensor out = zeros({1000}, DType::Float64);
    dist::all_reduce_into(world, out, in);
    const auto got = out.to_vector();
    for (std::size_t i = 0; i < v.size(); ++i)
      ASSERT_EQ(got[i], 0.25 * n * (n + 1) + n * static_cast<double>(i))
          << "element " << i << (native ? ", native" : ", composed");
    EXPECT_EQ(in.to_vector(), v) << "the input was written";
  }
}

// ---------------------------------------------------------------- defined semantics (issue 13)
// The values of tests/distributed/test_semantics.cpp on a real transport, on the default
// (composed) path and on MPI's native reductions.
TEST(MpiSemantics, NaNIntegerWrapAndPremulSum) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (bool native : {false, true}) {
    dist::Options opts;
    opts.native_reduction = native;
    const auto world = mpi::world(opts);
    const int r = world.rank();
    // CASES 11: world 2 ({0, 1}), Max of [NaN, 1] and [1, 3], the NaN on either
    // rank: [NaN, 3]; Min: [NaN, 1]. Composed path only: MPI's own MPI_MAX
    // is the implementation's (std::max-like) and may drop the NaN.
    if (!native)
      for (int nan_rank : {0, 1}) {
        auto pair = world.new_group({0, 1});
        if (!pair) continue;
        for (DType dt : {DType::Float64, DType::Float32, DType::BFloat16}) {
          const std::vector<double> mine =
              r == nan_rank ? std::vector<double>{nan, 1} : std::vector<double>{1, 3};
          Tensor mx = from_vector(mine, {2}, dt), mn = from_vector(mine, {2}, dt);
          dist::all_reduce(*pair, mx, dist::ReduceOp::Max);
          dist::all_reduce(*pair, mn, dist::ReduceOp::Min);
          const auto a = mx.to_vector(), b = mn.to_vector();
          EXPECT_TRUE(std::isnan(a[0]) && a[1] == 3.0)
              << dtype_name(dt) << " NaN on " << nan_rank << ": " << a[0] << "," << a[1];
          EXPECT_TRUE(std::isnan(b[0]) && b[1] == 1.0)
              << dtype_name(dt) << " NaN on " << nan_rank << ": " << b[0] << "," << b[1];
        }
      }
    // int32 2147483647 summed over the world: (n * (2^31 - 1)) mod 2^32 as
    // int32; n = 4: 2^33 - 4 = -4 (mod 2^32); n = 2: -2.
    Tensor i32 = full({3}, 2147483647.0, DType::Int32);
    dist::all_reduce(world, i32, dist::ReduceOp::Sum);
    const int64_t n = world.size();
    const auto wrapped =
        static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint64_t>(n) * 2147483647u));
    for (double v : i32.to_vector()) EXPECT_EQ(v, wrapped) << "native " << native;
    // The issue's case on two ranks: 2147483647 + 2147483647 = -2.
    if (auto two = world.new_group({0, 1})) {
      Tensor t = full({2}, 2147483647.0, DType::Int32);
      dist::all_reduce(*two, t, dist::ReduceOp::Sum);
      for (double v : t.to_vector()) EXPECT_EQ(v, -2.0) << "native " << native;
    }
    // PremulSum, world {0, 1}: factor 0.5, x = 2 and 4 gives 3; over the whole
    // world with x = r + 1: 0.5 * n(n+1)/2.
    auto pair = world.new_group({0, 1});
    if (pair) {
      Tensor t = full({2}, r == 0 ? 2.0 : 4.0, DType::Float32);
      dist::all_reduce(*pair, t, dist::ReduceOp::premul_sum(0.5));
      for (double v : t.to_vector()) EXPECT_EQ(v, 3.0) << "native " << native;
      Tensor u = full({1}, r == 0 ? 2.0 : 4.0, DType::Float64);
      dist::reduce(*pair, u, 1, dist::ReduceOp::premul_sum(0.5));
      EXPECT_EQ(u.to_vector()[0], r == 1 ? 3.0 : 2.0) << "native " << native;
    }
    Tensor w = full({5}, r + 1.0, DType::BFloat16);
    dist::all_reduce(world, w, dist::ReduceOp::premul_sum(0.5));
    for (double v : w.to_vector()) EXPECT_EQ(v, 0.5 * static_cast<double>(n * (n + 1) / 2));
    Tensor out = empty({1}, DType::Float64);
    dist::reduce_scatter_single(world, out, full({n}, r + 1.0, DType::Float64),
                                dist::ReduceOp::premul_sum(-2.0));
    EXPECT_EQ(out.to_vector()[0], -2.0 * static_cast<double>(n * (n + 1) / 2));
  }
}

// The native all_reduce's ring (reduce-scatter + all-gather over
// Isend/Irecv, MPI_Reduce_local per block): closed forms on sizes that split
// unevenly, chunked at max_count 3, and one answer on every rank where the
// order of a float sum matters.
// The ring runs on two members at every size and on more from 256 KiB, so
// the small cases run on the pair {0, 1} and one call above 256 KiB on the
// world.
static void ring_cases(const dist::ProcessGroup& world);

TEST(MpiNative, RingAllReduceMatchesClosedFormsOnEveryRank) {
  dist::Options opts;
  opts.native_reduction = true;
  const auto world = mpi::world(opts);
  if (auto pair = world.new_group({0, 1})) ring_cases(*pair);
  ring_cases(world);  // below 256 KiB: MPI_Iallreduce when more than two
  const int n = world.size(), r = world.rank();
  const int64_t big = (int64_t{256} << 10) / 4 + 5;  // float32 elements
  Tensor t = full({big}, r + 1.0, DType::Float32);
  dist::all_reduce(world, t, dist::ReduceOp::Sum);
  const auto got = t.to_vector();
  EXPECT_EQ(got.front(), n * (n + 1) / 2.0);
  EXPECT_EQ(got.back(), n * (n + 1) / 2.0);
  EXPECT_EQ(std::count(got.begin(), got.end(), n * (n + 1) / 2.0), big);
}

static void ring_cases(const dist::ProcessGroup& world) {
  const int n = world.size(), r = world.rank();
  const int64_t saved = mpi::max_count();
  for (int64_t max_count : {saved, int64_t{3}}) {
    mpi::set_max_count(max_count);
    for (int64_t len : {int64_t{n}, int64_t{n} + 1, 7 * int64_t{n} + 3, int64_t{1000}})
      for (DType dt : {DType::Float64, DType::Float32, DType::BFloat16, DType::Int32}) {
        std::vector<double> v(static_cast<std::size_t>(len));
        for (int64_t i = 0; i < len; ++i) v[static_cast<std::size_t>(i)] = r + i % 5;
        Tensor sum = from_vector(v, {len}, dt), mx = from_vector(v, {len}, dt);
        dist::all_reduce(world, sum, dist::ReduceOp::Sum);
        dist::all_reduce(world, mx, dist::ReduceOp::Max);
        const auto s = sum.to_vector(), m = mx.to_vector();
        for (int64_t i = 0; i < len; ++i) {
          const auto k = static_cast<double>(i % 5);
          EXPECT_EQ(s[static_cast<std::size_t>(i)], n * (n - 1) / 2 + n * k)
              << len << dtype_name(dt);
          EXPECT_EQ(m[static_cast<std::size_t>(i)], n - 1 + k) << len << dtype_name(dt);
        }
      }
    std::vector<double> v(1001);
    for (int i = 0; i < 1001; ++i)
      v[static_cast<std::size_t>(i)] = 1e8 * ((r + i) % 3) + 1.0 / (r + 1 + i % 7);
    Tensor t = from_vector(v, {1001}, DType::Float32);
    dist::all_reduce(world, t, dist::ReduceOp::Sum);
    Tensor first = from_vector(t.to_vector(), {1001}, DType::Float32);
    dist::broadcast(world, first, 0);
    EXPECT_EQ(std::memcmp(t.data_ptr(), first.data_ptr(), 1001 * sizeof(float)), 0) << "rank " << r;
  }
  mpi::set_max_count(saved);
}

// diffcomm's own messages travel on a duplicate communicator: a user's
// send with the tag they use (0x5d1c) still in flight when the receiver's
// all_gather posts its receives cannot be taken for the all_gather's data.
TEST(MpiSemantics, UserTagsNeverMatchDiffcommsOwnMessages) {
  dist::Options opts;
  opts.check = false;  // checked send/recv would wait for the receiver's envelope
  const auto world = mpi::world(opts);
  auto pair = world.new_group({0, 1});
  if (!pair) return;
  const int r = pair->rank();
  Tensor mine = full({4}, r + 1.0, DType::Float32), all = empty({8}, DType::Float32);
  Tensor user = full({4}, r == 0 ? 42.0 : 0.0, DType::Float32);
  if (r == 0) dist::send(*pair, user, 1, 0x5d1c);  // small: completes eagerly
  dist::all_gather_single(*pair, all, mine);
  if (r == 1) dist::recv(*pair, user, 0, 0x5d1c);
  EXPECT_EQ(all.to_vector(), (std::vector<double>{1, 1, 1, 1, 2, 2, 2, 2}));
  EXPECT_EQ(user.to_vector(), (std::vector<double>(4, 42.0)));
}

// ---------------------------------------------------------------- fault paths
// premul_sum(+0.0) on rank 0 and (-0.0) elsewhere is one reduction (the
// factors compare equal), also to checked mode's fingerprints: no mismatch,
// and 0 * sum on every rank.
TEST(MpiFaults, PlusAndMinusZeroPremulFactorsAgreeInCheckedMode) {
  dist::Options opts;
  opts.check = true;
  const auto world = mpi::world(opts);
  const int r = world.rank();
  Tensor t = full({3}, r + 1.0, DType::Float64);
  dist::all_reduce(world, t, dist::ReduceOp::premul_sum(r == 0 ? 0.0 : -0.0));
  for (double v : t.to_vector()) EXPECT_EQ(v, 0.0);
}

// The world with checked mode on and a 20 s deadline (the faults below must
// be reported well inside it).
static dist::ProcessGroup checked_world() {
  dist::Options opts;
  opts.check = true;
  opts.timeout_s = 20.0;
  return mpi::world(opts);
}

// A rank whose own arguments are wrong (input_splits that do not add up on
// rank 1 alone): in checked mode it still takes part in the members'
// agreement, carrying its error, so every peer raises CollectiveMismatch
// naming rank 1 and its error at once (well inside the 20 s deadline set
// here), and rank 1 raises InvalidArgument. The group goes on working.
TEST(MpiFaults, ARanksOwnBadArgumentsAreAnnouncedToItsPeers) {
  const auto world = checked_world();
  const int r = world.rank(), n = world.size();
  Tensor in = zeros({n, 2}, DType::Float64), out = zeros({n, 2}, DType::Float64);
  std::vector<int64_t> splits(static_cast<std::size_t>(n), 1);
  std::vector<int64_t> mine = splits;
  if (r == 1) mine[0] = 2;  // sums to n + 1: refused on rank 1 alone
  const auto start = std::chrono::steady_clock::now();
  try {
    dist::all_to_all_single(world, out, in, splits, mine);
    ADD_FAILURE() << "rank " << r << ": the call went through";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(r, 1) << e.what();
    EXPECT_NE(std::string(e.what()).find("input_splits sum to"), std::string::npos) << e.what();
  } catch (const CollectiveMismatch& e) {
    EXPECT_NE(r, 1) << e.what();
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 1 (global 1) refused its own call all_to_all_single("),
              std::string::npos)
        << what;
    EXPECT_NE(what.find(fmt::format("input_splits sum to {} but input has {} rows", n + 1, n)),
              std::string::npos)
        << what;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 5.0) << "rank " << r << " waited for its deadline";
  dist::barrier(world);  // the refused call took its number on every member: the group goes on
  Tensor t = full({2}, 1.0, DType::Float64);
  dist::all_reduce(world, t);
  for (double v : t.to_vector()) EXPECT_EQ(v, static_cast<double>(n));
}

// Two threads of one process on one group: the second is refused while the
// first is inside a call (rank 1 arrives late, so rank 0's first thread is
// still waiting), the refused call takes no call number, and the group goes
// on working. Every rank issues the all_reduce from a thread of its own and
// the barrier from main: the same threads in the same order on every rank.
TEST(MpiFaults, ASecondThreadOnABusyGroupIsRefused) {
  const auto world = mpi::world();
  const int r = world.rank();
  Tensor t = full({2}, 1.0, DType::Float64);
  if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(800));
  std::thread first([&] { dist::all_reduce(world, t); });
  if (r == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    try {
      dist::barrier(world);
      ADD_FAILURE() << "a second thread entered a busy MPI group";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("is inside all_reduce #"), std::string::npos)
          << e.what();
    }
  }
  first.join();
  for (double v : t.to_vector()) EXPECT_EQ(v, static_cast<double>(world.size()));
  dist::barrier(world);  // every rank's next call is the same call number
}

// Threads taking turns on one group (each call finishing before the next
// starts), issue [4/7] item 3. The same threads in the same order on every
// rank give the right sums; rank 0 alone moving a call to a new thread pairs
// it with the others' main-thread call, which checked mode now refuses on
// every member, naming both threads, instead of mixing their data.
TEST(MpiFaults, ThreadsTakingTurnsAtDifferentCallsAreAMismatch) {
  const auto world = checked_world();
  const int r = world.rank(), n = world.size();
  const auto on_worker = [](const std::function<void()>& f) {  // rethrows f's error here
    std::exception_ptr error;
    std::thread t([&] {
      try {
        f();
      } catch (...) {
        error = std::current_exception();
      }
    });
    t.join();
    if (error) std::rethrow_exception(error);
  };
  Tensor a = full({2}, 1.0, DType::Float64), b = full({2}, 2.0, DType::Float64);
  dist::all_reduce(world, a);                      // thread #0: main
  on_worker([&] { dist::all_reduce(world, b); });  // thread #1: a worker, on every rank
  dist::all_reduce(world, a);                      // thread #0 again
  for (double v : a.to_vector()) EXPECT_EQ(v, static_cast<double>(n * n));
  for (double v : b.to_vector()) EXPECT_EQ(v, 2.0 * n);

  const auto start = std::chrono::steady_clock::now();
  try {
    if (r == 0)
      on_worker([&] { dist::all_reduce(world, b); });  // a new thread (#2) on rank 0 only
    else
      dist::all_reduce(world, b);  // main (#0)
    ADD_FAILURE() << "rank " << r << ": threads taking turns at different calls went through";
  } catch (const CollectiveMismatch& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("calling thread differs"), std::string::npos) << what;
    EXPECT_NE(what.find("from its thread #2"), std::string::npos) << what;
    EXPECT_NE(what.find("from its thread #0"), std::string::npos) << what;
    // checked mode names where each member made the call, as the simulated world does
    EXPECT_NE(what.find(fmt::format("\ncalled at: {}:", __FILE__)), std::string::npos) << what;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 5.0) << "rank " << r << " waited for its deadline";
}

// A child forked after MPI was set up (issue [4/7] item 4) holds a copy of
// the parent's MPI state: in_forked_child() says so, and an Environment made
// and destroyed there leaves MPI alone (its destructor used to finalise, and
// hang, the parent's job at the child's exit), and a collective on the
// parent's group raises BackendError. The parents go on.
TEST(MpiFaults, AForkedChildLeavesTheParentsMpiAlone) {
  const auto world = mpi::world();
  EXPECT_FALSE(mpi::in_forked_child());
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int code = mpi::in_forked_child() ? 0 : 2;
    { const mpi::Environment again(nullptr, nullptr); }
    try {  // the parent's group: refused, where Open MPI aborted the job
      dist::barrier(world);
      code = 3;
    } catch (const BackendError& e) {
      if (std::string(e.what()).find("forked from the one that set MPI up") == std::string::npos)
        code = 4;
    }
    std::_Exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  Tensor t = full({2}, 1.0, DType::Float64);
  dist::all_reduce(world, t);
  for (double v : t.to_vector()) EXPECT_EQ(v, static_cast<double>(world.size()));
}

// ---------------------------------------------------------------- gradients across ranks
// Issue [4/8]'s cases on MPI, on the pair {0, 1}: the participation rule
// (dx = 3 on both ranks, was 2 and 4) and in-place writes to saved tensors
// after their forward use (the documented error, raised before any
// backward collective).
TEST(MpiGradients, EachRanksLossReachesADifferentCollective) {
  const auto world = mpi::world();
  const auto pair = world.new_group({0, 1});
  if (!pair) return;
  Tensor x = full({1}, 1.0, DType::Float64);
  x.set_requires_grad(true);
  Tensor y1 = nn::all_reduce(x, *pair);
  Tensor y2 = nn::all_reduce(scale(x, 2.0), *pair);
  backward({sum(pair->rank() == 0 ? y1 : y2)});
  EXPECT_EQ(x.grad().item(), 3.0);
}

TEST(MpiGradients, InPlaceWritesAfterTheForwardUseRaise) {
  const auto world = mpi::world();
  const auto pair = world.new_group({0, 1});
  if (!pair) return;
  const int r = pair->rank();
  {  // the DDP buffer sync: x = 2 / 3, buf = 5 / 7, loss = sum(x * buf), broadcast(buf)
    Tensor x = full({1}, r == 0 ? 2.0 : 3.0, DType::Float64);
    x.set_requires_grad(true);
    Tensor buf = full({1}, r == 0 ? 5.0 : 7.0, DType::Float64);
    Tensor loss = sum(mul(x, buf));
    dist::broadcast(*pair, buf, 0);
    EXPECT_THROW(backward({loss}), InvalidArgument);
  }
  for (dist::ReduceOp op : {dist::ReduceOp::Product, dist::ReduceOp::Max}) {
    Tensor x = full({1}, r == 0 ? 2.0 : 3.0, DType::Float64);
    x.set_requires_grad(true);
    Tensor y = nn::all_reduce(x, *pair, op);
    dist::all_reduce(*pair, x);
    EXPECT_THROW(backward({sum(y)}), InvalidArgument) << dist::reduce_op_name(op);
    pair->cohort()->discard();  // the refused backward left its collective pending
  }
  dist::barrier(*pair);
}

// ---------------------------------------------------------------- encoder-parallel step
// The same step on MPI and on the simulated world (run inside this process):
// routed rows, decoder inputs, encoder gradients and loss terms bit for bit
// (the step's sums are canonical: their order is the data's, not a
// backend's).
TEST(MpiEncoderParallel, StepMatchesTheSimulatedWorld) {
  const int n = mpi_size();
  struct MeshCase {
    int cp, tp;
    bool sp;
    encoder_parallel::CpLayout layout;
  };
  std::vector<MeshCase> meshes;
  if (n == 4) {
    meshes = {{2, 2, true, encoder_parallel::CpLayout::Zigzag},
              {2, 2, false, encoder_parallel::CpLayout::Contiguous},
              {1, 4, true, encoder_parallel::CpLayout::Contiguous},
              {1, 4, false, encoder_parallel::CpLayout::Contiguous}};
  } else {
    meshes = {{1, n, true, encoder_parallel::CpLayout::Contiguous}};
  }
  for (const auto& m : meshes) {
    encoder_parallel::StepConfig cfg;
    cfg.dp = 1;
    cfg.decoder = {m.cp, m.tp, m.sp, m.layout};
    cfg.encoder = {m.cp * m.tp, 1};
    cfg.hidden = 8;
    cfg.ffn = 8;
    cfg.ffn_blocks = 8;  // every tp up to 8 holds whole column blocks
    cfg.seed = 42;
    encoder_parallel::Batch b;
    b.samples.push_back({32, {{3, 9, 36, 1}, {17, 12, 48, 2}}});
    b.samples.push_back({16, {}});
    b.samples.push_back({48, {{0, 20, 80, 3}}});
    const std::vector<encoder_parallel::Batch> per_dp{b};

    const auto mine = encoder_parallel::run_step(mpi::world(), cfg, per_dp);

    sim::WorldOptions o;
    o.ranks = n;
    o.seed = 42;
    sim::World world(o);
    std::vector<encoder_parallel::StepRankResult> sim_results(static_cast<std::size_t>(n));
    world.run([&](sim::Rank& rank) {
      sim_results[static_cast<std::size_t>(rank.rank())] =
          encoder_parallel::run_step(rank.world(), cfg, per_dp);
    });
    const auto& ref = sim_results[static_cast<std::size_t>(mpi_rank())];
    EXPECT_EQ(mine.plan_fingerprint, ref.plan_fingerprint);
    EXPECT_EQ(mine.received_items, ref.received_items);
    EXPECT_EQ(mine.routed_rows.to_vector(), ref.routed_rows.to_vector())
        << "routed rows differ (cp " << m.cp << " tp " << m.tp << ")";
    EXPECT_EQ(mine.decoder_input.to_vector(), ref.decoder_input.to_vector());
    EXPECT_EQ(mine.encoder_grad.to_vector(), ref.encoder_grad.to_vector())
        << "cp " << m.cp << " tp " << m.tp << " sp " << m.sp;
    EXPECT_EQ(mine.loss_limbs, ref.loss_limbs);
  }
}

}  // namespace diffcomm

// Prints failures of non-root processes (their default printer is removed
// so the log has one copy of the progress).
class FailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[process %d] %s:%d: %s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
  }

 private:
  int rank_;
};

int main(int argc, char** argv) {
  diffcomm::mpi::Environment env(&argc, &argv);
  testing::InitGoogleTest(&argc, argv);
  const int rank = diffcomm::mpi_rank();
  if (rank != 0) {
    auto& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(rank));
  }
  int rc = RUN_ALL_TESTS();
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}
