// canonical_all_reduce gives the bits of one rank, whatever the group size.
//
// For a random C = k * size() chunks of a random trailing shape (elements per
// chunk from 0 to 40, so slices of ceil(N / size()) are uneven, empty or
// padded), data whose exponents spread over 2^-20..2^20 (so the order of the
// additions shows in the bits), every member of a random sub-group of a random
// world holds its k chunks. Every member's result must be, bit for bit:
//  - the independent reference: the canonical tree written here per element
//    on plain C++ floats/doubles (float32, float64);
//  - canonical_sum of all C chunks on one rank (every dtype, bfloat16 too).
// The property also runs the same C chunks on a second group size dividing
// C, and the two results must have the same bits.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/nn/canonical_all_reduce.hpp"
#include "diffcomm/nn/canonical_linear.hpp"
#include "support.hpp"

namespace diffcomm::prop {
namespace {

// The canonical tree on plain values: with m values left, value i becomes
// v[i] + v[i + m/2] for i < m/2, the odd one out is kept last.
template <class T>
T reference_tree(std::vector<T> v) {
  while (v.size() > 1) {
    const std::size_t m = v.size(), h = m / 2;
    std::vector<T> next;
    for (std::size_t i = 0; i < h; ++i) next.push_back(static_cast<T>(v[i] + v[i + h]));
    if (m % 2 == 1) next.push_back(v[m - 1]);
    v = std::move(next);
  }
  return v[0];
}

template <class T>
std::vector<uint8_t> reference_bytes(const std::vector<double>& global, int64_t C, int64_t n,
                                     bool avg) {
  std::vector<uint8_t> out(static_cast<std::size_t>(n) * sizeof(T));
  for (int64_t e = 0; e < n; ++e) {
    std::vector<T> v;
    for (int64_t c = 0; c < C; ++c) v.push_back(static_cast<T>(global[c * n + e]));
    T r = reference_tree(v);
    if (avg) r = static_cast<T>(r * static_cast<T>(1.0 / static_cast<double>(C)));
    std::memcpy(out.data() + e * sizeof(T), &r, sizeof(T));
  }
  return out;
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const Tensor c = t.to(Device::cpu());
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  return {p, p + c.nbytes()};
}

// Values with exponents spread over 2^-20..2^20 and both signs.
std::vector<double> spread_values(std::size_t count, Generator& gen) {
  std::vector<double> v(count);
  for (auto& e : v) {
    const double mant = 1.0 + static_cast<double>(gen.next_u64() % 1000003) / 1000003.0;
    const int exp = static_cast<int>(gen.next_u64() % 41) - 20;
    e = std::ldexp(gen.next_u64() % 2 ? mant : -mant, exp);
  }
  return v;
}

// Every member's result bytes (empty for non-members) on a world of `c`.
std::vector<std::vector<uint8_t>> run_canonical(const WorldCase& c, const Tensor& global, int64_t k,
                                                ReduceOp op, const std::string& what) {
  std::vector<std::vector<uint8_t>> got(static_cast<std::size_t>(c.world));
  run_world(c, what, [&](sim::Rank& rk) {
    auto g = make_group(rk, c);
    if (!g) return;
    Tensor mine = global.row_view(g->rank() * k, k).copy_data();
    got[static_cast<std::size_t>(rk.rank())] = bytes_of(nn::canonical_all_reduce(mine, *g, op));
  });
  return got;
}

void check_bits(DType dt, bool avg) {
  const WorldCase c = gen_world(1, 8);
  const int n_members = c.group_size();
  const auto k = *rc::gen::inRange<int64_t>(1, 4);
  const int64_t C = k * n_members;
  Shape shape{C};
  if (*rc::gen::inRange(0, 2) == 0) {
    shape.push_back(*rc::gen::inRange<int64_t>(0, 41));
  } else {
    const Shape row = gen_row_shape();
    shape.insert(shape.end(), row.begin(), row.end());
  }
  const ReduceOp op = avg ? ReduceOp::Avg : ReduceOp::Sum;
  const std::string what =
      fmt::format("canonical_all_reduce({}) {} {} k={} shape={}", avg ? "avg" : "sum",
                  dtype_name(dt), describe(c), k, shape_text(shape));
  RC_LOG() << what << "\n";

  Generator gen(c.seed ^ 0x9e3779b97f4a7c15ULL);
  const std::vector<double> values =
      spread_values(static_cast<std::size_t>(shape_numel(shape)), gen);
  const Tensor global = from_vector(values, shape, dt);
  const std::vector<double> rounded = global.to_vector();  // the values in dt
  const int64_t n = global.row_numel();

  const std::vector<uint8_t> one_rank =
      bytes_of(avg ? scale(nn::canonical_sum(global), 1.0 / static_cast<double>(C))
                   : nn::canonical_sum(global));
  std::vector<uint8_t> independent;
  if (dt == DType::Float64) independent = reference_bytes<double>(rounded, C, n, avg);
  if (dt == DType::Float32) independent = reference_bytes<float>(rounded, C, n, avg);
  if (!independent.empty() && independent != one_rank)
    RC_FAIL(fmt::format("{}: canonical_sum differs from the per-element reference tree", what));

  const auto got = run_canonical(c, global, k, op, what);
  for (int m : c.members)
    if (got[static_cast<std::size_t>(m)] != one_rank)
      RC_FAIL(fmt::format("{}: global rank {}: result bits differ from one rank's", what, m));

  // The same C chunks on another group size that divides C.
  std::vector<int> sizes;
  for (int w = 1; w <= 8; ++w)
    if (C % w == 0 && w != n_members) sizes.push_back(w);
  if (sizes.empty()) return;
  const int w2 = *rc::gen::elementOf(sizes);
  WorldCase c2{w2, c.seed + 1, {}};
  for (int r = w2 - 1; r >= 0; --r) c2.members.push_back(r);  // reversed: group rank != global
  const auto got2 = run_canonical(c2, global, C / w2, op, what + fmt::format(" (on {} ranks)", w2));
  for (int m : c2.members)
    if (got2[static_cast<std::size_t>(m)] != one_rank)
      RC_FAIL(fmt::format("{}: on {} ranks, global rank {}: bits differ", what, w2, m));
}

RC_GTEST_PROP(Canonical, BitsOfOneRank_float64, ()) { check_bits(DType::Float64, false); }
RC_GTEST_PROP(Canonical, BitsOfOneRank_float32, ()) { check_bits(DType::Float32, false); }
RC_GTEST_PROP(Canonical, BitsOfOneRank_bfloat16, ()) { check_bits(DType::BFloat16, false); }
RC_GTEST_PROP(Canonical, AvgBitsOfOneRank_float64, ()) { check_bits(DType::Float64, true); }
RC_GTEST_PROP(Canonical, AvgBitsOfOneRank_float32, ()) { check_bits(DType::Float32, true); }

// canonical_all_reduce_v: C chunks (0 included) dealt to the members in a
// random order and random counts; every member gets canonical_sum's bits of
// the chunks in id order.
void check_v_bits(DType dt) {
  const WorldCase c = gen_world(1, 8);
  const int n_members = c.group_size();
  const std::vector<int64_t> counts = gen_splits(n_members, 3);
  const int64_t C = total(counts);
  const auto n = *rc::gen::inRange<int64_t>(0, 41);
  std::vector<int64_t> order(static_cast<std::size_t>(C));
  std::iota(order.begin(), order.end(), int64_t{0});
  const auto keys = *rc::gen::container<std::vector<int>>(order.size(), rc::gen::arbitrary<int>());
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return keys[static_cast<std::size_t>(a)] < keys[static_cast<std::size_t>(b)];
  });
  nn::ChunkIds ids;
  std::size_t at = 0;
  for (int64_t k : counts) {
    ids.emplace_back(order.begin() + static_cast<std::ptrdiff_t>(at),
                     order.begin() + static_cast<std::ptrdiff_t>(at + static_cast<std::size_t>(k)));
    at += static_cast<std::size_t>(k);
  }
  const std::string what = fmt::format("canonical_all_reduce_v {} {} counts={} n={}",
                                       dtype_name(dt), describe(c), fmt::join(counts, ","), n);
  RC_LOG() << what << "\n";
  Generator gen(c.seed ^ 0x51ed27c3ULL);
  const Tensor global =
      from_vector(spread_values(static_cast<std::size_t>(C * n), gen), {C, n}, dt);
  const std::vector<uint8_t> one_rank =
      C == 0 ? bytes_of(zeros({n}, dt)) : bytes_of(nn::canonical_sum(global));
  if (dt == DType::Float64 && C > 0 &&
      reference_bytes<double>(global.to_vector(), C, n, false) != one_rank)
    RC_FAIL(fmt::format("{}: canonical_sum differs from the per-element reference tree", what));
  std::vector<std::vector<uint8_t>> got(static_cast<std::size_t>(c.world));
  run_world(c, what, [&](sim::Rank& rk) {
    auto g = make_group(rk, c);
    if (!g) return;
    const auto& mine = ids[static_cast<std::size_t>(g->rank())];
    Tensor chunks = empty({static_cast<int64_t>(mine.size()), n}, dt);
    for (std::size_t j = 0; j < mine.size(); ++j)
      chunks.row_view(static_cast<int64_t>(j), 1).copy_(global.row_view(mine[j], 1));
    got[static_cast<std::size_t>(rk.rank())] =
        bytes_of(nn::canonical_all_reduce_v(chunks, ids, *g));
  });
  for (int m : c.members)
    if (got[static_cast<std::size_t>(m)] != one_rank)
      RC_FAIL(fmt::format("{}: global rank {}: bits differ from one rank's", what, m));
}

