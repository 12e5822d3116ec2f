// The fault paths of issue [7/8] that need no MPI: deadlines that must be
// finite, fingerprints that treat +0 and -0 as one factor, one thread per
// group, one run() per World, fiber stacks that run out, and graphs deeper
// than a fiber stack. (The MPI ones are in tests/mpi/.)
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/distributed/backend/fingerprint.hpp"
#include "diffcomm/distributed/backend/options.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm {
namespace {

using dist::ReduceOp;
using testing::HasSubstr;

// ---- deadlines --------------------------------------------------------------

struct EnvGuard {
  explicit EnvGuard(const char* value) {
    if (value)
      setenv("DIFFCOMM_TIMEOUT", value, 1);
    else
      unsetenv("DIFFCOMM_TIMEOUT");
  }
  ~EnvGuard() { unsetenv("DIFFCOMM_TIMEOUT"); }
};

TEST(Deadline, NonFiniteOrNonPositiveTimeoutsAreRefused) {
  for (const char* bad : {"nan", "NaN", "inf", "-inf", "0", "-1", "1e999", "1e10", "1000001"}) {
    SCOPED_TRACE(bad);
    EnvGuard env(bad);
    try {
      (void)dist::Options{}.resolved_timeout_s();
      FAIL() << "DIFFCOMM_TIMEOUT=" << bad << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("DIFFCOMM_TIMEOUT"));
      EXPECT_THAT(e.what(), HasSubstr("finite number of seconds > 0"));
    }
  }
  for (double bad : {std::nan(""), std::numeric_limits<double>::infinity(), 0.0, -3.0, 1e11}) {
    dist::Options o;
    o.timeout_s = bad;
    EXPECT_THROW((void)o.resolved_timeout_s(), InvalidArgument) << bad;
  }
  {
    EnvGuard longest("1e6");  // the longest deadline is kept
    EXPECT_EQ(dist::Options{}.resolved_timeout_s(), dist::Options::kMaxTimeoutS);
  }
  EnvGuard env("2.5");
  EXPECT_EQ(dist::Options{}.resolved_timeout_s(), 2.5);
  dist::Options o;
  o.timeout_s = 0.25;
  EXPECT_EQ(o.resolved_timeout_s(), 0.25);
}

// ---- fingerprints -------------------------------------------------------------

dist::Call premul_call(double factor) {
  dist::Call c;
  c.op = dist::OpType::AllReduce;
  c.group = "world";
  c.group_size = 2;
  c.dtype = DType::Float64;
  c.reduce_op = ReduceOp::premul_sum(factor);
  return c;
}

TEST(Fingerprint, PlusAndMinusZeroFactorsAgree) {
  dist::Call plus = premul_call(0.0), minus = premul_call(-0.0);
  EXPECT_TRUE(std::signbit(minus.reduce_op.factor()));
  EXPECT_EQ(dist::fingerprint(plus), dist::fingerprint(minus));
  EXPECT_TRUE(dist::fingerprints_agree({dist::fingerprint(plus), dist::fingerprint(minus)}));
  // ... while different factors still disagree, on the reduce op.
  dist::Call other = premul_call(0.5);
  EXPECT_FALSE(dist::fingerprints_agree({dist::fingerprint(plus), dist::fingerprint(other)}));
  EXPECT_STREQ(dist::fingerprint_field(dist::fingerprint(plus), dist::fingerprint(other)),
               "reduce op");
}

TEST(Fingerprint, TheFirstDifferingFieldIsNamed) {
  dist::Call a = premul_call(1.0), b = a;
  b.seq = 3;
  EXPECT_STREQ(dist::fingerprint_field(dist::fingerprint(a), dist::fingerprint(b)), "call number");
  b = a;
  b.dtype = DType::Float32;
  EXPECT_STREQ(dist::fingerprint_field(dist::fingerprint(a), dist::fingerprint(b)), "dtype");
  EXPECT_STREQ(dist::fingerprint_field(dist::fingerprint(a), dist::fingerprint(a)), "");
}

