#include "diffcomm/autograd/autograd.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <boost/container/small_vector.hpp>
#include <cstdint>
#include <queue>
#include <typeinfo>
#include <unordered_set>

#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm {
namespace {

// Sequence numbers only need to be increasing in creation order *within one
// rank's graph*: the engine compares numbers of nodes of one graph. A shared
// monotonic counter gives exactly that whatever the interleaving of ranks, so
// it is the one piece of process-wide state the engine keeps (it carries no
// per-rank meaning, unlike a thread_local grad mode would).
std::atomic<uint64_t> g_next_sequence_nr{0};

// The sink of a leaf that requires grad: adds incoming gradients to .grad().
// The leaf owns it (TensorImpl::grad_accumulator) and it refers to the leaf
// weakly: a gradient for a leaf nobody holds any more has nowhere to be seen,
// so it is dropped.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(const std::shared_ptr<TensorImpl>& leaf) : leaf_(leaf) {
    outputs().push_back({leaf->shape, leaf->dtype, leaf->storage->device()});
  }
  std::string name() const override { return "AccumulateGrad"; }
  std::vector<Tensor> apply(std::vector<Tensor> grads) override {
    const std::shared_ptr<TensorImpl> leaf = leaf_.lock();
    if (!leaf) return {};
    Tensor& g = leaf->grad;
    if (!g.defined())
      g = grads[0].copy_data();
    else
      g = detail::accumulate_add(g, grads[0]);
    return {};
  }

 private:
  std::weak_ptr<TensorImpl> leaf_;
};

struct ReadyOrder {
  bool operator()(const Node* a, const Node* b) const {
    return a->sequence_nr() < b->sequence_nr();
  }
};

struct Capture {
  Node* node = nullptr;
  int slot = 0;
};

// The engine's per-node state, in one flat table: an open-addressing index
// from Node* to a slot in `states`. Four std::unordered_maps (buffers,
// dependency counts, seen, queued) cost an allocation per node per map on
// every backward, most of a small step's engine time.
struct NodeState {
  Node* node = nullptr;
  int deps = 0;
  bool seen = false;
  bool queued = false;
  std::vector<Tensor> buffer;
};

class NodeTable {
 public:
  NodeTable() : index_(16, -1) {}
  NodeState& operator[](Node* n) {
    std::size_t i = probe(n);
    if (index_[i] < 0) {
      if (2 * (states_.size() + 1) > index_.size()) {
        grow();
        i = probe(n);
      }
      index_[i] = static_cast<int>(states_.size());
      states_.push_back({n, 0, false, false, {}});
    }
    return states_[static_cast<std::size_t>(index_[i])];
  }

 private:
  std::size_t probe(Node* n) const {
    const std::size_t mask = index_.size() - 1;
    std::size_t i = (reinterpret_cast<std::uintptr_t>(n) >> 4) * 0x9E3779B97F4A7C15ull >> 7 & mask;
    while (index_[i] >= 0 && states_[static_cast<std::size_t>(index_[i])].node != n)
      i = (i + 1) & mask;
    return i;
  }
  void grow() {
    index_.assign(index_.size() * 2, -1);
    for (std::size_t k = 0; k < states_.size(); ++k)
      index_[probe(states_[k].node)] = static_cast<int>(k);
  }
  // Inline room for a small graph (a step of a few ops): the table, its
  // index, the roots, the stack and the ready queue cost no allocation then.
  // A reference into states_ is only held until the next operator[].
  boost::container::small_vector<int, 32> index_;  // power-of-two size, -1 = empty
  boost::container::small_vector<NodeState, 8> states_;
};

// One run of the engine over the graph reachable from the roots: seeded with
// the roots' gradients (add_roots), every reachable node's dependencies
// counted, the pending members of the cohorts reached added as roots
// (count_dependencies), then the nodes run in ReadyOrder as their
// dependencies finish (run).
class Engine {
 public:
  Engine(const char* who, bool retain_graph, bool accumulate)
      : who_(who), retain_graph_(retain_graph), accumulate_(accumulate) {}

