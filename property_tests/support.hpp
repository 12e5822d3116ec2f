#pragma once
// Shared machinery of the property tests: random worlds and sub-groups drawn
// by RapidCheck, per-rank data drawn from the rank's own Generator, inner
// products computed independently of diffcomm (to_vector and a plain loop),
// and failure messages that always carry the world seed.
//
// A property draws every *global* fact (world size, group members and order,
// roots, shapes, split matrices, the world seed) with RapidCheck, so the
// reproduce string RapidCheck prints on failure replays the exact case; the
// world seed is printed too (RC_LOG and every failure message) so the case
// can be replayed by hand with sim::World{ranks, seed}.
//
// Nothing here asserts from inside a rank fiber: rank functions record their
// results into vectors indexed by global rank, and the checks run after
// World::run returns (an RC_ASSERT throws a non-std exception, which the
// world would report as an anonymous rank failure).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <rapidcheck.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/distributed/group.hpp"
#include "diffcomm/distributed/reduce_op.hpp"
#include "diffcomm/sim/world.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::prop {

using dist::ReduceOp;

// ---------------------------------------------------------------- worlds

/// A world and a sub-group of it, as global facts.
struct WorldCase {
  int world = 1;
  uint64_t seed = 0;
  /// Global ranks of the group, in group order (group rank i = members[i]).
  std::vector<int> members;
  int group_size() const { return static_cast<int>(members.size()); }
};

/// Draws a world of [min_world, max_world] ranks and a sub-group of
/// [min_group, world] members in random order. When the world has more than
/// one rank, the group never starts at global rank 0 (so group-local rank 0
/// is never global rank 0: mixing the two is the classic bug). A world of one
/// rank can only have the group {0}.
inline WorldCase gen_world(int min_world, int max_world, int min_group = 1) {
  WorldCase c;
  c.world = *rc::gen::inRange(std::max(min_world, min_group), max_world + 1);
  c.seed = *rc::gen::arbitrary<uint64_t>();
  const int k = *rc::gen::inRange(min_group, c.world + 1);
  // A random order of all ranks: sort by random keys (shrinks to identity).
  const auto keys = *rc::gen::container<std::vector<int>>(static_cast<std::size_t>(c.world),
                                                          rc::gen::inRange(0, 1000));
  std::vector<int> order(static_cast<std::size_t>(c.world));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return keys[static_cast<std::size_t>(a)] < keys[static_cast<std::size_t>(b)];
  });
  if (c.world > 1 && order[0] == 0) std::swap(order[0], order[1]);
  c.members.assign(order.begin(), order.begin() + k);
  return c;
}

/// Position of global rank r in the group (its group-local rank), or -1.
inline int local_rank_of(const WorldCase& c, int r) {
  auto it = std::find(c.members.begin(), c.members.end(), r);
  return it == c.members.end() ? -1 : static_cast<int>(it - c.members.begin());
}

inline std::string describe(const WorldCase& c) {
  return fmt::format("world={} seed={} group(global ranks, group order)={{{}}}", c.world, c.seed,
                     fmt::join(c.members, ","));
}

/// Builds the group on every rank (collective over the world); nullopt on
/// ranks outside it. Every rank must call this.
inline std::optional<dist::ProcessGroup> make_group(sim::Rank& rk, const WorldCase& c) {
  return rk.world().new_group(c.members);
}

/// Runs fn on a seeded world; turns any exception into a RapidCheck failure
/// that names the case (seed included).
inline void run_world(const WorldCase& c, const std::string& what,
                      const std::function<void(sim::Rank&)>& fn) {
  sim::WorldOptions opt;
  opt.ranks = c.world;
  opt.seed = c.seed;
  opt.trace = false;
  sim::World world(opt);
  std::string error;
  try {
    world.run(fn);
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!error.empty())
    RC_FAIL(fmt::format("{} [{}]: world.run threw: {}", what, describe(c), error));
}