// A new_group facing a split with the same list is a mismatch on the fast
// path too (it was only one in the slow path and in checked MPI).
TEST(Fingerprint, NewGroupFacingSplitWithTheSameListDiffers) {
  dist::Call a;
  a.op = dist::OpType::NewGroup;
  a.group = "world";
  a.group_size = 2;
  a.members = {0, 1};
  a.members_are_ranks = true;
  dist::Call b = a;
  b.members_are_ranks = false;
  b.rank = 1;
  const std::vector<const dist::Call*> calls = {&a, &b};
  const std::string report = dist::compare(calls, std::vector<int>{0, 1});
  EXPECT_THAT(report, HasSubstr("kind of split (new_group vs split) differs"));
}

// ---- one thread per group -----------------------------------------------------

// A backend whose barrier waits until the test opens a gate; every other op
// only records its call number.
class GateBackend final : public dist::Backend {
 public:
  std::string backend_name() const override { return "gate"; }
  int rank() const override { return 0; }
  int size() const override { return 1; }
  int global_rank(int r) const override { return r; }
  bool supports(const Device& d) const override { return d.is_cpu(); }
  std::shared_ptr<Backend> split(dist::Call& c, int, int) override { return record(c), nullptr; }
  void barrier(dist::Call& c) override {
    record(c);
    std::unique_lock lock(mu_);
    entered_ = true;
    cv_.notify_all();
    cv_.wait(lock, [&] { return open_; });
  }
  void wait_entered() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return entered_; });
  }
  void open() {
    std::lock_guard lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  std::vector<uint64_t> seqs() {
    std::lock_guard lock(mu_);
    return seqs_;
  }
#define DIFFCOMM_GATE_OP(name) \
  void name(dist::Call& c) override { record(c); }
  DIFFCOMM_GATE_OP(all_reduce)
  DIFFCOMM_GATE_OP(broadcast)
  DIFFCOMM_GATE_OP(reduce)
  DIFFCOMM_GATE_OP(all_gather)
  DIFFCOMM_GATE_OP(all_gather_single)
  DIFFCOMM_GATE_OP(all_gather_v)
  DIFFCOMM_GATE_OP(gather)
  DIFFCOMM_GATE_OP(scatter)
  DIFFCOMM_GATE_OP(reduce_scatter)
  DIFFCOMM_GATE_OP(reduce_scatter_single)
  DIFFCOMM_GATE_OP(reduce_scatter_v)
  DIFFCOMM_GATE_OP(all_to_all)
  DIFFCOMM_GATE_OP(all_to_all_single)
  DIFFCOMM_GATE_OP(send)
  DIFFCOMM_GATE_OP(recv)
#undef DIFFCOMM_GATE_OP

 private:
  void record(const dist::Call& c) {
    std::lock_guard lock(mu_);
    seqs_.push_back(c.seq);
  }
  std::mutex mu_;
  std::condition_variable cv_;
  bool entered_ = false, open_ = false;
  std::vector<uint64_t> seqs_;
};

TEST(ThreadRule, ASecondThreadOnABusyGroupIsRefusedAndTakesNoCallNumber) {
  auto backend = std::make_shared<GateBackend>();
  const dist::ProcessGroup g(backend, "gate", nullptr);
  std::thread first([&] { dist::barrier(g); });  // call #0, held inside the backend
  backend->wait_entered();
  try {
    dist::all_reduce(g, full({2}, 1.0));
    ADD_FAILURE() << "a second thread entered a busy group";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("all_reduce on group 'gate' (gate backend, rank 0 of 1)"));
    EXPECT_THAT(e.what(), HasSubstr("is inside barrier #0 on this group"));
    EXPECT_THAT(e.what(), HasSubstr("one call at a time, from one thread at a time"));
  }
  backend->open();
  first.join();
  dist::all_reduce(g, full({2}, 1.0));  // free again, on any thread
  std::thread([&] { dist::barrier(g); }).join();
  EXPECT_EQ(backend->seqs(), (std::vector<uint64_t>{0, 1, 2}));
}