  void add_roots(const std::vector<Tensor>& roots, const std::vector<Tensor>& grad_roots) {
    for (std::size_t i = 0; i < roots.size(); ++i) {
      const Tensor& r = roots[i];
      if (!r.defined()) raise(who_, fmt::format("root {} is undefined", i));
      Edge e = gradient_edge(r);
      if (!e.valid())
        raise(who_,
              fmt::format("root {} ({}) does not require grad and has no grad_fn", i, r.str()));
      Tensor g;
      if (grad_roots.empty()) {
        if (r.numel() != 1)
          raise(who_, fmt::format("root {} ({}) has {} elements; pass its gradient explicitly", i,
                                  r.str(), r.numel()));
        g = ones(r.shape(), r.dtype(), r.device());
      } else {
        g = grad_roots[i].detach();
      }
      add_to_buffer(e.fn.get(), e.input_nr, g);
      root_nodes_.push_back(e.fn);
    }
  }

  // Count, for every reachable node, the edges that point at it; then add
  // the pending members of every cohort a reached node belongs to as roots
  // of their own (zero cotangents), until no new cohort turns up.
  void count_dependencies() {
    boost::container::small_vector<Node*, 16> stack;
    boost::container::small_vector<std::shared_ptr<Cohort>, 2> cohorts;
    auto visit = [&](Node* n) {
      NodeState& st = table_[n];
      if (st.seen) return;
      st.seen = true;
      stack.push_back(n);
      std::shared_ptr<Cohort> c = n->cohort();
      if (c && std::find(cohorts.begin(), cohorts.end(), c) == cohorts.end())
        cohorts.push_back(std::move(c));
    };
    auto count_deps = [&] {
      while (!stack.empty()) {
        Node* n = stack.back();
        stack.pop_back();
        for (auto& e : n->next_edges()) {
          if (!e.valid()) continue;
          ++table_[e.fn.get()].deps;
          visit(e.fn.get());
        }
      }
    };
    for (auto& n : root_nodes_) visit(n.get());
    count_deps();
    for (std::size_t k = 0; k < cohorts.size(); ++k)
      for (std::shared_ptr<Node>& member : cohorts[k]->pending()) {
        if (table_[member.get()].seen) continue;
        visit(member.get());
        count_deps();
        root_nodes_.push_back(std::move(member));
      }
  }

  // Runs every ready node; returns the gradients flowing into capture_edges.
  std::vector<Tensor> run(const std::vector<Edge>& capture_edges) {
    std::vector<Capture> captures(capture_edges.size());
    std::vector<Tensor> captured(capture_edges.size());
    for (std::size_t i = 0; i < capture_edges.size(); ++i)
      if (capture_edges[i].valid())
        captures[i] = {capture_edges[i].fn.get(), capture_edges[i].input_nr};
    for (auto& n : root_nodes_) {
      NodeState& st = table_[n.get()];
      if (st.deps == 0 && !st.queued) {
        st.queued = true;
        ready_.push(n.get());
      }
    }
    while (!ready_.empty()) {
      Node* node = ready_.top();
      ready_.pop();
      std::vector<Tensor> buf = std::move(table_[node].buffer);
      complete_gradients(node, buf);
      for (std::size_t i = 0; i < captures.size(); ++i)
        if (captures[i].node == node) captured[i] = buf[static_cast<std::size_t>(captures[i].slot)];
      apply(node, std::move(buf));
    }
    return captured;
  }

 private:
  void add_to_buffer(Node* node, int slot, const Tensor& g) {
    auto& buf = table_[node].buffer;
    if (buf.empty()) buf.resize(node->outputs().size());
    Tensor& b = buf[static_cast<std::size_t>(slot)];
    b = b.defined() ? detail::accumulate_add(b, g) : g;
  }

