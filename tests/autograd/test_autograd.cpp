// The autograd engine: accumulation, grad() vs backward(), deterministic
// execution order, zero-filling of missing output gradients, and misuse errors.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/autograd/ops.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm {
namespace {

Tensor leaf(const std::vector<double>& v, const Shape& shape) {
  Tensor t = from_vector(v, shape, DType::Float64);
  t.set_requires_grad(true);
  return t;
}

std::vector<double> vec(const Tensor& t) { return t.to_vector(); }

// Identity whose backward appends its tag to a log: records execution order.
struct LogFn : Function<LogFn> {
  static constexpr const char* kName = "LogBackward";
  std::string tag;
  std::vector<std::string>& log;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) { return {in[0].copy_data()}; }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) {
    log.push_back(tag);
    return {g[0]};
  }
};

Tensor logged(const Tensor& x, std::string tag, std::vector<std::string>& log) {
  return LogFn{{}, std::move(tag), log}.apply({x})[0];
}

// Two outputs from one input x of shape [n]: y0 = 2x (shape [n]) and
// y1 = 3 * sum(x) broadcast to [2, 2]. Records what its backward received.
struct TwoOut : Function<TwoOut> {
  static constexpr const char* kName = "TwoOutBackward";
  struct Seen {
    int calls = 0;
    bool g0_defined = false, g1_defined = false;
    Shape g1_shape;
    std::vector<double> g1_values;
  };
  Seen* seen = nullptr;
  Shape in_shape;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    in_shape = in[0].shape();
    double s = 0;
    for (double v : in[0].to_vector()) s += v;
    Tensor y0 = in[0].copy_data();
    for (int64_t i = 0; i < y0.numel(); ++i) y0.data<double>()[i] *= 2;
    return {y0, full({2, 2}, 3 * s, DType::Float64)};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) {
    ++seen->calls;
    seen->g0_defined = g[0].defined();
    seen->g1_defined = g[1].defined();
    if (!g[0].defined() || !g[1].defined()) return {Tensor()};
    seen->g1_shape = g[1].shape();
    seen->g1_values = g[1].to_vector();
    double s1 = 0;
    for (double v : g[1].to_vector()) s1 += v;
    std::vector<double> out = g[0].to_vector();
    for (double& v : out) v = 2 * v + 3 * s1;
    return {from_vector(out, in_shape, DType::Float64)};
  }
};

// y = x with a deliberately wrong backward (returns 3g): gradcheck must see it.
struct WrongGrad : Function<WrongGrad> {
  static constexpr const char* kName = "WrongGradBackward";
  std::vector<Tensor> forward(const std::vector<Tensor>& in) { return {in[0].copy_data()}; }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) { return {scale(g[0], 3.0)}; }
};

// Checks what forward() is handed.
struct InspectInputs : Function<InspectInputs> {
  static constexpr const char* kName = "InspectBackward";
  bool* any_requires_grad = nullptr;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    for (const auto& t : in) *any_requires_grad |= t.requires_grad() || !t.is_leaf();
    return {in[0].copy_data()};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) { return {g[0], g[0]}; }
};

// ---------------------------------------------------------------- recording

TEST(Autograd, RecordingFollowsRequiresGrad) {
  Tensor a = from_vector({1, 2}, {2});
  Tensor b = from_vector({3, 4}, {2});
  Tensor c = mul(a, b);
  EXPECT_TRUE(c.is_leaf());
  EXPECT_FALSE(c.requires_grad());

  a.set_requires_grad(true);
  EXPECT_TRUE(a.is_leaf());
  EXPECT_TRUE(a.requires_grad());
  Tensor d = mul(a, b);
  ASSERT_NE(d.grad_fn(), nullptr);
  EXPECT_EQ(d.grad_fn()->name(), "MulBackward");
  EXPECT_FALSE(d.is_leaf());
  EXPECT_TRUE(d.requires_grad());
  EXPECT_EQ(d.output_nr(), 0);
  ASSERT_EQ(d.grad_fn()->next_edges().size(), 2u);
  EXPECT_TRUE(d.grad_fn()->next_edges()[0].valid());   // a requires grad
  EXPECT_FALSE(d.grad_fn()->next_edges()[1].valid());  // b does not
  ASSERT_EQ(d.grad_fn()->outputs().size(), 1u);
  EXPECT_EQ(d.grad_fn()->outputs()[0].shape, (Shape{2}));
  EXPECT_EQ(d.grad_fn()->outputs()[0].dtype, DType::Float64);
}

