// Differentiable collectives: each op's forward and its adjoint side by side,
// written once on the dist primitives (so every backend shares them).
#include "diffcomm/nn/functional.hpp"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <numeric>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/tensor/error.hpp"
#include "nn/nn_site.hpp"

namespace diffcomm::nn {
namespace {

bool linear(ReduceOp op) {
  return op == ReduceOp::Sum || op == ReduceOp::Avg || op == ReduceOp::PremulSum;
}

// The adjoint of a linear reduction is the summed cotangent times this: 1 for
// Sum, 1/N for Avg, the factor for PremulSum.
double adjoint_scale(ReduceOp op, int n) {
  if (op == ReduceOp::Avg) return 1.0 / n;
  if (op == ReduceOp::PremulSum) return op.factor();
  return 1.0;
}
Tensor scaled(const Tensor& t, ReduceOp op, int n) {
  const double a = adjoint_scale(op, n);
  return a == 1.0 ? t : scale(t, a);
}

using detail::nn_site;

void check_defined(const char* op, const ProcessGroup& g, const Tensor& t, const char* role) {
  if (!t.defined()) raise(nn_site(op, g), fmt::format("{} is undefined", role));
}

void check_root(const char* op, const ProcessGroup& g, int root, const char* what) {
  if (root < 0 || root >= g.size())
    raise(nn_site(op, g), fmt::format("{} {} out of range [0, {}) (roots are group-local ranks)",
                                      what, root, g.size()));
}

void refuse_nonlinear(const char* op, const ProcessGroup& g, ReduceOp r) {
  if (!linear(r))
    raise(nn_site(op, g),
          fmt::format("reduce op {} has no gradient here (only all_reduce and reduce "
                      "differentiate max/min/product); use sum, avg or premul_sum",
                      dist::reduce_op_name(r)));
}

// prod_{s != r} xs[s], elementwise, by direct multiplication (exact with zeros).
Tensor exclusive_product(const std::vector<Tensor>& xs, int r) {
  const Tensor& ref = xs[0];
  std::vector<double> out(static_cast<std::size_t>(ref.numel()), 1.0);
  for (std::size_t s = 0; s < xs.size(); ++s) {
    if (static_cast<int>(s) == r) continue;
    const std::vector<double> v = xs[s].to_vector();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] *= v[i];
  }
  return from_vector(out, ref.shape(), ref.dtype());
}

// 1 where x holds the extremum y (x == y, or both NaN: a NaN result is held
// by every rank whose element is NaN), else 0.
Tensor extremum_mask(const Tensor& x, const Tensor& y) {
  const std::vector<double> xv = x.to_vector(), yv = y.to_vector();
  std::vector<double> m(xv.size());
  for (std::size_t i = 0; i < m.size(); ++i)
    m[i] = (xv[i] == yv[i] || (std::isnan(xv[i]) && std::isnan(yv[i]))) ? 1.0 : 0.0;
  return from_vector(m, x.shape(), x.dtype()).to(x.device());
}

// Gradient of a Max/Min/Product reduction over the group. x: this rank's
// input; y: the reduced value (same on every rank); total: the summed
// output gradient G (same on every rank).
Tensor nonlinear_grad(ReduceOp op, const ProcessGroup& g, const Tensor& x, const Tensor& y,
                      const Tensor& total, dist::Caller caller) {
  if (op == ReduceOp::Product) {
    std::vector<Tensor> all;
    for (int s = 0; s < g.size(); ++s) all.push_back(empty_like(x));
    dist::all_gather(g, all, x, caller);
    return mul(total, exclusive_product(all, g.rank()));
  }
  // Max/Min: G to the holders of the extremum, split evenly among ties; a
  // NaN result (NaN propagates) goes to the ranks holding a NaN there.
  Tensor mask = extremum_mask(x, y);
  Tensor count = mask.copy_data();
  dist::all_reduce(g, count, ReduceOp::Sum, caller);
  return div(mul(total, mask), count);
}

// True when checked_nbytes(shape, dtype, ...) would not throw: no negative
// dim and at most kMaxTensorBytes (a zero dim makes any shape fit).
bool fits_one_tensor(const Shape& shape, DType dtype) {
  uint64_t bytes = element_size(dtype);
  bool zero = false;
  for (int64_t d : shape) {
    if (d < 0) return false;
    zero = zero || d == 0;
  }
  if (zero) return true;
  for (int64_t d : shape) {
    const auto u = static_cast<uint64_t>(d);
    if (bytes > kMaxTensorBytes / u) return false;
    bytes *= u;
  }
  return true;
}

// Shape of an output of `x`'s rows allocated from splits, checked before
// anything is allocated: no negative entry, a row count that does not
// overflow, and a byte count one tensor can hold (InvalidArgument naming the
// op and the size otherwise).
Shape shape_from_splits(const char* op, const ProcessGroup& g, const Splits& splits,
                        const char* role, const Tensor& x) {
  int64_t rows = 0;
  for (std::size_t i = 0; i < splits.size(); ++i) {
    if (splits[i] < 0)
      raise(nn_site(op, g), fmt::format("{}[{}] = {} is negative", role, i, splits[i]));
    if (splits[i] > std::numeric_limits<int64_t>::max() - rows)
      raise(nn_site(op, g), fmt::format("{} [{}] sum past int64", role, fmt::join(splits, ",")));
    rows += splits[i];
  }
  Shape shape = x.shape();
  shape[0] = rows;
  // The message is formatted only for a shape that fails (checked_nbytes then
  // throws): formatting it up front cost more than the rest of the call.
  if (!fits_one_tensor(shape, x.dtype()))
    checked_nbytes(shape, x.dtype(),
                   fmt::format("nn::{} on group '{}' (rank {} of {}): output from {}", op, g.name(),
                               g.rank(), g.size(), role));
  return shape;
}

// ------------------------------------------------------------------ all_reduce
struct AllReduceFn : Function<AllReduceFn> {
  static constexpr const char* kName = "AllReduceBackward";
  dist::Caller caller;  // the user's call site: every call forward and backward makes
  ProcessGroup group;
  ReduceOp op;
  SavedTensor x, y;  // for Max/Min/Product
  std::vector<Tensor> saved() const { return {x.peek(), y.peek()}; }
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    // Out of place: the composed reduction and the simulated world read the
    // input directly (no copy of it into the output first).
    Tensor out = empty_like(in[0]);
    dist::all_reduce_into(group, out, in[0], op, caller);
    forward_call = group.last_call();
    if (!linear(op)) {
      x = SavedTensor(in[0], 0);
      y = SavedTensor(out, 1);
    }
    return {out};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    const ProcessGroup::BackwardOf tie(group, forward_call);
    if (!linear(op)) {  // before any collective: a changed saved tensor fails here
      (void)x.get(kName);
      (void)y.get(kName);
    }
    Tensor total = empty_like(grads[0]);
    dist::all_reduce_into(group, total, grads[0], linear(op) ? op : ReduceOp(ReduceOp::Sum),
                          caller);
    if (linear(op)) return {total};
    return {nonlinear_grad(op, group, x.get(kName), y.get(kName), total, caller)};
  }
  dist::CallId forward_call{};  // named by every call backward() makes
};

