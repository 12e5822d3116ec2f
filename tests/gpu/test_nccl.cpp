// The NCCL backend on the CUDA devices of this machine (ctest label `gpu`):
// one process, one thread per device, world = the devices used (1 on a
// one-GPU machine; the multi-rank instances run where there are several).
//
//  - the backend conformance suite (tests/conformance/), on CPU tensors
//    staged through the devices (Options::stage_cpu), on NCCL's native
//    collectives (seed 0 in the test name) and with every rooted and
//    all-to-all op forced onto grouped ncclSend/ncclRecv (seed 1);
//  - the adjoint identity of every differentiable op: through staging with
//    sim::adjoint_terms (the same case bodies as the mpi and sim checks), and
//    on CUDA tensors end to end (forward and backward on the device);
//  - device-path specifics: list forms over one buffer and apart, the
//    ncclAlltoAll promise, streams and ordering, borrowed communicators,
//    aborts, deadlines, fingerprint mismatches in split.
//
// Without a CUDA device every test is skipped with "no CUDA device: ...".
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "conformance/backend_fixture.hpp"
#include "conformance/conformance_suite.hpp"
#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/backends/nccl.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/sim/adjoint.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm {
namespace {

constexpr int kMaxWorld = 8;

// ---------------------------------------------------------------- skipping
// Every test starts by skipping itself, with the reason, when the devices it
// needs are missing (so ctest reports each as skipped, not passed).
#define DIFFCOMM_REQUIRE_GPUS(n)                                                                \
  do {                                                                                          \
    if (nccl::device_count() == 0) GTEST_SKIP() << "no CUDA device: " << nccl::device_status(); \
    if (nccl::device_count() < (n))                                                             \
      GTEST_SKIP() << "needs " << (n) << " CUDA devices, found " << nccl::device_count();       \
  } while (0)

int world_size() { return std::min(nccl::device_count(), kMaxWorld); }

// ---------------------------------------------------------------- worlds
using RankBody = std::function<void(const dist::ProcessGroup& world, int rank)>;

/// Runs body on a world of n ranks, rank r on device r in its own thread,
/// each with an owned communicator made from one unique id. Returns each
/// rank's exception text ("" when it finished).
std::vector<std::string> run_world(int n, const std::function<nccl::Options(int)>& options,
                                   const RankBody& body) {
  const ncclUniqueId id = nccl::unique_id();
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        const dist::ProcessGroup world = nccl::init_rank(id, n, r, r, options(r));
        body(world, r);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

std::function<nccl::Options(int)> same(nccl::Options o) {
  return [o](int) { return o; };
}

/// Options of the checking runs: CPU tensors staged, and a 120 s deadline so
/// that a bug that leaves members waiting fails the test instead of hanging.
nccl::Options checking(bool stage_cpu = true) {
  nccl::Options o;
  o.stage_cpu = stage_cpu;
  o.timeout_s = 120;
  return o;
}

void expect_no_errors(const std::vector<std::string>& errors, const std::string& what) {
  for (std::size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) ADD_FAILURE() << what << ": rank " << r << " failed: " << errors[r];
}

Tensor on(int device, const Tensor& t) { return t.to(Device::cuda(device)); }

}  // namespace

// ---------------------------------------------------------------- conformance
namespace conformance {
namespace {

class NcclRunner final : public BackendRunner {
 public:
  explicit NcclRunner(bool native) : native_(native) {}
  std::string name() const override { return "nccl"; }
  // Without any device every world is "possible" here, so that the fixture
  // does not skip with "runs at most 0 ranks" but run() skips with the reason.
  int max_world() const override {
    const int devices = nccl::device_count();
    return devices == 0 ? kMaxWorld : std::min(devices, kMaxWorld);
  }
  void run(int n, RankFn fn) override {
    if (nccl::device_count() == 0) GTEST_SKIP() << "no CUDA device: " << nccl::device_status();
    nccl::Options o = checking();
    o.prefer_native = native_;
    const auto errors =
        run_world(n, same(o), [&](const dist::ProcessGroup& g, int r) { fn(g, r); });
    expect_no_errors(
        errors, "nccl world of " + std::to_string(n) + (native_ ? " (native)" : " (send/recv)"));
  }

