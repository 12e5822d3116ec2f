// Each MPI-backend primitive against the raw MPI call it wraps, same sizes,
// same run, same buffers, in the configurations users choose between
// (dist::Options):
//   raw         the MPI call itself
//   native      diffcomm, checks off, MPI's own reductions (not bit-identical)
//   det         diffcomm, checks off, deterministic reductions (the default)
//   checked     diffcomm, checked mode (fingerprints), deterministic reductions
//   nn          the differentiable op (nn::, out of place: a fresh output from
//               the host block cache) on the det group, inputs not requiring grad
//   into        the dist:: primitive nn:: calls: all_reduce_into (out of place,
//               its own output) for all_reduce, the det call for the others
// Run under mpirun, e.g.
//   mpirun -np 4 --oversubscribe --allow-run-as-root --mca btl self,vader bench/bench_mpi
// Every iteration times `reps` calls of each variant back to back, in an order
// shuffled per iteration (the same seeded order on every process: a rotation
// keeps each variant's predecessor fixed, and what a predecessor leaves in the
// caches biases the variant after it; bench_torch_mpi.py's `core` read 1.2x
// `torch` at 16 MiB under rotation, equal shuffled), each bracketed by
// barriers, taking the slowest process's time. Counters: <variant>_us per call (median over
// iterations), native_vs_raw and det_vs_raw (medians of the per-iteration ratios to the raw call),
// nn_vs_det (median of the per-iteration ratio of nn to into: what the differentiable op adds
// over the primitive under it), det_vs_native and checked_vs_det (ratios of the medians), MBps =
// per-rank bytes / det time. Only process 0 prints.
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "diffcomm/backends/mpi.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/nn/functional.hpp"

using namespace diffcomm;

