// The backend conformance suite (tests/conformance/) on the simulated world:
// worlds of 1..9 ranks x every dtype, each with its own schedule seed.
// DIFFCOMM_CONFORMANCE_SEED=<n> adds n to every seed (other interleavings).
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "conformance/backend_fixture.hpp"
#include "conformance/conformance_suite.hpp"
#include "conformance/promises_suite.hpp"
#include "diffcomm/sim/world.hpp"

namespace diffcomm::conformance {
namespace {

class SimRunner final : public BackendRunner {
 public:
  explicit SimRunner(uint64_t seed) : seed_(seed) {}
  std::string name() const override { return "sim"; }
  int max_world() const override { return 16384; }
  void run(int world_size, RankFn fn) override {
    sim::WorldOptions options;
    options.ranks = world_size;
    options.seed = seed_;
    sim::World world(options);
    try {
      world.run([&](sim::Rank& rank) { fn(rank.world(), rank.rank()); });
    } catch (const std::exception& e) {
      std::string per_rank;
      const std::vector<std::string> messages = world.error_messages();
      for (std::size_t r = 0; r < messages.size(); ++r)
        if (!messages[r].empty()) per_rank += "\n  rank " + std::to_string(r) + ": " + messages[r];
      ADD_FAILURE() << "sim world of " << world_size << " ranks (seed " << seed_
                    << ") failed: " << e.what() << per_rank;
    }
  }

 private:
  uint64_t seed_;
};

std::vector<ConformanceParam> sim_params() {
  uint64_t extra = 0;
  if (const char* s = std::getenv("DIFFCOMM_CONFORMANCE_SEED"))
    extra = std::strtoull(s, nullptr, 10);
  const DType dtypes[] = {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16,
                          DType::Int32,   DType::Int64,   DType::UInt8};
  std::vector<ConformanceParam> out;
  for (int n = 1; n <= 9; ++n)
    for (DType dt : dtypes)
      out.push_back({n, dt, extra + 100 * static_cast<uint64_t>(n) + static_cast<uint64_t>(dt)});
  return out;
}

}  // namespace

std::unique_ptr<BackendRunner> make_backend_runner(const ConformanceParam& param) {
  return std::make_unique<SimRunner>(param.seed);
}

INSTANTIATE_TEST_SUITE_P(Sim, ConformanceTest, testing::ValuesIn(sim_params()),
                         conformance_param_name);

}  // namespace diffcomm::conformance
