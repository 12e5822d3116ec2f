// The simulated world itself: device meshes and local validation before any communication.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/distributed/mesh.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"
#include "fixtures.hpp"

namespace diffcomm {
namespace {

using namespace sim_testing;  // NOLINT(google-build-using-namespace)

// ============================================================ device mesh

TEST(SimMesh, DpCpTpCoordinatesGroupsAndRanks) {
  World w(options(8, 5));
  w.run([](Rank& r) {
    dist::DeviceMesh mesh = r.mesh({{"dp", 2}, {"cp", 2}, {"tp", 2}});
    const int g = r.rank();
    const int d = g / 4, c = (g / 2) % 2, t = g % 2;  // rank = d*cp*tp + c*tp + t
    EXPECT_EQ(mesh.coordinate("dp"), d);
    EXPECT_EQ(mesh.coordinate("cp"), c);
    EXPECT_EQ(mesh.coordinate("tp"), t);
    EXPECT_EQ(mesh.size("dp"), 2);
    EXPECT_EQ(mesh.dims().size(), 3u);
    EXPECT_EQ(mesh.rank_of({d, c, t}), g);
    EXPECT_EQ(mesh.rank_of({1, 0, 1}), 5);
    EXPECT_EQ(mesh.rank_of({0, 1, 0}), 2);

    EXPECT_EQ(mesh.group("tp").members(), (std::vector<int>{4 * d + 2 * c, 4 * d + 2 * c + 1}));
    EXPECT_EQ(mesh.group("tp").rank(), t);
    EXPECT_EQ(mesh.group("cp").members(), (std::vector<int>{4 * d + t, 4 * d + 2 + t}));
    EXPECT_EQ(mesh.group("cp").rank(), c);
    EXPECT_EQ(mesh.group("dp").members(), (std::vector<int>{2 * c + t, 4 + 2 * c + t}));
    EXPECT_EQ(mesh.group("dp").rank(), d);

    ProcessGroup parent = mesh.group(std::vector<std::string>{"cp", "tp"});
    EXPECT_EQ(parent.members(), (std::vector<int>{4 * d, 4 * d + 1, 4 * d + 2, 4 * d + 3}));
    EXPECT_EQ(parent.rank(), c * 2 + t);
    // Dims in another order: row-major in the order given (cp fastest here).
    ProcessGroup tp_cp = mesh.group(std::vector<std::string>{"tp", "cp"});
    EXPECT_EQ(tp_cp.members(), (std::vector<int>{4 * d, 4 * d + 2, 4 * d + 1, 4 * d + 3}));
    EXPECT_EQ(tp_cp.rank(), t * 2 + c);
    ProcessGroup all = mesh.group(std::vector<std::string>{"dp", "cp", "tp"});
    EXPECT_EQ(all.members(), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));

    // The groups communicate: sum of global ranks along each.
    Tensor x = full({1}, g, DType::Float64);
    dist::all_reduce(mesh.group("tp"), x);
    EXPECT_EQ(x.item(), 2.0 * (4 * d + 2 * c) + 1);
    Tensor y = full({1}, g, DType::Float64);
    dist::all_reduce(parent, y);
    EXPECT_EQ(y.item(), 16.0 * d + 6);
    Tensor z = full({1}, g, DType::Float64);
    dist::all_reduce(mesh.group("dp"), z);
    EXPECT_EQ(z.item(), 2.0 * (2 * c + t) + 4);

    EXPECT_THROW(mesh.size("pp"), InvalidArgument);
    EXPECT_THROW(mesh.coordinate("pp"), InvalidArgument);
    EXPECT_THROW(mesh.group("pp"), InvalidArgument);
    EXPECT_THROW(mesh.rank_of({0, 0}), InvalidArgument);
    EXPECT_THROW(mesh.rank_of({2, 0, 0}), InvalidArgument);
    EXPECT_THROW(mesh.group(std::vector<std::string>{"tp", "tp"}), InvalidArgument);
    // Bad dims are refused locally, before any communication.
    EXPECT_THROW(r.mesh({{"dp", 3}, {"tp", 2}}), InvalidArgument);
    EXPECT_THROW(r.mesh({{"dp", 4}, {"dp", 2}}), InvalidArgument);
    EXPECT_THROW(r.mesh({{"dp", 8}, {"tp", 0}}), InvalidArgument);
    EXPECT_THROW(r.mesh({{"", 8}}), InvalidArgument);
  });
}

// ============================================================ local validation

// Runs call on this rank and expects InvalidArgument naming the op, the
// group, this rank, and `needle`.
void expect_invalid(const ProcessGroup& g, const std::string& op, const std::string& needle,
                    const std::function<void()>& call) {
  std::string message;
  bool thrown = false;
  try {
    call();
  } catch (const InvalidArgument& e) {
    thrown = true;
    message = e.what();
  } catch (const std::exception& e) {
    message = std::string("wrong exception type: ") + e.what();
  }
  // Checks outside the catch handler (no fiber switch happens inside one).
  EXPECT_TRUE(thrown) << op << " on group '" << g.name() << "' rank " << g.rank() << ": " << needle
                      << " — " << message;
  if (!thrown) return;
  EXPECT_CONTAINS(message, op + " on group '" + g.name() + "'");
  EXPECT_CONTAINS(message, "rank " + std::to_string(g.rank()) + " of " + std::to_string(g.size()));
  EXPECT_CONTAINS(message, needle);
}

// Every bad call below must fail on the calling rank alone, before it is
// numbered or sent: afterwards all ranks still agree on the next collective,
// and no bad call was counted (bad_calls runs both halves).

// What the bad calls are made of: the group's size and rank, one 1x2 row,
// and splits of one row per member.
struct BadCallArgs {
  int n;
  int me;
  std::size_t un;
  Tensor row;
  dist::Splits ones_splits;
  static BadCallArgs of(const ProcessGroup& g) {
    const auto un = static_cast<std::size_t>(g.size());
    return {g.size(), g.rank(), un, zeros({1, 2}), dist::Splits(un, 1)};
  }
};

// k tensors of shape s.
std::vector<Tensor> list(std::size_t k, const Shape& s, DType dt = DType::Float32) {
  std::vector<Tensor> v;
  for (std::size_t i = 0; i < k; ++i) v.push_back(zeros(s, dt));
  return v;
}

// Splits that do not match the rows, roots out of range, dtypes that disagree.
void bad_splits_roots_and_dtypes(const ProcessGroup& g) {
  const BadCallArgs a = BadCallArgs::of(g);
  [[maybe_unused]] const int n = a.n, me = a.me;
  [[maybe_unused]] const std::size_t un = a.un;
  const Tensor& row = a.row;
  [[maybe_unused]] const dist::Splits& ones_splits = a.ones_splits;

  // splits vs rows, negative splits, wrong lengths
  expect_invalid(g, "all_gather_v", "output_splits sum to", [&] {
    dist::all_gather_v(g, zeros({n + 1, 2}), row, ones_splits);
  });
  expect_invalid(g, "all_gather_v", "is negative", [&] {
    dist::Splits s = ones_splits;
    s[0] = -1;
    dist::all_gather_v(g, zeros({n, 2}), row, s);
  });
  expect_invalid(g, "all_gather_v", "entries, expected", [&] {
    dist::all_gather_v(g, zeros({n + 1, 2}), row, dist::Splits(un + 1, 1));
  });
  expect_invalid(g, "all_gather_v", "but this rank's input has 2 rows", [&] {
    dist::all_gather_v(g, zeros({n, 2}), zeros({2, 2}), ones_splits);
  });
  expect_invalid(g, "reduce_scatter_v", "input_splits sum to", [&] {
    dist::reduce_scatter_v(g, row, zeros({n + 2, 2}), ones_splits);
  });
  expect_invalid(g, "reduce_scatter_v", "is negative", [&] {
    dist::Splits s = ones_splits;
    s[un - 1] = -2;
    dist::reduce_scatter_v(g, row, zeros({n, 2}), s);
  });
  expect_invalid(g, "all_to_all_single", "is negative", [&] {
    dist::Splits s = ones_splits;
    s[0] = -1;
    dist::all_to_all_single(g, zeros({n, 2}), zeros({n, 2}), ones_splits, s);
  });
  expect_invalid(g, "all_to_all_single", "input_splits sum to", [&] {
    dist::all_to_all_single(g, zeros({n, 2}), zeros({n + 1, 2}), ones_splits, ones_splits);
  });
  expect_invalid(g, "all_to_all_single", "output_splits has", [&] {
    dist::all_to_all_single(g, zeros({n, 2}), zeros({n, 2}), dist::Splits(un + 1, 0), ones_splits);
  });
  if (n > 1)
    expect_invalid(g, "all_to_all_single", "cannot split evenly", [&] {
      dist::all_to_all_single(g, zeros({n, 2}), zeros({n + 1, 2}));
    });
  expect_invalid(g, "all_to_all_single", "row shape", [&] {
    dist::all_to_all_single(g, zeros({n, 3}), zeros({n, 2}));
  });
  // roots out of range
  expect_invalid(g, "broadcast", "src " + std::to_string(n) + " out of range",
                 [&] { dist::broadcast(g, row, n); });
  expect_invalid(g, "broadcast", "src -1 out of range", [&] { dist::broadcast(g, row, -1); });
  expect_invalid(g, "reduce", "dst " + std::to_string(n) + " out of range",
                 [&] { dist::reduce(g, row, n); });
  expect_invalid(g, "gather", "dst -1 out of range", [&] { dist::gather(g, {}, row, -1); });
  expect_invalid(g, "scatter", "out of range", [&] { dist::scatter(g, row, {}, n + 3); });
  expect_invalid(g, "send", "out of range", [&] { dist::send(g, row, n); });
  expect_invalid(g, "recv", "out of range", [&] { dist::recv(g, row, -1); });
  expect_invalid(g, "send", "dst is this rank", [&] { dist::send(g, row, me); });
  expect_invalid(g, "recv", "src is this rank", [&] { dist::recv(g, row, me); });
  // dtypes of inputs and outputs disagree
  expect_invalid(g, "all_gather_single", "has dtype float64", [&] {
    dist::all_gather_single(g, zeros({n, 2}, DType::Float64), row);
  });
  expect_invalid(g, "all_to_all_single", "has dtype int32", [&] {
    dist::all_to_all_single(g, zeros({n, 2}, DType::Int32), zeros({n, 2}));
  });
  expect_invalid(g, "all_gather", "outputs[0] has dtype bfloat16", [&] {
    dist::all_gather(g, list(un, {1, 2}, DType::BFloat16), row);
  });
  expect_invalid(g, "reduce_scatter", "has dtype", [&] {
    auto ins = list(un, {1, 2});
    ins[un - 1] = zeros({1, 2}, DType::Int64);
    dist::reduce_scatter(g, row, ins);
  });
  expect_invalid(g, "reduce_scatter_v", "has dtype uint8", [&] {
    dist::reduce_scatter_v(g, zeros({1, 2}, DType::UInt8), zeros({n, 2}), ones_splits);
  });
}

// List lengths, shapes, reduce ops and undefined tensors.
void bad_lists_shapes_and_ops(const ProcessGroup& g) {
  const BadCallArgs a = BadCallArgs::of(g);
  [[maybe_unused]] const int n = a.n, me = a.me;
  [[maybe_unused]] const std::size_t un = a.un;
  const Tensor& row = a.row;
  [[maybe_unused]] const dist::Splits& ones_splits = a.ones_splits;

  // list lengths
  expect_invalid(g, "all_gather", "has " + std::to_string(n + 1) + " tensors, expected", [&] {
    dist::all_gather(g, list(un + 1, {1, 2}), row);
  });
  expect_invalid(g, "reduce_scatter", "tensors, expected", [&] {
    dist::reduce_scatter(g, row, list(un + 1, {1, 2}));
  });
  expect_invalid(g, "all_to_all", "tensors, expected",
                 [&] { dist::all_to_all(g, list(un, {1}), list(un + 1, {1})); });
  expect_invalid(g, "gather", "tensors, expected", [&] {
    dist::gather(g, list(un + 1, {1, 2}), row, me);
  });
  if (n > 1) {
    const int other = (me + 1) % n;
    expect_invalid(g, "gather", "non-dst rank", [&] {
      dist::gather(g, list(un, {1, 2}), row, other);
    });
    expect_invalid(g, "scatter", "non-src rank", [&] {
      dist::scatter(g, row, list(un, {1, 2}), other);
    });
  }
  // shapes
  expect_invalid(g, "all_gather_single", "has shape", [&] {
    dist::all_gather_single(g, zeros({n + 1, 2}), row);
  });
  expect_invalid(g, "all_gather_single", "0-d",
                 [&] { dist::all_gather_single(g, zeros({n}), zeros({})); });
  expect_invalid(g, "reduce_scatter_single", "has shape", [&] {
    dist::reduce_scatter_single(g, row, zeros({n, 3}));
  });
  expect_invalid(g, "all_gather", "outputs[0] has shape", [&] {
    dist::all_gather(g, list(un, {2, 2}), row);
  });
  expect_invalid(g, "scatter", "inputs[0] has shape",
                 [&] { dist::scatter(g, row, list(un, {3}), me); });
  expect_invalid(g, "all_to_all", "has shape", [&] {
    auto outs = list(un, {1});
    outs[static_cast<std::size_t>(me)] = zeros({2});
    dist::all_to_all(g, outs, list(un, {1}));
  });
  // reduce ops and undefined tensors
  expect_invalid(g, "all_reduce", "avg is undefined for integer dtype int32",
                 [&] { dist::all_reduce(g, zeros({2}, DType::Int32), ReduceOp::Avg); });
  expect_invalid(g, "reduce_scatter_single", "avg is undefined", [&] {
    dist::reduce_scatter_single(g, zeros({1}, DType::UInt8), zeros({n}, DType::UInt8),
                                ReduceOp::Avg);
  });
  expect_invalid(g, "all_reduce", "undefined", [&] { dist::all_reduce(g, Tensor()); });
}

void bad_calls(const ProcessGroup& g) {
  bad_splits_roots_and_dtypes(g);
  bad_lists_shapes_and_ops(g);
}

TEST(SimValidation, LocalErrorsComeBeforeAnyCommunication) {
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    World w(options(3, seed));
    w.run([](Rank& r) {
      auto sub = r.world().new_group({2, 1}, "sub");
      bad_calls(r.world());
      if (sub) bad_calls(*sub);
      // Nothing was numbered or sent: the next collective still matches.
      Tensor t = f32({static_cast<double>(r.rank())});
      dist::all_reduce(r.world(), t);
      EXPECT_EQ(t.item(), 3.0);
      if (sub) {
        Tensor u = f32({1});
        dist::all_reduce(*sub, u);
        EXPECT_EQ(u.item(), 2.0);
      }
      // Nothing was counted either: one new_group, one all_reduce on the
      // world, one on sub for its members.
      const dist::Stats& s = r.stats();
      EXPECT_EQ(s.total().calls, r.rank() == 0 ? 2u : 3u);
      EXPECT_EQ(s.get("world", "all_reduce").calls, 1u);
    });
    // Only the valid collectives were traced: world all_reduce x3, sub all_reduce x2.
    EXPECT_EQ(w.trace().size(), 5u);
  }
}

