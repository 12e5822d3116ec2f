#include "diffcomm/sim/equivalence.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::sim {
namespace {

/// A gradient in float64 on the CPU.
struct Dense {
  Shape shape;
  std::vector<double> v;
};

Dense dense(const Tensor& t, const std::string& who) {
  if (!t.defined()) raise("check_equivalence", who + ": the gradient is undefined (None)");
  const Tensor cpu = t.device().is_cpu() ? t : t.to(Device::cpu());
  return {cpu.shape(), cpu.to_vector()};
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

/// max|a - f b| / scale.
double rel_diff(const std::vector<double>& a, const std::vector<double>& b, double scale,
                double f = 1.0) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - f * b[i]));
  return m / scale;
}

/// The scale of relative errors: max|r|, 1 when r is all zero.
double scale_of(const std::vector<double>& r) {
  const double m = max_abs(r);
  return m > 0 ? m : 1.0;
}

int dim_index(const MeshDims& mesh, const std::string& name) {
  for (std::size_t i = 0; i < mesh.size(); ++i)
    if (mesh[i].name == name) return static_cast<int>(i);
  return -1;
}

int rank_of(const MeshDims& mesh, const std::vector<int>& coords) {
  int r = 0;
  for (std::size_t i = 0; i < mesh.size(); ++i) r = r * mesh[i].size + coords[i];
  return r;
}

/// The rank at coordinate k on dim `axis` and 0 on every other dim.
int axis_rank(const MeshDims& mesh, int axis, int k) {
  std::vector<int> c(mesh.size(), 0);
  if (axis >= 0) c[static_cast<std::size_t>(axis)] = k;
  return rank_of(mesh, c);
}

std::string who(const std::string& name, int rank) {
  return fmt::format("parameter '{}' on rank {}", name, rank);
}

}  // namespace

std::string mesh_str(const MeshDims& mesh) {
  std::string s = "{";
  for (std::size_t i = 0; i < mesh.size(); ++i)
    s += fmt::format("{}{}: {}", i ? ", " : "", mesh[i].name, mesh[i].size);
  return s + "}";
}

int mesh_world(const MeshDims& mesh) {
  std::set<std::string> names;
  int world = 1;
  for (const MeshDim& d : mesh) {
    if (d.name.empty())
      raise("check_equivalence", "mesh " + mesh_str(mesh) + ": a dim has an empty name");
    if (!names.insert(d.name).second)
      raise("check_equivalence",
            fmt::format("mesh {}: dim '{}' is named twice", mesh_str(mesh), d.name));
    if (d.size < 1)
      raise("check_equivalence", fmt::format("mesh {}: dim '{}' has size {}, expected >= 1",
                                             mesh_str(mesh), d.name, d.size));
    world *= d.size;
  }
  return world;
}

std::vector<int> mesh_coords(const MeshDims& mesh, int rank) {
  const int world = mesh_world(mesh);
  if (rank < 0 || rank >= world)
    raise("check_equivalence",
          fmt::format("rank {} is outside mesh {} of {} ranks", rank, mesh_str(mesh), world));
  std::vector<int> c(mesh.size());
  for (std::size_t i = mesh.size(); i-- > 0;) {
    c[i] = rank % mesh[i].size;
    rank /= mesh[i].size;
  }
  return c;
}

std::string Placement::str() const {
  switch (kind) {
    case Kind::Replicate: return "Replicate()";
    case Kind::Shard: return fmt::format("Shard({}, {})", dim, mesh_dim);
    case Kind::Partial: return fmt::format("Partial({})", mesh_dim);
  }
  return "?";
}

std::string placement_str(const Placement& outer, const std::vector<Placement>& inner) {
  if (inner.empty()) return outer.str();
  // fmt, not "[" + std::string&&: GCC 12 at -O3 reports a false -Wrestrict
  // on that operator+ (its bug 105329).
  std::string s = fmt::format("[{}", outer.str());
  for (const Placement& p : inner) s += fmt::format(", {}", p.str());
  return s + "]";
}

std::map<std::string, Tensor> reference_gradients(const RankGrads& one_rank) {
  std::map<std::string, Tensor> out;
  for (const auto& [name, g] : one_rank) {
    if (!g.grad.defined())
      raise("check_equivalence", who(name, 0) + " of the reference: the gradient is undefined");
    out[name] = g.grad;
  }
  return out;
}