 private:
  bool native_;
};

// seed 0: NCCL's native collectives where available; seed 1: gather,
// scatter (and every list/v form) on grouped ncclSend/ncclRecv.
// The suite compares with ==, and NCCL's Avg on floating dtypes multiplies
// each contribution by 1/size before summing (PreMulSum), which is exact only
// when size is a power of two. Worlds 1 and 2 (every group of the suite has 1
// or 2 members) run every dtype; worlds 4 and 8 (whose `sub` groups have 3
// and 7 members) run the integer dtypes, where Avg is refused and every
// other case is exact. Floating reductions on groups of every size, Avg with
// a tolerance, are NcclDevice.FloatReductionsOnGroupsOfEverySize.
std::vector<ConformanceParam> nccl_params() {
  const DType all[] = {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16,
                       DType::Int32,   DType::Int64,   DType::UInt8};
  std::vector<ConformanceParam> out;
  for (int n : {1, 2})
    for (DType dt : all) out.push_back({n, dt, 0});
  for (int n : {4, 8})
    for (DType dt : {DType::Int64, DType::Int32, DType::UInt8}) out.push_back({n, dt, 0});
  for (int n : {1, 2})
    for (DType dt : {DType::Float32, DType::BFloat16}) out.push_back({n, dt, 1});
  for (int n : {4, 8}) out.push_back({n, DType::Int64, 1});
  return out;
}

}  // namespace

std::unique_ptr<BackendRunner> make_backend_runner(const ConformanceParam& param) {
  return std::make_unique<NcclRunner>(param.seed == 0);
}

INSTANTIATE_TEST_SUITE_P(Nccl, ConformanceTest, testing::ValuesIn(nccl_params()),
                         conformance_param_name);

}  // namespace conformance

// ---------------------------------------------------------------- adjoints
namespace {

struct Terms {
  double lhs = 0, rhs = 0;
};

void expect_identity(const std::vector<std::vector<Terms>>& terms,
                     const std::vector<std::string>& labels, double tol) {
  for (std::size_t k = 0; k < terms.size(); ++k) {
    double lhs = 0, rhs = 0;
    for (const Terms& t : terms[k]) {
      lhs += t.lhs;
      rhs += t.rhs;
    }
    const double rel = std::abs(lhs - rhs) / std::max({std::abs(lhs), std::abs(rhs), 1e-300});
    EXPECT_LE(rel, tol) << labels[k] << ": sum <A x, y> = " << lhs << ", sum <x, A^T y> = " << rhs;
  }
}

}  // namespace

// sim::adjoint_terms (CPU tensors) through the staging path, like the mpi check.
TEST(NcclAdjoint, EveryOpThroughStaging) {
  DIFFCOMM_REQUIRE_GPUS(1);
  const int n = world_size();
  struct Case {
    std::string op;
    uint64_t seed;
    DType dtype;
  };
  std::vector<Case> cases;
  std::vector<std::string> labels;
  for (const std::string& op : sim::differentiable_ops())
    for (uint64_t seed = 0; seed < 3; ++seed)
      for (DType dt : {DType::Float64, DType::Float32}) {
        cases.push_back({op, seed, dt});
        labels.push_back(op + " seed " + std::to_string(seed) + " " + dtype_name(dt));
      }
  std::vector<std::vector<Terms>> terms(cases.size(),
                                        std::vector<Terms>(static_cast<std::size_t>(n)));
  const auto errors = run_world(n, same(checking()), [&](const dist::ProcessGroup& world, int r) {
    for (std::size_t k = 0; k < cases.size(); ++k) {
      const sim::AdjointCase c = sim::draw_adjoint_case(n, cases[k].seed);
      Generator gen(cases[k].seed * 7919 + static_cast<uint64_t>(r));
      const auto [l, rr] = sim::adjoint_terms(cases[k].op, world, c, cases[k].dtype, gen);
      terms[k][static_cast<std::size_t>(r)] = {l, rr};
    }
  });
  expect_no_errors(errors, "adjoints through staging");
  expect_identity(terms, labels, 1e-5);
}

// Forward and backward of every differentiable op on CUDA tensors (the
// device paths, no staging: a CPU tensor reaching the backend would be
// refused), float64 integers, so the identity holds exactly.
TEST(NcclAdjoint, EveryOpOnCudaTensors) {
  DIFFCOMM_REQUIRE_GPUS(1);
  const int n = world_size();
  std::vector<std::string> ops = sim::differentiable_ops();
  ops.push_back("all_reduce_avg");
  std::vector<std::pair<std::string, uint64_t>> cases;
  std::vector<std::string> labels;
  for (const std::string& op : ops)
    for (uint64_t seed = 0; seed < 3; ++seed) {
      cases.emplace_back(op, seed);
      labels.push_back(op + " seed " + std::to_string(seed) + " on CUDA tensors");
    }
  std::vector<std::vector<Terms>> terms(cases.size(),
                                        std::vector<Terms>(static_cast<std::size_t>(n)));
  const auto errors = run_world(
      n, same(checking(/*stage_cpu=*/false)), [&](const dist::ProcessGroup& world, int r) {
        for (std::size_t k = 0; k < cases.size(); ++k) {
          const sim::AdjointCase c = sim::draw_adjoint_case(n, cases[k].second);
          Generator gen(cases[k].second * 104729 + static_cast<uint64_t>(r));
          // The same case bodies as sim and mpi, with data on this rank's
          // device (a CPU tensor reaching the backend would be refused: no
          // staging in this world).
          const auto [l, rr] =
              sim::adjoint_terms(cases[k].first, world, c, DType::Float64, gen, Device::cuda(r));
          terms[k][static_cast<std::size_t>(r)] = {l, rr};
        }
      });
  expect_no_errors(errors, "adjoints on CUDA tensors");
  expect_identity(terms, labels, 1e-12);
}

// ---------------------------------------------------------------- device paths
// List forms whose tensors are rows of one buffer go to NCCL as is; lists of
// separate tensors go through a staging buffer. Both must give the closed
// forms, on the native and on the send/recv paths.
TEST(NcclDevice, ListFormsOnOneBufferAndApart) {
  DIFFCOMM_REQUIRE_GPUS(1);
  const int n = world_size();
  for (bool native : {true, false}) {
    nccl::Options o = checking(false);
    o.prefer_native = native;
    const auto errors = run_world(n, same(o), [&](const dist::ProcessGroup& g, int r) {
      const Device dev = Device::cuda(r);
      const int64_t k = 5;
      for (bool apart : {false, true}) {
        const std::string what = std::string(native ? "native" : "send/recv") +
                                 (apart ? ", separate tensors" : ", one buffer");
        Tensor buf = full({n * k}, -1.0, DType::Float32, dev);
        auto list = [&](const Tensor& b) {
          std::vector<Tensor> v;
          for (int s = 0; s < n; ++s)
            v.push_back(apart ? full({k}, -1.0, DType::Float32, dev) : b.row_view(s * k, k));
          return v;
        };
        // all_gather: outputs[s] = s + 1
        std::vector<Tensor> outs = list(buf);
        dist::all_gather(g, outs, full({k}, r + 1.0, DType::Float32, dev));
        for (int s = 0; s < n; ++s)
          for (double x : outs[static_cast<std::size_t>(s)].to_vector())
            EXPECT_EQ(x, s + 1.0) << what << ", all_gather";
        // reduce_scatter: inputs[j] = r + j -> output = sum_s (s + r_out)
        std::vector<Tensor> ins = list(buf);
        for (int j = 0; j < n; ++j) ins[static_cast<std::size_t>(j)].fill_(r + j);
        Tensor rs = zeros({k}, DType::Float32, dev);
        dist::reduce_scatter(g, rs, ins);
        for (double x : rs.to_vector())
          EXPECT_EQ(x, n * (n - 1) / 2.0 + n * r) << what << ", reduce_scatter";
        // gather to the last member, scatter from it
        const int root = n - 1;
        std::vector<Tensor> gouts;
        if (r == root) gouts = list(buf);
        dist::gather(g, gouts, full({k}, 10.0 + r, DType::Float32, dev), root);
        for (int s = 0; s < static_cast<int>(gouts.size()); ++s)
          for (double x : gouts[static_cast<std::size_t>(s)].to_vector())
            EXPECT_EQ(x, 10.0 + s) << what << ", gather";
        std::vector<Tensor> sins;
        if (r == root) {
          sins = list(buf);
          for (int s = 0; s < n; ++s) sins[static_cast<std::size_t>(s)].fill_(20.0 + s);
        }
        Tensor sout = zeros({k}, DType::Float32, dev);
        dist::scatter(g, sout, sins, root);
        for (double x : sout.to_vector()) EXPECT_EQ(x, 20.0 + r) << what << ", scatter";
      }
      nccl::synchronize(g);
    });
    expect_no_errors(errors, native ? "list forms (native)" : "list forms (send/recv)");
  }
}

// Sum, Product, Min and Max of floating dtypes on groups of 1..N members
// (sizes that are not powers of two included) are exact; Avg is NCCL's
// PreMulSum, compared with a tolerance of the dtype.
TEST(NcclDevice, FloatReductionsOnGroupsOfEverySize) {
  DIFFCOMM_REQUIRE_GPUS(1);
  const int n = world_size();
  const auto errors =
      run_world(n, same(checking(false)), [&](const dist::ProcessGroup& world, int r) {
        for (int k = 1; k <= n; ++k) {
          std::vector<int> first(static_cast<std::size_t>(k));
          std::iota(first.begin(), first.end(), 0);
          const auto g = world.new_group(first);
          if (!g) continue;
          const int me = g->rank();
          for (DType dt : {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16}) {
            const double tol = dt == DType::Float64 ? 1e-12 : dt == DType::Float32 ? 1e-6 : 1e-2;
            const int64_t len = 6;
            auto contribution = [&](dist::ReduceOp op, int s, int64_t i) {
              if (op == dist::ReduceOp::Product) return s % 2 == 1 ? 2.0 : 1.0;
              return static_cast<double>(s + 1 + i % 3);
            };
            auto expected = [&](dist::ReduceOp op, int64_t i) {
              double sum = 0, prod = 1;
              for (int s = 0; s < k; ++s) {
                sum += contribution(op, s, i);
                prod *= contribution(op, s, i);
              }
              switch (op) {
                case dist::ReduceOp::Sum: return sum;
                case dist::ReduceOp::Avg: return sum / k;
                case dist::ReduceOp::PremulSum: return op.factor() * sum;
                case dist::ReduceOp::Product: return prod;
                case dist::ReduceOp::Min: return contribution(op, 0, i);
                case dist::ReduceOp::Max: return contribution(op, k - 1, i);
              }
              return 0.0;
            };
            for (dist::ReduceOp op :
                 {dist::ReduceOp(dist::ReduceOp::Sum), dist::ReduceOp(dist::ReduceOp::Avg),
                  dist::ReduceOp(dist::ReduceOp::Product), dist::ReduceOp(dist::ReduceOp::Min),
                  dist::ReduceOp(dist::ReduceOp::Max), dist::ReduceOp::premul_sum(0.5)}) {
              std::vector<double> v(static_cast<std::size_t>(len));
              for (int64_t i = 0; i < len; ++i)
                v[static_cast<std::size_t>(i)] = contribution(op, me, i);
              Tensor t = on(r, from_vector(v, {len}, dt));
              dist::all_reduce(*g, t, op);
              const auto got = t.to_vector();
              for (int64_t i = 0; i < len; ++i) {
                const double e = expected(op, i), x = got[static_cast<std::size_t>(i)];
                if (op == dist::ReduceOp::Avg)
                  EXPECT_NEAR(x, e, tol * std::abs(e))
                      << dtype_name(dt) << " avg over " << k << " members";
                else
                  EXPECT_EQ(x, e) << dtype_name(dt) << " " << dist::reduce_op_name(op) << " over "
                                  << k << " members, element " << i;
              }
            }
          }
        }
      });
  expect_no_errors(errors, "float reductions");
}

// Options::even_all_to_all: ncclAlltoAll (NCCL >= 2.28) for even splits,
// and a local InvalidArgument, before any traffic, for uneven ones.
TEST(NcclDevice, EvenAllToAllPromise) {
  DIFFCOMM_REQUIRE_GPUS(1);
  const int n = world_size();
  RecordProperty("native_gather_scatter_all_to_all",
                 nccl::has_native_gather_scatter_all_to_all() ? "yes" : "no");
  RecordProperty("nccl_runtime_version", nccl::runtime_version());
  nccl::Options o = checking(false);
  o.even_all_to_all = true;
  const auto errors = run_world(n, same(o), [&](const dist::ProcessGroup& g, int r) {
    const Device dev = Device::cuda(r);
    const int64_t rows = 3, cols = 4;
    // Block j of rank r holds 100 r + j.
    std::vector<double> v;
    for (int j = 0; j < n; ++j)
      for (int64_t i = 0; i < rows * cols; ++i) v.push_back(100.0 * r + j);
    Tensor in = on(r, from_vector(v, {n * rows, cols}, DType::Float32));
    Tensor out = full({n * rows, cols}, -1.0, DType::Float32, dev);
    dist::all_to_all_single(g, out, in);
    const auto got = out.to_vector();
    for (int s = 0; s < n; ++s)
      for (int64_t i = 0; i < rows * cols; ++i)
        EXPECT_EQ(got[static_cast<std::size_t>(s * rows * cols + i)], 100.0 * s + r)
            << "block from " << s;
    if (n >= 2) {  // uneven on every rank: every rank refuses locally
      dist::Splits in_s, out_s;
      for (int j = 0; j < n; ++j) {
        in_s.push_back(j + 1);
        out_s.push_back(r + 1);
      }
      const int64_t in_rows = std::accumulate(in_s.begin(), in_s.end(), int64_t{0});
      EXPECT_THROW(
          dist::all_to_all_single(g, zeros({n * (r + 1), cols}, DType::Float32, dev),
                                  zeros({in_rows, cols}, DType::Float32, dev), out_s, in_s),
          InvalidArgument);
    }
    nccl::synchronize(g);
  });
  expect_no_errors(errors, "even all_to_all_single");
}

// Ops run on the group's stream; with order_with_current_stream they are
// ordered with diffcomm's tensor kernels (legacy default stream) even on a
// non-blocking stream; set_stream moves later ops.
TEST(NcclStreams, GroupStreamAndDefaultStreamOrdering) {
  DIFFCOMM_REQUIRE_GPUS(1);
  const int n = world_size();
  std::vector<cudaStream_t> streams(static_cast<std::size_t>(n), nullptr);
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
    ASSERT_EQ(
        cudaStreamCreateWithFlags(&streams[static_cast<std::size_t>(r)], cudaStreamNonBlocking),
        cudaSuccess);
  }
  const auto errors = run_world(
      n,
      [&](int r) {
        nccl::Options o;
        o.stream = streams[static_cast<std::size_t>(r)];
        return o;
      },
      [&](const dist::ProcessGroup& g, int r) {
        EXPECT_EQ(nccl::stream(g), streams[static_cast<std::size_t>(r)]);
        EXPECT_TRUE(nccl::owns_comm(g));
        EXPECT_EQ(nccl::device(g), r);
        const int64_t big = int64_t{1} << 22;
        Tensor x = empty({big}, DType::Float32, Device::cuda(r));
        x.fill_(r + 1.0);  // legacy default stream
        Tensor y = empty({n * big}, DType::Float32, Device::cuda(r));
        dist::all_gather_single(g, y, x);  // the group's non-blocking stream
        Tensor z = y.copy_data();          // legacy default stream again, no explicit sync
        const auto got = z.to_vector();
        for (int s = 0; s < n; ++s) {
          EXPECT_EQ(got[static_cast<std::size_t>(s * big)], s + 1.0);
          EXPECT_EQ(got[static_cast<std::size_t>((s + 1) * big - 1)], s + 1.0);
        }
        nccl::set_stream(g, nullptr);  // the default stream
        EXPECT_EQ(nccl::stream(g), nullptr);
        Tensor t = full({8}, 1.0, DType::Float32, Device::cuda(r));
        dist::all_reduce(g, t);
        nccl::synchronize(g);
        for (double v : t.to_vector()) EXPECT_EQ(v, static_cast<double>(n));
      });
  expect_no_errors(errors, "streams");
  for (int r = 0; r < n; ++r) {
    cudaSetDevice(r);
    cudaStreamDestroy(streams[static_cast<std::size_t>(r)]);
  }
}