  // Missing gradients become zeros; a gradient of the wrong shape or dtype
  // is refused.
  void complete_gradients(Node* node, std::vector<Tensor>& buf) const {
    const auto& metas = node->outputs();
    if (buf.empty()) buf.resize(metas.size());
    for (std::size_t s = 0; s < metas.size(); ++s) {
      const OutputMeta& m = metas[s];
      if (!buf[s].defined()) {
        buf[s] = zeros(m.shape, m.dtype, m.device);
        continue;
      }
      if (buf[s].shape() != m.shape || buf[s].dtype() != m.dtype)
        raise(who_,
              fmt::format("gradient for output {} of {} is {}, but that output is {}{}", s,
                          node->name(), buf[s].str(), dtype_name(m.dtype), shape_str(m.shape)));
    }
  }

  // Runs one node's backward and hands its input gradients to the nodes its
  // edges point at (each queued once its last dependency is done).
  void apply(Node* node, std::vector<Tensor> buf) {
    if (typeid(*node) == typeid(AccumulateGrad)) {  // final class: cheaper than dynamic_cast
      if (accumulate_) node->apply(std::move(buf));
      return;
    }
    if (node->released())
      raise(who_,
            fmt::format(
                "trying to backward through {} (sequence {}) a second time: its saved state was "
                "freed by an earlier backward; pass retain_graph=true to the first one",
                node->name(), node->sequence_nr()));
    std::vector<Tensor> grads_in = node->apply(std::move(buf));
    if (!retain_graph_) node->release();
    auto& edges = node->next_edges();
    if (grads_in.size() != edges.size())
      raise(who_, fmt::format("{} returned {} gradients for {} inputs", node->name(),
                              grads_in.size(), edges.size()));
    for (std::size_t i = 0; i < edges.size(); ++i) {
      const Edge& e = edges[i];
      if (!e.valid()) continue;
      if (grads_in[i].defined()) add_to_buffer(e.fn.get(), e.input_nr, grads_in[i]);
      if (--table_[e.fn.get()].deps == 0) ready_.push(e.fn.get());
    }
  }

  const char* who_;
  bool retain_graph_;
  bool accumulate_;
  NodeTable table_;
  boost::container::small_vector<std::shared_ptr<Node>, 4> root_nodes_;
  std::priority_queue<Node*, boost::container::small_vector<Node*, 16>, ReadyOrder> ready_;
};

std::vector<Tensor> run_engine(const std::vector<Tensor>& roots,
                               const std::vector<Tensor>& grad_roots, bool retain_graph,
                               bool accumulate, const std::vector<Edge>& capture_edges) {
  const char* who = accumulate ? "backward" : "grad";
  if (!grad_roots.empty() && grad_roots.size() != roots.size())
    raise(who, fmt::format("{} roots but {} root gradients", roots.size(), grad_roots.size()));
  Engine engine(who, retain_graph, accumulate);
  engine.add_roots(roots, grad_roots);
  engine.count_dependencies();
  return engine.run(capture_edges);
}

}  // namespace

Node::Node() : sequence_nr_(g_next_sequence_nr.fetch_add(1, std::memory_order_relaxed)) {}

// A node owns the nodes its edges point to, so destroying the last of a
// chain of N nodes destroyed N nested destructors: about 3500 collectives
// overflowed a 256 KiB fiber stack. Instead (as torch's deleteNode), a dying
// node moves every node it alone owns onto a local stack, and each of those
// gives up its saved state and then its edges the same way before it dies,
// with nothing left to destroy recursively. Saved state goes first: a saved
// input also owns its producer (through grad_fn), and releasing it while
// the edge still holds that producer leaves the edge as its only owner.
Node::~Node() {
  std::vector<std::shared_ptr<Node>> owned;
  // One edge at a time: two edges to one node (mul(h, h)) each see two
  // owners, and clearing both at once would destroy it recursively.
  auto take_edges = [&owned](EdgeList& edges) {
    for (Edge& e : edges) {
      std::shared_ptr<Node> fn = std::move(e.fn);
      if (fn && fn.use_count() == 1) owned.push_back(std::move(fn));
    }  // a node someone else still owns just loses this reference
    edges.clear();
  };
  take_edges(next_edges_);
  while (!owned.empty()) {
    std::shared_ptr<Node> node = std::move(owned.back());
    owned.pop_back();
    node->release();
    take_edges(node->next_edges_);
  }  // `node` dies here with no edges
}

