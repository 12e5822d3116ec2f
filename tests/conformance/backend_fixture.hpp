#pragma once
// The backend conformance suite's fixture: one set of test bodies
// (conformance_cases.hpp, instantiated by conformance_suite.hpp) run against
// every backend through a BackendRunner.
//
// A backend's conformance executable provides
//   - make_backend_runner(param): its runner (sim: a seeded sim::World of
//     param.world_size ranks; mpi: the processes started by mpirun, where the
//     world size is fixed and param.world_size must equal it);
//   - INSTANTIATE_TEST_SUITE_P(<Backend>, ConformanceTest, <params>, conformance_param_name)
// and includes conformance_suite.hpp (the TEST_P bodies) in exactly one TU.
//
// Rules for case bodies, which run on every rank (on sim: as fibers sharing
// one OS thread):
//  - every rank of a group enters every collective of the case, whatever its
//    EXPECTs found, so a failed expectation never turns into a hang (prefer
//    EXPECT_* over ASSERT_* before the case's last collective);
//  - no SCOPED_TRACE inside a rank function: gtest keeps its trace stack per
//    OS thread and interleaving fibers would corrupt it; put context in the
//    failure message instead (see conformance::where()).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "diffcomm/distributed/group.hpp"
#include "diffcomm/tensor/dtype.hpp"