namespace {

/// Each placement names a mesh dim of the mesh (at most once) and a tensor
/// dim in range; inner placements are not Replicate.
void validate_placement(const MeshDims& mesh, const PlacedGrad& g, const std::string& who,
                        int64_t ref_dims) {
  std::vector<Placement> all{g.placement};
  all.insert(all.end(), g.inner.begin(), g.inner.end());
  const std::string text = placement_str(g.placement, g.inner);
  std::set<std::string> seen;
  for (std::size_t i = 0; i < all.size(); ++i) {
    const Placement& p = all[i];
    if (p.kind == Placement::Kind::Replicate) {
      if (i > 0)
        raise("check_equivalence",
              fmt::format("{}: placement {}: an inner placement is Shard or Partial, not "
                          "Replicate (leave replicated dims out)",
                          who, text));
      continue;
    }
    if (dim_index(mesh, p.mesh_dim) < 0)
      raise("check_equivalence",
            fmt::format("{}: placement {} names mesh dim '{}', mesh {} has no such dim", who, text,
                        p.mesh_dim, mesh_str(mesh)));
    if (!seen.insert(p.mesh_dim).second)
      raise("check_equivalence",
            fmt::format("{}: placement {} names mesh dim '{}' twice", who, text, p.mesh_dim));
    if (p.kind == Placement::Kind::Shard && (p.dim < 0 || p.dim >= ref_dims))
      raise("check_equivalence",
            fmt::format("{}: placement {}: dim {} is out of range for the reference's {} dims", who,
                        text, p.dim, ref_dims));
  }
}

/// Every rank names the reference's parameters with one placement whose mesh
/// dim exists and whose Shard dim is in range.
void validate(const MeshDims& mesh, const std::vector<RankGrads>& per_rank,
              const std::map<std::string, Tensor>& reference) {
  const int world = mesh_world(mesh);
  if (static_cast<int>(per_rank.size()) != world)
    raise("check_equivalence", fmt::format("mesh {} has {} ranks, received gradients of {}",
                                           mesh_str(mesh), world, per_rank.size()));
  for (int r = 0; r < world; ++r) {
    const RankGrads& grads = per_rank[static_cast<std::size_t>(r)];
    for (const auto& [name, ref] : reference)
      if (!grads.count(name))
        raise("check_equivalence", fmt::format("{}: missing (the reference has it)", who(name, r)));
    for (const auto& [name, g] : grads) {
      auto it = reference.find(name);
      if (it == reference.end())
        raise("check_equivalence",
              fmt::format("{}: not in the reference's parameters", who(name, r)));
      validate_placement(mesh, g, who(name, r), it->second.dim());
      const PlacedGrad& g0 = per_rank[0].at(name);
      if (!(g.placement == g0.placement) || g.inner != g0.inner)
        raise("check_equivalence", fmt::format("{}: placement {}, expected {} (rank 0's)",
                                               who(name, r), placement_str(g.placement, g.inner),
                                               placement_str(g0.placement, g0.inner)));
    }
  }
}

/// The placement's mesh dim index (-1 for Replicate: every dim replicates).
int axis_of(const MeshDims& mesh, const Placement& p) {
  return p.kind == Placement::Kind::Replicate ? -1 : dim_index(mesh, p.mesh_dim);
}

/// The mesh dims a (possibly nested) placement splits or sums over.
std::vector<int> axes_of(const MeshDims& mesh, const PlacedGrad& g) {
  std::vector<int> out;
  if (axis_of(mesh, g.placement) >= 0) out.push_back(axis_of(mesh, g.placement));
  for (const Placement& p : g.inner) out.push_back(dim_index(mesh, p.mesh_dim));
  return out;
}

/// Ranks whose tensor differs from their first replica: the rank with the
/// same coordinates on the placement's axes and 0 on every other dim. A shape
/// difference is an error.
std::vector<int> divergent_ranks(const MeshDims& mesh, const std::vector<RankGrads>& per_rank,
                                 const std::string& name, double rtol) {
  const std::vector<int> axes = axes_of(mesh, per_rank[0].at(name));
  std::vector<int> out;
  for (int r = 0; r < static_cast<int>(per_rank.size()); ++r) {
    const std::vector<int> c = mesh_coords(mesh, r);
    std::vector<int> first(mesh.size(), 0);
    for (int a : axes) first[static_cast<std::size_t>(a)] = c[static_cast<std::size_t>(a)];
    const int base = rank_of(mesh, first);
    if (base == r) continue;
    const Dense a = dense(per_rank[static_cast<std::size_t>(r)].at(name).grad, who(name, r));
    const Dense b = dense(per_rank[static_cast<std::size_t>(base)].at(name).grad, who(name, base));
    if (a.shape != b.shape)
      raise("check_equivalence",
            fmt::format("{}: shape {}, expected {} (its replica rank {})", who(name, r),
                        shape_str(a.shape), shape_str(b.shape), base));
    if (rel_diff(a.v, b.v, scale_of(b.v)) > rtol) out.push_back(r);
  }
  return out;
}

void expect_shape(const Dense& d, const Shape& expected, const std::string& name, int rank,
                  const Placement& p) {
  if (d.shape != expected)
    raise("check_equivalence",
          fmt::format("{} ({}): shape {}, expected {} (the reference's)", who(name, rank), p.str(),
                      shape_str(d.shape), shape_str(expected)));
}

/// A reassembled gradient and, for Shard, each shard's [start, size) along dim.
struct Assembled {
  Dense g;
  std::vector<std::pair<int64_t, int64_t>> shards;
};

Assembled assemble_partial(const MeshDims& mesh, const std::vector<RankGrads>& per_rank,
                           const std::string& name, int axis, const Shape& ref_shape) {
  Assembled out;
  const Placement& p = per_rank[0].at(name).placement;
  for (int k = 0; k < mesh[static_cast<std::size_t>(axis)].size; ++k) {
    const int r = axis_rank(mesh, axis, k);
    const Dense d = dense(per_rank[static_cast<std::size_t>(r)].at(name).grad, who(name, r));
    expect_shape(d, ref_shape, name, r, p);
    if (k == 0) {
      out.g = d;
      continue;
    }
    for (std::size_t i = 0; i < d.v.size(); ++i) out.g.v[i] += d.v[i];
  }
  return out;
}

/// Sizes along dim of the shards, checked against the reference's shape.
std::vector<Dense> shard_tensors(const MeshDims& mesh, const std::vector<RankGrads>& per_rank,
                                 const std::string& name, int axis, const Shape& ref_shape) {
  const Placement& p = per_rank[0].at(name).placement;
  const auto dim = static_cast<std::size_t>(p.dim);
  std::vector<Dense> parts;
  std::vector<int> ranks;
  int64_t total = 0;
  for (int k = 0; k < mesh[static_cast<std::size_t>(axis)].size; ++k) {
    const int r = axis_rank(mesh, axis, k);
    parts.push_back(dense(per_rank[static_cast<std::size_t>(r)].at(name).grad, who(name, r)));
    ranks.push_back(r);
    Shape expected = ref_shape;
    if (parts.back().shape.size() == ref_shape.size()) expected[dim] = parts.back().shape[dim];
    expect_shape(parts.back(), expected, name, r, p);
    total += parts.back().shape[dim];
  }
  if (total != ref_shape[dim]) {
    std::string sizes;
    for (std::size_t k = 0; k < parts.size(); ++k)
      sizes += fmt::format("{}rank {}: {}", k ? ", " : "", ranks[k], parts[k].shape[dim]);
    raise("check_equivalence",
          fmt::format("parameter '{}' ({}): the shards' sizes along dim {} ({}) add up to {}, "
                      "expected {} (the reference's {})",
                      name, p.str(), p.dim, sizes, total, ref_shape[dim], shape_str(ref_shape)));
  }
  return parts;
}

/// The parts concatenated along dim (their shapes equal but along dim).
Dense concat(const std::vector<Dense>& parts, std::size_t dim) {
  Shape shape = parts.at(0).shape;
  shape[dim] = 0;
  for (const Dense& part : parts) shape[dim] += part.shape[dim];
  int64_t outer = 1, inner = 1;
  for (std::size_t i = 0; i < dim; ++i) outer *= shape[i];
  for (std::size_t i = dim + 1; i < shape.size(); ++i) inner *= shape[i];
  Dense out{shape, std::vector<double>(static_cast<std::size_t>(outer * shape[dim] * inner))};
  int64_t start = 0;
  for (const Dense& part : parts) {
    const int64_t n = part.shape[dim];
    for (int64_t o = 0; o < outer; ++o)
      std::copy_n(part.v.begin() + o * n * inner, n * inner,
                  out.v.begin() + (o * shape[dim] + start) * inner);
    start += n;
  }
  return out;
}

Assembled assemble_shard(const MeshDims& mesh, const std::vector<RankGrads>& per_rank,
                         const std::string& name, int axis, const Shape& ref_shape) {
  const auto dim = static_cast<std::size_t>(per_rank[0].at(name).placement.dim);
  const std::vector<Dense> parts = shard_tensors(mesh, per_rank, name, axis, ref_shape);
  Assembled out{concat(parts, dim), {}};
  int64_t start = 0;
  for (const Dense& part : parts) {
    out.shards.emplace_back(start, part.shape[dim]);
    start += part.shape[dim];
  }
  return out;
}

/// Rank `rank`'s part of an inner placement q, its shape checked against
/// the first part's (equal, but along q.dim for a Shard).
Dense inner_part(const std::vector<RankGrads>& per_rank, const std::string& name, int rank,
                 const Placement& q, const std::vector<Dense>& before, int first) {
  const PlacedGrad& g = per_rank[static_cast<std::size_t>(rank)].at(name);
  Dense d = dense(g.grad, who(name, rank));
  const std::string text = placement_str(g.placement, g.inner);
  if (q.kind == Placement::Kind::Shard && static_cast<int64_t>(d.shape.size()) <= q.dim)
    raise("check_equivalence", fmt::format("{} ({}): shape {} has no dim {}", who(name, rank), text,
                                           shape_str(d.shape), q.dim));
  if (before.empty()) return d;
  Shape expected = before[0].shape;
  if (q.kind == Placement::Kind::Shard && expected.size() == d.shape.size())
    expected[static_cast<std::size_t>(q.dim)] = d.shape[static_cast<std::size_t>(q.dim)];
  if (d.shape != expected)
    raise("check_equivalence",
          fmt::format("{} ({}): shape {}, expected {} (as rank {}, its first peer over {})",
                      who(name, rank), text, shape_str(d.shape), shape_str(expected), first,
                      q.mesh_dim));
  return d;
}

/// The gradients of `name` with its innermost placement applied: ranks that
/// differ only on that placement's mesh dim each hold the concatenation
/// (Shard) or the sum (Partial) of their tensors in coordinate order, so
/// what remains is a placement of one mesh dim fewer.
std::vector<RankGrads> collapse_inner(const MeshDims& mesh, const std::vector<RankGrads>& per_rank,
                                      const std::string& name) {
  const PlacedGrad& g0 = per_rank[0].at(name);
  const Placement q = g0.inner.back();
  const auto axis = static_cast<std::size_t>(dim_index(mesh, q.mesh_dim));
  const std::vector<Placement> rest(g0.inner.begin(), g0.inner.end() - 1);
  std::vector<RankGrads> out(per_rank.size());
  for (int r = 0; r < static_cast<int>(per_rank.size()); ++r) {
    std::vector<int> c = mesh_coords(mesh, r);
    if (c[axis] != 0) {  // its group's first rank (a lower rank) combined it already
      c[axis] = 0;
      out[static_cast<std::size_t>(r)][name] =
          out[static_cast<std::size_t>(rank_of(mesh, c))][name];
      continue;
    }
    std::vector<Dense> parts;
    for (int k = 0; k < mesh[axis].size; ++k) {
      c[axis] = k;
      parts.push_back(inner_part(per_rank, name, rank_of(mesh, c), q, parts, r));
    }
    Dense d = parts[0];
    if (q.kind == Placement::Kind::Shard) d = concat(parts, static_cast<std::size_t>(q.dim));
    for (std::size_t k = 1; q.kind == Placement::Kind::Partial && k < parts.size(); ++k)
      for (std::size_t i = 0; i < d.v.size(); ++i) d.v[i] += parts[k].v[i];
    out[static_cast<std::size_t>(r)][name] = {from_vector(d.v, d.shape), g0.placement, rest};
  }
  return out;
}

Assembled assemble(const MeshDims& mesh, const std::vector<RankGrads>& per_rank,
                   const std::string& name, const Shape& ref_shape) {
  const Placement& p = per_rank[0].at(name).placement;
  const int axis = axis_of(mesh, p);
  switch (p.kind) {
    case Placement::Kind::Partial: return assemble_partial(mesh, per_rank, name, axis, ref_shape);
    case Placement::Kind::Shard: return assemble_shard(mesh, per_rank, name, axis, ref_shape);
    case Placement::Kind::Replicate: break;
  }
  Assembled out{dense(per_rank[0].at(name).grad, who(name, 0)), {}};
  expect_shape(out.g, ref_shape, name, 0, p);
  return out;
}

/// max|g - r| / scale over the elements with dim index in [start, start + n).
double slab_error(const Dense& g, const std::vector<double>& r, std::size_t dim, int64_t start,
                  int64_t n, double scale) {
  int64_t outer = 1, inner = 1;
  for (std::size_t i = 0; i < dim; ++i) outer *= g.shape[i];
  for (std::size_t i = dim + 1; i < g.shape.size(); ++i) inner *= g.shape[i];
  const int64_t full = g.shape[dim];
  double m = 0;
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = (o * full + start) * inner; i < (o * full + start + n) * inner; ++i)
      m = std::max(m, std::abs(g.v[static_cast<std::size_t>(i)] - r[static_cast<std::size_t>(i)]));
  return m / scale;
}

