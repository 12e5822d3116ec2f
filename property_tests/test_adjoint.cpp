// Property 1: every linear differentiable collective's backward is the exact
// adjoint of its forward. For a random world (1..12 ranks), a random
// sub-group in random order that does not start at global rank 0, random
// shapes (zero rows and zero-size dims included), random roots and splits
// (zeros included), and data and cotangents that differ per rank (each rank
// draws from its own Generator):
//
//     sum over ranks r of <A(x)_r, y_r>  ==  sum over ranks r of <x_r, A^T(y)_r>
//
// where A^T(y) is what diffcomm::grad returns for the cotangents y. The inner
// products are plain double loops over to_vector(), recorded per rank and
// summed here, outside the world (not with diffcomm's own all_reduce).
//
// Tolerances. Let S = sum over ranks and elements of |a_i * b_i| on each side
// (the size rounding errors scale with; a relative test against the result
// itself is meaningless when it cancels to ~0).
//  - float64, normal data: |L - R| <= 1e-12 * max(S_L, S_R). Sums of <= 12
//    terms in double lose ~12 * 2^-53 ~ 1e-15 relative, so 1e-12 leaves
//    margin while any wrong factor, slice or route is O(1).
//  - float32 / bfloat16, integer data in [-4, 4]: every value, every sum over
//    <= 12 ranks (|sum| <= 48 < 2^8; canonical_all_reduce's <= 3 chunks per
//    rank: <= 144 < 2^8) and every product in the double inner
//    product is exact, so Sum and data-movement ops must match *exactly*.
//    Avg divides by N and rounds once in forward and once in backward (plus
//    possibly once more if 1/N is formed first): |L - R| <= 4u * (S_L + S_R)
//    with the unit roundoff u = 2^-24 (float32) or 2^-8 (bfloat16, 8
//    significand bits).
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <numeric>

#include "diffcomm/nn/canonical_all_reduce.hpp"
#include "diffcomm/nn/functional.hpp"
#include "support.hpp"