// ---------------------------------------------------------------- borrowed communicators
TEST(NcclBorrowed, WrapsATrainersCommunicatorWithoutOwningIt) {
  DIFFCOMM_REQUIRE_GPUS(1);
  const int n = world_size();
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        // The trainer's own communicator and stream.
        ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
        ncclComm_t comm = nullptr;
        ASSERT_EQ(ncclCommInitRank(&comm, n, id, r), ncclSuccess);
        cudaStream_t s = nullptr;
        ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
        {
          const dist::ProcessGroup g = nccl::from_comm(comm, s, {}, "trainer");
          EXPECT_FALSE(nccl::owns_comm(g));
          EXPECT_EQ(nccl::comm(g), comm);
          EXPECT_EQ(nccl::stream(g), s);
          EXPECT_EQ(g.rank(), r);
          EXPECT_EQ(g.size(), n);
          EXPECT_THROW(nccl::abort(g), InvalidArgument);
          Tensor x = full({1000}, r + 1.0, DType::Float32, Device::cuda(r));
          dist::all_reduce(g, x);
          nccl::synchronize(g);
          for (double v : x.to_vector()) EXPECT_EQ(v, n * (n + 1) / 2.0);
          // A sub-group of a borrowed communicator is a new, owned one.
          auto sub = g.new_group({0});
          EXPECT_EQ(sub.has_value(), r == 0);
          if (sub) {
            EXPECT_TRUE(nccl::owns_comm(*sub));
            EXPECT_EQ(sub->members(), std::vector<int>{0});
          }
        }
        // The group is gone; the trainer's communicator and stream still work.
        float* buf = nullptr;
        ASSERT_EQ(cudaMalloc(&buf, sizeof(float)), cudaSuccess);
        const float one = 1.0f;
        ASSERT_EQ(cudaMemcpy(buf, &one, sizeof one, cudaMemcpyHostToDevice), cudaSuccess);
        ASSERT_EQ(ncclAllReduce(buf, buf, 1, ncclFloat32, ncclSum, comm, s), ncclSuccess);
        ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        float got = 0;
        ASSERT_EQ(cudaMemcpy(&got, buf, sizeof got, cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(got, static_cast<float>(n));
        cudaFree(buf);
        EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);
        cudaStreamDestroy(s);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  expect_no_errors(errors, "borrowed communicator");
}

// ---------------------------------------------------------------- errors
TEST(NcclErrors, BadArgumentsAreRefusedLocally) {
  DIFFCOMM_REQUIRE_GPUS(1);
  EXPECT_THROW(nccl::from_comm(nullptr, nullptr), InvalidArgument);
  const ncclUniqueId id = nccl::unique_id();
  EXPECT_THROW(nccl::init_rank(id, 0, 0, 0), InvalidArgument);
  EXPECT_THROW(nccl::init_rank(id, 2, 2, 0), InvalidArgument);
  EXPECT_THROW(nccl::init_rank(id, 1, 0, nccl::device_count()), InvalidArgument);
  nccl::Options bad;
  bad.members = {3, 3};
  EXPECT_THROW(nccl::init_rank(id, 2, 0, 0, bad), InvalidArgument);
  const auto errors = run_world(1, same(nccl::Options{}), [&](const dist::ProcessGroup& g, int) {
    // CPU tensors need Options::stage_cpu; the funnel refuses them first.
    Tensor cpu = zeros({4});
    EXPECT_THROW(dist::all_reduce(g, cpu), InvalidArgument);
    if (nccl::device_count() >= 2) {  // a tensor on another device than the group's
      EXPECT_THROW(dist::all_reduce(g, zeros({4}, DType::Float32, Device::cuda(1))),
                   InvalidArgument);
    }
  });
  expect_no_errors(errors, "bad arguments");
}

TEST(NcclErrors, AnAbortedGroupRaisesBackendErrorNamingTheOp) {
  DIFFCOMM_REQUIRE_GPUS(1);
  const auto errors = run_world(1, same(nccl::Options{}), [&](const dist::ProcessGroup& g, int) {
    Tensor t = ones({4}, DType::Float32, Device::cuda(0));
    dist::all_reduce(g, t);
    nccl::abort(g);
    try {
      dist::all_reduce(g, t);
      ADD_FAILURE() << "all_reduce on an aborted communicator did not raise";
    } catch (const BackendError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("all_reduce #1"), std::string::npos) << what;
      EXPECT_NE(what.find("group 'world'"), std::string::npos) << what;
      EXPECT_NE(what.find("aborted"), std::string::npos) << what;
    }
    EXPECT_THROW(dist::barrier(g), BackendError);
    EXPECT_THROW(g.new_group({0}), BackendError);
  });
  expect_no_errors(errors, "abort");
}

