#pragma once
// Shared helpers of the simulated world's unit tests (tests/sim_world/).
#include <gtest/gtest.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "../exception_testing.hpp"
#include "diffcomm/distributed/group.hpp"
#include "diffcomm/distributed/reduce_op.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::sim_testing {

using dist::ProcessGroup;
using dist::ReduceOp;
using sim::Rank;
using sim::World;
using sim::WorldOptions;
using test_util::holds;
using test_util::what_of;

// Note: rank functions run as fibers on one OS thread, so no SCOPED_TRACE in
// them (gtest's trace stack is per thread); context goes into messages.

inline WorldOptions options(int ranks, uint64_t seed = 1) {
  WorldOptions o;
  o.ranks = ranks;
  o.seed = seed;
  return o;
}

inline bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}
#define EXPECT_CONTAINS(haystack, needle)                                                        \
  EXPECT_TRUE(contains((haystack), (needle))) << "expected to find \"" << (needle) << "\" in:\n" \
                                              << (haystack)

/// Runs fn and returns the exception run() raised (null if none).
inline std::exception_ptr run_catching(World& w, const std::function<void(Rank&)>& fn) {
  try {
    w.run(fn);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

inline Tensor f32(const std::vector<double>& v) {
  return from_vector(v, {static_cast<int64_t>(v.size())}, DType::Float32);
}

}  // namespace diffcomm::sim_testing