// Two threads taking turns (never at once) are fine: the rule is about
// concurrency, as c10d's, not about which thread.
TEST(ThreadRule, ThreadsTakingTurnsOnOneGroupAreAllowed) {
  auto backend = std::make_shared<GateBackend>();
  backend->open();
  const dist::ProcessGroup g(backend, "gate", nullptr);
  for (int i = 0; i < 4; ++i) std::thread([&] { dist::all_reduce(g, full({1}, 1.0)); }).join();
  EXPECT_EQ(backend->seqs().size(), 4u);
}

// ---- one run() per World --------------------------------------------------------

TEST(WorldRun, ASecondThreadIsRefusedWhileARunIsGoing) {
  sim::WorldOptions o;
  o.ranks = 2;
  sim::World world(o);
  std::atomic<bool> inside{false}, release{false};
  std::thread first([&] {
    world.run([&](sim::Rank& r) {
      if (r.rank() == 0) {
        inside = true;
        while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      dist::barrier(r.world());
    });
  });
  while (!inside) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  try {
    world.run([](sim::Rank&) {});
    ADD_FAILURE() << "a second run() started on a running World";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("already running on another thread"));
  }
  release = true;
  first.join();
  int ran = 0;
  world.run([&](sim::Rank& r) { ran += r.rank() + 1; });  // usable again afterwards
  EXPECT_EQ(ran, 3);
}

// ---- one seed, one report, whatever the heap ---------------------------------------

