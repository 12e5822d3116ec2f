// Random programs of differentiable collectives and their independent
// reference gradient (see gradient_program.hpp).
#include "gradient_program.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/nn/functional.hpp"

namespace diffcomm::differential {
namespace {

// SplitMix64: the same draws on every process for one seed.
struct Draws {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int below(int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); }
};

uint64_t mix(uint64_t a, uint64_t b) { return Draws{a * 0x100000001b3ull ^ b}.next(); }

// Small integers: every sum stays exact in float64 (Avg divides once).
double leaf_value(uint64_t seed, int rank, int64_t e) {
  return static_cast<double>(
             mix(mix(seed, 1000 + static_cast<uint64_t>(rank)), static_cast<uint64_t>(e)) % 9) -
         4.0;
}
double weight(uint64_t seed, std::size_t step, int rank, int64_t e) {
  const uint64_t h =
      mix(mix(mix(seed, 77 + step), static_cast<uint64_t>(rank)), static_cast<uint64_t>(e));
  return static_cast<double>(h % 7) - 3.0;
}

// Rows of a leaf cut into `parts` random (possibly empty) pieces.
std::vector<int64_t> random_cut(Draws& d, int parts) {
  std::vector<int64_t> cuts = {0, kLeafRows};
  for (int k = 1; k < parts; ++k) cuts.push_back(d.below(static_cast<int>(kLeafRows) + 1));
  std::sort(cuts.begin(), cuts.end());
  std::vector<int64_t> sizes;
  for (int k = 0; k < parts; ++k)
    sizes.push_back(cuts[static_cast<std::size_t>(k) + 1] - cuts[static_cast<std::size_t>(k)]);
  return sizes;
}

const char* name(GradOp op) {
  switch (op) {
    case GradOp::AllReduceSum: return "all_reduce(sum)";
    case GradOp::AllReduceAvg: return "all_reduce(avg)";
    case GradOp::Broadcast: return "broadcast";
    case GradOp::AllGatherSingle: return "all_gather_single";
    case GradOp::ReduceScatterSingle: return "reduce_scatter_single";
    case GradOp::AllToAllSingle: return "all_to_all_single";
  }
  return "?";
}

// ---- the reference: forward semantics on plain vectors ----------------------
using Vec = std::vector<double>;

// Output of group rank i given every member's input t[s] (group order).
Vec forward(const GradStep& s, const std::vector<Vec>& t, std::size_t i) {
  const std::size_t g = t.size();
  Vec y;
  switch (s.op) {
    case GradOp::AllReduceSum:
    case GradOp::AllReduceAvg:
      y.assign(t[0].size(), 0.0);
      for (const Vec& ts : t)
        for (std::size_t e = 0; e < y.size(); ++e) y[e] += ts[e];
      if (s.op == GradOp::AllReduceAvg)
        for (double& v : y) v /= static_cast<double>(g);
      return y;
    case GradOp::Broadcast: return t[static_cast<std::size_t>(s.root)];
    case GradOp::AllGatherSingle:
      for (const Vec& ts : t) y.insert(y.end(), ts.begin(), ts.end());
      return y;
    case GradOp::ReduceScatterSingle: {
      const std::size_t block = t[0].size() / g;
      y.assign(block, 0.0);
      for (const Vec& ts : t)
        for (std::size_t e = 0; e < block; ++e) y[e] += ts[i * block + e];
      return y;
    }
    case GradOp::AllToAllSingle:
      for (std::size_t j = 0; j < g; ++j) {
        const auto& row = s.splits[j];
        const int64_t off =
            std::accumulate(row.begin(), row.begin() + static_cast<std::ptrdiff_t>(i), int64_t{0});
        y.insert(y.end(), t[j].begin() + off, t[j].begin() + off + row[i]);
      }
      return y;
  }
  return y;
}

double summed_loss(const GradProgram& p, const std::vector<Vec>& x) {
  double total = 0.0;
  for (std::size_t k = 0; k < p.steps.size(); ++k) {
    const GradStep& s = p.steps[k];
    std::vector<Vec> t;
    for (int m : s.members) {
      Vec v = x[static_cast<std::size_t>(m)];
      for (double& e : v) e *= s.coeff[static_cast<std::size_t>(m)];
      t.push_back(std::move(v));
    }
    for (std::size_t i = 0; i < s.members.size(); ++i) {
      const int m = s.members[i];
      if (!s.used[static_cast<std::size_t>(m)]) continue;
      const Vec y = forward(s, t, i);
      for (std::size_t e = 0; e < y.size(); ++e)
        total += weight(p.seed, k, m, static_cast<int64_t>(e)) * y[e];
    }
  }
  return total;
}

// ---- the program on diffcomm ------------------------------------------------
Tensor apply(const GradStep& s, const Tensor& t, const dist::ProcessGroup& g) {
  const auto i = static_cast<std::size_t>(g.rank());
  switch (s.op) {
    case GradOp::AllReduceSum: return nn::all_reduce(t, g, dist::ReduceOp::Sum);
    case GradOp::AllReduceAvg: return nn::all_reduce(t, g, dist::ReduceOp::Avg);
    case GradOp::Broadcast: return nn::broadcast(t, s.root, g);
    case GradOp::AllGatherSingle: return nn::all_gather_single(t, g);
    case GradOp::ReduceScatterSingle: return nn::reduce_scatter_single(t, g);
    case GradOp::AllToAllSingle: {
      dist::Splits in = s.splits[i], out;
      for (const auto& row : s.splits) out.push_back(row[i]);
      return nn::all_to_all_single(t, out, in, g);
    }
  }
  return t;
}

}  // namespace