TEST(Autograd, GradientEdges) {
  Tensor plain = zeros({2}, DType::Float64);
  EXPECT_FALSE(gradient_edge(plain).valid());
  EXPECT_FALSE(gradient_edge(Tensor()).valid());

  Tensor x = leaf({1, 2}, {2});
  Edge e1 = gradient_edge(x);
  Edge e2 = gradient_edge(x);
  ASSERT_TRUE(e1.valid());
  EXPECT_EQ(e1.fn, e2.fn);  // one accumulator per leaf while it is alive
  EXPECT_EQ(e1.input_nr, 0);
  EXPECT_EQ(e1.fn->name(), "AccumulateGrad");

  Tensor y = scale(x, 2.0);
  Edge ey = gradient_edge(y);
  EXPECT_EQ(ey.fn, y.grad_fn());
  EXPECT_EQ(ey.input_nr, 0);
  EXPECT_EQ(y.grad_fn()->next_edges()[0].fn, e1.fn);
}

TEST(Autograd, ForwardSeesDetachedInputs) {
  Tensor x = leaf({1, 2}, {2});
  Tensor y = scale(x, 2.0);
  bool any = false;
  Tensor z = InspectInputs{{}, &any}.apply({x, y})[0];
  EXPECT_FALSE(any);
  ASSERT_NE(z.grad_fn(), nullptr);
  EXPECT_EQ(z.grad_fn()->name(), "InspectBackward");
}

TEST(Autograd, SequenceNumbersFollowCreationOrder) {
  Tensor x = leaf({1}, {1});
  Tensor a = scale(x, 1.0);
  Tensor b = scale(x, 1.0);
  Tensor c = add(a, b);
  EXPECT_LT(a.grad_fn()->sequence_nr(), b.grad_fn()->sequence_nr());
  EXPECT_LT(b.grad_fn()->sequence_nr(), c.grad_fn()->sequence_nr());
}

TEST(Autograd, MultiOutputNodeNumbersItsOutputs) {
  Tensor x = leaf({1, 2, 3}, {3});
  TwoOut::Seen seen;
  auto outs = TwoOut{{}, &seen, {}}.apply({x});
  ASSERT_EQ(outs.size(), 2u);
  EXPECT_EQ(outs[0].grad_fn(), outs[1].grad_fn());
  EXPECT_EQ(outs[0].output_nr(), 0);
  EXPECT_EQ(outs[1].output_nr(), 1);
  EXPECT_EQ(outs[1].shape(), (Shape{2, 2}));
  EXPECT_EQ(vec(outs[1]), std::vector<double>(4, 18.0));  // 3 * (1 + 2 + 3)
}

// ---------------------------------------------------------------- backward, grad

TEST(Autograd, ScalarRootGetsGradientOne) {
  Tensor x = leaf({1, -2, 3}, {3});
  backward({sum(mul(x, x))});  // d/dx sum x^2 = 2x
  EXPECT_EQ(vec(x.grad()), (std::vector<double>{2, -4, 6}));
  EXPECT_EQ(x.grad().dtype(), DType::Float64);
  EXPECT_EQ(x.grad().shape(), (Shape{3}));
  EXPECT_FALSE(x.grad().requires_grad());
}

TEST(Autograd, ExplicitRootGradient) {
  Tensor x = leaf({1, 2, 3, 4}, {2, 2});
  Tensor y = scale(x, 3.0);
  backward({y}, {from_vector({1, 0, -1, 2}, {2, 2})});
  EXPECT_EQ(vec(x.grad()), (std::vector<double>{3, 0, -3, 6}));
}

TEST(Autograd, LeafGradAccumulatesOverTwoBackwards) {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor y = sum(mul(x, x));
  backward({y}, {}, /*retain_graph=*/true);
  EXPECT_EQ(vec(x.grad()), (std::vector<double>{2, 4, 6}));
  backward({y}, {}, /*retain_graph=*/true);
  EXPECT_EQ(vec(x.grad()), (std::vector<double>{4, 8, 12}));
  // A fresh graph over the same leaf keeps accumulating.
  backward({sum(x)});
  EXPECT_EQ(vec(x.grad()), (std::vector<double>{5, 9, 13}));
  // Resetting .grad starts over.
  x.set_grad(Tensor());
  backward({y});
  EXPECT_EQ(vec(x.grad()), (std::vector<double>{2, 4, 6}));
}

