// Property 3: Max / Min / Product on all_reduce and reduce give the true
// gradient, checked against central finite differences in float64, and the
// tie rule of Max / Min (k ranks tied at the extremum get G/k each) against
// its closed form.
//
// Finite differences: the objective is J = sum over members m of
// <y_m, c_m> with fixed per-member cotangents c (y is zero off the root for
// reduce). For each member m and element i, the world is re-run with x_m[i]
// moved by +h and by -h (forward only), and (J+ - J-)/2h is compared with the
// gradient diffcomm::grad returned on m. Max/Min data has no ties (values per
// element at least 0.75 apart), so J is locally linear in every x_m[i]; the
// product is multilinear, so J is linear in each single x_m[i] even where
// some inputs are exactly zero. Either way the central difference is exact
// up to rounding (~ulp(J)/h ~ 1e-12 with h = 1e-3); the tolerance is 1e-8.
// The forward values are also checked against max/min/product computed here.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include "diffcomm/nn/functional.hpp"
#include "support.hpp"

namespace diffcomm::prop {
namespace {

enum class Coll { AllReduce, Reduce };

using Table = std::vector<std::vector<double>>;  // [member][element]

struct Case {
  WorldCase w;
  Coll coll = Coll::AllReduce;
  ReduceOp op = ReduceOp::Max;
  int root = 0;
  Table x;  // inputs
  Table c;  // cotangents
};

std::string table_text(const Table& t) {
  std::string s;
  for (std::size_t m = 0; m < t.size(); ++m)
    s += fmt::format("{}m{}=[{}]", m ? " " : "", m, fmt::join(t[m], ","));
  return s;
}

std::string describe(const Case& c) {
  return fmt::format(
      "{}({}) {} root={} x: {} cot: {}", c.coll == Coll::AllReduce ? "all_reduce" : "reduce",
      dist::reduce_op_name(c.op), prop::describe(c.w), c.root, table_text(c.x), table_text(c.c));
}

// Cotangents: multiples of 1/4 in [-2, 2] (their sums are exact).
Table gen_cotangents(int n, int e) {
  Table c(static_cast<std::size_t>(n));
  for (auto& row : c)
    for (int i = 0; i < e; ++i) row.push_back(*rc::gen::inRange(-8, 9) / 4.0);
  return c;
}

Case gen_fd_case(Coll coll, ReduceOp op) {
  Case c;
  c.coll = coll;
  c.op = op;
  c.w = gen_world(1, 4);
  const int n = c.w.group_size();
  const int e = *rc::gen::inRange(1, 4);
  c.root = *rc::gen::inRange(0, n);
  c.x.assign(static_cast<std::size_t>(n), std::vector<double>(static_cast<std::size_t>(e)));
  for (int i = 0; i < e; ++i) {
    if (op == ReduceOp::Product) {
      // Some inputs exactly zero (possibly several on one element).
      for (auto& row : c.x) {
        const bool zero = *rc::gen::inRange(0, 3) == 0;
        row[static_cast<std::size_t>(i)] = zero ? 0.0 : *rc::gen::inRange(-16, 17) / 8.0 + 0.0625;
      }
    } else {
      // Distinct values: a random order of the members, integer positions
      // plus a fraction < 0.25, so neighbours are >= 0.75 apart.
      const auto keys = *rc::gen::container<std::vector<int>>(static_cast<std::size_t>(n),
                                                              rc::gen::inRange(0, 1000));
      std::vector<int> order(static_cast<std::size_t>(n));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
        return keys[static_cast<std::size_t>(a)] < keys[static_cast<std::size_t>(b)];
      });
      for (int pos = 0; pos < n; ++pos) {
        const auto m = static_cast<std::size_t>(order[static_cast<std::size_t>(pos)]);
        c.x[m][static_cast<std::size_t>(i)] = pos - n / 2.0 + keys[m] / 4000.0;
      }
    }
  }
  c.c = gen_cotangents(n, e);
  return c;
}

Tensor apply(const Case& c, const Tensor& x, const dist::ProcessGroup& g) {
  return c.coll == Coll::AllReduce ? nn::all_reduce(x, g, c.op) : nn::reduce(x, c.root, g, c.op);
}