GradProgram make_grad_program(int world, uint64_t seed) {
  Draws d{seed * 0x2545F4914F6CDD1Dull + 17};
  GradProgram p;
  p.world = world;
  p.seed = seed;
  const int steps = 2 + d.below(5);
  for (int k = 0; k < steps; ++k) {
    GradStep s;
    s.op = static_cast<GradOp>(d.below(6));
    std::vector<int> ranks(static_cast<std::size_t>(world));
    std::iota(ranks.begin(), ranks.end(), 0);
    for (std::size_t a = ranks.size(); a > 1; --a)  // Fisher-Yates: group order != global order
      std::swap(ranks[a - 1], ranks[static_cast<std::size_t>(d.below(static_cast<int>(a)))]);
    ranks.resize(static_cast<std::size_t>(1 + d.below(world)));
    s.members = ranks;
    const int g = static_cast<int>(ranks.size());
    s.root = d.below(g);
    for (int i = 0; i < g; ++i) s.splits.push_back(random_cut(d, g));
    for (int r = 0; r < world; ++r) {
      s.coeff.push_back(static_cast<double>(d.below(5)) - 2.0);
      s.used.push_back(d.below(2) == 1);
    }
    p.steps.push_back(std::move(s));
  }
  return p;
}

std::string describe(const GradProgram& p) {
  std::string out = fmt::format("world {}, seed {}:\n", p.world, p.seed);
  for (std::size_t k = 0; k < p.steps.size(); ++k) {
    const GradStep& s = p.steps[k];
    std::vector<int> users;
    for (int m : s.members)
      if (s.used[static_cast<std::size_t>(m)]) users.push_back(m);
    out += fmt::format("  {}: {} on [{}] root {}; losses of [{}] use it\n", k, name(s.op),
                       fmt::join(s.members, ","), s.root, fmt::join(users, ","));
  }
  return out;
}

std::vector<double> run_grad_program(const GradProgram& p, const dist::ProcessGroup& world_group) {
  const int rank = world_group.rank();
  std::vector<double> values;
  for (int64_t e = 0; e < kLeafRows; ++e) values.push_back(leaf_value(p.seed, rank, e));
  Tensor x = from_vector(values, {kLeafRows}, DType::Float64);
  x.set_requires_grad(true);
  std::vector<Tensor> terms;
  for (std::size_t k = 0; k < p.steps.size(); ++k) {
    const GradStep& s = p.steps[k];
    const auto g = world_group.new_group(s.members);  // collective over the world
    if (!g) continue;
    const Tensor y = apply(s, scale(x, s.coeff[static_cast<std::size_t>(rank)]), *g);
    if (!s.used[static_cast<std::size_t>(rank)]) continue;
    std::vector<double> w;
    for (int64_t e = 0; e < y.numel(); ++e) w.push_back(weight(p.seed, k, rank, e));
    terms.push_back(dot(y, from_vector(w, {y.numel()}, DType::Float64)));
  }
  if (terms.empty()) {
    world_group.cohort()->backward_pending();  // no loss here: still take part
  } else {
    Tensor loss = terms[0];
    for (std::size_t i = 1; i < terms.size(); ++i) loss = add(loss, terms[i]);
    backward({loss});
  }
  return x.grad().defined() ? x.grad().to_vector() : std::vector<double>(kLeafRows, 0.0);
}

std::vector<std::vector<double>> reference_gradients(const GradProgram& p) {
  // The summed loss is linear in the leaves: its gradient at element (r, e)
  // is the loss of the unit vector there.
  std::vector<Vec> x(static_cast<std::size_t>(p.world), Vec(kLeafRows, 0.0));
  std::vector<std::vector<double>> grads(static_cast<std::size_t>(p.world));
  for (std::size_t r = 0; r < x.size(); ++r)
    for (std::size_t e = 0; e < static_cast<std::size_t>(kLeafRows); ++e) {
      x[r][e] = 1.0;
      grads[r].push_back(summed_loss(p, x));
      x[r][e] = 0.0;
    }
  return grads;
}

}  // namespace diffcomm::differential