namespace {

enum class Op { AllReduce, Broadcast, AllGatherSingle, ReduceScatterSingle, AllToAllSingle };

double slowest(double local) {
  double out = 0;
  MPI_Allreduce(&local, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

template <class F>
double timed(int reps, F&& f) {
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  for (int i = 0; i < reps; ++i) f();
  MPI_Barrier(MPI_COMM_WORLD);
  return slowest(MPI_Wtime() - t0) / reps;
}

dist::ProcessGroup configured(bool check, bool native) {
  dist::Options o;
  o.check = check;
  o.native_reduction = native;
  return mpi::world(o);
}

// The median of xs (the upper one of an even count).
double median(std::vector<double> xs) {
  std::nth_element(xs.begin(), xs.begin() + static_cast<std::ptrdiff_t>(xs.size() / 2), xs.end());
  return xs[xs.size() / 2];
}

// Paired ratio: each iteration's a over the b timed in the same iteration,
// then the median, so load that shifts between iterations cancels.
double paired_median(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> r;
  for (std::size_t i = 0; i < a.size(); ++i) r.push_back(a[i] / b[i]);
  return median(std::move(r));
}

// The counters of one size from the variants' samples (in the order run()
// builds them: raw, native, det, checked, nn, the primitive under nn).
void report(benchmark::State& state, const std::vector<std::vector<double>>& samples, int64_t bytes,
            int n) {
  auto us = [&](std::size_t v) { return median(samples[v]) * 1e6; };
  state.counters["raw_us"] = us(0);
  state.counters["native_us"] = us(1);
  state.counters["det_us"] = us(2);
  state.counters["checked_us"] = us(3);
  // issue 27 item 4's target: native and det against raw.
  state.counters["native_vs_raw"] = paired_median(samples[1], samples[0]);
  state.counters["det_vs_raw"] = paired_median(samples[2], samples[0]);
  state.counters["nn_us"] = us(4);
  state.counters["into_us"] = us(5);
  state.counters["nn_vs_det"] = paired_median(samples[4], samples[5]);
  state.counters["det_vs_native"] = us(2) / us(1);
  state.counters["checked_vs_det"] = us(3) / us(2);
  state.counters["MBps"] = static_cast<double>(bytes) / us(2);
  state.counters["ranks"] = n;
}

void run(benchmark::State& state, Op op) {
  const dist::ProcessGroup native = configured(false, true), det = configured(false, false),
                           checked = configured(true, false);
  const int n = det.size();
  const int64_t bytes = state.range(0);  // per rank
  const int64_t elems = std::max<int64_t>(bytes / 4, n) / n * n;
  const int reps = bytes >= (1 << 20) ? 5 : 50;
  const int count = static_cast<int>(elems);
  // The calls diffcomm wraps take per-peer counts (splits may differ per
  // rank): MPI_Reduce_scatter and MPI_Alltoallv, not the _block/uniform forms.
  std::vector<int> block_counts(static_cast<std::size_t>(n), count / n), block_displs;
  for (int p = 0; p < n; ++p) block_displs.push_back(p * (count / n));
  // Every variant has its own buffers (nn's output is its cached block), so
  // each starts its turn on buffers the previous variant did not touch. With
  // shared buffers the variant after nn found them hot in the cache and nn
  // found its block cold: 0.8 ms of a 4 ms 16 MiB all_gather at np 2 came
  // from which variant ran before, not from the op (2026-12-03).
  struct Buffers {
    Tensor in, out_big, out_small, out_same;
  };
  auto buffers = [&] {
    return Buffers{full({elems}, 1.0, DType::Float32), empty({elems * n}, DType::Float32),
                   empty({elems / n}, DType::Float32), empty({elems}, DType::Float32)};
  };
  auto raw = [&, b = buffers()]() mutable {
    switch (op) {
      case Op::AllReduce:
        MPI_Allreduce(MPI_IN_PLACE, b.in.data_ptr(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
      case Op::Broadcast: MPI_Bcast(b.in.data_ptr(), count, MPI_FLOAT, 0, MPI_COMM_WORLD); break;
      case Op::AllGatherSingle:
        MPI_Allgather(b.in.data_ptr(), count, MPI_FLOAT, b.out_big.data_ptr(), count, MPI_FLOAT,
                      MPI_COMM_WORLD);
        break;
      case Op::ReduceScatterSingle:
        MPI_Reduce_scatter(b.in.data_ptr(), b.out_small.data_ptr(), block_counts.data(), MPI_FLOAT,
                           MPI_SUM, MPI_COMM_WORLD);
        break;
      case Op::AllToAllSingle:
        MPI_Alltoallv(b.in.data_ptr(), block_counts.data(), block_displs.data(), MPI_FLOAT,
                      b.out_same.data_ptr(), block_counts.data(), block_displs.data(), MPI_FLOAT,
                      MPI_COMM_WORLD);
        break;
    }
  };
  auto ours = [&](const dist::ProcessGroup& group) {
    return [&, group, b = buffers()]() mutable {
      switch (op) {
        case Op::AllReduce: dist::all_reduce(group, b.in); break;
        case Op::Broadcast: dist::broadcast(group, b.in, 0); break;
        case Op::AllGatherSingle: dist::all_gather_single(group, b.out_big, b.in); break;
        case Op::ReduceScatterSingle: dist::reduce_scatter_single(group, b.out_small, b.in); break;
        case Op::AllToAllSingle: dist::all_to_all_single(group, b.out_same, b.in); break;
      }
    };
  };
  const dist::Splits even;  // all_to_all_single: empty splits are even splits
  auto differentiable = [&, in = full({elems}, 1.0, DType::Float32)] {
    switch (op) {
      case Op::AllReduce: (void)nn::all_reduce(in, det); break;
      case Op::Broadcast: (void)nn::broadcast(in, 0, det); break;
      case Op::AllGatherSingle: (void)nn::all_gather_single(in, det); break;
      case Op::ReduceScatterSingle: (void)nn::reduce_scatter_single(in, det); break;
      case Op::AllToAllSingle: (void)nn::all_to_all_single(in, even, even, det); break;
    }
  };
  // The primitive under nn::: all_reduce_into for all_reduce (nn::all_reduce
  // is out of place), the det call itself for the others.
  auto primitive = [&, into = ours(det), b = buffers()]() mutable {
    if (op == Op::AllReduce)
      dist::all_reduce_into(det, b.out_same, b.in);
    else
      into();
  };
  const std::vector<std::function<void()>> variants = {raw,           ours(native),   ours(det),
                                                       ours(checked), differentiable, primitive};
  // Medians over iterations: this machine is shared, and a median ignores
  // the iterations another process disturbed.
  std::vector<std::vector<double>> samples(variants.size());
  std::mt19937 shuffle(static_cast<unsigned>(bytes));  // same seed, same order on every rank
  std::vector<std::size_t> order(variants.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  for (auto _ : state) {
    std::vector<double> t(variants.size());
    std::shuffle(order.begin(), order.end(), shuffle);
    for (std::size_t i : order) t[i] = timed(reps, variants[i]);
    for (std::size_t v = 0; v < t.size(); ++v) samples[v].push_back(t[v]);
    state.SetIterationTime(t[2]);
  }
  report(state, samples, bytes, n);
}

void Sizes(benchmark::internal::Benchmark* b) {
  for (int64_t s : {int64_t{1} << 10, int64_t{64} << 10, int64_t{256} << 10, int64_t{1} << 20,
                    int64_t{4} << 20, int64_t{16} << 20})
    b->Arg(s);
  b->UseManualTime()->Iterations(31);
}

void BM_AllReduce(benchmark::State& s) { run(s, Op::AllReduce); }
void BM_Broadcast(benchmark::State& s) { run(s, Op::Broadcast); }
void BM_AllGatherSingle(benchmark::State& s) { run(s, Op::AllGatherSingle); }
void BM_ReduceScatterSingle(benchmark::State& s) { run(s, Op::ReduceScatterSingle); }
void BM_AllToAllSingle(benchmark::State& s) { run(s, Op::AllToAllSingle); }

BENCHMARK(BM_AllReduce)->Apply(Sizes);
BENCHMARK(BM_Broadcast)->Apply(Sizes);
BENCHMARK(BM_AllGatherSingle)->Apply(Sizes);
BENCHMARK(BM_ReduceScatterSingle)->Apply(Sizes);
BENCHMARK(BM_AllToAllSingle)->Apply(Sizes);

class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace

int main(int argc, char** argv) {
  mpi::Environment env(&argc, &argv);
  benchmark::Initialize(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    NullReporter quiet;
    benchmark::RunSpecifiedBenchmarks(&quiet);
  }
  benchmark::Shutdown();
  return 0;
}
