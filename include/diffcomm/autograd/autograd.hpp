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

#include "diffcomm/tensor/tensor.hpp"

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

class Cohort;

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
  /// The tensors saved for backward (SavedTensor) while not released; see
  /// hand_off().
  virtual std::vector<Tensor> saved_tensors() const { return {}; }

  /// Creation order; later nodes have larger numbers.
  uint64_t sequence_nr() const { return sequence_nr_; }
  // Inline room for the usual one or two inputs and one output: two
  // allocations fewer per recorded op.
  using EdgeList = boost::container::small_vector<Edge, 2>;
  using OutputMetaList = boost::container::small_vector<OutputMeta, 1>;
  EdgeList& next_edges() { return next_edges_; }
  OutputMetaList& outputs() { return outputs_; }
  /// The cohort this node runs with (null: none, or gone); see Cohort.
  std::shared_ptr<Cohort> cohort() const { return cohort_.lock(); }

 private:
  friend class Cohort;
  uint64_t sequence_nr_;
  std::weak_ptr<Cohort> cohort_;  // the cohort owns its members, not the reverse
  EdgeList next_edges_;
  OutputMetaList outputs_;
};

/// Nodes that run their backward together: whenever a backward pass (backward
/// or grad) runs any node of a cohort, it also runs every member of that
/// cohort that has not run yet, with zero cotangents where the pass's roots
/// do not reach it. The cohort of a rank is its differentiable collectives
/// (nn::, one cohort per rank, ProcessGroup::cohort()): their backward calls
/// pair across ranks by order, so every rank must run the backward of every
/// collective it took part in, whatever its own loss reaches, and even when
/// it dropped the output (the participation rule, docs/semantics.md). The
/// engine runs ready nodes by descending sequence number, so every rank
/// issues those backward calls in reverse forward order.
///
/// A cohort owns its members until a backward pass without retain_graph has
/// run them (a member run with retain_graph stays, and runs again in the
/// next pass, on every rank alike). Code that issues differentiable
/// collectives on tensors that require grad and never runs their backward
/// (an evaluation loop) should pass detached tensors, or call discard() on
/// every rank. A member holds its group, whose state holds the cohort: a
/// member that never runs keeps both alive until discard() (sim::World
/// discards a rank's cohort when its rank function returns). Used by one
/// thread at a time (the rank's).
class Cohort {
 public:
  /// Makes `node` a member (its last: creation order). Null is ignored.
  static void add(const std::shared_ptr<Cohort>& cohort, const std::shared_ptr<Node>& node);
  /// The members still to run, in creation order (drops the ones that ran).
  std::vector<std::shared_ptr<Node>> pending();
  /// Runs the backward of every pending member with zero cotangents (and
  /// what flows from them): the participation of a rank whose loss reaches
  /// none of its collectives this step. Accumulates into leaves' .grad()
  /// like backward().
  void backward_pending(bool retain_graph = false);
  /// Forgets every pending member without running it. Every rank of the
  /// groups concerned must do the same, or their backward calls no longer
  /// pair (CollectiveMismatch naming the forward calls).
  void discard() { nodes_.clear(); }
  /// Forgets one member without running it (hand_off()).
  void remove(const Node* node);

 private:
  std::vector<std::shared_ptr<Node>> nodes_;
};

/// A tensor a node saves for its backward, with its storage's version at
/// saving time (torch's SavedVariable): get() raises when an in-place write
/// (fill_, copy_, an in-place collective such as a buffer broadcast) changed
/// it since, instead of computing the gradient from the new values. A write
/// before the tensor is saved is fine.
class SavedTensor {
 public:
  SavedTensor() = default;
  /// `index` names it in the message (torch: "saved tensor 0").
  SavedTensor(Tensor t, int index) : t_(std::move(t)), version_(t_.version()), index_(index) {}
  /// The saved tensor. Throws InvalidArgument ("one of the variables needed
  /// for gradient computation has been modified by an inplace operation:
  /// [MulBackward] saved tensor 1, float64[1], is at version 1; expected
  /// version 0 instead") when it changed.
  const Tensor& get(const char* node) const;
  bool defined() const { return t_.defined(); }
  /// The saved tensor, unchecked (for hand_off()).
  const Tensor& peek() const { return t_; }

 private:
  Tensor t_;
  uint64_t version_ = 0;
  int index_ = 0;
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
  /// T's `saved()`, when it declares one (the ops holding a SavedTensor).
  std::vector<Tensor> saved_tensors() const override {
    if constexpr (requires(const T& t) { t.saved(); })
      if (fn_) return fn_->saved();
    return {};
  }

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
/// Every pending member of a cohort that a reached node belongs to runs too
/// (see Cohort).
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grad_roots = {},
              bool retain_graph = false);

/// Returns d(roots)/d(inputs) contracted with grad_roots, without touching any
/// .grad(). Every reachable node runs, and every pending member of a cohort
/// that a reached node belongs to (see Cohort), so every rank issues the same
/// backward collectives. An input that no gradient reaches gets zeros when
/// allow_unused, else InvalidArgument.
std::vector<Tensor> grad(const std::vector<Tensor>& roots, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_roots = {}, bool retain_graph = false,
                         bool allow_unused = true);

/// What hand_off() found in a graph.
struct HandOff {
  std::vector<Tensor> saved;  ///< tensors its nodes saved for backward (each once)
  int collectives = 0;        ///< nodes that were cohort members (differentiable collectives)
};

/// Hands the graph reachable from `outputs` over to another autograd engine
/// that will decide when its backward runs (the Python bridge: torch's engine
/// runs diffcomm's graph as one node of its own). Every node of that graph
/// leaves its cohort, since the other engine now orders those backward calls
/// across ranks (diffcomm.torch keeps the participation rule in torch's
/// terms); the saved tensors are returned so the other engine can version
/// them too (torch's save_for_backward). Cost: one visit per node.
HandOff hand_off(const std::vector<Tensor>& outputs);

/// Central finite-difference check in float64. fn maps the inputs (float64,
/// requires_grad) to one tensor; its gradient against a fixed random
/// cotangent is compared with the numeric one. Returns the largest absolute
/// difference over all input elements (the caller judges the tolerance).
double gradcheck_max_error(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                           const std::vector<Tensor>& inputs, double eps = 1e-6, uint64_t seed = 1);

}  // namespace diffcomm