namespace diffcomm::prop {
namespace {

enum class Op {
  AllReduceSum,
  AllReduceAvg,
  Broadcast,
  ReduceSum,
  ReduceAvg,
  AllGather,
  AllGatherSingle,
  AllGatherV,
  Gather,
  Scatter,
  ReduceScatterSum,
  ReduceScatterAvg,
  ReduceScatterSingleSum,
  ReduceScatterSingleAvg,
  ReduceScatterVSum,
  ReduceScatterVAvg,
  AllToAll,
  AllToAllSingle,
  AllReducePremulSum,
  ReducePremulSum,
  ReduceScatterPremulSum,
  ReduceScatterSinglePremulSum,
  ReduceScatterVPremulSum,
  CanonicalAllReduceSum,
  CanonicalAllReduceAvg,
  CanonicalAllReduceV,
  CanonicalReduceScatter,
};

const char* op_text(Op op) {
  switch (op) {
    case Op::AllReduceSum: return "all_reduce(sum)";
    case Op::AllReduceAvg: return "all_reduce(avg)";
    case Op::Broadcast: return "broadcast";
    case Op::ReduceSum: return "reduce(sum)";
    case Op::ReduceAvg: return "reduce(avg)";
    case Op::AllGather: return "all_gather(partial)";
    case Op::AllGatherSingle: return "all_gather_single(partial)";
    case Op::AllGatherV: return "all_gather_v(partial)";
    case Op::Gather: return "gather";
    case Op::Scatter: return "scatter";
    case Op::ReduceScatterSum: return "reduce_scatter(sum)";
    case Op::ReduceScatterAvg: return "reduce_scatter(avg)";
    case Op::ReduceScatterSingleSum: return "reduce_scatter_single(sum)";
    case Op::ReduceScatterSingleAvg: return "reduce_scatter_single(avg)";
    case Op::ReduceScatterVSum: return "reduce_scatter_v(sum)";
    case Op::ReduceScatterVAvg: return "reduce_scatter_v(avg)";
    case Op::AllToAll: return "all_to_all";
    case Op::AllToAllSingle: return "all_to_all_single";
    case Op::AllReducePremulSum: return "all_reduce(premul_sum(-0.375))";
    case Op::ReducePremulSum: return "reduce(premul_sum(-0.375))";
    case Op::ReduceScatterPremulSum: return "reduce_scatter(premul_sum(-0.375))";
    case Op::ReduceScatterSinglePremulSum: return "reduce_scatter_single(premul_sum(-0.375))";
    case Op::ReduceScatterVPremulSum: return "reduce_scatter_v(premul_sum(-0.375))";
    case Op::CanonicalAllReduceSum: return "canonical_all_reduce(sum)";
    case Op::CanonicalAllReduceAvg: return "canonical_all_reduce(avg)";
    case Op::CanonicalAllReduceV: return "canonical_all_reduce_v(sum)";
    case Op::CanonicalReduceScatter: return "canonical_reduce_scatter";
  }
  return "?";
}

bool averages(Op op) {
  return op == Op::AllReduceAvg || op == Op::ReduceAvg || op == Op::ReduceScatterAvg ||
         op == Op::ReduceScatterSingleAvg || op == Op::ReduceScatterVAvg ||
         op == Op::CanonicalAllReduceAvg;
}

bool premul(Op op) {
  return op == Op::AllReducePremulSum || op == Op::ReducePremulSum ||
         op == Op::ReduceScatterPremulSum || op == Op::ReduceScatterSinglePremulSum ||
         op == Op::ReduceScatterVPremulSum;
}

// PremulSum's factor: negative and not a power of two, so a missing or
// inverted scale in the adjoint shows.
constexpr double kFactor = -0.375;

ReduceOp reduce_op(Op op) {
  if (premul(op)) return ReduceOp::premul_sum(kFactor);
  return averages(op) ? ReduceOp::Avg : ReduceOp::Sum;
}

// The global facts of one case; only the fields the op uses are drawn.
struct Case {
  WorldCase w;
  int root = 0;
  Shape shape;      // any-shape ops
  Shape row_shape;  // row ops: trailing dims
  int64_t rows = 0;
  std::vector<int64_t> splits;               // _v ops
  std::vector<std::vector<int64_t>> matrix;  // all-to-alls
};

std::string describe(Op op, DType dt, const Case& c) {
  std::string s = fmt::format("{} {} {}", op_text(op), dtype_name(dt), prop::describe(c.w));
  switch (op) {
    case Op::Broadcast:
    case Op::ReduceSum:
    case Op::ReduceAvg:
    case Op::Gather:
    case Op::Scatter: s += fmt::format(" root={}", c.root); break;
    default: break;
  }
  s += fmt::format(" shape={} row_shape={} rows={}", shape_text(c.shape), shape_text(c.row_shape),
                   c.rows);
  if (!c.splits.empty()) s += fmt::format(" splits=[{}]", fmt::join(c.splits, ","));
  for (std::size_t i = 0; i < c.matrix.size(); ++i)
    s += fmt::format(" m[{}]=[{}]", i, fmt::join(c.matrix[i], ","));
  return s;
}

Case gen_case(Op op) {
  Case c;
  c.w = gen_world(1, 12);
  const int n = c.w.group_size();
  switch (op) {
    case Op::AllReduceSum:
    case Op::AllReduceAvg:
    case Op::AllReducePremulSum:
    case Op::AllGather:
    case Op::ReduceScatterSum:
    case Op::ReduceScatterAvg:
    case Op::ReduceScatterPremulSum: c.shape = gen_any_shape(); break;
    case Op::Broadcast:
    case Op::ReduceSum:
    case Op::ReduceAvg:
    case Op::ReducePremulSum:
    case Op::Gather:
    case Op::Scatter:
      c.shape = gen_any_shape();
      c.root = *rc::gen::inRange(0, n);
      break;
    case Op::AllGatherSingle:
    case Op::ReduceScatterSingleSum:
    case Op::ReduceScatterSingleAvg:
    case Op::ReduceScatterSinglePremulSum:
      c.row_shape = gen_row_shape();
      c.rows = *rc::gen::inRange<int64_t>(0, 4);
      break;
    case Op::AllGatherV:
    case Op::ReduceScatterVSum:
    case Op::ReduceScatterVAvg:
    case Op::ReduceScatterVPremulSum:
      c.row_shape = gen_row_shape();
      c.splits = gen_splits(n);
      break;
    case Op::AllToAll:
    case Op::AllToAllSingle:
      c.row_shape = gen_row_shape();
      c.matrix = gen_split_matrix(n);
      break;
    case Op::CanonicalAllReduceSum:
    case Op::CanonicalAllReduceAvg:  // rows: chunks per rank (at least one)
      c.row_shape = gen_row_shape();
      c.rows = *rc::gen::inRange<int64_t>(1, 4);
      break;
    case Op::CanonicalAllReduceV: {  // splits: chunks per member; matrix[m]: member m's ids
      c.row_shape = gen_row_shape();
      c.splits = gen_splits(n);
      std::vector<int64_t> ids(static_cast<std::size_t>(total(c.splits)));
      std::iota(ids.begin(), ids.end(), int64_t{0});
      const auto keys =
          *rc::gen::container<std::vector<int>>(ids.size(), rc::gen::arbitrary<int>());
      std::stable_sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) {
        return keys[static_cast<std::size_t>(a)] < keys[static_cast<std::size_t>(b)];
      });
      std::size_t at = 0;
      for (int64_t k : c.splits) {
        c.matrix.emplace_back(
            ids.begin() + static_cast<std::ptrdiff_t>(at),
            ids.begin() + static_cast<std::ptrdiff_t>(at + static_cast<std::size_t>(k)));
        at += static_cast<std::size_t>(k);
      }
      break;
    }
    case Op::CanonicalReduceScatter:  // shape: [k chunks, rows per member, ...]
      c.row_shape = gen_row_shape();
      c.rows = *rc::gen::inRange<int64_t>(1, 4);
      c.shape = {*rc::gen::inRange<int64_t>(1, 4)};
      break;
  }
  return c;
}

