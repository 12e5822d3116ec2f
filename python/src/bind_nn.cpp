// diffcomm._core.nn: the differentiable collectives on diffcomm tensors.
#include <vector>

#include "bind.hpp"
#include "diffcomm/nn/canonical_all_reduce.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm_python {

namespace {
dc::nn::GatherGrad parse_gather_grad(const std::string& s) {
  if (s == "partial") return dc::nn::GatherGrad::Partial;
  if (s == "replicated") return dc::nn::GatherGrad::Replicated;
  dc::raise("diffcomm",
            std::string("unknown gather grad convention '") + s + "' (partial, replicated)");
}
}  // namespace

void bind_nn(nb::module_& m) {
  using namespace dc::nn;
  auto nn = m.def_submodule("nn", "Differentiable collectives on diffcomm tensors.");
  // Defaults by name (converted implicitly): a ReduceOp instance held by a
  // function record would outlive the type at teardown.
  const char* sum = "sum";
  // Lambdas, not function pointers: each op's last parameter, its caller,
  // is left to its default here; the binding's ScopedCaller (the user's
  // Python line) wins over it (dist/caller.hpp).
  nn.def(
      "all_reduce",
      [](const Tensor& x, const ProcessGroup& g, ReduceOp op) { return all_reduce(x, g, op); },
      "x"_a, "group"_a, "op"_a = sum, release());
  nn.def(
      "broadcast",
      [](const Tensor& x, int src, const ProcessGroup& g) { return broadcast(x, src, g); }, "x"_a,
      "src"_a, "group"_a, release());
  nn.def(
      "reduce",
      [](const Tensor& x, int dst, const ProcessGroup& g, ReduceOp op) {
        return reduce(x, dst, g, op);
      },
      "x"_a, "dst"_a, "group"_a, "op"_a = sum, release());
  nn.def(
      "all_gather",
      [](const Tensor& x, const ProcessGroup& g, const std::string& grad) {
        return all_gather(x, g, parse_gather_grad(grad));
      },
      "x"_a, "group"_a, "grad"_a = "partial", release());
  nn.def(
      "all_gather_single",
      [](const Tensor& x, const ProcessGroup& g, const std::string& grad) {
        return all_gather_single(x, g, parse_gather_grad(grad));
      },
      "x"_a, "group"_a, "grad"_a = "partial", release());
  nn.def(
      "all_gather_v",
      [](const Tensor& x, const std::vector<int64_t>& splits, const ProcessGroup& g,
         const std::string& grad) { return all_gather_v(x, splits, g, parse_gather_grad(grad)); },
      "x"_a, "output_splits"_a, "group"_a, "grad"_a = "partial", release());
  nn.def(
      "gather", [](const Tensor& x, int dst, const ProcessGroup& g) { return gather(x, dst, g); },
      "x"_a, "dst"_a, "group"_a, release());
  nn.def(
      "scatter",
      [](const std::vector<Tensor>& xs, int src, const ProcessGroup& g) {
        return scatter(xs, src, g);
      },
      "xs"_a, "src"_a, "group"_a, release());
  nn.def(
      "reduce_scatter",
      [](const std::vector<Tensor>& xs, const ProcessGroup& g, ReduceOp op) {
        return reduce_scatter(xs, g, op);
      },
      "xs"_a, "group"_a, "op"_a = sum, release());
  nn.def(
      "reduce_scatter_single",
      [](const Tensor& x, const ProcessGroup& g, ReduceOp op) {
        return reduce_scatter_single(x, g, op);
      },
      "x"_a, "group"_a, "op"_a = sum, release());
  nn.def(
      "reduce_scatter_v",
      [](const Tensor& x, const std::vector<int64_t>& splits, const ProcessGroup& g, ReduceOp op) {
        return reduce_scatter_v(x, splits, g, op);
      },
      "x"_a, "input_splits"_a, "group"_a, "op"_a = sum, release());
  nn.def(
      "all_to_all",
      [](const std::vector<Tensor>& xs, const ProcessGroup& g,
         const std::vector<dc::Shape>& shapes) { return all_to_all(xs, g, shapes); },
      "xs"_a, "group"_a, "output_shapes"_a = std::vector<dc::Shape>{}, release());
  nn.def(
      "all_to_all_single",
      [](const Tensor& x, const std::vector<int64_t>& out, const std::vector<int64_t>& in,
         const ProcessGroup& g) { return all_to_all_single(x, out, in, g); },
      "x"_a, "output_splits"_a, "input_splits"_a, "group"_a, release());
  nn.def(
      "copy_to_tp_region",
      [](const Tensor& x, const ProcessGroup& g) { return copy_to_tp_region(x, g); }, "x"_a,
      "group"_a, release());
  nn.def(
      "canonical_all_reduce",
      [](const Tensor& x, const ProcessGroup& g, ReduceOp op) {
        return canonical_all_reduce(x, g, op);
      },
      "chunks"_a, "group"_a, "op"_a = sum, release());
  nn.def(
      "canonical_sum", [](const Tensor& x, ReduceOp op) { return canonical_sum(x, op); },
      "chunks"_a, "op"_a = sum, release());
  nn.def("cat_or_empty", &cat_or_empty, "rows"_a, "anchor"_a, "width"_a, release());
}

}  // namespace diffcomm_python