// A member waits for a message nobody sends: the deadline of its host wait
// aborts its owned communicator and raises Timeout instead of hanging.
TEST(NcclErrors, DeadlineTurnsAHostWaitIntoTimeout) {
  DIFFCOMM_REQUIRE_GPUS(2);
  nccl::Options o;
  o.timeout_s = 2.0;
  std::atomic<bool> rank0_done{false};
  const auto errors = run_world(2, same(o), [&](const dist::ProcessGroup& g, int r) {
    if (r == 0) {
      Tensor t = zeros({16}, DType::Float32, Device::cuda(0));
      const auto start = std::chrono::steady_clock::now();
      try {
        dist::recv(g, t, 1);  // enqueued: returns without waiting
        nccl::synchronize(g);
        ADD_FAILURE() << "a recv nobody matches completed";
      } catch (const Timeout& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("timed out after 2 s"), std::string::npos) << what;
        EXPECT_NE(what.find("synchronize"), std::string::npos) << what;
        EXPECT_NE(what.find("aborted"), std::string::npos) << what;
      }
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
      EXPECT_THROW(dist::barrier(g), BackendError);  // aborted: refused at once
      rank0_done = true;
      return;
    }
    // Rank 1 posts nothing; once rank 0 has timed out it gives up its side
    // too (an abort, so that destroying it waits for nobody).
    while (!rank0_done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    nccl::abort(g);
  });
  expect_no_errors(errors, "deadline of a host wait");
}

