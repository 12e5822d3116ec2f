#pragma once
// Where an nn:: op was called, for its errors (shared by the op files).
#include <fmt/format.h>

#include "diffcomm/distributed/group.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm::nn::detail {

/// Where nn::`op` was called on `g`: "nn::op on group 'g' (rank r of n)".
inline ErrorSite nn_site(const char* op, const dist::ProcessGroup& g) {
  return {
      .op = fmt::format("nn::{}", op), .group = g.name(), .rank = g.rank(), .group_size = g.size()};
}

}  // namespace diffcomm::nn::detail
