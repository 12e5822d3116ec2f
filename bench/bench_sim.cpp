// Simulated-world collectives against their floors. Every benchmark here is a
// *pair*: each benchmark iteration (a "repetition") runs the floor and the
// measured code once each, alternating which goes first, so both see the same
// machine load (the development machine is a shared 2-core box). The reported
// counters are medians over the repetitions; the manual time is the measured
// side's median.
//
//  - BM_Barrier / BM_AllReduce8B: sim barrier / 8-byte all_reduce vs N bare
//    Boost.Fiber fibers on a boost::fibers::barrier (N context switches per
//    round: the floor of any rendezvous). Both sides get their stacks from the
//    same allocator (protected_fixedsize_stack, the sim's) of the same size.
//  - BM_Bandwidth: all_reduce / all_to_all_single vs memcpy of N distinct
//    B-byte buffers into N distinct destinations (the op's working set).
//    Bytes are counted the same way on both sides: N*B per op (every input
//    byte read once and every output byte written once).
//  - BM_NnFwdBwd: nn::all_to_all_single / nn::all_reduce forward + backward
//    (autograd) in a world of 8 created once; rank 0 times `iters` iterations.
//  - BM_NnAllReduce8B: nn::all_reduce of one float64 (input requiring grad
//    or not, forward only) in a world of 8, vs dist::all_reduce: the C++
//    side of bench/bench_sim_run.py's comparison with diffcomm.sim.run.
//  - BM_CanonicalAllReduce: nn::canonical_all_reduce of k chunks of n float64
//    per rank in a world of 8 (defaults), vs nn::all_reduce of the rank's n
//    elements (the alternative: same result up to the last bits), forward only.
//  - BM_AllToAllHuge: 16384 ranks, all_to_all_single of 2 rows x 4 B per peer:
//    time per call and peak resident memory, vs the N^2 block-copy floor.
//  - BM_ListForm: list-form all_to_all / all_gather (one 4-byte tensor per
//    peer) at 1024 ranks vs the single-tensor form of the same bytes (the
//    "floor" columns).
//  - BM_DeadlockReport: one rank skips a barrier at N ranks; time and peak
//    memory until run() has raised.
// The last argument of the sim benchmarks selects the world configuration:
// 0 = bench config (RoundRobin, trace off, 64 KiB stacks), 1 = WorldOptions{}
// defaults (Random schedule, trace on, 256 KiB stacks: what diffcomm-sim and
// the examples run); 2 = defaults with the trace off and 3 = defaults with
// RoundRobin (BM_Barrier at 1024 and 16384 ranks only, to attribute the defaults' cost).
// Times are wall clock, or each side's thread CPU time with
// DIFFCOMM_BENCH_CLOCK=cpu (for a shared machine; see BenchClock).
#include <benchmark/benchmark.h>
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <boost/fiber/all.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/nn/canonical_all_reduce.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"

using namespace diffcomm;

namespace {

// The benchmark's clock: wall time (steady_clock) by default, or this
// thread's CPU time (user + system) with DIFFCOMM_BENCH_CLOCK=cpu. Why: every
// simulated world and every floor here runs on one thread, so on a quiet
// machine the two agree, while on a shared one CPU time leaves out the time
// the thread waited for a core (other jobs' cache and memory traffic still
// count). RESULTS.md says which clock a number was taken with.
struct BenchClock {
  using duration = std::chrono::nanoseconds;
  using rep = duration::rep;
  using period = duration::period;
  using time_point = std::chrono::time_point<BenchClock>;
  static constexpr bool is_steady = true;
  static bool cpu() {
    static const bool use_cpu = [] {
      const char* v = std::getenv("DIFFCOMM_BENCH_CLOCK");
      return v != nullptr && std::string(v) == "cpu";
    }();
    return use_cpu;
  }
  static time_point now() noexcept {
    if (!cpu())
      return time_point(std::chrono::duration_cast<duration>(
          std::chrono::steady_clock::now().time_since_epoch()));
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return time_point(std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec));
  }
};
using Clock = BenchClock;
// Printed in the benchmark's context header ("clock: ...").
const int kClockContext =
    (benchmark::AddCustomContext("clock", BenchClock::cpu()
                                              ? "thread CPU time (DIFFCOMM_BENCH_CLOCK=cpu)"
                                              : "wall (steady_clock)"),
     0);

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Peak resident set since the last reset_peak_rss(), MiB. Linux resets
// VmHWM when "5" is written to /proc/self/clear_refs, so one benchmark's
// peak is not hidden by an earlier one's.
void reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
}
double peak_rss_mib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // kB
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