RC_GTEST_PROP(Canonical, VBitsOfOneRank_float64, ()) { check_v_bits(DType::Float64); }
RC_GTEST_PROP(Canonical, VBitsOfOneRank_bfloat16, ()) { check_v_bits(DType::BFloat16); }

// canonical_reduce_scatter: member m's rows of canonical_sum, bit for bit.
void check_reduce_scatter_bits(DType dt) {
  const WorldCase c = gen_world(1, 8);
  const int N = c.group_size();
  const auto k = *rc::gen::inRange<int64_t>(1, 4);
  const auto R = *rc::gen::inRange<int64_t>(0, 4);
  const auto width = *rc::gen::inRange<int64_t>(1, 6);
  const int64_t C = k * N;
  const std::string what = fmt::format("canonical_reduce_scatter {} {} k={} R={} width={}",
                                       dtype_name(dt), describe(c), k, R, width);
  RC_LOG() << what << "\n";
  Generator gen(c.seed ^ 0x2545f491ULL);
  const Tensor global = from_vector(spread_values(static_cast<std::size_t>(C * N * R * width), gen),
                                    {C, N * R, width}, dt);
  const Tensor sum = nn::canonical_sum(global);  // [N * R, width]
  std::vector<std::vector<uint8_t>> got(static_cast<std::size_t>(c.world));
  run_world(c, what, [&](sim::Rank& rk) {
    auto g = make_group(rk, c);
    if (!g) return;
    got[static_cast<std::size_t>(rk.rank())] =
        bytes_of(nn::canonical_reduce_scatter(global.row_view(g->rank() * k, k).copy_data(), *g));
  });
  for (std::size_t m = 0; m < c.members.size(); ++m)
    if (got[static_cast<std::size_t>(c.members[m])] !=
        bytes_of(sum.row_view(static_cast<int64_t>(m) * R, R).copy_data()))
      RC_FAIL(fmt::format("{}: member {}: rows differ from one rank's canonical_sum", what, m));
}

