#pragma once
// Reverse-mode autograd on a graph of Nodes joined by Edges.
//
// Rules that matter for collectives (see DESIGN.md):
//  - Deterministic order: ready nodes run by descending sequence number (the
//    order nodes were created in), so identical graphs issue their backward
//    collectives in the same order on every rank.
//  - A reachable node whose outputs got no gradient gets zeros, so a
//    multi-output collective always runs its backward.
//  - No ambient per-thread state: there is no grad mode. Backward functions
//    work on gradient tensors, which never require grad, so they record
//    nothing; Function<T> hands forward() detached inputs.
#include <boost/container/small_vector.hpp>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "diffcomm/tensor.hpp"

namespace diffcomm {

/// One input of a node's backward: the gradient goes to input `input_nr` of
/// node `fn`. An empty edge (fn == nullptr) means "no gradient needed".
struct Edge {
  std::shared_ptr<Node> fn;
  int input_nr = 0;
  bool valid() const { return fn != nullptr; }
};

/// What a node needs to know about each of its forward outputs to check and
/// materialise their gradients.
struct OutputMeta {
  Shape shape;
  DType dtype = DType::Float32;
  Device device;
};

/// A backward function. apply() receives one gradient per forward output (in
/// the order of outputs) and returns one per forward input (next_edges).
class Node : public std::enable_shared_from_this<Node> {
 public:
  Node();
  /// Iterative: destroying a graph of any depth uses constant stack.
  virtual ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  virtual std::string name() const = 0;
  /// grads.size() == outputs().size(); result size == next_edges().size().
  /// Undefined entries in the result mean "no gradient for that input".
  virtual std::vector<Tensor> apply(std::vector<Tensor> grads) = 0;
  /// Frees saved state after a backward without retain_graph.
  virtual void release() {}
  virtual bool released() const { return false; }

  /// Creation order; later nodes have larger numbers.
  uint64_t sequence_nr() const { return sequence_nr_; }
  // Inline room for the usual one or two inputs and one output: two
  // allocations fewer per recorded op.
  using EdgeList = boost::container::small_vector<Edge, 2>;
  using OutputMetaList = boost::container::small_vector<OutputMeta, 1>;
  EdgeList& next_edges() { return next_edges_; }
  OutputMetaList& outputs() { return outputs_; }

 private:
  uint64_t sequence_nr_;
  EdgeList next_edges_;
  OutputMetaList outputs_;
};

/// The edge a gradient for `t` must flow into: its grad_fn and output number,
/// the leaf's accumulator when it requires grad, else an empty edge.
Edge gradient_edge(const Tensor& t);

/// Records `node` as the producer of `outputs` (sets grad_fn/output_nr and the
/// node's output metadata) and its next edges from `inputs`.
void connect(const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs,
             std::vector<Tensor>& outputs);

/// True when any input requires grad, i.e. a node must be recorded.
bool any_requires_grad(const std::vector<Tensor>& inputs);

/// Helper for writing a differentiable op, forward and backward side by side:
///
///   struct Scale : Function<Scale> {
///     double alpha;
///     std::vector<Tensor> forward(const std::vector<Tensor>& in);   // detached
///     std::vector<Tensor> backward(const std::vector<Tensor>& grads);
///   };
///   Tensor y = Scale{{}, 2.0}.apply({x})[0];
///
/// The T object (with whatever it saved in forward) becomes the node's state.
/// forward() receives detached inputs, so nothing inside it is recorded; a
/// tensor saved from forward must be an input or a detached output (saving a
/// non-detached output would form a reference cycle). backward() receives one
/// gradient per output (zeros where none flowed) and returns one per input
/// (undefined where the input needs none).
template <class T>
class Function {
 public:
  std::vector<Tensor> apply(const std::vector<Tensor>& inputs) &&;
  /// name() of the node; override by defining `static constexpr const char* kName`.
};

namespace detail {
template <class T>
class FunctionNode final : public Node {
 public:
  explicit FunctionNode(T fn) : fn_(std::move(fn)) {}
  std::string name() const override { return T::kName; }
  std::vector<Tensor> apply(std::vector<Tensor> grads) override;
  void release() override { fn_.reset(); }
  bool released() const override { return !fn_.has_value(); }

 private:
  std::optional<T> fn_;
};
[[noreturn]] void throw_released(const std::string& name);
}  // namespace detail

template <class T>
std::vector<Tensor> Function<T>::apply(const std::vector<Tensor>& inputs) && {
  T& self = static_cast<T&>(*this);
  if (!any_requires_grad(inputs)) {
    // Nothing to record (e.g. every op inside a backward): forward may see
    // the caller's handles, since none of them can record anything; an
    // output that is one of those handles still comes back as a fresh one,
    // as if the inputs had been detached. Saves a handle per input per op.
    std::vector<Tensor> outputs = self.forward(inputs);
    for (auto& out : outputs)
      for (const auto& in : inputs)
        if (out.defined() && out.same(in)) {
          out = out.detach();
          break;
        }
    return outputs;
  }
  std::vector<Tensor> detached;
  detached.reserve(inputs.size());
  for (const auto& t : inputs) detached.push_back(t.defined() ? t.detach() : Tensor{});
  std::vector<Tensor> outputs = self.forward(detached);
  auto node = std::make_shared<detail::FunctionNode<T>>(std::move(self));
  connect(node, inputs, outputs);
  return outputs;
}

template <class T>
std::vector<Tensor> detail::FunctionNode<T>::apply(std::vector<Tensor> grads) {
  if (!fn_) throw_released(name());
  return fn_->backward(grads);
}

/// Runs backward from roots, accumulating into the .grad() of leaves that
/// require grad. grad_roots[i] is the gradient of roots[i]; an empty list means
/// ones for every root (each root must then have one element). With
/// retain_graph false the graph's saved state is freed and a second backward
/// through it throws InvalidArgument.
/// Throws InvalidArgument on shape/dtype mismatches and released graphs.
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grad_roots = {},
              bool retain_graph = false);

/// Returns d(roots)/d(inputs) contracted with grad_roots, without touching any
/// .grad(). Every reachable node runs (so every rank issues the same backward
/// collectives). An input that no gradient reaches gets zeros when
/// allow_unused, else InvalidArgument.
std::vector<Tensor> grad(const std::vector<Tensor>& roots, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_roots = {}, bool retain_graph = false,
                         bool allow_unused = true);

/// Central finite-difference check in float64. fn maps the inputs (float64,
/// requires_grad) to one tensor; its gradient against a fixed random
/// cotangent is compared with the numeric one. Returns the largest absolute
/// difference over all input elements (the caller judges the tolerance).
double gradcheck_max_error(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                           const std::vector<Tensor>& inputs, double eps = 1e-6, uint64_t seed = 1);

}  // namespace diffcomm