// ------------------------------------------------------------------ broadcast
struct BroadcastFn : Function<BroadcastFn> {
  static constexpr const char* kName = "BroadcastBackward";
  dist::Caller caller;  // the user's call site: every call forward and backward makes
  ProcessGroup group;
  int src;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    // Only the root's bytes are sent; every other rank's output is
    // overwritten whole, so it needs no copy of the input (a 16 MiB copy
    // per call was a third of the call over the torch transport).
    Tensor out = group.rank() == src ? in[0].copy_data() : empty_like(in[0]);
    dist::broadcast(group, out, src, caller);
    forward_call = group.last_call();
    return {out};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    const ProcessGroup::BackwardOf tie(group, forward_call);
    Tensor total = grads[0].copy_data();
    dist::reduce(group, total, src, ReduceOp::Sum, caller);
    if (group.rank() != src) total.fill_(0.0);
    return {total};
  }
  dist::CallId forward_call{};  // named by every call backward() makes
};

// ------------------------------------------------------------------ reduce
struct ReduceFn : Function<ReduceFn> {
  static constexpr const char* kName = "ReduceBackward";
  dist::Caller caller;  // the user's call site: every call forward and backward makes
  ProcessGroup group;
  int dst;
  ReduceOp op;
  SavedTensor x, y;  // for Max/Min/Product
  std::vector<Tensor> saved() const { return {x.peek(), y.peek()}; }
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    Tensor out = in[0].copy_data();
    dist::reduce(group, out, dst, op, caller);
    forward_call = group.last_call();
    if (group.rank() != dst) out.fill_(0.0);  // defined: zeros off the root
    if (!linear(op)) {
      x = SavedTensor(in[0], 0);
      y = SavedTensor(out, 1);
    }
    return {out};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    const ProcessGroup::BackwardOf tie(group, forward_call);
    if (!linear(op)) {  // before any collective: a changed saved tensor fails here
      (void)x.get(kName);
      (void)y.get(kName);
    }
    // Only dst's output depends on x; other ranks' outputs are constants.
    Tensor total = grads[0].copy_data();
    dist::broadcast(group, total, dst, caller);
    if (linear(op)) return {scaled(total, op, group.size())};
    Tensor value = y.get(kName).copy_data();
    dist::broadcast(group, value, dst, caller);
    return {nonlinear_grad(op, group, x.get(kName), value, total, caller)};
  }
  dist::CallId forward_call{};  // named by every call backward() makes
};