RC_GTEST_PROP(Canonical, ReduceScatterBitsOfOneRank_float32, ()) {
  check_reduce_scatter_bits(DType::Float32);
}
RC_GTEST_PROP(Canonical, ReduceScatterBitsOfOneRank_bfloat16, ()) {
  check_reduce_scatter_bits(DType::BFloat16);
}

// canonical_column_parallel_linear on a random TP group, with and without
// SP: y, dx and dweight against an independent float64 computation rounded
// as the tensors round (T: double or float), written here:
//   y[i, c]  = round(sum_p x[i, p] A[p, c])           (p in order)
//   dA[p, c] = round(sum_i x[i, p] dy[i, c])          (i in order)
//   dx[i, p] = tree over the blocks b of round(sum_{c in b} dy[i, c] A[p, c]),
//              each tree addition in T.
// The same independent values for every TP size: dx's bits do not depend on
// it. The adjoint identity follows (these are dy's adjoint formulas); it is
// also checked in float64 below on the values themselves.
template <class T>
void check_column_linear(DType dt) {
  const int N = *rc::gen::inRange(1, 5);
  const WorldCase c{N, *rc::gen::arbitrary<uint64_t>(), {}};
  WorldCase group = c;
  for (int r = 0; r < N; ++r) group.members.push_back(r);
  const bool sp = *rc::gen::arbitrary<bool>();
  const auto R = *rc::gen::inRange<int64_t>(0, 4);  // rows per member with SP
  const auto in = *rc::gen::inRange<int64_t>(1, 5);
  const auto cols = *rc::gen::inRange<int64_t>(1, 5);  // per member
  std::vector<int64_t> widths;
  for (int64_t w = 1; w <= cols; ++w)
    if (cols % w == 0) widths.push_back(w);
  const int64_t w = *rc::gen::elementOf(widths);
  const int64_t rows = sp ? N * R : R, F = N * cols;
  const std::string what = fmt::format(
      "canonical_column_parallel_linear {} tp={} sp={} R={} in={} cols={} block_cols={}",
      dtype_name(dt), N, sp, R, in, cols, w);
  RC_LOG() << what << "\n";
  Generator gen(c.seed);
  const Tensor X =
      from_vector(spread_values(static_cast<std::size_t>(rows * in), gen), {rows, in}, dt);
  const Tensor A = from_vector(spread_values(static_cast<std::size_t>(in * F), gen), {in, F}, dt);
  const Tensor dY =
      from_vector(spread_values(static_cast<std::size_t>(rows * F), gen), {rows, F}, dt);
  const std::vector<double> x = X.to_vector(), a = A.to_vector(), dy = dY.to_vector();
  // Half the cases add a term to dx after the tree (dx_addend): D over the
  // gathered rows; without SP each member must ask only for its elements.
  const bool with_addend = *rc::gen::arbitrary<bool>();
  const Tensor D =
      from_vector(spread_values(static_cast<std::size_t>(rows * in), gen), {rows, in}, dt);
  const std::vector<double> d = D.to_vector();
  std::vector<int64_t> asked(static_cast<std::size_t>(N), 0);  // elements each member asked for
  auto at = [](const std::vector<double>& v, int64_t i, int64_t j, int64_t ld) {
    return v[static_cast<std::size_t>(i * ld + j)];
  };
  auto rnd = [](double v) { return static_cast<double>(static_cast<T>(v)); };
  // The independent values.
  std::vector<double> y_ref(static_cast<std::size_t>(rows * F)),
      da_ref(static_cast<std::size_t>(in * F)), dx_ref(static_cast<std::size_t>(rows * in));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t cc = 0; cc < F; ++cc) {
      double s = 0;
      for (int64_t p = 0; p < in; ++p) s += at(x, i, p, in) * at(a, p, cc, F);
      y_ref[static_cast<std::size_t>(i * F + cc)] = rnd(s);
    }
  for (int64_t p = 0; p < in; ++p)
    for (int64_t cc = 0; cc < F; ++cc) {
      double s = 0;
      for (int64_t i = 0; i < rows; ++i) s += at(x, i, p, in) * at(dy, i, cc, F);
      da_ref[static_cast<std::size_t>(p * F + cc)] = rnd(s);
    }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t p = 0; p < in; ++p) {
      std::vector<T> blocks;
      for (int64_t b = 0; b < F / w; ++b) {
        double s = 0;
        for (int64_t cc = b * w; cc < (b + 1) * w; ++cc) s += at(dy, i, cc, F) * at(a, p, cc, F);
        blocks.push_back(static_cast<T>(s));
      }
      T v = reference_tree(blocks);
      if (with_addend) v = static_cast<T>(v + static_cast<T>(at(d, i, p, in)));
      dx_ref[static_cast<std::size_t>(i * in + p)] = static_cast<double>(v);
    }
  // Every member's y, dx, dweight.
  struct Got {
    std::vector<double> y, dx, dw;
  };
  std::vector<Got> got(static_cast<std::size_t>(N));
  auto columns = [&](const Tensor& t, int r) {  // columns [r*cols, (r+1)*cols) of [m, F]
    const int64_t m = t.size(0);
    std::vector<double> v = t.to_vector(), out;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t cc = r * cols; cc < (r + 1) * cols; ++cc)
        out.push_back(v[static_cast<std::size_t>(i * F + cc)]);
    return from_vector(out, {m, cols}, dt);
  };
  run_world(group, what, [&](sim::Rank& rk) {
    const int r = rk.rank();
    Tensor xr = sp ? X.row_view(r * R, R).copy_data() : X.copy_data();
    Tensor wr = columns(A, r);
    xr.set_requires_grad(true);
    wr.set_requires_grad(true);
    std::function<Tensor(int64_t, int64_t)> addend;
    if (with_addend)
      addend = [&, r](int64_t begin, int64_t count) {
        asked[static_cast<std::size_t>(r)] += count;
        const int64_t offset = sp ? r * R * in : 0;  // SP: this member's rows
        return D.view_as_shape({rows * in}).row_view(offset + begin, count).copy_data();
      };
    const Tensor y = nn::canonical_column_parallel_linear(xr, wr, rk.world(), sp, w, addend);
    const std::vector<Tensor> g = diffcomm::grad({y}, {xr, wr}, {columns(dY, r)});
    got[static_cast<std::size_t>(r)] = {y.to_vector(), g[0].to_vector(), g[1].to_vector()};
  });
  if (with_addend) {  // the addend is evaluated once per element overall
    int64_t total_asked = 0;
    for (int64_t a_r : asked) total_asked += a_r;
    if (total_asked != rows * in)
      RC_FAIL(fmt::format("{}: members asked for {} addend elements, dx has {}", what, total_asked,
                          rows * in));
  }
  // The adjoint identities in float64 (y is bilinear in x and A):
  // <y, dy> = <x, dx> = <A, dA>, summed over members.
  double lhs = 0, rhs_x = 0, rhs_a = 0, scale_sum = 0;
  for (int r = 0; r < N; ++r) {
    const Got& m = got[static_cast<std::size_t>(r)];
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t cc = 0; cc < cols; ++cc) {
        const std::size_t k = static_cast<std::size_t>(i * cols + cc),
                          full = static_cast<std::size_t>(i * F + r * cols + cc);
        if (m.y[k] != y_ref[full])
          RC_FAIL(fmt::format("{}: rank {} y[{}, {}] differs", what, r, i, cc));
        lhs += m.y[k] * dy[full];
        scale_sum += std::abs(m.y[k] * dy[full]);
      }
    for (int64_t p = 0; p < in; ++p)
      for (int64_t cc = 0; cc < cols; ++cc) {
        const std::size_t k = static_cast<std::size_t>(p * cols + cc),
                          full = static_cast<std::size_t>(p * F + r * cols + cc);
        if (m.dw[k] != da_ref[full])
          RC_FAIL(fmt::format("{}: rank {} dweight[{}, {}] differs", what, r, p, cc));
        rhs_a += a[full] * m.dw[k];
      }
    const int64_t first = sp ? r * R : 0, count = sp ? R : rows;
    for (int64_t i = 0; i < count; ++i)
      for (int64_t p = 0; p < in; ++p) {
        const double v = m.dx[static_cast<std::size_t>(i * in + p)];
        if (v != dx_ref[static_cast<std::size_t>((first + i) * in + p)])
          RC_FAIL(
              fmt::format("{}: rank {} dx[{}, {}] differs from the canonical tree", what, r, i, p));
        if (!with_addend && (sp || r == 0))  // a replica's x counts once
          rhs_x += at(x, first + i, p, in) * v;
      }
  }
  const double tol = 1e-9 * std::max(1.0, scale_sum);
  if (dt == DType::Float64 &&
      ((!with_addend && std::abs(lhs - rhs_x) > tol) || std::abs(lhs - rhs_a) > tol))
    RC_FAIL(fmt::format("{}: adjoint identity: <y, dy> {}, <x, dx> {}, <A, dA> {}", what, lhs,
                        rhs_x, rhs_a));
}

RC_GTEST_PROP(Canonical, ColumnParallelLinearBitsOfOneRank_float64, ()) {
  check_column_linear<double>(DType::Float64);
}
RC_GTEST_PROP(Canonical, ColumnParallelLinearBitsOfOneRank_float32, ()) {
  check_column_linear<float>(DType::Float32);
}

}  // namespace
}  // namespace diffcomm::prop