struct Applied {
  std::vector<Tensor> inputs;   // leaves
  std::vector<Tensor> outputs;  // A(x) on this rank
};

Applied apply(Op op, const Case& c, const dist::ProcessGroup& g, DType dt, Generator& gen) {
  const int n = g.size();
  const auto me = static_cast<std::size_t>(g.rank());
  Applied a;
  auto leaves = [&](const Shape& s, int count) {
    for (int i = 0; i < count; ++i) a.inputs.push_back(draw_leaf(s, dt, gen));
  };
  switch (op) {
    case Op::AllReduceSum:
    case Op::AllReduceAvg:
    case Op::AllReducePremulSum:
      leaves(c.shape, 1);
      a.outputs = {nn::all_reduce(a.inputs[0], g, reduce_op(op))};
      break;
    case Op::Broadcast:
      leaves(c.shape, 1);
      a.outputs = {nn::broadcast(a.inputs[0], c.root, g)};
      break;
    case Op::ReduceSum:
    case Op::ReduceAvg:
    case Op::ReducePremulSum:
      leaves(c.shape, 1);
      a.outputs = {nn::reduce(a.inputs[0], c.root, g, reduce_op(op))};
      break;
    case Op::AllGather:
      leaves(c.shape, 1);
      a.outputs = nn::all_gather(a.inputs[0], g);
      break;
    case Op::AllGatherSingle:
      leaves(with_rows(c.rows, c.row_shape), 1);
      a.outputs = {nn::all_gather_single(a.inputs[0], g)};
      break;
    case Op::AllGatherV:
      leaves(with_rows(c.splits[me], c.row_shape), 1);
      a.outputs = {nn::all_gather_v(a.inputs[0], c.splits, g)};
      break;
    case Op::Gather:
      leaves(c.shape, 1);
      a.outputs = nn::gather(a.inputs[0], c.root, g);
      break;
    case Op::Scatter:
      leaves(c.shape, n);
      a.outputs = {nn::scatter(a.inputs, c.root, g)};
      break;
    case Op::ReduceScatterSum:
    case Op::ReduceScatterAvg:
    case Op::ReduceScatterPremulSum:
      leaves(c.shape, n);
      a.outputs = {nn::reduce_scatter(a.inputs, g, reduce_op(op))};
      break;
    case Op::ReduceScatterSingleSum:
    case Op::ReduceScatterSingleAvg:
    case Op::ReduceScatterSinglePremulSum:
      leaves(with_rows(n * c.rows, c.row_shape), 1);
      a.outputs = {nn::reduce_scatter_single(a.inputs[0], g, reduce_op(op))};
      break;
    case Op::ReduceScatterVSum:
    case Op::ReduceScatterVAvg:
    case Op::ReduceScatterVPremulSum:
      leaves(with_rows(total(c.splits), c.row_shape), 1);
      a.outputs = {nn::reduce_scatter_v(a.inputs[0], c.splits, g, reduce_op(op))};
      break;
    case Op::AllToAll: {
      std::vector<Shape> out_shapes;
      for (std::size_t s = 0; s < static_cast<std::size_t>(n); ++s) {
        a.inputs.push_back(draw_leaf(with_rows(c.matrix[me][s], c.row_shape), dt, gen));
        out_shapes.push_back(with_rows(c.matrix[s][me], c.row_shape));
      }
      a.outputs = nn::all_to_all(a.inputs, g, out_shapes);
      break;
    }
    case Op::AllToAllSingle:
      leaves(with_rows(total(c.matrix[me]), c.row_shape), 1);
      a.outputs = {nn::all_to_all_single(a.inputs[0], column(c.matrix, me), c.matrix[me], g)};
      break;
    case Op::CanonicalAllReduceSum:
    case Op::CanonicalAllReduceAvg:
      leaves(with_rows(c.rows, c.row_shape), 1);
      a.outputs = {nn::canonical_all_reduce(a.inputs[0], g, reduce_op(op))};
      break;
    case Op::CanonicalAllReduceV:
      leaves(with_rows(c.splits[me], c.row_shape), 1);
      a.outputs = {nn::canonical_all_reduce_v(a.inputs[0], c.matrix, g)};
      break;
    case Op::CanonicalReduceScatter: {
      Shape s{c.shape[0], n * c.rows};
      s.insert(s.end(), c.row_shape.begin(), c.row_shape.end());
      leaves(s, 1);
      a.outputs = {nn::canonical_reduce_scatter(a.inputs[0], g)};
      break;
    }
  }
  return a;
}

