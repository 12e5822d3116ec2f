#pragma once
// DeviceMesh: ranks of a group laid out on named dimensions, row-major with
// the last dimension fastest (torch.distributed.DeviceMesh). For dims
// {dp, cp, tp}: rank = d*cp*tp + c*tp + t; the CP x TP "parent" group has
// rank c*tp + t.
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "diffcomm/distributed/group.hpp"

namespace diffcomm::dist {

class DeviceMesh {
 public:
  using Dims = std::vector<std::pair<std::string, int>>;

  /// Collective over `world`: every member calls it with the same dims, whose
  /// sizes multiply to world.size(). Creates one group per dim eagerly.
  /// Throws InvalidArgument on a product mismatch, a size < 1 or a repeated
  /// or empty name.
  DeviceMesh(ProcessGroup world, Dims dims);

  const Dims& dims() const { return dims_; }
  /// Size of a dim; throws InvalidArgument for an unknown name.
  int size(const std::string& dim) const;
  /// This rank's coordinate along a dim.
  int coordinate(const std::string& dim) const;
  /// The group of ranks that differ from this one only along `dim`, ordered
  /// by that coordinate.
  const ProcessGroup& group(const std::string& dim) const;
  /// The group along several dims (e.g. {"cp", "tp"}), ordered row-major in
  /// the order given (last fastest). Created on first use: collective over
  /// the world, so every rank must ask for the same groups in the same order.
  ProcessGroup group(const std::vector<std::string>& dims);
  /// World rank of the given coordinates (one per dim, in dims() order).
  int rank_of(const std::vector<int>& coords) const;
  const ProcessGroup& world() const { return world_; }

 private:
  std::size_t index_of(const std::string& dim) const;
  ProcessGroup world_;
  Dims dims_;
  std::vector<int> coords_;
  std::map<std::vector<std::string>, ProcessGroup> groups_;
};

}  // namespace diffcomm::dist
