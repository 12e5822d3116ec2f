// Property 2: the Replicated gather convention. With GatherGrad::Replicated a
// rank's gradient is its own slice of its *own* output gradient — no
// communication, no sum over receivers — and, when every receiver computes
// the same loss on the gathered tensor (tensor-parallel replicas), that
// equals the single-rank reference gradient, while Partial (the adjoint)
// counts it once per receiver.
//
// The single-rank reference is plain autograd with no collectives: the
// members' inputs concatenated with diffcomm::cat, one loss, one grad().
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include "diffcomm/nn/functional.hpp"
#include "support.hpp"

namespace diffcomm::prop {
namespace {

enum class Gather { List, Single, V };

const char* gather_text(Gather k) {
  switch (k) {
    case Gather::List: return "all_gather";
    case Gather::Single: return "all_gather_single";
    case Gather::V: return "all_gather_v";
  }
  return "?";
}

struct Case {
  WorldCase w;
  Gather kind = Gather::Single;
  Shape row_shape;
  int64_t rows = 0;             // List, Single: rows of every member
  std::vector<int64_t> splits;  // V
  uint64_t data_seed = 0;       // replicated data, drawn outside the world too
};

std::string describe(const Case& c) {
  return fmt::format("{} {} row_shape={} rows={} splits=[{}] data_seed={}", gather_text(c.kind),
                     prop::describe(c.w), shape_text(c.row_shape), c.rows, fmt::join(c.splits, ","),
                     c.data_seed);
}

Case gen_case(Gather kind) {
  Case c;
  c.kind = kind;
  c.w = gen_world(1, 8);
  c.row_shape = gen_row_shape();
  c.rows = *rc::gen::inRange<int64_t>(0, 4);
  if (kind == Gather::V) c.splits = gen_splits(c.w.group_size());
  c.data_seed = *rc::gen::arbitrary<uint64_t>();
  return c;
}

int64_t rows_of(const Case& c, int member) {
  return c.kind == Gather::V ? c.splits[static_cast<std::size_t>(member)] : c.rows;
}

// Member m's input, the same inside and outside the world.
Tensor member_input(const Case& c, int member) {
  Generator gen(c.data_seed + 7919ull * static_cast<uint64_t>(member + 1));
  return rand_normal(with_rows(rows_of(c, member), c.row_shape), gen, 0.0, 1.0, DType::Float64);
}

// Fixed weights of the replicated loss L(Y) = <Y * Y, W> (nonlinear, so the
// cotangent depends on every member's data).
Tensor loss_weights(const Case& c, const Shape& gathered) {
  Generator gen(c.data_seed ^ 0xA5A5A5A5ull);
  return rand_normal(gathered, gen, 0.0, 1.0, DType::Float64);
}

// Row-concatenated gather output with the autograd graph kept.
Tensor gathered(Gather kind, const Tensor& x, const Case& c, const dist::ProcessGroup& g,
                nn::GatherGrad mode) {
  switch (kind) {
    case Gather::List: {
      // Give the list form rows (a leading dim) so the outputs concatenate.
      return cat(nn::all_gather(x, g, mode));
    }
    case Gather::Single: return nn::all_gather_single(x, g, mode);
    case Gather::V: return nn::all_gather_v(x, c.splits, g, mode);
  }
  return {};
}

bool same(const std::vector<double>& a, const std::vector<double>& b, double tol) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!(std::fabs(a[i] - b[i]) <= tol * (1 + std::fabs(b[i])))) return false;
  return true;
}

std::string values(const std::vector<double>& v) { return fmt::format("[{}]", fmt::join(v, ", ")); }