TEST(SimValidation, NewGroupArgumentsAreCheckedLocally) {
  World w(options(3));
  w.run([](Rank& r) {
    const ProcessGroup& g = r.world();
    expect_invalid(g, "new_group", "listed twice", [&] { g.new_group({0, 1, 0}); });
    expect_invalid(g, "new_group", "out of range", [&] { g.new_group({0, 3}); });
    expect_invalid(g, "new_group", "out of range", [&] { g.new_group({-1}); });
    EXPECT_THROW(g.new_group({}), InvalidArgument);
    // Still in step.
    auto sub = g.new_group({1, 2});
    EXPECT_EQ(sub.has_value(), r.rank() != 0);
    if (sub) {
      EXPECT_EQ(sub->name(), "{1,2}");
    }
    dist::barrier(g);
  });
}

TEST(SimValidation, ABadCallOnOneRankFailsThereAndReleasesTheOthers) {
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    World w(options(3, seed));
    std::exception_ptr e = run_catching(w, [](Rank& r) {
      Tensor t = f32({1});
      dist::broadcast(r.world(), t, r.rank() == 1 ? 7 : 0);
    });
    ASSERT_TRUE(holds<InvalidArgument>(e)) << what_of(e);
    EXPECT_CONTAINS(what_of(e), "rank 1");
    EXPECT_CONTAINS(what_of(e), "broadcast on group 'world'");
    EXPECT_TRUE(holds<InvalidArgument>(w.errors()[1]));
    EXPECT_TRUE(holds<RankFailure>(w.errors()[0])) << w.error_messages()[0];
    EXPECT_TRUE(holds<RankFailure>(w.errors()[2])) << w.error_messages()[2];
    EXPECT_EQ(w.stats(1).get("world", "broadcast").calls, 0u);
  }
}

}  // namespace
}  // namespace diffcomm
