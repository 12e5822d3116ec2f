// What the funnel's one-thread-per-group check costs (issue [7/8]): the
// claim and release of a group (ProcessGroup::CallSlot) alone, against a
// whole barrier through the funnel on a one-rank group whose backend does
// nothing (the funnel's floor: validation, numbering, stats, flight
// recorder, slot). Run with --benchmark_repetitions=9
// --benchmark_enable_random_interleaving=true; RESULTS.md has the medians.
#include <benchmark/benchmark.h>

#include <memory>
#include <string>

#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/distributed/group.hpp"

namespace {

using namespace diffcomm;

// A one-rank backend that moves nothing: the funnel is all that runs.
class NoopBackend final : public dist::Backend {
 public:
  std::string backend_name() const override { return "noop"; }
  int rank() const override { return 0; }
  int size() const override { return 1; }
  int global_rank(int r) const override { return r; }
  bool supports(const Device& d) const override { return d.is_cpu(); }
  std::shared_ptr<Backend> split(dist::Call&, int, int) override { return nullptr; }
  void barrier(dist::Call&) override {}
  void all_reduce(dist::Call&) override {}
  void broadcast(dist::Call&) override {}
  void reduce(dist::Call&) override {}
  void all_gather(dist::Call&) override {}
  void all_gather_single(dist::Call&) override {}
  void all_gather_v(dist::Call&) override {}
  void gather(dist::Call&) override {}
  void scatter(dist::Call&) override {}
  void reduce_scatter(dist::Call&) override {}
  void reduce_scatter_single(dist::Call&) override {}
  void reduce_scatter_v(dist::Call&) override {}
  void all_to_all(dist::Call&) override {}
  void all_to_all_single(dist::Call&) override {}
  void send(dist::Call&) override {}
  void recv(dist::Call&) override {}
};

void BM_FunnelBarrierNoop(benchmark::State& state) {
  const dist::ProcessGroup g(std::make_shared<NoopBackend>(), "noop", nullptr);
  for (auto _ : state) dist::barrier(g);
}

void BM_CallSlotOnly(benchmark::State& state) {
  const dist::ProcessGroup g(std::make_shared<NoopBackend>(), "noop", nullptr);
  dist::Call call;
  call.op = dist::OpType::Barrier;
  for (auto _ : state) {
    const dist::ProcessGroup::CallSlot slot(g, call);
    benchmark::DoNotOptimize(&slot);
  }
}

}  // namespace

BENCHMARK(BM_FunnelBarrierNoop);
BENCHMARK(BM_CallSlotOnly);

BENCHMARK_MAIN();
