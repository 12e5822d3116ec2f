#include "diffcomm/distributed/mesh.hpp"

#include <fmt/format.h>

#include <set>

#include "diffcomm/tensor/error.hpp"

namespace diffcomm::dist {
namespace {
std::string dims_str(const DeviceMesh::Dims& dims) {
  std::vector<std::string> parts;
  for (const auto& [n, s] : dims) parts.push_back(fmt::format("{}:{}", n, s));
  return fmt::format("{{{}}}", fmt::join(parts, ", "));
}
}  // namespace

DeviceMesh::DeviceMesh(ProcessGroup world, Dims dims)
    : world_(std::move(world)), dims_(std::move(dims)) {
  int64_t product = 1;
  std::set<std::string> names;
  for (const auto& [n, s] : dims_) {
    if (n.empty() || !names.insert(n).second)
      raise("DeviceMesh", fmt::format("empty or repeated dim name in {}", dims_str(dims_)));
    if (s < 1) raise("DeviceMesh", fmt::format("dim '{}' has size {} (< 1)", n, s));
    product *= s;
  }
  if (product != world_.size())
    raise("DeviceMesh", fmt::format("dims {} hold {} ranks but group '{}' has {}", dims_str(dims_),
                                    product, world_.name(), world_.size()));
  int r = world_.rank();
  coords_.assign(dims_.size(), 0);
  for (std::size_t i = dims_.size(); i-- > 0;) {
    coords_[i] = r % dims_[i].second;
    r /= dims_[i].second;
  }
  for (const auto& d : dims_) group(std::vector<std::string>{d.first});
}

std::size_t DeviceMesh::index_of(const std::string& dim) const {
  for (std::size_t i = 0; i < dims_.size(); ++i)
    if (dims_[i].first == dim) return i;
  raise("DeviceMesh", fmt::format("unknown dim '{}' (mesh {})", dim, dims_str(dims_)));
}

int DeviceMesh::size(const std::string& dim) const { return dims_[index_of(dim)].second; }
int DeviceMesh::coordinate(const std::string& dim) const { return coords_[index_of(dim)]; }

const ProcessGroup& DeviceMesh::group(const std::string& dim) const {
  auto it = groups_.find({dim});
  if (it == groups_.end()) index_of(dim);  // throws for unknown names
  return it->second;
}

int DeviceMesh::rank_of(const std::vector<int>& coords) const {
  if (coords.size() != dims_.size())
    raise("DeviceMesh::rank_of",
          fmt::format("{} coordinates for {} dims", coords.size(), dims_.size()));
  int r = 0;
  for (std::size_t i = 0; i < dims_.size(); ++i) {
    if (coords[i] < 0 || coords[i] >= dims_[i].second)
      raise("DeviceMesh::rank_of",
            fmt::format("coordinate {} out of range for '{}'", coords[i], dims_[i].first));
    r = r * dims_[i].second + coords[i];
  }
  return r;
}

ProcessGroup DeviceMesh::group(const std::vector<std::string>& dims) {
  auto it = groups_.find(dims);
  if (it != groups_.end()) return it->second;
  if (dims.empty()) raise("DeviceMesh::group", "no dims given");
  std::vector<std::size_t> in;
  std::vector<bool> selected(dims_.size(), false);
  for (const auto& d : dims) {
    const std::size_t i = index_of(d);
    if (selected[i]) raise("DeviceMesh::group", fmt::format("dim '{}' repeated", d));
    selected[i] = true;
    in.push_back(i);
  }
  // color: linear index over the unselected dims; key: row-major index over
  // the selected dims in the order the caller gave them.
  int color = 0, key = 0;
  for (std::size_t i = 0; i < dims_.size(); ++i)
    if (!selected[i]) color = color * dims_[i].second + coords_[i];
  for (std::size_t i : in) key = key * dims_[i].second + coords_[i];
  // Name the group by its dims and its members' global ranks.
  std::vector<int> members;
  {
    std::vector<int> c = coords_;
    const int count = [&] {
      int n = 1;
      for (std::size_t i : in) n *= dims_[i].second;
      return n;
    }();
    for (int k = 0; k < count; ++k) {
      int rem = k;
      for (std::size_t j = in.size(); j-- > 0;) {
        c[in[j]] = rem % dims_[in[j]].second;
        rem /= dims_[in[j]].second;
      }
      members.push_back(world_.global_rank(rank_of(c)));
    }
  }
  std::vector<int64_t> fingerprint;
  for (const auto& d : dims_) fingerprint.push_back(d.second);
  for (std::size_t i : in) fingerprint.push_back(-1 - static_cast<int64_t>(i));
  std::string name = fmt::format("{}{{{}}}", fmt::join(dims, "*"), fmt::join(members, ","));
  auto g = world_.split(color, key, fingerprint, name);
  if (!g) raise("DeviceMesh::group", "backend returned no group for a member");
  groups_.emplace(dims, *g);
  return *g;
}

}  // namespace diffcomm::dist