/// The shards that differ, when some (not all) do.
std::vector<int> differing_shards(const Assembled& a, const std::vector<double>& r,
                                  const Placement& p, double scale, double rtol) {
  std::vector<int> out;
  for (std::size_t k = 0; k < a.shards.size(); ++k) {
    const auto [start, n] = a.shards[k];
    if (slab_error(a.g, r, static_cast<std::size_t>(p.dim), start, n, scale) > rtol)
      out.push_back(static_cast<int>(k));
  }
  if (out.size() == a.shards.size()) out.clear();
  return out;
}

/// Fills the factor, its expressions and the shard map of a failing finding.
void explain(ParamFinding& f, const MeshDims& mesh, const Assembled& a,
             const std::vector<double>& r, const EquivalenceOptions& options) {
  double gr = 0, rr = 0;
  for (std::size_t i = 0; i < r.size(); ++i) {
    gr += a.g.v[i] * r[i];
    rr += r[i] * r[i];
  }
  const double scale = scale_of(r);
  f.has_factor = true;
  f.factor = rr > 0 ? gr / rr : 0.0;
  f.factor_residual = rel_diff(a.g.v, r, scale, f.factor);
  f.factor_fits = rr > 0 && f.factor_residual <= options.factor_rtol;
  if (f.factor_fits) f.expressions = factor_expressions(mesh, f.factor, options.factor_rtol);
  if (f.placement.kind == Placement::Kind::Shard && !f.factor_fits)
    f.differing_shards = differing_shards(a, r, f.placement, scale, options.rtol);
}

}  // namespace