void detail::throw_released(const std::string& name) {
  raise("backward",
        fmt::format("{} was already run and its saved state freed; pass retain_graph=true", name));
}

Edge gradient_edge(const Tensor& t) {
  if (!t.defined()) return {};
  const auto& impl = t.impl();
  if (impl->grad_fn) return {impl->grad_fn, impl->output_nr};
  if (!impl->requires_grad) return {};
  if (!impl->grad_accumulator) impl->grad_accumulator = std::make_shared<AccumulateGrad>(impl);
  return {impl->grad_accumulator, 0};
}

bool any_requires_grad(const std::vector<Tensor>& inputs) {
  for (const auto& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

void connect(const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs,
             std::vector<Tensor>& outputs) {
  auto& edges = node->next_edges();
  edges.clear();
  edges.reserve(inputs.size());
  for (const auto& t : inputs) edges.push_back(gradient_edge(t));
  auto& metas = node->outputs();
  metas.clear();
  metas.reserve(outputs.size());
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].defined())
      raise(node->name(), fmt::format("forward returned an undefined output {}", i));
    // A fresh handle per output, so two outputs sharing data (or an output
    // that is an input's data) still get their own grad_fn slot. A handle
    // only this list holds (the usual new tensor from forward) is already
    // such a handle: detaching it again cost two allocations per op.
    const auto& impl = outputs[i].impl();
    if (impl.use_count() != 1 || impl->grad_fn || impl->requires_grad || impl->grad.defined())
      outputs[i] = outputs[i].detach();
    metas.push_back({outputs[i].shape(), outputs[i].dtype(), outputs[i].device()});
    outputs[i].impl()->grad_fn = node;
    outputs[i].impl()->output_nr = static_cast<int>(i);
  }
}

const Tensor& SavedTensor::get(const char* node) const {
  if (t_.defined() && t_.version() != version_)
    throw InvalidArgument(fmt::format(
        "one of the variables needed for gradient computation has been modified by an inplace "
        "operation: [{}] saved tensor {}, {}, is at version {}; expected version {} instead "
        "(an in-place write after the forward use, e.g. a broadcast into a buffer the forward "
        "read; write into a copy, or write before the forward use)",
        node, index_, t_.str(), t_.version(), version_));
  return t_;
}

void Cohort::add(const std::shared_ptr<Cohort>& cohort, const std::shared_ptr<Node>& node) {
  if (!cohort || !node) return;
  cohort->nodes_.push_back(node);
  node->cohort_ = cohort;
}

std::vector<std::shared_ptr<Node>> Cohort::pending() {
  std::erase_if(nodes_, [](const std::shared_ptr<Node>& n) { return n->released(); });
  return nodes_;
}

void Cohort::remove(const Node* node) {
  // The member handed off is almost always the newest: search from the back.
  const auto it = std::find_if(nodes_.rbegin(), nodes_.rend(),
                               [&](const std::shared_ptr<Node>& n) { return n.get() == node; });
  if (it == nodes_.rend()) return;
  (*it)->cohort_.reset();
  nodes_.erase(std::next(it).base());
}

HandOff hand_off(const std::vector<Tensor>& outputs) {
  HandOff found;
  std::vector<Node*> stack;
  std::unordered_set<Node*> seen;
  auto visit = [&](Node* n) {
    if (n != nullptr && seen.insert(n).second) stack.push_back(n);
  };
  for (const Tensor& t : outputs)
    if (t.defined()) visit(t.impl()->grad_fn.get());
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    if (const std::shared_ptr<Cohort> c = n->cohort()) {
      c->remove(n);
      ++found.collectives;
    }
    for (Tensor& s : n->saved_tensors())
      if (s.defined() && std::none_of(found.saved.begin(), found.saved.end(),
                                      [&](const Tensor& k) { return k.same(s); }))
        found.saved.push_back(std::move(s));
    for (const Edge& e : n->next_edges()) visit(e.fn.get());
  }
  return found;
}

