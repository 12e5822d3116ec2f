// diffcomm._core.sim (continued): the mesh-equivalence oracle's core
// (sim/equivalence.hpp). diffcomm.sim.check_equivalence runs the step and
// calls check_mesh here once per mesh.
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bind.hpp"
#include "diffcomm/sim/equivalence.hpp"

namespace diffcomm_python {
namespace {

using dc::sim::MeshDims;
using dc::sim::Placement;
using Dims = std::vector<std::pair<std::string, int>>;
/// {name: (gradient or None, placement, inner placements)}.
using PyRankGrads =
    std::map<std::string, std::tuple<std::optional<Tensor>, Placement, std::vector<Placement>>>;

MeshDims mesh_dims(const Dims& dims) {
  MeshDims out;
  for (const auto& [name, size] : dims) out.push_back({name, size});
  return out;
}

Dims dims_of(const MeshDims& mesh) {
  Dims out;
  for (const auto& d : mesh) out.emplace_back(d.name, d.size);
  return out;
}

std::vector<dc::sim::RankGrads> rank_grads(const std::vector<PyRankGrads>& per_rank) {
  std::vector<dc::sim::RankGrads> out(per_rank.size());
  for (std::size_t r = 0; r < per_rank.size(); ++r)
    for (const auto& [name, g] : per_rank[r])
      out[r][name] = {std::get<0>(g).value_or(Tensor()), std::get<1>(g), std::get<2>(g)};
  return out;
}

void bind_placement(nb::module_& s) {
  nb::class_<Placement>(s, "Placement",
                        "How a rank's gradient relates to the global one: Replicate(), "
                        "Shard(dim, mesh_dim) or Partial(mesh_dim); other dims replicate.")
      .def_static("replicate", &Placement::replicate)
      .def_static("shard", &Placement::shard, "dim"_a, "mesh_dim"_a)
      .def_static("partial", &Placement::partial, "mesh_dim"_a)
      .def_prop_ro("kind",
                   [](const Placement& p) {
                     switch (p.kind) {
                       case Placement::Kind::Shard: return "shard";
                       case Placement::Kind::Partial: return "partial";
                       case Placement::Kind::Replicate: break;
                     }
                     return "replicate";
                   })
      .def_ro("dim", &Placement::dim)
      .def_ro("mesh_dim", &Placement::mesh_dim)
      .def("__eq__", [](const Placement& a, const Placement& b) { return a == b; })
      // A value: pickled by its fields (a rank process's step returns it).
      .def("__getstate__",
           [](const Placement& p) {
             return std::make_tuple(static_cast<int>(p.kind), p.dim, p.mesh_dim);
           })
      .def("__setstate__",
           [](Placement& p, const std::tuple<int, int64_t, std::string>& s) {
             const int kind = std::get<0>(s);
             if (kind < 0 || kind > static_cast<int>(Placement::Kind::Partial))
               throw dc::InvalidArgument("unpickling a Placement: kind " + std::to_string(kind));
             new (&p) Placement{static_cast<Placement::Kind>(kind), std::get<1>(s), std::get<2>(s)};
           })
      .def("__repr__", &Placement::str);
}

void bind_findings(nb::module_& s) {
  using dc::sim::ParamFinding;
  nb::class_<ParamFinding>(s, "ParamFinding", "What the check found for one parameter.")
      .def_ro("name", &ParamFinding::name)
      .def_ro("placement", &ParamFinding::placement)
      .def_ro("inner", &ParamFinding::inner)
      .def_prop_ro(
          "placement_str",
          [](const ParamFinding& f) { return dc::sim::placement_str(f.placement, f.inner); })
      .def_ro("ok", &ParamFinding::ok)
      .def_ro("max_rel_error", &ParamFinding::max_rel_error)
      .def_ro("divergent_ranks", &ParamFinding::divergent_ranks)
      .def_prop_ro(
          "factor",
          [](const ParamFinding& f) { return f.has_factor ? nb::cast(f.factor) : nb::none(); })
      .def_ro("factor_residual", &ParamFinding::factor_residual)
      .def_ro("factor_fits", &ParamFinding::factor_fits)
      .def_ro("expressions", &ParamFinding::expressions)
      .def_ro("differing_shards", &ParamFinding::differing_shards)
      .def_ro("missing_ranks", &ParamFinding::missing_ranks);
  using dc::sim::MeshFindings;
  nb::class_<MeshFindings>(s, "MeshFindings", "The findings of one mesh, parameters by name.")
      .def_prop_ro("mesh", [](const MeshFindings& m) { return dims_of(m.mesh); })
      .def_ro("params", &MeshFindings::params)
      .def_prop_ro("ok", &MeshFindings::ok)
      .def("line", [](const MeshFindings& m, const ParamFinding& f) { return f.str(m.mesh); })
      .def("__str__", &MeshFindings::str);
}

}  // namespace

void bind_equivalence(nb::module_& m) {
  nb::module_ s = nb::borrow<nb::module_>(m.attr("sim"));
  bind_placement(s);
  bind_findings(s);
  s.def(
      "check_mesh",
      [](const Dims& mesh, const std::vector<PyRankGrads>& per_rank,
         const std::map<std::string, Tensor>& reference, double rtol, double factor_rtol) {
        return dc::sim::check_mesh(mesh_dims(mesh), rank_grads(per_rank), reference,
                                   {rtol, factor_rtol});
      },
      "mesh"_a, "per_rank"_a, "reference"_a, "rtol"_a, "factor_rtol"_a, release(),
      "sim::check_mesh: per_rank[r] = {name: (tensor or None, placement, inner placements)}; "
      "InvalidArgument on bad input.");
}

}  // namespace diffcomm_python
