#pragma once
// The mesh-equivalence oracle: a training step's gradients on a mesh against
// the same step on one rank (every mesh dim 1), with the wrong factor named.
//
// A pure function over tensors already computed: per rank of the mesh, each
// parameter's gradient and its placement; it reassembles every parameter's
// global gradient, compares it with the reference and explains a failure:
//   - a scalar factor (least squares) and, when it fits, the expressions over
//     the mesh dims it equals (`tp`, `1/dp`, `dp*tp`, `dp/tp`, `world`);
//   - for a Shard placement, the shards that differ while the others match;
//   - for replicas (every dim the placement does not name), the ranks whose
//     gradient differs from their first replica.
// Running the step is equivalence_run.hpp's part (sim::World) and
// diffcomm.sim.check_equivalence's (Python).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::sim {

/// One named mesh dimension.
struct MeshDim {
  std::string name;
  int size = 1;
};
/// A mesh: dims in order, ranks row-major with the last dim fastest (as
/// dist::DeviceMesh): rank = sum_i coord_i * prod_{j > i} size_j.
using MeshDims = std::vector<MeshDim>;

/// "{dp: 2, tp: 2}" (dims in order).
std::string mesh_str(const MeshDims& mesh);
/// The product of the dim sizes. Throws InvalidArgument for a size < 1, an
/// empty or repeated name.
int mesh_world(const MeshDims& mesh);
/// The coordinates of `rank` (one per dim, in order). Throws InvalidArgument
/// for a rank outside [0, mesh_world(mesh)).
std::vector<int> mesh_coords(const MeshDims& mesh, int rank);

/// How one rank's gradient relates to the parameter's global gradient, over
/// one mesh dim; every other dim of the mesh holds replicas (equal values).
///  - Replicate: every rank holds the whole gradient.
///  - Shard(dim, mesh_dim): the global gradient is the concatenation along
///    tensor dim `dim` of the ranks' tensors in mesh_dim coordinate order.
///    Uneven shards are accepted in any sizes (torch.chunk's included,
///    zero-size shards too) as long as they add up to the reference's size.
///  - Partial(mesh_dim): the global gradient is the sum over mesh_dim.
struct Placement {
  enum class Kind { Replicate, Shard, Partial };
  Kind kind = Kind::Replicate;
  int64_t dim = 0;       ///< tensor dim (Shard)
  std::string mesh_dim;  ///< mesh dim (Shard, Partial)

  static Placement replicate() { return {}; }
  static Placement shard(int64_t dim, std::string mesh_dim) {
    return {Kind::Shard, dim, std::move(mesh_dim)};
  }
  static Placement partial(std::string mesh_dim) { return {Kind::Partial, 0, std::move(mesh_dim)}; }
  /// "Replicate()", "Shard(0, tp)", "Partial(dp)".
  std::string str() const;
  friend bool operator==(const Placement&, const Placement&) = default;
};

/// "Shard(0, dp)", or for a nested placement "[Shard(0, dp), Partial(tp)]".
std::string placement_str(const Placement& outer, const std::vector<Placement>& inner);

/// One rank's gradient of one parameter and its placement.
///
/// `inner`: further placements on other mesh dims, applied within the shard
/// `placement` describes, outer to inner, as a DTensor placement list in mesh
/// dim order: [Shard(0, dp), Shard(0, tp)] cuts dim 0 by dp, then each dp
/// piece by tp; [Shard(0, dp), Partial(tp)] sums over tp, then concatenates
/// over dp. Inner placements are Shard or Partial, each on its own mesh dim;
/// empty (the usual case) for a one-dim placement.
///
/// An undefined `grad` (a rank whose backward never reached the parameter)
/// is a finding (ParamFinding::missing_ranks), not an error.
struct PlacedGrad {
  Tensor grad;
  Placement placement;
  std::vector<Placement> inner = {};
};
/// One rank's gradients by parameter name.
using RankGrads = std::map<std::string, PlacedGrad>;