// ------------------------------------------------------------------ gathers
struct AllGatherFn : Function<AllGatherFn> {
  static constexpr const char* kName = "AllGatherBackward";
  dist::Caller caller;  // the user's call site: every call forward and backward makes
  ProcessGroup group;
  GatherGrad mode;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    std::vector<Tensor> outs;
    for (int s = 0; s < group.size(); ++s) outs.push_back(empty_like(in[0]));
    dist::all_gather(group, outs, in[0], caller);
    forward_call = group.last_call();
    return outs;
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    const ProcessGroup::BackwardOf tie(group, forward_call);
    if (mode == GatherGrad::Replicated) return {grads[static_cast<std::size_t>(group.rank())]};
    Tensor dx = empty_like(grads[0]);
    dist::reduce_scatter(group, dx, grads, ReduceOp::Sum, caller);
    return {dx};
  }
  dist::CallId forward_call{};  // named by every call backward() makes
};

struct AllGatherSingleFn : Function<AllGatherSingleFn> {
  static constexpr const char* kName = "AllGatherSingleBackward";
  dist::Caller caller;  // the user's call site: every call forward and backward makes
  ProcessGroup group;
  GatherGrad mode;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    if (in[0].dim() == 0)
      raise(nn_site("all_gather_single", group), "x is 0-d; it needs rows (dim 0)");
    Shape shape = in[0].shape();
    shape[0] *= group.size();
    Tensor out = empty(shape, in[0].dtype(), in[0].device());
    dist::all_gather_single(group, out, in[0], caller);
    forward_call = group.last_call();
    return {out};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    const ProcessGroup::BackwardOf tie(group, forward_call);
    const int64_t rows = grads[0].size(0) / group.size();
    if (mode == GatherGrad::Replicated)
      return {grads[0].row_view(group.rank() * rows, rows).copy_data()};
    Shape shape = grads[0].shape();
    shape[0] = rows;
    Tensor dx = empty(shape, grads[0].dtype(), grads[0].device());
    dist::reduce_scatter_single(group, dx, grads[0], ReduceOp::Sum, caller);
    return {dx};
  }
  dist::CallId forward_call{};  // named by every call backward() makes
};

