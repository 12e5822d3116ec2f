// Property 4: compositions of collectives.
//  - all_gather then reduce_scatter (list, single and _v forms, same splits)
//    is y = N x on every member, and backward through both gives dx = N g.
//  - all_to_all_single with splits M followed by all_to_all_single with the
//    splits swapped is the identity on data, and its gradient is the
//    identity too (both exact: pure data movement).
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <limits>

#include "diffcomm/nn/functional.hpp"
#include "support.hpp"

namespace diffcomm::prop {
namespace {

// Largest |a_i - k b_i| relative to 1 + |k b_i|; infinity on a size mismatch.
double scaled_error(const std::vector<double>& a, const std::vector<double>& b, double k) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double e = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    e = std::max(e, std::fabs(a[i] - k * b[i]) / (1 + std::fabs(k * b[i])));
  return e;
}

RC_GTEST_PROP(Composition, AllGatherThenReduceScatterIsNTimesIdentity, ()) {
  const WorldCase w = gen_world(1, 12);
  const int n = w.group_size();
  const Shape row_shape = gen_row_shape();
  const auto rows = *rc::gen::inRange<int64_t>(0, 4);
  const std::vector<int64_t> splits = gen_splits(n);
  const std::string what = fmt::format("{} row_shape={} rows={} splits=[{}]", describe(w),
                                       shape_text(row_shape), rows, fmt::join(splits, ","));
  RC_LOG() << what << "\n";

  const char* forms[] = {"all_gather -> reduce_scatter",
                         "all_gather_single -> reduce_scatter_single",
                         "all_gather_v -> reduce_scatter_v"};
  struct Seen {
    std::vector<double> x, y, g, dx;
  };
  const auto uw = static_cast<std::size_t>(w.world);
  std::vector<std::vector<Seen>> seen(uw, std::vector<Seen>(3));
  run_world(w, what, [&](sim::Rank& rk) {
    auto g = make_group(rk, w);
    if (!g) return;
    auto& mine = seen[static_cast<std::size_t>(rk.rank())];
    for (std::size_t f = 0; f < 3; ++f) {
      const int64_t r = f == 2 ? splits[static_cast<std::size_t>(g->rank())] : rows;
      Tensor x = draw_leaf(with_rows(r, row_shape), DType::Float64, rk.generator());
      Tensor y;
      if (f == 0) y = nn::reduce_scatter(nn::all_gather(x, *g), *g);
      if (f == 1) y = nn::reduce_scatter_single(nn::all_gather_single(x, *g), *g);
      if (f == 2) y = nn::reduce_scatter_v(nn::all_gather_v(x, splits, *g), splits, *g);
      Tensor cot = draw(y.shape(), DType::Float64, rk.generator());
      Tensor dx = diffcomm::grad({y}, {x}, {cot})[0];
      mine[f] = {x.to_vector(), y.to_vector(), cot.to_vector(), dx.to_vector()};
    }
  });
  for (std::size_t r = 0; r < uw; ++r) {
    if (local_rank_of(w, static_cast<int>(r)) < 0) continue;
    for (std::size_t f = 0; f < 3; ++f) {
      const Seen& s = seen[r][f];
      if (!(scaled_error(s.y, s.x, n) <= 1e-13))
        RC_FAIL(
            fmt::format("{}: {}: forward on global rank {} is not {} * x", what, forms[f], r, n));
      if (!(scaled_error(s.dx, s.g, n) <= 1e-13))
        RC_FAIL(fmt::format("{}: {}: gradient on global rank {} is not {} * cotangent", what,
                            forms[f], r, n));
    }
  }
}

RC_GTEST_PROP(Composition, AllToAllSingleThenSwappedSplitsIsIdentity, ()) {
  const WorldCase w = gen_world(1, 12);
  const int n = w.group_size();
  const Shape row_shape = gen_row_shape();
  const auto m = gen_split_matrix(n);
  std::string what = fmt::format("{} row_shape={}", describe(w), shape_text(row_shape));
  for (std::size_t i = 0; i < m.size(); ++i)
    what += fmt::format(" m[{}]=[{}]", i, fmt::join(m[i], ","));
  RC_LOG() << what << "\n";

  const auto uw = static_cast<std::size_t>(w.world);
  std::vector<std::vector<double>> x(uw), z(uw), g(uw), dx(uw);
  std::vector<Shape> mid_shape(uw);
  run_world(w, what, [&](sim::Rank& rk) {
    auto grp = make_group(rk, w);
    if (!grp) return;
    const auto me = static_cast<std::size_t>(grp->rank());
    const auto r = static_cast<std::size_t>(rk.rank());
    Tensor xt = draw_leaf(with_rows(total(m[me]), row_shape), DType::Float64, rk.generator());
    Tensor y = nn::all_to_all_single(xt, column(m, me), m[me], *grp);
    Tensor zt = nn::all_to_all_single(y, m[me], column(m, me), *grp);
    Tensor gt = draw(zt.shape(), DType::Float64, rk.generator());
    mid_shape[r] = y.shape();
    x[r] = xt.to_vector();
    z[r] = zt.to_vector();
    g[r] = gt.to_vector();
    dx[r] = diffcomm::grad({zt}, {xt}, {gt})[0].to_vector();
  });
  for (std::size_t r = 0; r < uw; ++r) {
    const int me = local_rank_of(w, static_cast<int>(r));
    if (me < 0) continue;
    const int64_t want_rows = total(column(m, static_cast<std::size_t>(me)));
    if (mid_shape[r] != with_rows(want_rows, row_shape))
      RC_FAIL(fmt::format("{}: global rank {}: intermediate shape {}, expected {}", what, r,
                          shape_text(mid_shape[r]), shape_text(with_rows(want_rows, row_shape))));
    if (z[r] != x[r])
      RC_FAIL(fmt::format("{}: global rank {}: round trip changed the data", what, r));
    if (dx[r] != g[r])
      RC_FAIL(fmt::format("{}: global rank {}: gradient of the round trip is not the cotangent",
                          what, r));
  }
}

}  // namespace
}  // namespace diffcomm::prop
