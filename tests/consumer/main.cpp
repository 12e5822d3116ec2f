// Uses the installed diffcomm: d/dx sum(x) must be all ones.
#include <cstdio>
#include <exception>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/config.hpp"
#include "diffcomm/tensor/tensor.hpp"

int main() {
  try {
    diffcomm::Tensor x = diffcomm::ones({3});
    x.set_requires_grad();
    diffcomm::Tensor y = diffcomm::sum(x);
    if (y.item() != 3.0) {
      std::fprintf(stderr, "consumer: sum(ones({3})) = %g, expected 3\n", y.item());
      return 1;
    }
    diffcomm::backward({y});
    const diffcomm::Tensor g = x.grad();
    if (!g.defined() || g.shape() != diffcomm::Shape{3}) {
      std::fprintf(stderr, "consumer: x.grad() is missing or has the wrong shape\n");
      return 1;
    }
    for (double v : g.to_vector()) {
      if (v != 1.0) {
        std::fprintf(stderr, "consumer: grad element %g, expected 1\n", v);
        return 1;
      }
    }
    std::printf("diffcomm %s consumer: grad of sum(ones({3})) == 1: ok\n", DIFFCOMM_VERSION);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
}
