// Simulated-world collectives against their floors, measured in the same run:
//  - BM_BareFiberBarrier: N plain Boost.Fiber fibers on a boost::fibers::barrier
//    (the cost of N context switches per round: the floor of any rendezvous);
//  - BM_Memcpy: memcpy of the bytes a collective must move;
//  - BM_Sim*: barrier, all_reduce and all_to_all_single in a sim::World.
// Each Sim/Bare benchmark runs `rounds` operations inside one world run and
// reports manual time per operation, so fiber creation is not counted.
// Counters: us_per_op, ns_per_rank (time per op / ranks), GBps (bytes the op
// must move / time), max_rss_MiB (peak resident set of the process so far).
#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <boost/fiber/all.hpp>
#include <chrono>
#include <cstring>
#include <vector>

#include "diffcomm/dist/collectives.hpp"
#include "diffcomm/sim/world.hpp"

using namespace diffcomm;
using Clock = std::chrono::steady_clock;

namespace {

double max_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // ru_maxrss is KiB on Linux
}

int rounds_for(int64_t ranks, int64_t bytes) {
  // Keep each world run around a few hundred ms in Release.
  const double work = static_cast<double>(ranks) * (static_cast<double>(bytes) + 2048.0);
  const int r = static_cast<int>(2e8 / work);
  return std::max(2, std::min(r, 200));
}

sim::WorldOptions options(int ranks) {
  sim::WorldOptions o;
  o.ranks = ranks;
  o.seed = 1;
  o.schedule = sim::Schedule::RoundRobin;
  o.stack_size = 64 * 1024;
  o.trace = false;
  return o;
}

void report(benchmark::State& state, double seconds, int rounds, int64_t ranks,
            double bytes_moved) {
  const double per_op = seconds / rounds;
  state.SetIterationTime(per_op);
  state.counters["us_per_op"] = per_op * 1e6;
  state.counters["ns_per_rank"] = per_op * 1e9 / static_cast<double>(ranks);
  if (bytes_moved > 0) state.counters["GBps"] = bytes_moved / per_op / 1e9;
  state.counters["max_rss_MiB"] = max_rss_mib();
}

// ---------------------------------------------------------------- floors
void BM_BareFiberBarrier(benchmark::State& state) {
  const int ranks = static_cast<int>(state.range(0));
  const int rounds = rounds_for(ranks, 8);
  for (auto _ : state) {
    boost::fibers::use_scheduling_algorithm<boost::fibers::algo::round_robin>();
    boost::fibers::barrier barrier(static_cast<std::size_t>(ranks));
    Clock::time_point t0, t1;
    std::vector<boost::fibers::fiber> fibers;
    for (int r = 0; r < ranks; ++r)
      fibers.emplace_back(std::allocator_arg, boost::fibers::fixedsize_stack(64 * 1024), [&, r] {
        barrier.wait();
        if (r == 0) t0 = Clock::now();
        for (int i = 0; i < rounds; ++i) barrier.wait();
        if (r == 0) t1 = Clock::now();
      });
    for (auto& f : fibers) f.join();
    report(state, std::chrono::duration<double>(t1 - t0).count(), rounds, ranks, 0);
  }
}

void BM_Memcpy(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  std::vector<char> a(bytes, 1), b(bytes, 0);
  for (auto _ : state) {
    const auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    benchmark::DoNotOptimize(b.data());
    benchmark::ClobberMemory();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    state.SetIterationTime(s);
  }
  state.counters["GBps"] =
      benchmark::Counter(static_cast<double>(bytes) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
}

// ---------------------------------------------------------------- sim collectives
enum class Op { Barrier, AllReduce, AllToAllSingle };

void run_sim(benchmark::State& state, Op op) {
  const int ranks = static_cast<int>(state.range(0));
  const int64_t bytes = op == Op::Barrier ? 0 : state.range(1);  // per rank
  const int rounds = rounds_for(ranks, bytes);
  for (auto _ : state) {
    sim::World world(options(ranks));
    Clock::time_point t0, t1;
    world.run([&](sim::Rank& rank) {
      const auto& g = rank.world();
      int64_t elems = std::max<int64_t>(bytes / 4, 1);
      if (op == Op::AllToAllSingle) elems = std::max<int64_t>(elems / ranks, 1) * ranks;
      Tensor x = op == Op::Barrier ? Tensor{} : full({elems}, 1.0, DType::Float32);
      Tensor y = op == Op::AllToAllSingle ? empty_like(x) : Tensor{};
      dist::barrier(g);
      if (rank.rank() == 0) t0 = Clock::now();
      for (int i = 0; i < rounds; ++i) {
        switch (op) {
          case Op::Barrier: dist::barrier(g); break;
          case Op::AllReduce: dist::all_reduce(g, x); break;
          case Op::AllToAllSingle: dist::all_to_all_single(g, y, x); break;
        }
      }
      dist::barrier(g);
      if (rank.rank() == 0) t1 = Clock::now();
    });
    // Bytes the op must move through memory in one process: all_reduce reads
    // N inputs and writes N outputs; all_to_all_single copies N inputs once.
    const double n = static_cast<double>(ranks), b = static_cast<double>(bytes);
    const double moved = op == Op::AllReduce ? 2 * n * b : op == Op::AllToAllSingle ? n * b : 0;
    report(state, std::chrono::duration<double>(t1 - t0).count(), rounds, ranks, moved);
  }
}

void BM_SimBarrier(benchmark::State& s) { run_sim(s, Op::Barrier); }
void BM_SimAllReduce(benchmark::State& s) { run_sim(s, Op::AllReduce); }
void BM_SimAllToAllSingle(benchmark::State& s) { run_sim(s, Op::AllToAllSingle); }

// ranks x bytes-per-rank, capped so one world holds at most ~256 MiB of data.
void Matrix(benchmark::internal::Benchmark* b) {
  for (int64_t ranks : {8, 64, 512, 4096})
    for (int64_t bytes :
         {int64_t{8}, int64_t{4096}, int64_t{1} << 16, int64_t{1} << 20, int64_t{16} << 20})
      if (ranks * bytes <= (int64_t{256} << 20)) b->Args({ranks, bytes});
}

}  // namespace

BENCHMARK(BM_BareFiberBarrier)
    ->Arg(8)
    ->Arg(64)
    ->Arg(512)
    ->Arg(4096)
    ->UseManualTime()
    ->Iterations(3);
BENCHMARK(BM_Memcpy)->RangeMultiplier(16)->Range(8, 16 << 20)->UseManualTime();
BENCHMARK(BM_SimBarrier)
    ->Args({8, 0})
    ->Args({64, 0})
    ->Args({512, 0})
    ->Args({4096, 0})
    ->UseManualTime()
    ->Iterations(3);
BENCHMARK(BM_SimAllReduce)->Apply(Matrix)->UseManualTime()->Iterations(2);
BENCHMARK(BM_SimAllToAllSingle)->Apply(Matrix)->UseManualTime()->Iterations(2);

BENCHMARK_MAIN();