/// Tolerances of the check.
struct EquivalenceOptions {
  /// A gradient passes when max|g - r| / max|r| <= rtol (max|r| taken as 1
  /// when r is all zero; replicas: the same measure against their first
  /// replica).
  double rtol = 1e-12;
  /// A failing gradient is `factor x reference` when max|g - f r| / max|r|
  /// <= factor_rtol, and f equals a mesh expression e when |f - e| <=
  /// factor_rtol * |e|. Looser than rtol: f is itself computed in floating
  /// point from the whole tensor.
  double factor_rtol = 1e-9;
};

/// What the check found for one parameter on one mesh.
struct ParamFinding {
  std::string name;
  Placement placement;
  std::vector<Placement> inner;  ///< PlacedGrad::inner
  bool ok = true;                ///< matches the reference and replicas agree
  double max_rel_error = 0;      ///< max|g - r| / max|r| (g: the reassembled gradient)
  /// Ranks whose gradient differs (beyond rtol) from the replica with the
  /// same coordinates on the placement's dim and 0 on every other dim.
  std::vector<int> divergent_ranks;
  bool has_factor = false;     ///< factor is set: the gradients differ
  double factor = 0;           ///< least squares: <g, r> / <r, r> (0 when r = 0)
  double factor_residual = 0;  ///< max|g - factor r| / max|r|
  bool factor_fits = false;    ///< factor_residual <= factor_rtol
  /// When factor_fits: the mesh expressions equal to factor of the simplest
  /// matching kind, in this order of kinds: `d`, `1/d`, `a*b`, `1/(a*b)`,
  /// `a/b`, `world`, `1/world`, over dims of size > 1 (`world` only with 3 or
  /// more such dims: otherwise it is one of the former). Expressions worth 1
  /// are never listed. Several entries = a tie (e.g. dp = tp = 2 and a
  /// factor of 2: {"dp", "tp"}), listed in mesh dim order.
  std::vector<std::string> expressions;
  /// Shard placement only, when some shards match and others do not: the
  /// mesh_dim coordinates of the shards that differ.
  std::vector<int> differing_shards;
  /// Ranks whose gradient is undefined (None) while the reference has one;
  /// when not empty, nothing else is compared (ok = false).
  std::vector<int> missing_ranks;

  /// One line, e.g. "encoder.w: grad = 4.000 x reference = dp*tp on mesh
  /// {dp: 2, tp: 2}".
  std::string str(const MeshDims& mesh) const;
};

/// The findings of one mesh, parameters in name order.
struct MeshFindings {
  MeshDims mesh;
  std::vector<ParamFinding> params;
  bool ok() const;
  /// One line per failing parameter, or one line saying all match.
  std::string str() const;
};

/// The report of check_equivalence over several meshes.
struct EquivalenceReport {
  std::vector<MeshFindings> meshes;
  bool ok() const;
  /// MeshFindings::str of every mesh, in order.
  std::string str() const;
};

/// The global gradients of a world-1 run (the reference): each parameter's
/// tensor as is, whatever its placement. Throws InvalidArgument when the
/// gradient is undefined.
std::map<std::string, Tensor> reference_gradients(const RankGrads& one_rank);

/// Checks one mesh's per-rank gradients (per_rank[r]: rank r, r < world)
/// against the reference. Every rank must report the same parameters with the
/// same placement, the reference exactly these parameters; tensors may have
/// any floating dtype and lie on any device (compared in float64 on the CPU).
/// Throws InvalidArgument naming the parameter, the rank and expected vs
/// received for: a rank count other than the mesh's world, a missing or
/// extra parameter, a placement naming a dim the mesh does not have or
/// differing between ranks, an inner placement that is Replicate or names a
/// mesh dim twice, a Shard dim out of range, and a shape that does not fit
/// the reference's (replicas and Partial: equal shapes; Shard: equal except
/// along dim, sizes adding up to the reference's).
MeshFindings check_mesh(const MeshDims& mesh, const std::vector<RankGrads>& per_rank,
                        const std::map<std::string, Tensor>& reference,
                        const EquivalenceOptions& options = {});

/// The mesh expressions equal to `factor` within factor_rtol (see
/// ParamFinding::expressions); empty when none is.
std::vector<std::string> factor_expressions(const MeshDims& mesh, double factor,
                                            double factor_rtol = 1e-9);

}  // namespace diffcomm::sim
