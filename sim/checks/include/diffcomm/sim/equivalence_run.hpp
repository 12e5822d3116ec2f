#pragma once
// The mesh-equivalence oracle from C++: a step run in a sim::World on one
// rank (the reference: every dim 1) and on each mesh, compared by check_mesh
// (equivalence.hpp). diffcomm.sim.check_equivalence is the same in Python.
#include <cstdint>
#include <functional>
#include <vector>

#include "diffcomm/distributed/mesh.hpp"
#include "diffcomm/sim/equivalence.hpp"

namespace diffcomm::sim {

/// The user's step on one rank: its gradients and their placements. `mesh`
/// is over the rank's world (non-const: the step may ask for multi-dim
/// groups, DeviceMesh::group).
using EquivalenceStep = std::function<RankGrads(dist::DeviceMesh& mesh, uint64_t seed)>;

/// The dims a step sees on `mesh`: mesh's dims in order, then every other
/// dim that a mesh of `all` names, at size 1 (first-named order).
MeshDims full_mesh(const MeshDims& mesh, const std::vector<MeshDims>& all);

/// Runs `step` in a sim::World seeded with `seed` on full_mesh of every dim
/// at size 1 (the reference, world 1) and on full_mesh(mesh, meshes) of each
/// mesh, and check_mesh's each run against the reference (one MeshFindings
/// per mesh, in order). Throws the world's first failure when a step throws
/// or the ranks' collectives disagree, and check_mesh's InvalidArgument.
EquivalenceReport check_equivalence(const EquivalenceStep& step,
                                    const std::vector<MeshDims>& meshes, uint64_t seed = 0,
                                    const EquivalenceOptions& options = {});

}  // namespace diffcomm::sim
