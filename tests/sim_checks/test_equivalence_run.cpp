// check_equivalence from C++ (sim/checks/include/diffcomm/sim/equivalence_run.hpp):
// hand-written steps in a sim::World whose gradients have a closed form.
#include <gtest/gtest.h>

#include <vector>

#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/sim/equivalence_run.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::sim {
namespace {

/// d/dw of sum(rows * w) over this rank's dp rows of DATA (8 x 2, DATA[i][j]
/// = 2i + j): the column sums of rows [k*8/n, (k+1)*8/n).
Tensor dp_rows_grad(const dist::DeviceMesh& mesh) {
  const int n = mesh.size("dp"), k = mesh.coordinate("dp");
  std::vector<double> g{0, 0};
  for (int i = k * 8 / n; i < (k + 1) * 8 / n; ++i) {
    g[0] += 2 * i;
    g[1] += 2 * i + 1;
  }
  return from_vector(g, {2});
}

const std::vector<MeshDims> kMeshes{{{"dp", 4}}, {{"dp", 2}, {"tp", 2}}};

TEST(EquivalenceRun, FullMeshAppendsTheOtherDimsAtSizeOne) {
  EXPECT_EQ(mesh_str(full_mesh({{"cp", 2}}, {{{"dp", 2}}, {{"cp", 2}, {"tp", 2}}})),
            "{cp: 2, dp: 1, tp: 1}");
  EXPECT_EQ(mesh_str(full_mesh({}, kMeshes)), "{dp: 1, tp: 1}");
}

TEST(EquivalenceRun, PartialStepMatchesOnEveryMesh) {
  const auto step = [](dist::DeviceMesh& mesh, uint64_t) {
    return RankGrads{{"w", {dp_rows_grad(mesh), Placement::partial("dp")}}};
  };
  const auto report = check_equivalence(step, kMeshes);
  EXPECT_TRUE(report.ok()) << report.str();
  ASSERT_EQ(report.meshes.size(), 2u);
  EXPECT_EQ(mesh_str(report.meshes[0].mesh), "{dp: 4, tp: 1}");
  EXPECT_EQ(report.meshes[1].params.at(0).max_rel_error, 0.0);  // integers: exact
}

TEST(EquivalenceRun, PartialSummedAgainIsDpTimes) {
  // After the all-reduce every dp rank holds the whole (56, 64); declared
  // Partial it is summed again: dp x (56, 64).
  const auto step = [](dist::DeviceMesh& mesh, uint64_t) {
    Tensor g = dp_rows_grad(mesh);
    dist::all_reduce(mesh.group("dp"), g);
    return RankGrads{{"w", {g, Placement::partial("dp")}}};
  };
  const auto report = check_equivalence(step, kMeshes);
  EXPECT_FALSE(report.ok());
  EXPECT_EQ(report.meshes[0].params.at(0).factor, 4.0);
  EXPECT_EQ(report.str(),
            "w: grad = 4.000 x reference = dp on mesh {dp: 4, tp: 1}\n"
            "w: grad = 2.000 x reference = dp or tp (a tie: equal on this mesh) on mesh "
            "{dp: 2, tp: 2}");
}

TEST(EquivalenceRun, AStepsErrorEndsTheCheck) {
  const auto step = [](dist::DeviceMesh& mesh, uint64_t) -> RankGrads {
    if (mesh.world().rank() == 1) throw InvalidArgument("step: rank 1 failed");
    return {{"w", {dp_rows_grad(mesh), Placement::partial("dp")}}};
  };
  EXPECT_THROW(check_equivalence(step, kMeshes), Error);
}

}  // namespace
}  // namespace diffcomm::sim