int rounds_for(int64_t ranks, int64_t bytes) {
  // Keep each timed side around 100 ms in Release, but at least 10 rounds:
  // rank 0 takes the timestamps, and under the Random schedule it resumes at
  // a random place within a round, so each end of the interval is off by up
  // to one round (with the old minimum of 2 rounds, +-50 % at 16384 ranks).
  const double work = static_cast<double>(ranks) * (static_cast<double>(bytes) + 2048.0);
  const int r = static_cast<int>(1e8 / work);
  return std::max(10, std::min(r, 200));
}

sim::WorldOptions options(int ranks, int64_t config) {
  sim::WorldOptions o;  // config 1: the defaults users get
  o.ranks = ranks;
  if (config == 0) {
    o.seed = 1;
    o.schedule = sim::Schedule::RoundRobin;
    o.stack_size = 64 * 1024;
    o.trace = false;
  }
  // Attribution of the defaults' cost (BM_Barrier only): config 2 is the
  // defaults with the trace off, config 3 the defaults with RoundRobin.
  if (config == 2) o.trace = false;
  if (config == 3) o.schedule = sim::Schedule::RoundRobin;
  return o;
}

// Runs floor() and measured() `reps` times, alternating which goes first;
// each returns seconds per op. Sets the manual time to the measured median.
template <class Floor, class Measured>
void pair(benchmark::State& state, Floor floor, Measured measured, double ranks, double bytes) {
  std::vector<double> f, m, ratio;
  bool floor_first = true;
  for (auto _ : state) {
    double tf = 0, tm = 0;
    if (floor_first) {
      tf = floor();
      tm = measured();
    } else {
      tm = measured();
      tf = floor();
    }
    floor_first = !floor_first;
    f.push_back(tf);
    m.push_back(tm);
    ratio.push_back(tm / tf);
    state.SetIterationTime(tm);
  }
  const double mf = median(f), mm = median(m);
  state.counters["floor_us"] = mf * 1e6;
  state.counters["us_per_op"] = mm * 1e6;
  state.counters["ns_per_rank"] = mm * 1e9 / ranks;
  state.counters["floor_ns_per_rank"] = mf * 1e9 / ranks;
  state.counters["ratio"] = median(ratio);  // measured / floor, median of per-rep ratios
  if (bytes > 0) {
    state.counters["GBps"] = bytes / mm / 1e9;
    state.counters["floor_GBps"] = bytes / mf / 1e9;
    state.counters["fraction"] = mf / mm;  // of the floor's bandwidth
  }
}

// ---------------------------------------------------------------- floors
double bare_barrier(int ranks, int rounds, std::size_t stack_size) {
  boost::fibers::use_scheduling_algorithm<boost::fibers::algo::round_robin>();
  boost::fibers::barrier barrier(static_cast<std::size_t>(ranks));
  Clock::time_point t0, t1;
  std::vector<boost::fibers::fiber> fibers;
  fibers.reserve(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r)
    fibers.emplace_back(std::allocator_arg, boost::fibers::protected_fixedsize_stack(stack_size),
                        [&, r] {
                          barrier.wait();
                          if (r == 0) t0 = Clock::now();
                          for (int i = 0; i < rounds; ++i) barrier.wait();
                          if (r == 0) t1 = Clock::now();
                        });
  for (auto& f : fibers) f.join();
  return std::chrono::duration<double>(t1 - t0).count() / rounds;
}