struct AllGatherVFn : Function<AllGatherVFn> {
  static constexpr const char* kName = "AllGatherVBackward";
  dist::Caller caller;  // the user's call site: every call forward and backward makes
  ProcessGroup group;
  Splits splits;
  GatherGrad mode;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    if (in[0].dim() == 0) raise(nn_site("all_gather_v", group), "x is 0-d; it needs rows (dim 0)");
    const Shape shape = shape_from_splits("all_gather_v", group, splits, "output_splits", in[0]);
    Tensor out = empty(shape, in[0].dtype(), in[0].device());
    dist::all_gather_v(group, out, in[0], splits, caller);
    forward_call = group.last_call();
    return {out};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    const ProcessGroup::BackwardOf tie(group, forward_call);
    const auto r = static_cast<std::size_t>(group.rank());
    Shape shape = grads[0].shape();
    shape[0] = splits[r];
    if (mode == GatherGrad::Replicated) {
      const int64_t offset = std::accumulate(
          splits.begin(), splits.begin() + static_cast<std::ptrdiff_t>(r), int64_t{0});
      return {grads[0].row_view(offset, splits[r]).copy_data()};
    }
    Tensor dx = empty(shape, grads[0].dtype(), grads[0].device());
    dist::reduce_scatter_v(group, dx, grads[0], splits, ReduceOp::Sum, caller);
    return {dx};
  }
  dist::CallId forward_call{};  // named by every call backward() makes
};

struct GatherFn : Function<GatherFn> {
  static constexpr const char* kName = "GatherBackward";
  dist::Caller caller;  // the user's call site: every call forward and backward makes
  ProcessGroup group;
  int dst;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    std::vector<Tensor> outs;
    const bool me = group.rank() == dst;
    for (int s = 0; s < group.size(); ++s)
      outs.push_back(me ? empty_like(in[0]) : zeros_like(in[0]));
    dist::gather(group, me ? outs : std::vector<Tensor>{}, in[0], dst, caller);
    forward_call = group.last_call();
    return outs;
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    const ProcessGroup::BackwardOf tie(group, forward_call);
    Tensor dx = empty_like(grads[0]);
    dist::scatter(group, dx, group.rank() == dst ? grads : std::vector<Tensor>{}, dst, caller);
    return {dx};
  }
  dist::CallId forward_call{};  // named by every call backward() makes
};

struct ScatterFn : Function<ScatterFn> {
  static constexpr const char* kName = "ScatterBackward";
  dist::Caller caller;  // the user's call site: every call forward and backward makes
  ProcessGroup group;
  int src;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    Tensor out = empty_like(in[0]);
    dist::scatter(group, out, group.rank() == src ? in : std::vector<Tensor>{}, src, caller);
    forward_call = group.last_call();
    return {out};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    const ProcessGroup::BackwardOf tie(group, forward_call);
    const auto n = static_cast<std::size_t>(group.size());
    std::vector<Tensor> outs;
    for (std::size_t s = 0; s < n; ++s) outs.push_back(zeros_like(grads[0]));
    dist::gather(group, group.rank() == src ? outs : std::vector<Tensor>{}, grads[0], src, caller);
    return outs;
  }
  dist::CallId forward_call{};  // named by every call backward() makes
};

// ------------------------------------------------------------------ reduce-scatters
struct ReduceScatterFn : Function<ReduceScatterFn> {
  static constexpr const char* kName = "ReduceScatterBackward";
  dist::Caller caller;  // the user's call site: every call forward and backward makes
  ProcessGroup group;
  ReduceOp op;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    if (in.empty())
      raise(nn_site("reduce_scatter", group), "xs is empty; expected one tensor per member");
    Tensor out = empty_like(in[0]);
    dist::reduce_scatter(group, out, in, op, caller);
    forward_call = group.last_call();
    return {out};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    const ProcessGroup::BackwardOf tie(group, forward_call);
    std::vector<Tensor> outs;
    for (int s = 0; s < group.size(); ++s) outs.push_back(empty_like(grads[0]));
    dist::all_gather(group, outs, grads[0], caller);
    for (auto& t : outs) t = scaled(t, op, group.size());
    return outs;
  }
  dist::CallId forward_call{};  // named by every call backward() makes
};

