#include "diffcomm/sim/equivalence_run.hpp"

#include <algorithm>

#include "diffcomm/sim/world.hpp"

namespace diffcomm::sim {
namespace {

/// Every rank's gradients of one run of `step` on `dims`.
std::vector<RankGrads> run_on(const EquivalenceStep& step, const MeshDims& dims, uint64_t seed) {
  WorldOptions wo;
  wo.ranks = mesh_world(dims);
  wo.seed = seed;
  World world(wo);
  dist::DeviceMesh::Dims named;
  for (const MeshDim& d : dims) named.emplace_back(d.name, d.size);
  std::vector<RankGrads> out(static_cast<std::size_t>(wo.ranks));
  world.run([&](Rank& r) {
    dist::DeviceMesh mesh(r.world(), named);
    out[static_cast<std::size_t>(r.rank())] = step(mesh, seed);
  });
  return out;
}

}  // namespace

MeshDims full_mesh(const MeshDims& mesh, const std::vector<MeshDims>& all) {
  MeshDims out = mesh;
  auto named = [&](const std::string& n) {
    return std::any_of(out.begin(), out.end(), [&](const MeshDim& d) { return d.name == n; });
  };
  for (const MeshDims& m : all)
    for (const MeshDim& d : m)
      if (!named(d.name)) out.push_back({d.name, 1});
  return out;
}

EquivalenceReport check_equivalence(const EquivalenceStep& step,
                                    const std::vector<MeshDims>& meshes, uint64_t seed,
                                    const EquivalenceOptions& options) {
  const auto reference = reference_gradients(run_on(step, full_mesh({}, meshes), seed).at(0));
  EquivalenceReport report;
  for (const MeshDims& mesh : meshes) {
    const MeshDims dims = full_mesh(mesh, meshes);
    report.meshes.push_back(check_mesh(dims, run_on(step, dims, seed), reference, options));
  }
  return report;
}

}  // namespace diffcomm::sim