double unit_roundoff(DType dt) {
  switch (dt) {
    case DType::Float32: return std::ldexp(1.0, -24);
    case DType::BFloat16: return std::ldexp(1.0, -8);
    default: return std::ldexp(1.0, -53);
  }
}

void check_adjoint(Op op, DType dt) {
  const Case c = gen_case(op);
  const std::string what = describe(op, dt, c);
  RC_LOG() << what << "\n";

  const auto w = static_cast<std::size_t>(c.w.world);
  std::vector<Inner> lhs(w), rhs(w);
  std::vector<std::string> problems(w);
  run_world(c.w, what, [&](sim::Rank& rk) {
    auto g = make_group(rk, c.w);
    if (!g) return;
    Applied a = apply(op, c, *g, dt, rk.generator());
    std::vector<Tensor> cots;
    for (const auto& y : a.outputs) cots.push_back(draw(y.shape(), dt, rk.generator()));
    std::vector<Tensor> grads = diffcomm::grad(a.outputs, a.inputs, cots);
    const auto r = static_cast<std::size_t>(rk.rank());
    if (grads.size() != a.inputs.size()) {
      problems[r] =
          fmt::format("grad returned {} tensors for {} inputs", grads.size(), a.inputs.size());
      return;
    }
    for (std::size_t i = 0; i < grads.size(); ++i)
      if (!grads[i].defined() || grads[i].shape() != a.inputs[i].shape() ||
          grads[i].dtype() != a.inputs[i].dtype()) {
        problems[r] =
            fmt::format("gradient {} is {}, input is {}", i,
                        grads[i].defined() ? grads[i].str() : "undefined", a.inputs[i].str());
        return;
      }
    lhs[r] = inner(a.outputs, cots);
    rhs[r] = inner(a.inputs, grads);
  });
  for (std::size_t r = 0; r < w; ++r)
    if (!problems[r].empty()) RC_FAIL(fmt::format("{}: global rank {}: {}", what, r, problems[r]));

  double L = 0, R = 0, SL = 0, SR = 0;
  for (std::size_t r = 0; r < w; ++r) {
    L += lhs[r].value;
    R += rhs[r].value;
    SL += lhs[r].scale;
    SR += rhs[r].scale;
  }
  double tol = 0;
  if (dt == DType::Float64)
    tol = 1e-12 * std::max(SL, SR);
  else if (averages(op) || premul(op))
    tol = 4 * unit_roundoff(dt) * (SL + SR);
  if (!(std::fabs(L - R) <= tol)) {
    std::string per_rank;
    for (std::size_t r = 0; r < w; ++r)
      per_rank += fmt::format(" r{}:<Ax,y>={:.17g},<x,ATy>={:.17g}", r, lhs[r].value, rhs[r].value);
    RC_FAIL(
        fmt::format("{}: sum <A x, y> = {:.17g} but sum <x, A^T y> = {:.17g} (|diff| {:.3g} > "
                    "tol {:.3g});{}",
                    what, L, R, std::fabs(L - R), tol, per_rank));
  }
}