// A deadlock among several pending rendezvous: the order in which the world
// wakes the waiting ranks (and so which failure leads the report) depends on
// the seed only. It depended on the rendezvous' heap addresses: the same
// seed gave another report when the heap was laid out differently.
TEST(Determinism, ADeadlockReportDoesNotDependOnTheHeap) {
  auto report = [](int perturb) {
    std::vector<std::unique_ptr<char[]>> junk;  // shifts where the world's blocks land
    for (int i = 0; i < perturb; ++i) junk.emplace_back(new char[0x420 + 64 * i]);
    sim::WorldOptions o;
    o.ranks = 6;
    o.seed = 42;
    sim::World world(o);
    try {
      world.run([](sim::Rank& r) {
        // Even ranks wait in their pair's barrier, odd ranks in the world's:
        // four rendezvous pending, none can complete.
        auto pair = r.world().split(r.rank() / 2, r.rank(), {}, "pair");
        dist::barrier(r.rank() % 2 == 0 ? *pair : r.world());
      });
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string first = report(0);
  EXPECT_THAT(first, HasSubstr("deadlock"));
  for (int perturb = 1; perturb <= 8; ++perturb) EXPECT_EQ(report(perturb), first) << perturb;
}

// ---- out of memory: ResourceExhausted, whatever ran out ---------------------------

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAsan = true;
#else
constexpr bool kAsan = false;
#endif

// Issue [4/7] item 4: a rank whose own code runs out of memory (the standard
// library's std::bad_alloc, which names nothing) ends the run with
// ResourceExhausted naming the rank, not a plain Error reading
// "std::bad_alloc"; the other rank, waiting in a barrier, gets RankFailure.
TEST(WorldRun, ARanksOwnBadAllocIsResourceExhausted) {
  sim::WorldOptions o;
  o.ranks = 2;
  sim::World world(o);
  try {
    world.run([](sim::Rank& r) {
      if (r.rank() == 1) throw std::bad_alloc();
      dist::barrier(r.world());
    });
    FAIL() << "the run succeeded";
  } catch (const ResourceExhausted& e) {
    EXPECT_EQ(e.kind(), ErrorKind::ResourceExhausted);
    EXPECT_EQ(e.site().global_rank, 1);
    EXPECT_THAT(e.what(), HasSubstr("rank 1: out of memory: std::bad_alloc from an allocation "
                                    "outside diffcomm's tensors"));
    const auto& failures = sim::run_failures(e)->failures();
    ASSERT_EQ(failures.size(), 2u);
    EXPECT_THAT(e.what(), HasSubstr("rank 0: "));
  }
}

// A tensor too large for memory on a rank: OutOfMemory (a ResourceExhausted)
// naming the bytes, carried to World::run with its kind.
TEST(WorldRun, ATensorBeyondMemoryOnARankIsResourceExhaustedNamingTheBytes) {
  if (kAsan) GTEST_SKIP() << "AddressSanitizer aborts on requests of this size";
  sim::WorldOptions o;
  o.ranks = 2;
  sim::World world(o);
  try {
    world.run([](sim::Rank& r) {
      if (r.rank() == 0) (void)zeros(Shape{int64_t{1} << 45}, DType::Float32);
      dist::barrier(r.world());
    });
    FAIL() << "the run succeeded";
  } catch (const ResourceExhausted& e) {
    EXPECT_THAT(e.what(), HasSubstr("rank 0: diffcomm: cannot allocate 140737488355328 bytes"));
  }
}

// ---- fiber stacks that cannot be allocated ---------------------------------------

// The child of the test below: 1024 stacks of 1 MiB under a 512 MiB limit.
[[noreturn]] void run_world_beyond_the_limit() {
  rlimit limit{};
  limit.rlim_cur = limit.rlim_max = 512ull << 20;
  setrlimit(RLIMIT_AS, &limit);
  sim::WorldOptions o;
  o.ranks = 1024;
  o.stack_size = 1 << 20;
  sim::World world(o);
  try {
    world.run([](sim::Rank&) {});
    std::fprintf(stderr, "the world ran\n");
    std::_Exit(1);
  } catch (const ResourceExhausted& e) {
    std::fprintf(stderr, "%s\n", e.what());
    std::_Exit(0);
  }
}

// Under an address-space limit (ulimit -v 512 MiB) a world whose stacks need
// 1 GiB raises ResourceExhausted naming the ranks and the stack size, instead of
// std::terminate. In a child process (the limit must not reach the test
// runner).
TEST(WorldRun, StacksBeyondTheAddressSpaceLimitRaiseResourceExhausted) {
  if (kAsan) GTEST_SKIP() << "AddressSanitizer reserves more address space than the limit";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_world_beyond_the_limit(), testing::ExitedWithCode(0),
              "cannot allocate the fiber stack of rank [0-9]+ of 1024 \\(1048576 bytes each");
}

// ---- deep graphs -------------------------------------------------------------

// 100k differentiable collectives in one chain, forward, backward and freed,
// in a world with the default 256 KiB stacks (about 3500 overflowed it when
// the graph was freed recursively). Avg keeps the values finite: every link
// maps (x0, x1) to their mean, so d(sum of both ranks' y)/dx_r = 1.
TEST(DeepGraph, AHundredThousandCollectivesRunAndFree) {
  constexpr int kLinks = 100000;
  sim::WorldOptions o;
  o.ranks = 2;
  sim::World world(o);
  std::vector<double> dx(2), y(2);
  world.run([&](sim::Rank& r) {
    Tensor x = full({1}, r.rank() == 0 ? 1.0 : 3.0, DType::Float64);
    x.set_requires_grad(true);
    Tensor h = x;
    for (int i = 0; i < kLinks; ++i) h = nn::all_reduce(h, r.world(), ReduceOp::Avg);
    y[static_cast<std::size_t>(r.rank())] = h.item();
    backward({sum(h)});
    h = Tensor{};  // the whole chain is freed here, on the fiber's stack
    dx[static_cast<std::size_t>(r.rank())] = x.grad().item();
  });
  EXPECT_EQ(y, (std::vector<double>{2.0, 2.0}));
  EXPECT_EQ(dx, (std::vector<double>{1.0, 1.0}));
}

// Freeing an unused deep graph (no backward ran, every node still holds its
// saved tensors) on a small stack: saved inputs own their producers too.
TEST(DeepGraph, AnUnusedChainWithSavedTensorsFreesOnASmallStack) {
  sim::WorldOptions o;
  o.ranks = 1;
  o.stack_size = 64 * 1024;
  sim::World world(o);
  world.run([&](sim::Rank&) {
    Tensor x = full({4}, 1.0, DType::Float64);
    x.set_requires_grad(true);
    Tensor h = x;
    for (int i = 0; i < 100000; ++i) h = mul(h, h);  // mul saves both inputs
    h = Tensor{};
  });
  SUCCEED();
}

}  // namespace
}  // namespace diffcomm
