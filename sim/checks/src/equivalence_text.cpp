// The text of the mesh-equivalence report: one line per finding.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "diffcomm/sim/equivalence.hpp"

namespace diffcomm::sim {
namespace {

std::string number(double x) {
  return (x == 0 || std::abs(x) >= 0.01) ? fmt::format("{:.3f}", x) : fmt::format("{:.3e}", x);
}

std::string join(const std::vector<std::string>& parts, const char* sep) {
  std::string s;
  for (std::size_t i = 0; i < parts.size(); ++i) s += (i ? sep : "") + parts[i];
  return s;
}

std::string value_line(const ParamFinding& f) {
  if (f.factor_fits && !f.expressions.empty())
    return fmt::format("grad = {} x reference = {}{}", number(f.factor),
                       join(f.expressions, " or "),
                       f.expressions.size() > 1 ? " (a tie: equal on this mesh)" : "");
  if (f.factor_fits)
    return fmt::format("grad = {} x reference (no mesh expression equals it)", number(f.factor));
  if (!f.differing_shards.empty()) {
    std::vector<std::string> shards;
    for (int k : f.differing_shards)
      shards.push_back(fmt::format("{}={}", f.placement.mesh_dim, k));
    return fmt::format(
        "shards {} of {} differ from the reference, the others match "
        "(max rel error {:.3g})",
        join(shards, ", "), placement_str(f.placement, f.inner), f.max_rel_error);
  }
  return fmt::format(
      "grad differs from the reference (max rel error {:.3g}); not a multiple of it "
      "(best scalar fit {} leaves {:.3g})",
      f.max_rel_error, number(f.factor), f.factor_residual);
}

}  // namespace

std::string ParamFinding::str(const MeshDims& mesh) const {
  std::vector<std::string> lines;
  if (!missing_ranks.empty()) {
    std::vector<std::string> ranks;
    for (int r : missing_ranks) ranks.push_back(std::to_string(r));
    lines.push_back(fmt::format(
        "{}: no gradient (None) on ranks {} of mesh {}; the reference has one (backward "
        "did not reach the parameter there)",
        name, join(ranks, ", "), mesh_str(mesh)));
  }
  if (has_factor)
    lines.push_back(fmt::format("{}: {} on mesh {}", name, value_line(*this), mesh_str(mesh)));
  if (!divergent_ranks.empty()) {
    std::vector<std::string> ranks;
    for (int r : divergent_ranks) ranks.push_back(std::to_string(r));
    lines.push_back(
        fmt::format("{}: replicas differ ({}): ranks {} disagree with their first "
                    "replica on mesh {}",
                    name, placement_str(placement, inner), join(ranks, ", "), mesh_str(mesh)));
  }
  if (lines.empty())
    lines.push_back(fmt::format("{}: matches the reference (max rel error {:.3g}) on mesh {}", name,
                                max_rel_error, mesh_str(mesh)));
  return join(lines, "\n");
}

std::string MeshFindings::str() const {
  std::vector<std::string> lines;
  double worst = 0;
  for (const ParamFinding& f : params) {
    worst = std::max(worst, f.max_rel_error);
    if (!f.ok) lines.push_back(f.str(mesh));
  }
  if (lines.empty())
    return fmt::format("mesh {}: all {} gradients match the reference (max rel error {:.3g})",
                       mesh_str(mesh), params.size(), worst);
  return join(lines, "\n");
}

std::string EquivalenceReport::str() const {
  std::vector<std::string> lines;
  for (const MeshFindings& m : meshes) lines.push_back(m.str());
  return join(lines, "\n");
}

}  // namespace diffcomm::sim