MeshFindings check_mesh(const MeshDims& mesh, const std::vector<RankGrads>& per_rank,
                        const std::map<std::string, Tensor>& reference,
                        const EquivalenceOptions& options) {
  validate(mesh, per_rank, reference);
  MeshFindings out{mesh, {}};
  for (const auto& [name, ref_tensor] : reference) {
    const Dense ref = dense(ref_tensor, "parameter '" + name + "' of the reference");
    ParamFinding f;
    f.name = name;
    f.placement = per_rank[0].at(name).placement;
    f.inner = per_rank[0].at(name).inner;
    for (int r = 0; r < static_cast<int>(per_rank.size()); ++r)
      if (!per_rank[static_cast<std::size_t>(r)].at(name).grad.defined())
        f.missing_ranks.push_back(r);
    if (!f.missing_ranks.empty()) {
      f.ok = false;
      out.params.push_back(std::move(f));
      continue;
    }
    f.divergent_ranks = divergent_ranks(mesh, per_rank, name, options.rtol);
    std::vector<RankGrads> collapsed;
    const std::vector<RankGrads>* grads = &per_rank;
    while (!grads->at(0).at(name).inner.empty()) {
      collapsed = collapse_inner(mesh, *grads, name);
      grads = &collapsed;
    }
    const Assembled a = assemble(mesh, *grads, name, ref.shape);
    f.max_rel_error = rel_diff(a.g.v, ref.v, scale_of(ref.v));
    f.ok = f.max_rel_error <= options.rtol && f.divergent_ranks.empty();
    if (f.max_rel_error > options.rtol) explain(f, mesh, a, ref.v, options);
    out.params.push_back(std::move(f));
  }
  return out;
}

bool MeshFindings::ok() const {
  return std::all_of(params.begin(), params.end(), [](const ParamFinding& f) { return f.ok; });
}

bool EquivalenceReport::ok() const {
  return std::all_of(meshes.begin(), meshes.end(), [](const MeshFindings& m) { return m.ok(); });
}

}  // namespace diffcomm::sim