TEST(Autograd, GradIsACopyNotAnAlias) {
  Tensor x = leaf({1, 2}, {2});
  Tensor g = from_vector({5, 7}, {2});
  backward({x}, {g});  // a leaf as its own root
  EXPECT_EQ(vec(x.grad()), (std::vector<double>{5, 7}));
  g.fill_(0);
  EXPECT_EQ(vec(x.grad()), (std::vector<double>{5, 7}));
  EXPECT_NE(x.grad().data_ptr(), g.data_ptr());
}

TEST(Autograd, SharedSubexpressionsSumTheirContributions) {
  // y = sum(x*x + x) + sum(3x): dy/dx = 2x + 1 + 3.
  Tensor x = leaf({0.5, -1, 2}, {3});
  Tensor y = add(sum(add(mul(x, x), x)), sum(scale(x, 3.0)));
  backward({y});
  EXPECT_EQ(vec(x.grad()), (std::vector<double>{5, 2, 8}));
}

TEST(Autograd, SeveralRootsAtOnce) {
  Tensor x = leaf({1, 2}, {2});
  Tensor y1 = sum(scale(x, 2.0));
  Tensor y2 = dot(x, x);
  backward({y1, y2});  // 2 + 2x
  EXPECT_EQ(vec(x.grad()), (std::vector<double>{4, 6}));
  Tensor z = leaf({1, 2}, {2});
  backward({sum(z), scale(z, -1.0)}, {ones({}, DType::Float64), from_vector({1, 2}, {2})});
  EXPECT_EQ(vec(z.grad()), (std::vector<double>{0, -1}));
}

TEST(Autograd, GradDoesNotTouchDotGrad) {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor w = leaf({4, 5, 6}, {3});
  Tensor y = dot(x, w);
  auto g = grad({y}, {x, w});
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(vec(g[0]), (std::vector<double>{4, 5, 6}));
  EXPECT_EQ(vec(g[1]), (std::vector<double>{1, 2, 3}));
  EXPECT_FALSE(x.grad().defined());
  EXPECT_FALSE(w.grad().defined());

  // With a .grad already present it stays as it was.
  Tensor x2 = leaf({1, 2}, {2});
  x2.set_grad(from_vector({100, 200}, {2}));
  auto g2 = grad({sum(scale(x2, 5.0))}, {x2});
  EXPECT_EQ(vec(g2[0]), (std::vector<double>{5, 5}));
  EXPECT_EQ(vec(x2.grad()), (std::vector<double>{100, 200}));
}

TEST(Autograd, GradWithRespectToAnIntermediate) {
  Tensor x = leaf({1, 2}, {2});
  Tensor h = scale(x, 3.0);
  Tensor y = dot(h, h);  // dy/dh = 2h = 6x
  auto g = grad({y}, {h, x}, {}, /*retain_graph=*/true);
  EXPECT_EQ(vec(g[0]), (std::vector<double>{6, 12}));
  EXPECT_EQ(vec(g[1]), (std::vector<double>{18, 36}));  // 18x
  // retain_graph lets the same graph run again.
  auto again = grad({y}, {x});
  EXPECT_EQ(vec(again[0]), (std::vector<double>{18, 36}));
}

TEST(Autograd, UnusedInputs) {
  Tensor x = leaf({1, 2}, {2});
  Tensor unused = leaf({7, 7, 7}, {3});
  Tensor y = sum(x);
  auto g = grad({y}, {x, unused}, {}, /*retain_graph=*/true);
  EXPECT_EQ(vec(g[0]), (std::vector<double>{1, 1}));
  EXPECT_EQ(vec(g[1]), std::vector<double>(3, 0.0));
  EXPECT_EQ(g[1].shape(), (Shape{3}));
  EXPECT_THROW(grad({y}, {x, unused}, {}, true, /*allow_unused=*/false), InvalidArgument);
  EXPECT_THROW(grad({y}, {Tensor()}), InvalidArgument);
}

TEST(Autograd, GradRunsEveryReachableNode) {
  // A branch that does not lead to the requested input still runs, so every
  // rank issues the same backward collectives.
  std::vector<std::string> log;
  Tensor x = leaf({1}, {1});
  Tensor w = leaf({2}, {1});
  Tensor xb = logged(x, "x-branch", log);  // created first
  Tensor wb = logged(w, "w-branch", log);
  Tensor y = add(xb, wb);
  auto g = grad({sum(y)}, {x});
  EXPECT_EQ(vec(g[0]), (std::vector<double>{1}));
  EXPECT_EQ(log, (std::vector<std::string>{"w-branch", "x-branch"}));
  EXPECT_FALSE(w.grad().defined());
}

// ---------------------------------------------------------------- order