struct ReduceScatterSingleFn : Function<ReduceScatterSingleFn> {
  static constexpr const char* kName = "ReduceScatterSingleBackward";
  dist::Caller caller;  // the user's call site: every call forward and backward makes
  ProcessGroup group;
  ReduceOp op;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    const Tensor& x = in[0];
    if (x.dim() == 0 || x.size(0) % group.size() != 0)
      raise(nn_site("reduce_scatter_single", group),
            fmt::format("x {} needs a row count divisible by the group size {}", x.str(),
                        group.size()));
    Shape shape = x.shape();
    shape[0] /= group.size();
    Tensor out = empty(shape, x.dtype(), x.device());
    dist::reduce_scatter_single(group, out, x, op, caller);
    forward_call = group.last_call();
    return {out};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    const ProcessGroup::BackwardOf tie(group, forward_call);
    Shape shape = grads[0].shape();
    shape[0] *= group.size();
    Tensor dx = empty(shape, grads[0].dtype(), grads[0].device());
    dist::all_gather_single(group, dx, grads[0], caller);
    return {scaled(dx, op, group.size())};
  }
  dist::CallId forward_call{};  // named by every call backward() makes
};

struct ReduceScatterVFn : Function<ReduceScatterVFn> {
  static constexpr const char* kName = "ReduceScatterVBackward";
  dist::Caller caller;  // the user's call site: every call forward and backward makes
  ProcessGroup group;
  Splits splits;
  ReduceOp op;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    const Tensor& x = in[0];
    if (x.dim() == 0) raise(nn_site("reduce_scatter_v", group), "x is 0-d; it needs rows (dim 0)");
    if (static_cast<int>(splits.size()) != group.size())
      raise(nn_site("reduce_scatter_v", group),
            fmt::format("input_splits has {} entries, expected {}", splits.size(), group.size()));
    Shape shape = x.shape();
    shape[0] = splits[static_cast<std::size_t>(group.rank())];
    if (shape[0] < 0) raise(nn_site("reduce_scatter_v", group), "negative split");
    Tensor out = empty(shape, x.dtype(), x.device());
    dist::reduce_scatter_v(group, out, x, splits, op, caller);
    forward_call = group.last_call();
    return {out};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    const ProcessGroup::BackwardOf tie(group, forward_call);
    Shape shape = grads[0].shape();
    shape[0] = std::accumulate(splits.begin(), splits.end(), int64_t{0});
    Tensor dx = empty(shape, grads[0].dtype(), grads[0].device());
    dist::all_gather_v(group, dx, grads[0], splits, caller);
    return {scaled(dx, op, group.size())};
  }
  dist::CallId forward_call{};  // named by every call backward() makes
};

// ------------------------------------------------------------------ all-to-alls
struct AllToAllFn : Function<AllToAllFn> {
  static constexpr const char* kName = "AllToAllBackward";
  dist::Caller caller;  // the user's call site: every call forward and backward makes
  ProcessGroup group;
  std::vector<Shape> out_shapes;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    const auto n = static_cast<std::size_t>(group.size());
    if (in.size() != n)
      raise(nn_site("all_to_all", group),
            fmt::format("xs has {} tensors, expected {}", in.size(), n));
    if (out_shapes.empty())
      for (const auto& t : in) out_shapes.push_back(t.shape());
    if (out_shapes.size() != n)
      raise(nn_site("all_to_all", group),
            fmt::format("output_shapes has {} entries, expected {}", out_shapes.size(), n));
    std::vector<Tensor> outs;
    for (const auto& s : out_shapes) outs.push_back(empty(s, in[0].dtype(), in[0].device()));
    dist::all_to_all(group, outs, in, caller);
    forward_call = group.last_call();
    return outs;
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    const ProcessGroup::BackwardOf tie(group, forward_call);
    // The gradient of xs[j] comes back from member j: the exact reverse route.
    std::vector<Tensor> dxs;
    for (int s = 0; s < group.size(); ++s)
      dxs.push_back(
          empty(in_shapes[static_cast<std::size_t>(s)], grads[0].dtype(), grads[0].device()));
    dist::all_to_all(group, dxs, grads, caller);
    return dxs;
  }
  std::vector<Shape> in_shapes;
  dist::CallId forward_call{};  // named by every call backward() makes
};

