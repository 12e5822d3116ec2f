// The mesh expressions a gradient factor may equal (ParamFinding::expressions).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "diffcomm/sim/equivalence.hpp"

namespace diffcomm::sim {
namespace {

/// One candidate expression; a lower kind is simpler.
struct Candidate {
  int kind = 0;
  std::string text;
  double value = 1;
};

/// The candidates over the dims of size > 1, in kind order, each kind in
/// mesh dim order: d, 1/d, a*b, 1/(a*b), a/b, world, 1/world.
std::vector<Candidate> candidates(const MeshDims& mesh) {
  std::vector<MeshDim> dims;
  for (const MeshDim& d : mesh)
    if (d.size > 1) dims.push_back(d);
  std::vector<Candidate> out;
  for (const MeshDim& d : dims) out.push_back({0, d.name, double(d.size)});
  for (const MeshDim& d : dims) out.push_back({1, "1/" + d.name, 1.0 / d.size});
  for (std::size_t i = 0; i < dims.size(); ++i)
    for (std::size_t j = i + 1; j < dims.size(); ++j) {
      const double v = double(dims[i].size) * dims[j].size;
      out.push_back({2, dims[i].name + "*" + dims[j].name, v});
      out.push_back({3, "1/(" + dims[i].name + "*" + dims[j].name + ")", 1.0 / v});
    }
  for (const MeshDim& a : dims)
    for (const MeshDim& b : dims)
      if (a.name != b.name) out.push_back({4, a.name + "/" + b.name, double(a.size) / b.size});
  if (dims.size() >= 3) {
    double world = 1;
    for (const MeshDim& d : dims) world *= d.size;
    out.push_back({5, "world", world});
    out.push_back({6, "1/world", 1.0 / world});
  }
  return out;
}

}  // namespace

std::vector<std::string> factor_expressions(const MeshDims& mesh, double factor,
                                            double factor_rtol) {
  std::vector<Candidate> matches;
  for (Candidate& c : candidates(mesh))
    if (c.value != 1.0 && std::abs(factor - c.value) <= factor_rtol * std::abs(c.value))
      matches.push_back(std::move(c));
  int simplest = 7;
  for (const Candidate& c : matches) simplest = std::min(simplest, c.kind);
  std::vector<std::string> out;
  for (const Candidate& c : matches)
    if (c.kind == simplest) out.push_back(c.text);
  return out;
}

}  // namespace diffcomm::sim