void Cohort::backward_pending(bool retain_graph) {
  std::vector<std::shared_ptr<Node>> members = pending();
  if (members.empty()) return;
  // Any one member as the root (with a zero cotangent) brings in the rest.
  Node& first = *members.front();
  const OutputMeta& m = first.outputs().at(0);
  Tensor handle = zeros(m.shape, m.dtype, m.device);
  handle.impl()->grad_fn = members.front();
  handle.impl()->output_nr = 0;
  run_engine({handle}, {zeros(m.shape, m.dtype, m.device)}, retain_graph, /*accumulate=*/true, {});
}

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grad_roots,
              bool retain_graph) {
  run_engine(roots, grad_roots, retain_graph, /*accumulate=*/true, {});
}

std::vector<Tensor> grad(const std::vector<Tensor>& roots, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_roots, bool retain_graph,
                         bool allow_unused) {
  std::vector<Edge> edges;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) raise("grad", fmt::format("input {} is undefined", i));
    edges.push_back(gradient_edge(inputs[i]));
  }
  std::vector<Tensor> out =
      run_engine(roots, grad_roots, retain_graph, /*accumulate=*/false, edges);
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (out[i].defined()) continue;
    if (!allow_unused)
      raise("grad",
            fmt::format(
                "input {} ({}) is not reached from the roots (pass allow_unused=true for zeros)", i,
                inputs[i].str()));
    out[i] = zeros_like(inputs[i]);
  }
  return out;
}

double gradcheck_max_error(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                           const std::vector<Tensor>& inputs, double eps, uint64_t seed) {
  std::vector<Tensor> leaves;
  for (const auto& x : inputs) {
    if (x.dtype() != DType::Float64) throw_dtype_mismatch("gradcheck", DType::Float64, x.dtype());
    Tensor l = x.copy_data();
    l.set_requires_grad(true);
    leaves.push_back(l);
  }
  Tensor y = fn(leaves);
  Generator gen(seed);
  Tensor cot = rand_normal(y.shape(), gen, 0.0, 1.0, DType::Float64);
  std::vector<Tensor> analytic = grad({y}, leaves, {cot});
  const std::vector<double> c = cot.to_vector();
  auto objective = [&](const std::vector<Tensor>& xs) {
    const std::vector<double> v = fn(xs).to_vector();
    double s = 0.0;
    for (std::size_t i = 0; i < v.size(); ++i) s += v[i] * c[i];
    return s;
  };
  double worst = 0.0;
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    const std::vector<double> a = analytic[k].to_vector();
    for (int64_t e = 0; e < inputs[k].numel(); ++e) {
      std::vector<Tensor> xs;
      for (const auto& x : inputs) xs.push_back(x.copy_data());
      double* p = xs[k].data<double>();
      const double orig = p[e];
      p[e] = orig + eps;
      const double fp = objective(xs);
      p[e] = orig - eps;
      const double fm = objective(xs);
      const double numeric = (fp - fm) / (2.0 * eps);
      worst = std::max(worst, std::abs(numeric - a[static_cast<std::size_t>(e)]));
    }
  }
  return worst;
}

// A member of Tensor defined in the autograd layer: its error names the
// grad_fn (a Node), which the tensor layer only declares.
Tensor& Tensor::set_requires_grad(bool value) {
  if (!impl_) detail::throw_undefined_tensor();
  if (value && !is_floating(dtype()))
    raise("set_requires_grad",
          fmt::format("only floating-point tensors can require grad, got {}", str()));
  if (!is_leaf())
    raise("set_requires_grad",
          fmt::format("{} is not a leaf (it has grad_fn {}); detach() it first", str(),
                      grad_fn()->name()));
  impl_->requires_grad = value;
  return *this;
}

}  // namespace diffcomm