TEST(Autograd, ReadyNodesRunInDescendingCreationOrder) {
  // Two independent branches, created interleaved: a, b, c(a), d(b).
  // Breadth-first from the root would give c d a b, depth-first c a d b; the
  // engine must give d c b a.
  auto run = [] {
    std::vector<std::string> log;
    Tensor x = leaf({1, 2}, {2});
    Tensor a = logged(x, "a", log);
    Tensor b = logged(x, "b", log);
    Tensor c = logged(a, "c", log);
    Tensor d = logged(b, "d", log);
    EXPECT_LT(a.grad_fn()->sequence_nr(), b.grad_fn()->sequence_nr());
    EXPECT_LT(b.grad_fn()->sequence_nr(), c.grad_fn()->sequence_nr());
    EXPECT_LT(c.grad_fn()->sequence_nr(), d.grad_fn()->sequence_nr());
    backward({sum(add(c, d))});
    EXPECT_EQ(vec(x.grad()), (std::vector<double>{2, 2}));
    return log;
  };
  const auto first = run();
  EXPECT_EQ(first, (std::vector<std::string>{"d", "c", "b", "a"}));
  EXPECT_EQ(run(), first);  // identical graphs, identical order
}

TEST(Autograd, OrderIsCreationOrderNotEdgeOrder) {
  // The root consumes the branches in the opposite order from their creation.
  std::vector<std::string> log;
  Tensor x = leaf({1}, {1});
  Tensor p = logged(x, "first", log);
  Tensor q = logged(x, "second", log);
  Tensor r = logged(x, "third", log);
  backward({sum(cat({r, p, q}))});
  EXPECT_EQ(log, (std::vector<std::string>{"third", "second", "first"}));
  EXPECT_EQ(vec(x.grad()), (std::vector<double>{3}));
}

TEST(Autograd, ANodeWaitsForAllItsConsumers) {
  // s feeds both a late node and an early one; it runs only after both.
  std::vector<std::string> log;
  Tensor x = leaf({1}, {1});
  Tensor s = logged(x, "shared", log);
  Tensor early = logged(s, "early", log);
  Tensor mid = logged(x, "mid", log);
  Tensor late = logged(s, "late", log);
  backward({sum(add(add(early, late), mid))});
  EXPECT_EQ(log, (std::vector<std::string>{"late", "mid", "early", "shared"}));
}

// ---------------------------------------------------------------- zeros for missing grads

TEST(Autograd, MissingOutputGradientBecomesZeros) {
  Tensor x = leaf({1, 2, 3}, {3});
  TwoOut::Seen seen;
  auto outs = TwoOut{{}, &seen, {}}.apply({x});
  backward({sum(outs[0])});  // only output 0 is used
  EXPECT_EQ(seen.calls, 1);
  EXPECT_TRUE(seen.g0_defined);
  ASSERT_TRUE(seen.g1_defined);
  EXPECT_EQ(seen.g1_shape, (Shape{2, 2}));
  EXPECT_EQ(seen.g1_values, std::vector<double>(4, 0.0));
  EXPECT_EQ(vec(x.grad()), (std::vector<double>{2, 2, 2}));

  // Only output 1 used: output 0's gradient is zeros of shape [3].
  Tensor x2 = leaf({1, 2, 3}, {3});
  TwoOut::Seen seen2;
  auto outs2 = TwoOut{{}, &seen2, {}}.apply({x2});
  backward({sum(outs2[1])});  // d/dx of 4 * 3 * sum(x) = 12
  EXPECT_EQ(seen2.calls, 1);
  EXPECT_EQ(vec(x2.grad()), (std::vector<double>{12, 12, 12}));
}

TEST(Autograd, MultiOutputGradcheck) {
  TwoOut::Seen seen;  // outlives every node gradcheck builds
  auto f = [&seen](const std::vector<Tensor>& in) {
    auto outs = TwoOut{{}, &seen, {}}.apply({in[0]});
    return add(scale(sum(outs[0]), 0.5), dot(outs[1], outs[1]));
  };
  EXPECT_LT(gradcheck_max_error(f, {from_vector({0.3, -1.2, 2.0}, {3})}), 1e-6);
}

// ---------------------------------------------------------------- gradcheck itself

