// The mesh-equivalence oracle (sim/checks/include/diffcomm/sim/equivalence.hpp) on
// hand-built gradients: every expected value is written out by hand (sums,
// concatenations, factors and expressions computed on paper).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "diffcomm/sim/equivalence.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::sim {
namespace {

Tensor t(const std::vector<double>& v, Shape shape = {}) {
  if (shape.empty()) shape = {static_cast<int64_t>(v.size())};
  return from_vector(v, shape);
}

/// Every rank of `mesh` holds grads[r] with one placement, parameter "w".
std::vector<RankGrads> ranks_of(const std::vector<Tensor>& grads, const Placement& p) {
  std::vector<RankGrads> out;
  for (const Tensor& g : grads) out.push_back({{"w", {g, p}}});
  return out;
}

std::map<std::string, Tensor> ref_w(const Tensor& r) { return {{"w", r}}; }

const MeshDims kDpTp22{{"dp", 2}, {"tp", 2}};

/// The finding of "w" when every rank holds `scale * r` (Replicate).
ParamFinding scaled(const MeshDims& mesh, double scale) {
  const std::vector<double> r{1, -2, 3};
  std::vector<Tensor> grads;
  for (int i = 0; i < mesh_world(mesh); ++i) grads.push_back(t({scale, -2 * scale, 3 * scale}));
  return check_mesh(mesh, ranks_of(grads, Placement::replicate()), ref_w(t(r))).params.at(0);
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(no InvalidArgument)";
}

TEST(Equivalence, MeshCoordsAreRowMajorLastFastest) {
  const MeshDims mesh{{"dp", 2}, {"tp", 3}};
  EXPECT_EQ(mesh_world(mesh), 6);
  EXPECT_EQ(mesh_coords(mesh, 4), (std::vector<int>{1, 1}));
  EXPECT_EQ(mesh_coords(mesh, 5), (std::vector<int>{1, 2}));
  EXPECT_EQ(mesh_str(mesh), "{dp: 2, tp: 3}");
  EXPECT_THROW(mesh_coords(mesh, 6), InvalidArgument);
  EXPECT_THROW(mesh_world({{"dp", 2}, {"dp", 2}}), InvalidArgument);
  EXPECT_THROW(mesh_world({{"dp", 0}}), InvalidArgument);
}

TEST(Equivalence, ReplicatedEqualGradientsPass) {
  const auto f = scaled(kDpTp22, 1.0);
  EXPECT_TRUE(f.ok);
  EXPECT_EQ(f.max_rel_error, 0.0);
  EXPECT_FALSE(f.has_factor);
}

TEST(Equivalence, PartialIsSummedOverItsDim) {
  // dp = 0 holds [1, 2], dp = 1 holds [3, 4] (replicated over tp): sum [4, 6].
  const auto grads =
      ranks_of({t({1, 2}), t({1, 2}), t({3, 4}), t({3, 4})}, Placement::partial("dp"));
  const auto m = check_mesh(kDpTp22, grads, ref_w(t({4, 6})));
  EXPECT_TRUE(m.ok());
  // Against [2, 3] the sum is 2x: a factor of 2, a tie between dp and tp.
  const auto bad = check_mesh(kDpTp22, grads, ref_w(t({2, 3}))).params.at(0);
  EXPECT_FALSE(bad.ok);
  EXPECT_NEAR(bad.factor, 2.0, 1e-15);
  EXPECT_EQ(bad.expressions, (std::vector<std::string>{"dp", "tp"}));
  EXPECT_EQ(bad.str(kDpTp22),
            "w: grad = 2.000 x reference = dp or tp (a tie: equal on this mesh) on mesh "
            "{dp: 2, tp: 2}");
}

TEST(Equivalence, FactorOfTheWorldIsTheProductOfItsTwoDims) {
  const auto f = scaled(kDpTp22, 4.0);
  EXPECT_FALSE(f.ok);
  EXPECT_TRUE(f.factor_fits);
  EXPECT_NEAR(f.factor, 4.0, 1e-15);
  EXPECT_NEAR(f.max_rel_error, 3.0, 1e-15);  // max|4r - r| / max|r| = 9 / 3
  EXPECT_EQ(f.expressions, (std::vector<std::string>{"dp*tp"}));
  EXPECT_EQ(f.str(kDpTp22), "w: grad = 4.000 x reference = dp*tp on mesh {dp: 2, tp: 2}");
}

TEST(Equivalence, ExpressionKinds) {
  const MeshDims dp4tp2{{"dp", 4}, {"tp", 2}};
  EXPECT_EQ(scaled(dp4tp2, 0.25).expressions, (std::vector<std::string>{"1/dp"}));
  // 2 is tp and dp/tp: the single dim is simpler.
  EXPECT_EQ(scaled(dp4tp2, 2.0).expressions, (std::vector<std::string>{"tp"}));
  const MeshDims dp6tp4{{"dp", 6}, {"tp", 4}, {"cp", 1}};
  EXPECT_EQ(scaled(dp6tp4, 1.5).expressions, (std::vector<std::string>{"dp/tp"}));
  EXPECT_EQ(scaled(dp6tp4, 1.0 / 24).expressions, (std::vector<std::string>{"1/(dp*tp)"}));
  const MeshDims three{{"dp", 2}, {"cp", 3}, {"tp", 5}};
  EXPECT_EQ(scaled(three, 30.0).expressions, (std::vector<std::string>{"world"}));
  EXPECT_EQ(scaled(three, 1.0 / 30).expressions, (std::vector<std::string>{"1/world"}));
  const auto none = scaled(kDpTp22, 3.0);
  EXPECT_TRUE(none.factor_fits);
  EXPECT_TRUE(none.expressions.empty());
  EXPECT_EQ(none.str(kDpTp22),
            "w: grad = 3.000 x reference (no mesh expression equals it) on mesh {dp: 2, tp: 2}");
  // Within factor_rtol (1e-9) of 2 still matches; 1e-6 off does not.
  EXPECT_EQ(factor_expressions(kDpTp22, 2.0 * (1 + 1e-10)).size(), 2u);
  EXPECT_TRUE(factor_expressions(kDpTp22, 2.0 * (1 + 1e-6)).empty());
}

TEST(Equivalence, NotAMultiple) {
  // r = [1, 0], g = [1, 1]: <g, r>/<r, r> = 1, residual max|g - r| / 1 = 1.
  const auto grads = ranks_of({t({1, 1})}, Placement::replicate());
  const auto f = check_mesh({{"dp", 1}}, grads, ref_w(t({1, 0}))).params.at(0);
  EXPECT_FALSE(f.ok);
  EXPECT_EQ(f.factor, 1.0);
  EXPECT_EQ(f.factor_residual, 1.0);
  EXPECT_FALSE(f.factor_fits);
  EXPECT_TRUE(f.expressions.empty());
  EXPECT_NE(f.str({{"dp", 1}}).find("not a multiple of it"), std::string::npos);
}

TEST(Equivalence, UnevenShardsAsTorchChunkAndEmpty) {
  // Reference [5, 2] = 0..9; torch.chunk(5 rows, 3) = 2, 2, 1 rows.
  const Tensor r = t({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, {5, 2});
  const MeshDims tp3{{"tp", 3}};
  const auto chunk = ranks_of({t({0, 1, 2, 3}, {2, 2}), t({4, 5, 6, 7}, {2, 2}), t({8, 9}, {1, 2})},
                              Placement::shard(0, "tp"));
  EXPECT_TRUE(check_mesh(tp3, chunk, ref_w(r)).ok());
  const auto empty =
      ranks_of({t({0, 1, 2, 3}, {2, 2}), t({}, {0, 2}), t({4, 5, 6, 7, 8, 9}, {3, 2})},
               Placement::shard(0, "tp"));
  EXPECT_TRUE(check_mesh(tp3, empty, ref_w(r)).ok());
}

TEST(Equivalence, ShardAlongAnInnerDim) {
  // [[1, 2, 3], [4, 5, 6]] as columns on tp = 0, 1, 2.
  const Tensor r = t({1, 2, 3, 4, 5, 6}, {2, 3});
  const auto cols = ranks_of({t({1, 4}, {2, 1}), t({2, 5}, {2, 1}), t({3, 6}, {2, 1})},
                             Placement::shard(1, "tp"));
  EXPECT_TRUE(check_mesh({{"tp", 3}}, cols, ref_w(r)).ok());
  const auto swapped = ranks_of({t({2, 5}, {2, 1}), t({1, 4}, {2, 1}), t({3, 6}, {2, 1})},
                                Placement::shard(1, "tp"));
  const auto f = check_mesh({{"tp", 3}}, swapped, ref_w(r)).params.at(0);
  EXPECT_FALSE(f.ok);
  EXPECT_EQ(f.differing_shards, (std::vector<int>{0, 1}));
}

TEST(Equivalence, ShardMapOfADroppedContribution) {
  // Rows [1, 2], [3, 4], [5, 6] on tp = 0, 1, 2; tp = 1 lost its row.
  // factor = <g, r>/<r, r> = 66 / 91: no scalar fits, shard tp = 1 differs.
  const Tensor r = t({1, 2, 3, 4, 5, 6}, {3, 2});
  const auto grads = ranks_of({t({1, 2}, {1, 2}), t({0, 0}, {1, 2}), t({5, 6}, {1, 2})},
                              Placement::shard(0, "tp"));
  const MeshDims tp3{{"tp", 3}};
  const auto f = check_mesh(tp3, grads, ref_w(r)).params.at(0);
  EXPECT_FALSE(f.ok);
  EXPECT_NEAR(f.factor, 66.0 / 91.0, 1e-15);
  EXPECT_FALSE(f.factor_fits);
  EXPECT_EQ(f.differing_shards, (std::vector<int>{1}));
  EXPECT_NEAR(f.max_rel_error, 4.0 / 6.0, 1e-15);
  EXPECT_EQ(f.str(tp3),
            "w: shards tp=1 of Shard(0, tp) differ from the reference, the others match (max rel "
            "error 0.667) on mesh {tp: 3}");
}

TEST(Equivalence, DivergentReplicasNamed) {
  // Shard(0, tp) on {dp: 2, tp: 2}: rank 3 (dp 1, tp 1) differs from its
  // replica rank 1 (dp 0, tp 1); the gradient itself (ranks 0, 1) matches.
  const auto grads = ranks_of({t({1}), t({2}), t({1}), t({7})}, Placement::shard(0, "tp"));
  const auto m = check_mesh(kDpTp22, grads, ref_w(t({1, 2})));
  const auto& f = m.params.at(0);
  EXPECT_FALSE(f.ok);
  EXPECT_EQ(f.max_rel_error, 0.0);
  EXPECT_EQ(f.divergent_ranks, (std::vector<int>{3}));
  EXPECT_EQ(m.str(),
            "w: replicas differ (Shard(0, tp)): ranks 3 disagree with their first replica on "
            "mesh {dp: 2, tp: 2}");
}

TEST(Equivalence, ZeroReferenceAndReportOfSeveralMeshes) {
  const auto zero = ranks_of({t({0, 0}), t({0, 0})}, Placement::replicate());
  EquivalenceReport report;
  report.meshes.push_back(check_mesh({{"dp", 2}}, zero, ref_w(t({0, 0}))));
  EXPECT_TRUE(report.ok());
  EXPECT_EQ(report.str(), "mesh {dp: 2}: all 1 gradients match the reference (max rel error 0)");
  report.meshes.push_back(check_mesh(
      {{"dp", 2}}, ranks_of({t({0, 1}), t({0, 1})}, Placement::replicate()), ref_w(t({0, 0}))));
  EXPECT_FALSE(report.ok());
  // r = 0: no factor fits (factor reported as 0).
  EXPECT_FALSE(report.meshes[1].params[0].factor_fits);
}

/// Parameter "w" on every rank with a nested placement.
std::vector<RankGrads> nested_of(const std::vector<Tensor>& grads, const Placement& outer,
                                 const std::vector<Placement>& inner) {
  std::vector<RankGrads> out;
  for (const Tensor& g : grads) out.push_back({{"w", {g, outer, inner}}});
  return out;
}

TEST(Equivalence, NestedShardCutsEachOuterShardAgain) {
  // DTensor [Shard(0), Shard(0)] on {dp: 2, tp: 2}: rows 0..3 of the
  // reference; dp cuts [0, 1] | [2, 3], tp cuts each again: rank r holds row r.
  const Tensor r = t({0, 1, 2, 3});
  const auto ok = nested_of({t({0}), t({1}), t({2}), t({3})}, Placement::shard(0, "dp"),
                            {Placement::shard(0, "tp")});
  const auto m = check_mesh(kDpTp22, ok, ref_w(r));
  EXPECT_TRUE(m.ok()) << m.str();
  // Row 2 lost on rank 2 (dp 1, tp 0): the outer shard dp = 1 differs.
  const auto lost = nested_of({t({0}), t({1}), t({0}), t({3})}, Placement::shard(0, "dp"),
                              {Placement::shard(0, "tp")});
  const auto f = check_mesh(kDpTp22, lost, ref_w(r)).params.at(0);
  EXPECT_FALSE(f.ok);
  EXPECT_EQ(f.differing_shards, (std::vector<int>{1}));
  EXPECT_EQ(f.str(kDpTp22),
            "w: shards dp=1 of [Shard(0, dp), Shard(0, tp)] differ from the reference, the "
            "others match (max rel error 0.667) on mesh {dp: 2, tp: 2}");
}

TEST(Equivalence, NestedShardAndPartialAndReplicasOfAThirdDim) {
  // [Shard(1, dp), Partial(tp)] on {dp: 2, pp: 2, tp: 2} (pp replicates):
  // reference [[1, 2]]; dp 0 holds column 0 as tp halves 0.25 + 0.75, dp 1
  // column 1 as 1.5 + 0.5. Rank = dp*4 + pp*2 + tp.
  const MeshDims mesh{{"dp", 2}, {"pp", 2}, {"tp", 2}};
  const Tensor r = t({1, 2}, {1, 2});
  std::vector<Tensor> g;
  for (int rank = 0; rank < 8; ++rank) {
    const int dp = rank / 4, tp = rank % 2;
    const double v = dp == 0 ? (tp == 0 ? 0.25 : 0.75) : (tp == 0 ? 1.5 : 0.5);
    g.push_back(t({v}, {1, 1}));
  }
  auto grads = nested_of(g, Placement::shard(1, "dp"), {Placement::partial("tp")});
  EXPECT_TRUE(check_mesh(mesh, grads, ref_w(r)).ok());
  // A replica over pp (rank 7: dp 1, pp 1, tp 1) differs: named alone, not its tp peer.
  grads[7]["w"].grad = t({9}, {1, 1});
  const auto f = check_mesh(mesh, grads, ref_w(r)).params.at(0);
  EXPECT_FALSE(f.ok);
  EXPECT_EQ(f.divergent_ranks, (std::vector<int>{7}));
  // Every rank doubled: a factor of 2 = dp, pp or tp (a tie).
  auto doubled = nested_of(g, Placement::shard(1, "dp"), {Placement::partial("tp")});
  for (auto& rg : doubled) rg["w"].grad = t({2 * rg["w"].grad.to_vector()[0]}, {1, 1});
  const auto d = check_mesh(mesh, doubled, ref_w(r)).params.at(0);
  EXPECT_TRUE(d.factor_fits);
  EXPECT_EQ(d.expressions, (std::vector<std::string>{"dp", "pp", "tp"}));
}

TEST(Equivalence, MissingGradientIsAFindingNamingTheRanks) {
  auto grads = ranks_of({t({1, 2}), t({1, 2})}, Placement::replicate());
  grads[1]["w"].grad = Tensor();
  const MeshDims dp2{{"dp", 2}};
  const auto f = check_mesh(dp2, grads, ref_w(t({1, 2}))).params.at(0);
  EXPECT_FALSE(f.ok);
  EXPECT_EQ(f.missing_ranks, (std::vector<int>{1}));
  EXPECT_EQ(f.str(dp2),
            "w: no gradient (None) on ranks 1 of mesh {dp: 2}; the reference has one (backward "
            "did not reach the parameter there)");
}

TEST(Equivalence, BadNestedPlacementsNamed) {
  const auto r = ref_w(t({1, 2, 3, 4}));
  const std::vector<Tensor> four{t({1}), t({2}), t({3}), t({4})};
  EXPECT_EQ(error_of([&] {
              check_mesh(kDpTp22,
                         nested_of(four, Placement::shard(0, "dp"), {Placement::replicate()}), r);
            }),
            "check_equivalence: parameter 'w' on rank 0: placement [Shard(0, dp), Replicate()]: "
            "an inner placement is Shard or Partial, not Replicate (leave replicated dims out)");
  EXPECT_EQ(error_of([&] {
              check_mesh(kDpTp22,
                         nested_of(four, Placement::shard(0, "dp"), {Placement::partial("dp")}), r);
            }),
            "check_equivalence: parameter 'w' on rank 0: placement [Shard(0, dp), Partial(dp)] "
            "names mesh dim 'dp' twice");
  auto uneven = nested_of({t({1}), t({2}), t({3, 4}), t({4})}, Placement::shard(0, "dp"),
                          {Placement::partial("tp")});
  EXPECT_EQ(error_of([&] { check_mesh(kDpTp22, uneven, r); }),
            "check_equivalence: parameter 'w' on rank 3 ([Shard(0, dp), Partial(tp)]): shape "
            "[1], expected [2] (as rank 2, its first peer over tp)");
}

TEST(Equivalence, BadInputErrorsNameParameterRankExpectedReceived) {
  const auto r = ref_w(t({1, 2}));
  const std::string unknown = error_of([&] {
    check_mesh(kDpTp22,
               ranks_of({t({1, 2}), t({1, 2}), t({1, 2}), t({1, 2})}, Placement::partial("pp")), r);
  });
  EXPECT_NE(unknown.find("parameter 'w' on rank 0: placement Partial(pp) names mesh dim 'pp', "
                         "mesh {dp: 2, tp: 2} has no such dim"),
            std::string::npos)
      << unknown;
  const std::string shape = error_of([&] {
    check_mesh({{"dp", 1}}, ranks_of({t({1, 2, 3})}, Placement::replicate()), r);
  });
  EXPECT_NE(shape.find("parameter 'w' on rank 0 (Replicate()): shape [3], expected [2]"),
            std::string::npos)
      << shape;
  const std::string replica = error_of([&] {
    check_mesh({{"dp", 2}}, ranks_of({t({1, 2}), t({1})}, Placement::replicate()), r);
  });
  EXPECT_NE(replica.find("parameter 'w' on rank 1: shape [1], expected [2] (its replica rank 0)"),
            std::string::npos)
      << replica;
  const std::string sum = error_of([&] {
    check_mesh({{"tp", 2}}, ranks_of({t({1}), t({2, 3})}, Placement::shard(0, "tp")), r);
  });
  EXPECT_NE(sum.find("along dim 0 (rank 0: 1, rank 1: 2) add up to 3, expected 2"),
            std::string::npos)
      << sum;
  EXPECT_NE(error_of([&] {
              check_mesh(kDpTp22, ranks_of({t({1, 2})}, Placement::replicate()), r);
            }).find("mesh {dp: 2, tp: 2} has 4 ranks, received gradients of 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              check_mesh({{"dp", 1}}, {RankGrads{}}, r);
            }).find("parameter 'w' on rank 0: missing"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              check_mesh({{"tp", 2}},
                         {{{"w", {t({1}), Placement::shard(0, "tp")}}},
                          {{"w", {t({2}), Placement::replicate()}}}},
                         r);
            }).find("parameter 'w' on rank 1: placement Replicate(), expected Shard(0, tp)"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              check_mesh({{"tp", 1}}, ranks_of({t({1, 2})}, Placement::shard(1, "tp")), r);
            }).find("dim 1 is out of range"),
            std::string::npos);
}

}  // namespace
}  // namespace diffcomm::sim