// ---------------------------------------------------------------- shapes

inline std::string shape_text(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ",")); }

/// Any shape: 0..3 dims, each 0..3 (0-d and zero-size tensors included).
inline Shape gen_any_shape() {
  const int dims = *rc::gen::inRange(0, 4);
  Shape s;
  for (int i = 0; i < dims; ++i) s.push_back(*rc::gen::inRange<int64_t>(0, 4));
  return s;
}

/// Trailing row shape for row-moving ops: 0..2 dims, each 0..3.
inline Shape gen_row_shape() {
  const int dims = *rc::gen::inRange(0, 3);
  Shape s;
  for (int i = 0; i < dims; ++i) s.push_back(*rc::gen::inRange<int64_t>(0, 4));
  return s;
}

inline Shape with_rows(int64_t rows, const Shape& row_shape) {
  Shape s{rows};
  s.insert(s.end(), row_shape.begin(), row_shape.end());
  return s;
}

/// n split sizes in [0, max], zeros included.
inline std::vector<int64_t> gen_splits(int n, int64_t max = 3) {
  return *rc::gen::container<std::vector<int64_t>>(static_cast<std::size_t>(n),
                                                   rc::gen::inRange<int64_t>(0, max + 1));
}

/// n x n split matrix: m[i][j] = rows member i sends to member j.
inline std::vector<std::vector<int64_t>> gen_split_matrix(int n, int64_t max = 3) {
  std::vector<std::vector<int64_t>> m;
  for (int i = 0; i < n; ++i) m.push_back(gen_splits(n, max));
  return m;
}

inline std::vector<int64_t> column(const std::vector<std::vector<int64_t>>& m, std::size_t j) {
  std::vector<int64_t> c;
  for (const auto& row : m) c.push_back(row[j]);
  return c;
}

inline int64_t total(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

// ---------------------------------------------------------------- data

/// Per-rank random data of a dtype. float64: standard normal (rounding is
/// exercised). float32 / bfloat16: integers in [-4, 4], exactly
/// representable, and so are all their sums over <= 12 ranks (|sum| <= 48 <
/// 2^8, the bfloat16 significand), which makes Sum and data-movement ops
/// exact in every dtype.
inline Tensor draw(const Shape& shape, DType dtype, Generator& gen) {
  if (dtype == DType::Float64) return rand_normal(shape, gen, 0.0, 1.0, DType::Float64);
  std::vector<double> v(static_cast<std::size_t>(shape_numel(shape)));
  for (auto& e : v) e = static_cast<double>(static_cast<int>(gen.next_u64() % 9) - 4);
  return from_vector(v, shape, dtype);
}

inline Tensor draw_leaf(const Shape& shape, DType dtype, Generator& gen) {
  Tensor t = draw(shape, dtype, gen);
  t.set_requires_grad(true);
  return t;
}

/// <a, b> in double, from the raw values: independent of diffcomm's ops.
struct Inner {
  double value = 0;  ///< sum of a_i b_i
  double scale = 0;  ///< sum of |a_i b_i| (the size rounding errors scale with)
};

inline Inner inner(const Tensor& a, const Tensor& b) {
  const std::vector<double> va = a.to_vector();
  const std::vector<double> vb = b.to_vector();
  if (va.size() != vb.size())
    throw std::logic_error(fmt::format("inner: {} vs {}", a.str(), b.str()));
  Inner r;
  for (std::size_t i = 0; i < va.size(); ++i) {
    r.value += va[i] * vb[i];
    r.scale += std::fabs(va[i] * vb[i]);
  }
  return r;
}

inline Inner inner(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  if (a.size() != b.size()) throw std::logic_error("inner: list sizes differ");
  Inner r;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const Inner p = inner(a[i], b[i]);
    r.value += p.value;
    r.scale += p.scale;
  }
  return r;
}

inline std::string dtype_text(DType d) { return dtype_name(d); }

}  // namespace diffcomm::prop