struct AllToAllSingleFn : Function<AllToAllSingleFn> {
  static constexpr const char* kName = "AllToAllSingleBackward";
  dist::Caller caller;  // the user's call site: every call forward and backward makes
  ProcessGroup group;
  Splits out_splits, in_splits;
  Shape in_shape;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    const Tensor& x = in[0];
    if (x.dim() == 0) raise(nn_site("all_to_all_single", group), "x is 0-d; it needs rows (dim 0)");
    in_shape = x.shape();
    // Empty output_splits: even splits, so the output has x's shape (which
    // already fits a tensor); no temporary splits vector or shape copy.
    Tensor out =
        out_splits.empty()
            ? empty(x.shape(), x.dtype(), x.device())
            : empty(shape_from_splits("all_to_all_single", group, out_splits, "output_splits", x),
                    x.dtype(), x.device());
    dist::all_to_all_single(group, out, x, out_splits, in_splits, caller);
    forward_call = group.last_call();
    return {out};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    const ProcessGroup::BackwardOf tie(group, forward_call);
    Tensor dx = empty(in_shape, grads[0].dtype(), grads[0].device());
    dist::all_to_all_single(group, dx, grads[0], in_splits, out_splits, caller);
    return {dx};
  }
  dist::CallId forward_call{};  // named by every call backward() makes
};

struct CopyToTpRegionFn : Function<CopyToTpRegionFn> {
  static constexpr const char* kName = "CopyToTpRegionBackward";
  dist::Caller caller;  // the user's call site: every call forward and backward makes
  ProcessGroup group;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) { return {in[0]}; }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    Tensor g = grads[0].copy_data();
    dist::all_reduce(group, g, ReduceOp::Sum, caller);
    return {g};
  }
};

struct EmptyFromAnchorFn : Function<EmptyFromAnchorFn> {
  static constexpr const char* kName = "CatOrEmptyBackward";
  int64_t width;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    return {empty({0, width}, in[0].dtype(), in[0].device())};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) {
    (void)grads;
    return {Tensor{}};  // the anchor gets no contribution (the engine makes it zero)
  }
};

// Joins the op's autograd node (when one was recorded) to its rank's
// cohort, so every backward pass of this rank runs its backward, whatever
// the rank's loss reaches (the participation rule; see Cohort).
std::vector<Tensor> joined(std::vector<Tensor> outs, const ProcessGroup& group) {
  if (!outs.empty() && outs[0].defined()) Cohort::add(group.cohort(), outs[0].grad_fn());
  return outs;
}

}  // namespace

Tensor all_reduce(const Tensor& x, const ProcessGroup& group, ReduceOp op, dist::Caller caller) {
  check_defined("all_reduce", group, x, "x");
  return joined(AllReduceFn{{}, caller, group, op, {}, {}}.apply({x}), group)[0];
}

Tensor broadcast(const Tensor& x, int src, const ProcessGroup& group, dist::Caller caller) {
  check_defined("broadcast", group, x, "x");
  check_root("broadcast", group, src, "src");
  return joined(BroadcastFn{{}, caller, group, src}.apply({x}), group)[0];
}

Tensor reduce(const Tensor& x, int dst, const ProcessGroup& group, ReduceOp op,
              dist::Caller caller) {
  check_defined("reduce", group, x, "x");
  check_root("reduce", group, dst, "dst");
  return joined(ReduceFn{{}, caller, group, dst, op, {}, {}}.apply({x}), group)[0];
}

std::vector<Tensor> all_gather(const Tensor& x, const ProcessGroup& group, GatherGrad grad,
                               dist::Caller caller) {
  check_defined("all_gather", group, x, "x");
  return joined(AllGatherFn{{}, caller, group, grad}.apply({x}), group);
}

Tensor all_gather_single(const Tensor& x, const ProcessGroup& group, GatherGrad grad,
                         dist::Caller caller) {
  check_defined("all_gather_single", group, x, "x");
  return joined(AllGatherSingleFn{{}, caller, group, grad}.apply({x}), group)[0];
}

Tensor all_gather_v(const Tensor& x, const Splits& output_splits, const ProcessGroup& group,
                    GatherGrad grad, dist::Caller caller) {
  check_defined("all_gather_v", group, x, "x");
  if (static_cast<int>(output_splits.size()) != group.size())
    raise(nn_site("all_gather_v", group), fmt::format("output_splits has {} entries, expected {}",
                                                      output_splits.size(), group.size()));
  return joined(AllGatherVFn{{}, caller, group, output_splits, grad}.apply({x}), group)[0];
}

