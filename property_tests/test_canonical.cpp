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

#include <cstring>

#include "diffcomm/nn/canonical_all_reduce.hpp"
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

}  // namespace
}  // namespace diffcomm::prop