// memcpy of N distinct B-byte sources into N distinct destinations.
struct CopyFloor {
  std::vector<std::vector<char>> src, dst;
  CopyFloor(int64_t n, int64_t bytes) {
    for (int64_t i = 0; i < n; ++i) {
      src.emplace_back(static_cast<std::size_t>(bytes), static_cast<char>(i));
      dst.emplace_back(static_cast<std::size_t>(bytes), 0);
    }
  }
  double run(int rounds) {
    const auto t0 = Clock::now();
    for (int k = 0; k < rounds; ++k)
      for (std::size_t i = 0; i < src.size(); ++i) {
        std::memcpy(dst[i].data(), src[i].data(), src[i].size());
        benchmark::ClobberMemory();
      }
    return seconds_since(t0) / rounds;
  }
};

// ---------------------------------------------------------------- sim collectives
enum class Op { Barrier, AllReduce, AllToAllSingle };

double sim_op(Op op, int ranks, int64_t bytes, int rounds, int64_t config) {
  sim::World world(options(ranks, config));
  Clock::time_point t0, t1;
  world.run([&](sim::Rank& rank) {
    const auto& g = rank.world();
    int64_t elems = std::max<int64_t>(bytes / 4, 1);
    if (op == Op::AllToAllSingle) elems = std::max<int64_t>(elems / ranks, 1) * ranks;
    Tensor x = op == Op::Barrier ? Tensor{} : full({elems}, 1.0, DType::Float32);
    // Zero-filled, not empty: the floor's destinations are written before
    // they are timed too, so neither side pays first-touch page faults in
    // the timed loop (with two rounds at 8 x 16 MiB they were half the time).
    Tensor y = op == Op::AllToAllSingle ? zeros_like(x) : Tensor{};
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
  return std::chrono::duration<double>(t1 - t0).count() / rounds;
}

// args: ranks, config
void BM_Barrier(benchmark::State& state) {
  const int ranks = static_cast<int>(state.range(0));
  const auto opts = options(ranks, state.range(1));
  const int rounds = rounds_for(ranks, 8);
  pair(
      state, [&] { return bare_barrier(ranks, rounds, opts.stack_size); },
      [&] { return sim_op(Op::Barrier, ranks, 0, rounds, state.range(1)); }, ranks, 0);
}

// args: ranks, config; the floor is the bare barrier (a rendezvous is all an
// 8-byte all_reduce needs in one process).
void BM_AllReduce8B(benchmark::State& state) {
  const int ranks = static_cast<int>(state.range(0));
  const auto opts = options(ranks, state.range(1));
  const int rounds = rounds_for(ranks, 8);
  pair(
      state, [&] { return bare_barrier(ranks, rounds, opts.stack_size); },
      [&] { return sim_op(Op::AllReduce, ranks, 8, rounds, state.range(1)); }, ranks, 0);
}

// args: op (1 = all_reduce, 2 = all_to_all_single), ranks, bytes per rank, config
void BM_Bandwidth(benchmark::State& state) {
  const auto op = static_cast<Op>(state.range(0));
  const int ranks = static_cast<int>(state.range(1));
  const int64_t bytes = state.range(2);
  const int rounds = rounds_for(ranks, bytes);
  CopyFloor floor(ranks, bytes);
  pair(
      state, [&] { return floor.run(rounds); },
      [&] { return sim_op(op, ranks, bytes, rounds, state.range(3)); }, ranks,
      static_cast<double>(ranks) * static_cast<double>(bytes));
}

// ---------------------------------------------------------------- nn forward + backward
// World 8, x = 8 peers x 4 rows x 16 float32; loss = sum(op(x)); backward.
// The world is created once; rank 0 times `iters` iterations between two
// barriers. The floor is the same loop with the collective replaced by
// clone (the autograd + tensor work alone).
double nn_loop(sim::World& world, int op, int iters, bool with_collective) {
  Clock::time_point t0, t1;
  world.run([&](sim::Rank& rank) {
    const auto& g = rank.world();
    Tensor x = full({8 * 4, 16}, 1.0 + rank.rank(), DType::Float32);
    x.set_requires_grad(true);
    dist::barrier(g);
    if (rank.rank() == 0) t0 = Clock::now();
    for (int i = 0; i < iters; ++i) {
      Tensor y = !with_collective ? clone(x)
                 : op == 0        ? nn::all_to_all_single(x, {}, {}, g)
                                  : nn::all_reduce(x, g);
      backward({sum(y)});
    }
    dist::barrier(g);
    if (rank.rank() == 0) t1 = Clock::now();
  });
  return std::chrono::duration<double>(t1 - t0).count() / iters;
}

// args: op (0 = all_to_all_single, 1 = all_reduce), config
void BM_NnFwdBwd(benchmark::State& state) {
  const int op = static_cast<int>(state.range(0));
  sim::World world(options(8, state.range(1)));
  const int iters = 2000;
  pair(
      state, [&] { return nn_loop(world, op, iters, false); },
      [&] { return nn_loop(world, op, iters, true); }, 8, 0);
}

// ---------------------------------------------------------------- the op diffcomm.sim.run times
// World 8, one float64, `iters` calls per rank of nn::all_reduce (what
// diffcomm.torch.all_reduce runs under diffcomm.sim.run), its input
// requiring grad or not (forward only: no backward); the floor is the same
// loop with dist::all_reduce in place. bench/bench_sim_run.py compares
// sim.run against us_per_op here.
double nn_all_reduce_loop(sim::World& world, int iters, int mode) {
  Clock::time_point t0, t1;
  world.run([&](sim::Rank& rank) {
    const auto& g = rank.world();
    Tensor x = full({1}, 1.0, DType::Float64);
    if (mode == 2) x.set_requires_grad(true);
    dist::barrier(g);
    if (rank.rank() == 0) t0 = Clock::now();
    for (int i = 0; i < iters; ++i) {
      if (mode == 0)
        dist::all_reduce(g, x);
      else
        benchmark::DoNotOptimize(nn::all_reduce(x, g));
    }
    dist::barrier(g);
    if (rank.rank() == 0) t1 = Clock::now();
  });
  return std::chrono::duration<double>(t1 - t0).count() / iters;
}

// args: requires_grad (0/1), config
void BM_NnAllReduce8B(benchmark::State& state) {
  sim::World world(options(8, state.range(1)));
  const int iters = 2000;
  const int mode = state.range(0) != 0 ? 2 : 1;
  pair(
      state, [&] { return nn_all_reduce_loop(world, iters, 0); },
      [&] { return nn_all_reduce_loop(world, iters, mode); }, 8, 0);
}

// ---------------------------------------------------------------- canonical all-reduce
// World 8 (the defaults), `iters` forward calls per rank; variant 0 is the
// floor (nn::all_reduce of the rank's [n] partial), 1 nn::canonical_all_reduce
// of its [k, n] chunks.
double canonical_loop(sim::World& world, int iters, int64_t n, int64_t k, bool canonical) {
  Clock::time_point t0, t1;
  world.run([&](sim::Rank& rank) {
    const auto& g = rank.world();
    Tensor chunks = full({k, n}, 1.0 + rank.rank(), DType::Float64);
    Tensor partial = full({n}, 1.0 + rank.rank(), DType::Float64);
    dist::barrier(g);
    if (rank.rank() == 0) t0 = Clock::now();
    for (int i = 0; i < iters; ++i) {
      if (canonical)
        benchmark::DoNotOptimize(nn::canonical_all_reduce(chunks, g));
      else
        benchmark::DoNotOptimize(nn::all_reduce(partial, g));
    }
    dist::barrier(g);
    if (rank.rank() == 0) t1 = Clock::now();
  });
  return std::chrono::duration<double>(t1 - t0).count() / iters;
}

// args: n (float64 elements per chunk), k (chunks per rank)
void BM_CanonicalAllReduce(benchmark::State& state) {
  sim::World world(options(8, 1));
  const int64_t n = state.range(0), k = state.range(1);
  const int iters = n >= 8192 ? 200 : 2000;
  pair(
      state, [&] { return canonical_loop(world, iters, n, k, false); },
      [&] { return canonical_loop(world, iters, n, k, true); }, 8, 0);
}

// ---------------------------------------------------------------- 16384 ranks
// all_to_all_single, 2 rows of one float32 per peer (8 B per peer-pair), even
// splits. Floor: the N^2 block copies alone, between N distinct buffers.
// Memory: peak RSS during the world's run (reset before), vs the payload
// (N inputs + N outputs).
void BM_AllToAllHuge(benchmark::State& state) {
  const int ranks = static_cast<int>(state.range(0));
  const int64_t rows = 2 * static_cast<int64_t>(ranks);
  const double payload_mib = 2.0 * ranks * static_cast<double>(rows) * 4 / (1 << 20);
  std::vector<double> sim_s, floor_s, rss;
  for (auto _ : state) {
    reset_peak_rss();
    double t = 0;
    {
      sim::World world(options(ranks, state.range(1)));
      world.run([&](sim::Rank& rank) {
        Tensor x = full({rows, 1}, rank.rank(), DType::Float32);
        Tensor y = zeros_like(x);  // touched before timing, as the floor's `out`
        dist::barrier(rank.world());
        const auto t0 = Clock::now();
        dist::all_to_all_single(rank.world(), y, x);
        if (rank.rank() == 0) t = seconds_since(t0);  // the last arriver ran the move
        dist::barrier(rank.world());
      });
    }
    rss.push_back(peak_rss_mib());
    sim_s.push_back(t);
    state.SetIterationTime(t);
    {
      // Floor: the same N^2 8-byte blocks between N distinct buffers.
      std::vector<std::vector<float>> in(static_cast<std::size_t>(ranks)),
          out(static_cast<std::size_t>(ranks));
      for (auto& v : in) v.assign(static_cast<std::size_t>(rows), 1.0f);
      for (auto& v : out) v.assign(static_cast<std::size_t>(rows), 0.0f);
      const auto t0 = Clock::now();
      for (std::size_t s = 0; s < in.size(); ++s)
        for (std::size_t j = 0; j < out.size(); ++j)
          std::memcpy(out[j].data() + 2 * s, in[s].data() + 2 * j, 8);
      benchmark::DoNotOptimize(out.back().data());
      floor_s.push_back(seconds_since(t0));
    }
  }
  state.counters["s_per_call"] = median(sim_s);
  state.counters["floor_s"] = median(floor_s);
  state.counters["ratio"] = median(sim_s) / median(floor_s);
  state.counters["peak_rss_MiB"] = median(rss);
  state.counters["payload_MiB"] = payload_mib;
}

// ---------------------------------------------------------------- list forms
// dist::all_to_all / dist::all_gather with one small tensor per peer vs the
// single-tensor form moving the same bytes (all_to_all_single /
// all_gather_single); bench config. One call per side per repetition.
// args: op (0 = all_to_all, 1 = all_gather), ranks
double list_op(int op, int ranks, bool list) {
  sim::World world(options(ranks, 0));
  Clock::time_point t0, t1;
  world.run([&](sim::Rank& rank) {
    const auto& g = rank.world();
    const auto n = static_cast<std::size_t>(ranks);
    Tensor x = full({ranks}, 1.0, DType::Float32), y = empty_like(x);
    Tensor one = full({1}, 1.0, DType::Float32);
    std::vector<Tensor> ins, outs;
    if (list) {
      for (std::size_t i = 0; i < n; ++i) {
        ins.push_back(x.row_view(static_cast<int64_t>(i), 1));
        outs.push_back(y.row_view(static_cast<int64_t>(i), 1));
      }
    }
    dist::barrier(g);
    if (rank.rank() == 0) t0 = Clock::now();
    if (op == 0 && list) dist::all_to_all(g, outs, ins);
    if (op == 0 && !list) dist::all_to_all_single(g, y, x);
    if (op == 1 && list) dist::all_gather(g, outs, one);
    if (op == 1 && !list) dist::all_gather_single(g, y, one);
    dist::barrier(g);
    if (rank.rank() == 0) t1 = Clock::now();
  });
  return std::chrono::duration<double>(t1 - t0).count();
}

void BM_ListForm(benchmark::State& state) {
  const int op = static_cast<int>(state.range(0));
  const int ranks = static_cast<int>(state.range(1));
  pair(
      state, [&] { return list_op(op, ranks, false); }, [&] { return list_op(op, ranks, true); },
      ranks, 0);
}

// ---------------------------------------------------------------- deadlock report
void BM_DeadlockReport(benchmark::State& state) {
  const int ranks = static_cast<int>(state.range(0));
  std::vector<double> rss;
  for (auto _ : state) {
    reset_peak_rss();
    std::size_t what = 0;
    {
      sim::World world(options(ranks, state.range(1)));
      const auto t0 = Clock::now();
      try {
        world.run([&](sim::Rank& rank) {
          if (rank.rank() != ranks - 1) dist::barrier(rank.world());
        });
      } catch (const Deadlock& e) {
        what = std::strlen(e.what());
      }
      state.SetIterationTime(seconds_since(t0));
    }
    rss.push_back(peak_rss_mib());
    state.counters["report_KiB"] = static_cast<double>(what) / 1024.0;
  }
  state.counters["peak_rss_MiB"] = median(rss);
}

void BarrierArgs(benchmark::internal::Benchmark* b) {
  for (int64_t config : {0, 1})
    for (int64_t ranks : {8, 64, 1024, 4096, 16384}) b->Args({ranks, config});
}

void BandwidthArgs(benchmark::internal::Benchmark* b) {
  for (int64_t config : {0, 1})
    for (int64_t op : {1, 2})
      for (auto [ranks, bytes] : std::vector<std::pair<int64_t, int64_t>>{
               {8, 64 << 10}, {8, 1 << 20}, {8, 16 << 20}, {64, 64 << 10}, {64, 1 << 20}})
        b->Args({op, ranks, bytes, config});
}

// {variant 0/1} x {bench config, defaults}.
void OpByConfig(benchmark::internal::Benchmark* b) {
  for (int64_t config : {0, 1})
    for (int64_t variant : {0, 1}) b->Args({variant, config});
}

}  // namespace

BENCHMARK(BM_Barrier)->Apply(BarrierArgs)->UseManualTime()->Iterations(5);
// Which part of the defaults costs at 16384 ranks: trace off / RoundRobin.
BENCHMARK(BM_Barrier)
    ->Args({1024, 2})
    ->Args({1024, 3})
    ->Args({16384, 2})
    ->Args({16384, 3})
    ->UseManualTime()
    ->Iterations(5);
BENCHMARK(BM_AllReduce8B)->Apply(BarrierArgs)->UseManualTime()->Iterations(5);
BENCHMARK(BM_Bandwidth)->Apply(BandwidthArgs)->UseManualTime()->Iterations(5);
BENCHMARK(BM_ListForm)->Args({0, 1024})->Args({1, 1024})->UseManualTime()->Iterations(5);
BENCHMARK(BM_NnFwdBwd)->Apply(OpByConfig)->UseManualTime()->Iterations(7);
BENCHMARK(BM_NnAllReduce8B)->Apply(OpByConfig)->UseManualTime()->Iterations(7);
BENCHMARK(BM_CanonicalAllReduce)
    ->Args({1, 1})
    ->Args({8192, 1})
    ->Args({8192, 4})
    ->UseManualTime()
    ->Iterations(7);
// Heavy (GiBs, minutes before the fixes): run alone, e.g.
// --benchmark_filter=AllToAllHuge, so other benchmarks do not share its peak.
BENCHMARK(BM_AllToAllHuge)->Args({16384, 0})->UseManualTime()->Iterations(1);
BENCHMARK(BM_DeadlockReport)->Args({4096, 1})->Args({16384, 1})->UseManualTime()->Iterations(1);

BENCHMARK_MAIN();