TEST(Gradcheck, AcceptsCorrectAndRejectsWrongGradients) {
  const Tensor x = from_vector({0.5, -1.5, 2.0}, {3});
  auto right = [](const std::vector<Tensor>& in) { return scale(in[0], 3.0); };
  auto wrong = [](const std::vector<Tensor>& in) { return WrongGrad{}.apply({in[0]})[0]; };
  EXPECT_LT(gradcheck_max_error(right, {x}), 1e-6);
  EXPECT_GT(gradcheck_max_error(wrong, {x}), 0.1);
  EXPECT_THROW(gradcheck_max_error(right, {from_vector({1}, {1}, DType::Float32)}),
               InvalidArgument);
  // The inputs are not modified.
  EXPECT_EQ(vec(x), (std::vector<double>{0.5, -1.5, 2.0}));
}

// ---------------------------------------------------------------- errors

TEST(AutogradErrors, BackwardTwiceThroughAFreedGraph) {
  Tensor x = leaf({1, 2}, {2});
  Tensor y = sum(mul(x, x));
  backward({y});
  try {
    backward({y});
    FAIL() << "second backward through a freed graph succeeded";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("retain_graph"), std::string::npos) << e.what();
  }
  Tensor z = sum(scale(x, 2.0));
  grad({z}, {x});
  EXPECT_THROW(grad({z}, {x}), InvalidArgument);
}

TEST(AutogradErrors, RequiresGradOnlyOnFloatingLeaves) {
  for (DType d : {DType::Int32, DType::Int64, DType::UInt8}) {
    Tensor t = zeros({2}, d);
    EXPECT_THROW(t.set_requires_grad(true), InvalidArgument) << dtype_name(d);
    EXPECT_FALSE(t.requires_grad());
    EXPECT_NO_THROW(t.set_requires_grad(false));
  }
  for (DType d : {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16}) {
    Tensor t = zeros({2}, d);
    EXPECT_NO_THROW(t.set_requires_grad(true)) << dtype_name(d);
    EXPECT_TRUE(t.requires_grad());
  }
  Tensor x = leaf({1}, {1});
  Tensor y = scale(x, 2.0);
  EXPECT_THROW(y.set_requires_grad(true), InvalidArgument);  // not a leaf
  EXPECT_NO_THROW(y.detach().set_requires_grad(true));
}

TEST(AutogradErrors, RootGradientShapeOrDTypeMismatch) {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor y = mul(x, x);
  EXPECT_THROW(backward({y}, {ones({4}, DType::Float64)}, true), InvalidArgument);
  EXPECT_THROW(backward({y}, {ones({3, 1}, DType::Float64)}, true), InvalidArgument);
  EXPECT_THROW(backward({y}, {ones({3}, DType::Float32)}, true), InvalidArgument);
  EXPECT_THROW(grad({y}, {x}, {ones({2}, DType::Float64)}, true), InvalidArgument);
  // Root gradients must match the roots in number.
  EXPECT_THROW(backward({y}, {ones({3}, DType::Float64), ones({3}, DType::Float64)}, true),
               InvalidArgument);
  // The leaf root itself is checked too.
  EXPECT_THROW(backward({x}, {ones({2}, DType::Float64)}), InvalidArgument);
  EXPECT_FALSE(x.grad().defined());
  backward({y}, {ones({3}, DType::Float64)});  // and the right one works
  EXPECT_EQ(vec(x.grad()), (std::vector<double>{2, 4, 6}));
}

TEST(AutogradErrors, RootThatDoesNotRequireGrad) {
  Tensor x = from_vector({1, 2}, {2});
  EXPECT_THROW(backward({sum(x)}), InvalidArgument);
  EXPECT_THROW(grad({sum(x)}, {x}), InvalidArgument);
  EXPECT_THROW(backward({Tensor()}), InvalidArgument);
}

TEST(AutogradErrors, NonScalarRootNeedsAnExplicitGradient) {
  Tensor x = leaf({1, 2}, {2});
  Tensor y = scale(x, 2.0);
  try {
    backward({y}, {}, true);
    FAIL() << "backward of a 2-element root without a gradient succeeded";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("gradient"), std::string::npos) << e.what();
  }
  EXPECT_THROW(grad({y}, {x}, {}, true), InvalidArgument);
  // A 1-element root of any rank is fine.
  Tensor one = leaf({4}, {1, 1});
  backward({scale(one, 2.0)});
  EXPECT_EQ(vec(one.grad()), (std::vector<double>{2}));
}

TEST(AutogradErrors, FunctionReturningTheWrongNumberOfGradients) {
  Tensor x = leaf({1, 2}, {2});
  bool any = false;
  // InspectInputs returns two gradients; give it one input.
  Tensor y = InspectInputs{{}, &any}.apply({x})[0];
  EXPECT_THROW(backward({sum(y)}), InvalidArgument);
}

}  // namespace
}  // namespace diffcomm