namespace diffcomm::conformance {

/// The function a backend runs on every rank, with that rank's world group.
using RankFn = std::function<void(const dist::ProcessGroup& world, int rank)>;

/// How a backend runs a function on every rank of a world.
class BackendRunner {
 public:
  virtual ~BackendRunner() = default;
  /// "sim", "mpi", "nccl".
  virtual std::string name() const = 0;
  /// Largest world this runner can provide (mpi: exactly the mpirun size).
  virtual int max_world() const = 0;
  /// Runs fn on every rank of a world of world_size ranks and returns when all
  /// have finished. Reports any rank's exception as a gtest failure.
  virtual void run(int world_size, RankFn fn) = 0;
};

struct ConformanceParam {
  int world_size = 1;
  DType dtype = DType::Float32;
  uint64_t seed = 0;  ///< schedule seed where the backend has one (sim)
};

inline void PrintTo(const ConformanceParam& p, std::ostream* os) {
  *os << "{world " << p.world_size << ", " << dtype_name(p.dtype) << ", seed " << p.seed << "}";
}

inline std::string conformance_param_name(const testing::TestParamInfo<ConformanceParam>& info) {
  std::ostringstream os;
  os << "w" << info.param.world_size << "_" << dtype_name(info.param.dtype) << "_seed"
     << info.param.seed;
  return os.str();
}

/// Defined once per conformance executable (one per backend).
std::unique_ptr<BackendRunner> make_backend_runner(const ConformanceParam& param);

// ---------------------------------------------------------------- groups
// Every case runs on several groups of one world, built with the public API
// only (new_group / split), so that roots and ranks are group-local and
// differ from global ranks:
//   world     all ranks, in order;
//   permuted  all ranks, reversed with the first two swapped
//             (N = 4: global 2, 3, 1, 0);
//   sub       ranks 1..N-1 by the same rule (N = 5: 3, 4, 2, 1): excludes
//             global rank 0, so rank 0 of the group is never global rank 0;
//   split     two disjoint groups running the case concurrently: even ranks
//             and odd ranks, each in descending order (ProcessGroup::split);
//   nested    the `sub` rule applied to the local ranks of `permuted`: a
//             group made from a group.

/// `items` reversed, then (for 3 or more) the first two swapped.
inline std::vector<int> scrambled(std::vector<int> items) {
  std::reverse(items.begin(), items.end());
  if (items.size() >= 3) std::swap(items[0], items[1]);
  return items;
}
inline std::vector<int> iota_from(int first, int last_exclusive) {
  std::vector<int> v;
  for (int r = first; r < last_exclusive; ++r) v.push_back(r);
  return v;
}
/// Local ranks (of a group of n) of the `permuted` group.
inline std::vector<int> permuted_order(int n) { return scrambled(iota_from(0, n)); }
/// Local ranks (of a group of n) of the `sub` group: all but 0 when n >= 2.
inline std::vector<int> sub_order(int n) {
  return n == 1 ? std::vector<int>{0} : scrambled(iota_from(1, n));
}

/// "group 'sub' (rank 1 of 3, global 4)" for failure messages.
inline std::string where(const dist::ProcessGroup& g) {
  std::ostringstream os;
  os << "group '" << g.name() << "' (rank " << g.rank() << " of " << g.size() << ", global "
     << g.global_rank(g.rank()) << ")";
  return os.str();
}

/// Checks that g has exactly the expected global members, and that this
/// rank's local rank is its position in that list.
inline void expect_members(const dist::ProcessGroup& g, const std::vector<int>& expected,
                           int my_global) {
  EXPECT_EQ(g.members(), expected) << "members of " << where(g);
  EXPECT_EQ(g.size(), static_cast<int>(expected.size())) << where(g);
  const auto pos = std::find(expected.begin(), expected.end(), my_global);
  EXPECT_NE(pos, expected.end()) << where(g) << ": global rank " << my_global << " not a member";
  if (pos != expected.end()) {
    EXPECT_EQ(g.rank(), static_cast<int>(pos - expected.begin())) << where(g);
  }
  for (int r = 0; r < g.size() && r < static_cast<int>(expected.size()); ++r)
    EXPECT_EQ(g.global_rank(r), expected[static_cast<std::size_t>(r)]) << where(g);
}

/// Calls fn on every group of the list above that this rank belongs to.
/// Collective over world: every rank must call it.
inline void for_each_group(const dist::ProcessGroup& world, int rank,
                           const std::function<void(const dist::ProcessGroup&)>& fn) {
  const int n = world.size();
  const int me = world.global_rank(rank);
  auto globals = [&](const std::vector<int>& local, const dist::ProcessGroup& parent) {
    std::vector<int> out;
    for (int r : local) out.push_back(parent.global_rank(r));
    return out;
  };

  fn(world);

  std::optional<dist::ProcessGroup> permuted = world.new_group(permuted_order(n), "permuted");
  EXPECT_TRUE(permuted.has_value()) << "permuted group holds every rank";
  if (permuted) {
    expect_members(*permuted, globals(permuted_order(n), world), me);
    fn(*permuted);
  }

  const std::vector<int> sub_local = sub_order(n);
  std::optional<dist::ProcessGroup> sub = world.new_group(sub_local, "sub");
  const bool in_sub = std::find(sub_local.begin(), sub_local.end(), rank) != sub_local.end();
  EXPECT_EQ(sub.has_value(), in_sub) << "new_group membership of world rank " << rank;
  if (sub) {
    expect_members(*sub, globals(sub_local, world), me);
    fn(*sub);
  }

  const int color = rank % 2;
  std::optional<dist::ProcessGroup> half =
      world.split(color, n - rank, {static_cast<int64_t>(n)}, color == 0 ? "even" : "odd");
  EXPECT_TRUE(half.has_value()) << "split with color >= 0 returns a group";
  if (half) {
    std::vector<int> expected;
    for (int r = n - 1; r >= 0; --r)
      if (r % 2 == color) expected.push_back(world.global_rank(r));
    expect_members(*half, expected, me);
    fn(*half);
  }

  if (permuted) {
    const std::vector<int> nested_local = sub_order(n);
    std::optional<dist::ProcessGroup> nested = permuted->new_group(nested_local, "nested");
    const bool in_nested =
        std::find(nested_local.begin(), nested_local.end(), permuted->rank()) != nested_local.end();
    EXPECT_EQ(nested.has_value(), in_nested) << "new_group membership of " << where(*permuted);
    if (nested) {
      expect_members(*nested, globals(nested_local, *permuted), me);
      fn(*nested);
    }
  }
}

// ---------------------------------------------------------------- fixture
class ConformanceTest : public testing::TestWithParam<ConformanceParam> {
 protected:
  void SetUp() override {
    runner_ = make_backend_runner(GetParam());
    ASSERT_NE(runner_, nullptr);
    if (GetParam().world_size > runner_->max_world())
      GTEST_SKIP() << runner_->name() << " runs at most " << runner_->max_world() << " ranks";
  }

  /// Runs body(group, dtype) on every rank, on every group of for_each_group.
  void run_case(const std::function<void(const dist::ProcessGroup&, DType)>& body) {
    const ConformanceParam p = GetParam();
    runner_->run(p.world_size, [&](const dist::ProcessGroup& world, int rank) {
      for_each_group(world, rank, [&](const dist::ProcessGroup& g) { body(g, p.dtype); });
    });
  }

  std::unique_ptr<BackendRunner> runner_;
};

}  // namespace diffcomm::conformance