struct Forward {
  double objective = 0;  // J = sum over members of <y_m, c_m>
  Table y;               // per member
};

// Runs the forward on inputs x; with grads != nullptr also the backward.
Forward run_forward(const Case& c, const Table& x, Table* grads, const std::string& what) {
  const auto n = static_cast<std::size_t>(c.w.group_size());
  Table y(n);
  std::vector<double> parts(n, 0.0);
  if (grads) grads->assign(n, {});
  run_world(c.w, what, [&](sim::Rank& rk) {
    auto g = make_group(rk, c.w);
    if (!g) return;
    const auto m = static_cast<std::size_t>(g->rank());
    const auto e = static_cast<int64_t>(x[m].size());
    Tensor xm = from_vector(x[m], {e}, DType::Float64);
    xm.set_requires_grad(true);
    Tensor ym = apply(c, xm, *g);
    y[m] = ym.to_vector();
    Tensor cm = from_vector(c.c[m], {e}, DType::Float64);
    parts[m] = inner(ym, cm).value;
    if (grads) (*grads)[m] = diffcomm::grad({ym}, {xm}, {cm})[0].to_vector();
  });
  Forward f;
  f.y = y;
  for (double p : parts) f.objective += p;
  return f;
}

// max / min / product over members of one element, computed here.
double reference(ReduceOp op, const Table& x, std::size_t i) {
  double r = x[0][i];
  for (std::size_t m = 1; m < x.size(); ++m) {
    if (op == ReduceOp::Max) r = std::max(r, x[m][i]);
    if (op == ReduceOp::Min) r = std::min(r, x[m][i]);
    if (op == ReduceOp::Product) r *= x[m][i];
  }
  return r;
}

void check_fd(Coll coll, ReduceOp op) {
  const Case c = gen_fd_case(coll, op);
  const std::string what = describe(c);
  RC_LOG() << what << "\n";
  const std::size_t n = c.x.size();
  const std::size_t e = c.x[0].size();

  Table grads;
  const Forward base = run_forward(c, c.x, &grads, what);
  for (std::size_t m = 0; m < n; ++m)
    for (std::size_t i = 0; i < e; ++i) {
      const bool owns = coll == Coll::AllReduce || static_cast<int>(m) == c.root;
      const double want = owns ? reference(op, c.x, i) : 0.0;
      if (base.y[m][i] != want)
        RC_FAIL(fmt::format("{}: forward on member {} element {} is {}, expected {}", what, m, i,
                            base.y[m][i], want));
    }

  constexpr double h = 1e-3;
  for (std::size_t m = 0; m < n; ++m)
    for (std::size_t i = 0; i < e; ++i) {
      Table plus = c.x, minus = c.x;
      plus[m][i] += h;
      minus[m][i] -= h;
      const double fd = (run_forward(c, plus, nullptr, what).objective -
                         run_forward(c, minus, nullptr, what).objective) /
                        (2 * h);
      const double g = grads[m][i];
      if (!(std::fabs(fd - g) <= 1e-8 * (1 + std::fabs(fd))))
        RC_FAIL(
            fmt::format("{}: d J / d x[member {}][{}]: grad() gives {:.17g}, central "
                        "difference gives {:.17g}",
                        what, m, i, g, fd));
    }
}

RC_GTEST_PROP(Nonlinear, AllReduceMaxMatchesFiniteDifferences, ()) {
  check_fd(Coll::AllReduce, ReduceOp::Max);
}
RC_GTEST_PROP(Nonlinear, AllReduceMinMatchesFiniteDifferences, ()) {
  check_fd(Coll::AllReduce, ReduceOp::Min);
}
RC_GTEST_PROP(Nonlinear, AllReduceProductMatchesFiniteDifferences, ()) {
  check_fd(Coll::AllReduce, ReduceOp::Product);
}
RC_GTEST_PROP(Nonlinear, ReduceMaxMatchesFiniteDifferences, ()) {
  check_fd(Coll::Reduce, ReduceOp::Max);
}
RC_GTEST_PROP(Nonlinear, ReduceMinMatchesFiniteDifferences, ()) {
  check_fd(Coll::Reduce, ReduceOp::Min);
}
RC_GTEST_PROP(Nonlinear, ReduceProductMatchesFiniteDifferences, ()) {
  check_fd(Coll::Reduce, ReduceOp::Product);
}