#define DIFFCOMM_ADJOINT_PROPS(Name, OP)                                                \
  RC_GTEST_PROP(Adjoint, Name##_float64, ()) { check_adjoint(Op::OP, DType::Float64); } \
  RC_GTEST_PROP(Adjoint, Name##_float32, ()) { check_adjoint(Op::OP, DType::Float32); } \
  RC_GTEST_PROP(Adjoint, Name##_bfloat16, ()) { check_adjoint(Op::OP, DType::BFloat16); }

DIFFCOMM_ADJOINT_PROPS(AllReduceSum, AllReduceSum)
DIFFCOMM_ADJOINT_PROPS(AllReduceAvg, AllReduceAvg)
DIFFCOMM_ADJOINT_PROPS(Broadcast, Broadcast)
DIFFCOMM_ADJOINT_PROPS(ReduceSum, ReduceSum)
DIFFCOMM_ADJOINT_PROPS(ReduceAvg, ReduceAvg)
DIFFCOMM_ADJOINT_PROPS(AllGatherPartial, AllGather)
DIFFCOMM_ADJOINT_PROPS(AllGatherSingle, AllGatherSingle)
DIFFCOMM_ADJOINT_PROPS(AllGatherV, AllGatherV)
DIFFCOMM_ADJOINT_PROPS(Gather, Gather)
DIFFCOMM_ADJOINT_PROPS(Scatter, Scatter)
DIFFCOMM_ADJOINT_PROPS(ReduceScatterSum, ReduceScatterSum)
DIFFCOMM_ADJOINT_PROPS(ReduceScatterAvg, ReduceScatterAvg)
DIFFCOMM_ADJOINT_PROPS(ReduceScatterSingleSum, ReduceScatterSingleSum)
DIFFCOMM_ADJOINT_PROPS(ReduceScatterSingleAvg, ReduceScatterSingleAvg)
DIFFCOMM_ADJOINT_PROPS(ReduceScatterVSum, ReduceScatterVSum)
DIFFCOMM_ADJOINT_PROPS(ReduceScatterVAvg, ReduceScatterVAvg)
DIFFCOMM_ADJOINT_PROPS(AllToAll, AllToAll)
DIFFCOMM_ADJOINT_PROPS(AllToAllSingle, AllToAllSingle)
DIFFCOMM_ADJOINT_PROPS(AllReducePremulSum, AllReducePremulSum)
DIFFCOMM_ADJOINT_PROPS(ReducePremulSum, ReducePremulSum)
DIFFCOMM_ADJOINT_PROPS(ReduceScatterPremulSum, ReduceScatterPremulSum)
DIFFCOMM_ADJOINT_PROPS(ReduceScatterSinglePremulSum, ReduceScatterSinglePremulSum)
DIFFCOMM_ADJOINT_PROPS(ReduceScatterVPremulSum, ReduceScatterVPremulSum)
DIFFCOMM_ADJOINT_PROPS(CanonicalAllReduceSum, CanonicalAllReduceSum)
DIFFCOMM_ADJOINT_PROPS(CanonicalAllReduceAvg, CanonicalAllReduceAvg)
DIFFCOMM_ADJOINT_PROPS(CanonicalAllReduceV, CanonicalAllReduceV)
DIFFCOMM_ADJOINT_PROPS(CanonicalReduceScatter, CanonicalReduceScatter)

}  // namespace
}  // namespace diffcomm::prop