// (a) Per-rank *different* cotangents: Replicated gives exactly this rank's
// rows of its own cotangent (compared element by element, exact).
void check_own_slice(Gather kind) {
  const Case c = gen_case(kind);
  const std::string what = describe(c) + " [own slice of own cotangent]";
  RC_LOG() << what << "\n";
  const auto w = static_cast<std::size_t>(c.w.world);
  std::vector<std::vector<double>> got(w), want(w);
  std::vector<bool> member(w, false);
  run_world(c.w, what, [&](sim::Rank& rk) {
    auto g = make_group(rk, c.w);
    if (!g) return;
    const auto r = static_cast<std::size_t>(rk.rank());
    member[r] = true;
    Tensor x = member_input(c, g->rank());
    x.set_requires_grad(true);
    Tensor y = gathered(kind, x, c, *g, nn::GatherGrad::Replicated);
    Tensor cot = draw(y.shape(), DType::Float64, rk.generator());
    got[r] = diffcomm::grad({y}, {x}, {cot})[0].to_vector();
    // Independent expectation: rows [offset, offset + rows) of cot.
    int64_t offset = 0;
    for (int s = 0; s < g->rank(); ++s) offset += rows_of(c, s);
    const int64_t row = shape_numel(c.row_shape);
    const std::vector<double> all = cot.to_vector();
    want[r].assign(all.begin() + offset * row,
                   all.begin() + (offset + rows_of(c, g->rank())) * row);
  });
  for (std::size_t r = 0; r < w; ++r)
    if (member[r] && got[r] != want[r])
      RC_FAIL(fmt::format("{}: global rank {}: Replicated gradient {} != own slice {}", what, r,
                          values(got[r]), values(want[r])));
}

// (b) Replicated loss on every receiver: Replicated == single-rank
// reference, Partial == group size x reference.
void check_reference(Gather kind) {
  const Case c = gen_case(kind);
  const std::string what = describe(c) + " [replicated loss vs single-rank reference]";
  RC_LOG() << what << "\n";
  const int n = c.w.group_size();

  // Single-rank reference: no collectives at all.
  std::vector<Tensor> xs;
  for (int m = 0; m < n; ++m) {
    xs.push_back(member_input(c, m));
    xs.back().set_requires_grad(true);
  }
  Tensor all = cat(xs);
  Tensor weights = loss_weights(c, all.shape());
  Tensor loss = dot(mul(all, all), weights);
  std::vector<Tensor> ref = diffcomm::grad({loss}, xs);

  const auto w = static_cast<std::size_t>(c.w.world);
  std::vector<std::vector<double>> replicated(w), partial(w);
  std::vector<int> local(w, -1);
  run_world(c.w, what, [&](sim::Rank& rk) {
    auto g = make_group(rk, c.w);
    if (!g) return;
    const auto r = static_cast<std::size_t>(rk.rank());
    local[r] = g->rank();
    for (auto mode : {nn::GatherGrad::Replicated, nn::GatherGrad::Partial}) {
      Tensor x = member_input(c, g->rank());
      x.set_requires_grad(true);
      Tensor y = gathered(kind, x, c, *g, mode);
      Tensor l = dot(mul(y, y), loss_weights(c, y.shape()));
      (mode == nn::GatherGrad::Replicated ? replicated : partial)[r] =
          diffcomm::grad({l}, {x})[0].to_vector();
    }
  });
  for (std::size_t r = 0; r < w; ++r) {
    if (local[r] < 0) continue;
    const std::vector<double> want = ref[static_cast<std::size_t>(local[r])].to_vector();
    std::vector<double> want_n = want;
    for (auto& v : want_n) v *= n;
    if (!same(replicated[r], want, 1e-12))
      RC_FAIL(
          fmt::format("{}: global rank {} (member {}): Replicated gradient {} != single-rank "
                      "reference {}",
                      what, r, local[r], values(replicated[r]), values(want)));
    if (!same(partial[r], want_n, 1e-12))
      RC_FAIL(
          fmt::format("{}: global rank {} (member {}): Partial gradient {} != {} x reference {}",
                      what, r, local[r], values(partial[r]), n, values(want_n)));
  }
}

RC_GTEST_PROP(Replicated, AllGatherSingleOwnSlice, ()) { check_own_slice(Gather::Single); }
RC_GTEST_PROP(Replicated, AllGatherSingleMatchesSingleRankReference, ()) {
  check_reference(Gather::Single);
}
RC_GTEST_PROP(Replicated, AllGatherOwnSlice, ()) { check_own_slice(Gather::List); }
RC_GTEST_PROP(Replicated, AllGatherMatchesSingleRankReference, ()) {
  check_reference(Gather::List);
}
RC_GTEST_PROP(Replicated, AllGatherVOwnSlice, ()) { check_own_slice(Gather::V); }
RC_GTEST_PROP(Replicated, AllGatherVMatchesSingleRankReference, ()) { check_reference(Gather::V); }

}  // namespace
}  // namespace diffcomm::prop