std::vector<Tensor> gather(const Tensor& x, int dst, const ProcessGroup& group,
                           dist::Caller caller) {
  check_defined("gather", group, x, "x");
  check_root("gather", group, dst, "dst");
  return joined(GatherFn{{}, caller, group, dst}.apply({x}), group);
}

Tensor scatter(const std::vector<Tensor>& xs, int src, const ProcessGroup& group,
               dist::Caller caller) {
  check_root("scatter", group, src, "src");
  if (static_cast<int>(xs.size()) != group.size())
    raise(nn_site("scatter", group),
          fmt::format("xs has {} tensors, expected {} on every rank (values are "
                      "used on src only)",
                      xs.size(), group.size()));
  for (const auto& t : xs) check_defined("scatter", group, t, "xs[i]");
  return joined(ScatterFn{{}, caller, group, src}.apply(xs), group)[0];
}

Tensor reduce_scatter(const std::vector<Tensor>& xs, const ProcessGroup& group, ReduceOp op,
                      dist::Caller caller) {
  refuse_nonlinear("reduce_scatter", group, op);
  for (const auto& t : xs) check_defined("reduce_scatter", group, t, "xs[i]");
  return joined(ReduceScatterFn{{}, caller, group, op}.apply(xs), group)[0];
}

Tensor reduce_scatter_single(const Tensor& x, const ProcessGroup& group, ReduceOp op,
                             dist::Caller caller) {
  refuse_nonlinear("reduce_scatter_single", group, op);
  check_defined("reduce_scatter_single", group, x, "x");
  return joined(ReduceScatterSingleFn{{}, caller, group, op}.apply({x}), group)[0];
}

Tensor reduce_scatter_v(const Tensor& x, const Splits& input_splits, const ProcessGroup& group,
                        ReduceOp op, dist::Caller caller) {
  refuse_nonlinear("reduce_scatter_v", group, op);
  check_defined("reduce_scatter_v", group, x, "x");
  return joined(ReduceScatterVFn{{}, caller, group, input_splits, op}.apply({x}), group)[0];
}

std::vector<Tensor> all_to_all(const std::vector<Tensor>& xs, const ProcessGroup& group,
                               const std::vector<Shape>& output_shapes, dist::Caller caller) {
  for (const auto& t : xs) check_defined("all_to_all", group, t, "xs[i]");
  AllToAllFn fn{{}, caller, group, output_shapes, {}};
  for (const auto& t : xs) fn.in_shapes.push_back(t.shape());
  return joined(std::move(fn).apply(xs), group);
}

Tensor all_to_all_single(const Tensor& x, const Splits& output_splits, const Splits& input_splits,
                         const ProcessGroup& group, dist::Caller caller) {
  check_defined("all_to_all_single", group, x, "x");
  return joined(AllToAllSingleFn{{}, caller, group, output_splits, input_splits, {}}.apply({x}),
                group)[0];
}

Tensor copy_to_tp_region(const Tensor& x, const ProcessGroup& group, dist::Caller caller) {
  check_defined("copy_to_tp_region", group, x, "x");
  return joined(CopyToTpRegionFn{{}, caller, group}.apply({x}), group)[0];
}

Tensor cat_or_empty(const std::vector<Tensor>& rows, const Tensor& anchor, int64_t width) {
  if (width < 0) raise("cat_or_empty", fmt::format("negative width {}", width));
  if (!rows.empty()) {
    for (std::size_t i = 0; i < rows.size(); ++i)
      if (!rows[i].defined() || rows[i].dim() != 2 || rows[i].size(1) != width)
        raise("cat_or_empty",
              fmt::format("rows[{}] is {}, expected [n, {}]", i, rows[i].str(), width));
    return cat(rows);
  }
  if (!anchor.defined()) raise("cat_or_empty", "no rows and an undefined anchor");
  return EmptyFromAnchorFn{{}, width}.apply({anchor})[0];
}

}  // namespace diffcomm::nn