// The same hang without any host wait: the op still in flight past the
// deadline is named by the group's next op (no synchronization per op).
TEST(NcclErrors, DeadlineOfAnOpInFlightRaisesAtTheNextOp) {
  DIFFCOMM_REQUIRE_GPUS(2);
  nccl::Options o;
  o.timeout_s = 1.0;
  std::atomic<bool> rank0_done{false};
  const auto errors = run_world(2, same(o), [&](const dist::ProcessGroup& g, int r) {
    if (r == 0) {
      Tensor t = zeros({16}, DType::Float32, Device::cuda(0));
      dist::recv(g, t, 1);
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      try {
        dist::all_reduce(g, t);
        ADD_FAILURE() << "an op after an overdue recv was enqueued";
      } catch (const Timeout& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("waiting in recv #0"), std::string::npos) << what;
        EXPECT_NE(what.find("aborted"), std::string::npos) << what;
      }
      rank0_done = true;
      return;
    }
    while (!rank0_done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    nccl::abort(g);
  });
  expect_no_errors(errors, "deadline of an op in flight");
}

// Members that pass different fingerprints to split all get
// CollectiveMismatch, before ncclCommSplit: the group stays usable.
TEST(NcclErrors, SplitFingerprintMismatchIsRaisedOnEveryMember) {
  DIFFCOMM_REQUIRE_GPUS(2);
  const int n = world_size();
  const auto errors = run_world(n, same(checking(false)), [&](const dist::ProcessGroup& g, int r) {
    EXPECT_THROW(g.split(0, r, {static_cast<int64_t>(r)}, "mismatched"), CollectiveMismatch);
    Tensor t = ones({3}, DType::Float32, Device::cuda(r));
    dist::all_reduce(g, t);
    for (double v : t.to_vector()) EXPECT_EQ(v, static_cast<double>(n));
  });
  expect_no_errors(errors, "split fingerprints");
}

}  // namespace diffcomm
