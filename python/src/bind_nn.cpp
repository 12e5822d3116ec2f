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
  nn.def("all_reduce", &all_reduce, "x"_a, "group"_a, "op"_a = sum, release());
  nn.def("broadcast", &broadcast, "x"_a, "src"_a, "group"_a, release());
  nn.def("reduce", &reduce, "x"_a, "dst"_a, "group"_a, "op"_a = sum, release());
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
  nn.def("gather", &gather, "x"_a, "dst"_a, "group"_a, release());
  nn.def("scatter", &scatter, "xs"_a, "src"_a, "group"_a, release());
  nn.def("reduce_scatter", &reduce_scatter, "xs"_a, "group"_a, "op"_a = sum, release());
  nn.def("reduce_scatter_single", &reduce_scatter_single, "x"_a, "group"_a, "op"_a = sum,
         release());
  nn.def("reduce_scatter_v", &reduce_scatter_v, "x"_a, "input_splits"_a, "group"_a, "op"_a = sum,
         release());
  nn.def("all_to_all", &all_to_all, "xs"_a, "group"_a, "output_shapes"_a = std::vector<dc::Shape>{},
         release());
  nn.def("all_to_all_single", &all_to_all_single, "x"_a, "output_splits"_a, "input_splits"_a,
         "group"_a, release());
  nn.def("copy_to_tp_region", &copy_to_tp_region, "x"_a, "group"_a, release());
  nn.def("canonical_all_reduce", &canonical_all_reduce, "chunks"_a, "group"_a, "op"_a = sum,
         release());
  nn.def("canonical_sum", &canonical_sum, "chunks"_a, release());
  nn.def("cat_or_empty", &cat_or_empty, "rows"_a, "anchor"_a, "width"_a, release());
}

}  // namespace diffcomm_python
