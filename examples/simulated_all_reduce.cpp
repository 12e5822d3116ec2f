// A differentiable all_reduce across 8 simulated ranks, with backward.
//
// Rank r holds x_r (4 values) and a weight w_r. Every rank computes
//   y = all_reduce(x, Sum) = x_0 + ... + x_7,   loss_r = sum(y * w_r),
// and calls backward. The total loss is L = sum_r <y, w_r>, so
//   dL/dx_r = w_0 + ... + w_7   (the same on every rank),
// which the backward of all_reduce delivers with one all_reduce of the
// gradients. The program prints each rank's gradient and exits 1 if any
// differs from that closed form.
#include <cmath>
#include <cstdio>
#include <vector>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/nn/functional.hpp"
#include "diffcomm/sim/world.hpp"

namespace dc = diffcomm;

constexpr int kRanks = 8;
constexpr int kLen = 4;

// w_r[i] = (r + 1) * (i + 1): rank-dependent weights.
double weight(int r, int i) { return (r + 1.0) * (i + 1.0); }

int main() {
  dc::sim::WorldOptions options;
  options.ranks = kRanks;
  options.seed = 42;  // one seed = one interleaving of the ranks
  dc::sim::World world(options);

  std::vector<std::vector<double>> grads(kRanks);
  world.run([&](dc::sim::Rank& rank) {
    const int r = rank.rank();
    std::vector<double> x_values, w_values;
    for (int i = 0; i < kLen; ++i) {
      x_values.push_back(r + 0.5 * i);
      w_values.push_back(weight(r, i));
    }
    dc::Tensor x = dc::from_vector(x_values, {kLen}, dc::DType::Float64);
    x.set_requires_grad(true);
    const dc::Tensor w = dc::from_vector(w_values, {kLen}, dc::DType::Float64);

    dc::Tensor y = dc::nn::all_reduce(x, rank.world());  // Sum over the 8 ranks
    dc::Tensor loss = dc::sum(dc::mul(y, w));
    dc::backward({loss});  // runs the adjoint all_reduce on every rank

    grads[static_cast<std::size_t>(r)] = x.grad().to_vector();
  });

  bool ok = true;
  for (int r = 0; r < kRanks; ++r) {
    std::printf("rank %d: dL/dx =", r);
    for (int i = 0; i < kLen; ++i) {
      double expected = 0;  // sum over ranks s of w_s[i] = 36 * (i + 1)
      for (int s = 0; s < kRanks; ++s) expected += weight(s, i);
      const double got = grads[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)];
      std::printf(" %g", got);
      if (std::abs(got - expected) > 1e-12 * std::abs(expected)) {
        std::printf(" (expected %g)", expected);
        ok = false;
      }
    }
    std::printf("\n");
  }
  std::printf("%s\n", ok ? "gradients match the closed form" : "gradient MISMATCH");
  return ok ? 0 : 1;
}