// Tie rule: k members tied at the extremum each get G/k, the others 0, where
// G is the summed output gradient (all_reduce: sum of every member's
// cotangent; reduce: the root's cotangent). Max on x and Min on -x in one
// world run.
void check_ties(Coll coll) {
  Case c;
  c.coll = coll;
  c.w = gen_world(1, 6);
  const int n = c.w.group_size();
  const int e = *rc::gen::inRange(1, 4);
  c.root = *rc::gen::inRange(0, n);
  c.x.assign(static_cast<std::size_t>(n), std::vector<double>(static_cast<std::size_t>(e)));
  std::vector<int> tied(static_cast<std::size_t>(e), 0);
  for (int i = 0; i < e; ++i) {
    const auto ii = static_cast<std::size_t>(i);
    const double top = *rc::gen::inRange(-4, 5);
    for (auto& row : c.x)
      row[ii] = *rc::gen::inRange(0, 2) ? top : top - *rc::gen::inRange(1, 9) / 4.0;
    // At least one member holds the extremum.
    c.x[static_cast<std::size_t>(*rc::gen::inRange(0, n))][ii] = top;
    for (const auto& row : c.x) tied[ii] += row[ii] == top;
  }
  c.c = gen_cotangents(n, e);
  c.op = ReduceOp::Max;
  const std::string what = describe(c) + " [tie rule, Max on x and Min on -x]";
  RC_LOG() << what << "\n";

  const auto un = static_cast<std::size_t>(n);
  Table gmax(un), gmin(un);
  run_world(c.w, what, [&](sim::Rank& rk) {
    auto g = make_group(rk, c.w);
    if (!g) return;
    const auto m = static_cast<std::size_t>(g->rank());
    std::vector<double> neg = c.x[m];
    for (auto& v : neg) v = -v;
    Tensor a = from_vector(c.x[m], {e}, DType::Float64);
    Tensor b = from_vector(neg, {e}, DType::Float64);
    a.set_requires_grad(true);
    b.set_requires_grad(true);
    Tensor cm = from_vector(c.c[m], {e}, DType::Float64);
    Tensor ya, yb;
    if (coll == Coll::AllReduce) {
      ya = nn::all_reduce(a, *g, ReduceOp::Max);
      yb = nn::all_reduce(b, *g, ReduceOp::Min);
    } else {
      ya = nn::reduce(a, c.root, *g, ReduceOp::Max);
      yb = nn::reduce(b, c.root, *g, ReduceOp::Min);
    }
    std::vector<Tensor> d = diffcomm::grad({ya, yb}, {a, b}, {cm, cm});
    gmax[m] = d[0].to_vector();
    gmin[m] = d[1].to_vector();
  });
  for (int i = 0; i < e; ++i) {
    const auto ii = static_cast<std::size_t>(i);
    double G = 0;
    if (coll == Coll::AllReduce)
      for (const auto& row : c.c) G += row[ii];
    else
      G = c.c[static_cast<std::size_t>(c.root)][ii];
    const double top = reference(ReduceOp::Max, c.x, ii);
    for (std::size_t m = 0; m < un; ++m) {
      const double want = c.x[m][ii] == top ? G / tied[ii] : 0.0;
      for (const auto* got : {&gmax, &gmin})
        if (!(std::fabs((*got)[m][ii] - want) <= 1e-14 * std::fabs(G)))
          RC_FAIL(fmt::format(
              "{}: element {}: {} members tied, G = {}; member {} got {} from {}, "
              "expected {}",
              what, i, tied[ii], G, m, (*got)[m][ii], got == &gmax ? "max" : "min", want));
    }
  }
}

RC_GTEST_PROP(Nonlinear, AllReduceTiesSplitGradientEvenly, ()) { check_ties(Coll::AllReduce); }
RC_GTEST_PROP(Nonlinear, ReduceTiesSplitGradientEvenly, ()) { check_ties(Coll::Reduce); }

}  // namespace
}  // namespace diffcomm::prop
