#pragma once
// The backend conformance cases: one function per primitive collective of
// include/diffcomm/distributed/collectives.hpp, run by every rank of a group with
// one dtype. Backend-agnostic: they use only dist:: and the tensor API, so
// the sim, mpi and nccl conformance executables run the very same bodies.
//
// Expected values are closed forms of the inputs, never the output of the
// code under test:
//  - moved data (gather, scatter, all_to_all, send, ...): member s holds
//    mval(global rank of s, block, i) = (16*global + 7*block + i) mod 251,
//    so a row that arrives from the wrong rank, the wrong block or the wrong
//    group (the `split` groups run concurrently) shows;
//  - reductions: member s contributes rval(op, s, i) and the result is
//    rexpect(op, i) (Sum: sum of the members' global ranks + N*(i mod 3);
//    Avg: N-1 + i mod 3 + global rank of member 0; Product: a power of two;
//    Min/Max: of (5*global + 3*i) mod 11).
// Every value is an integer in [0, 255), the products are powers of two, the
// sums stay < 256 for worlds up to 20 ranks and the averages are integers:
// exact in every dtype, including bfloat16 and uint8, so results compare with
// ==. Buffers to be written start as kSentinel, which no expected value
// equals, so an element left unwritten is caught.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "backend_fixture.hpp"
#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::conformance {

using dist::ProcessGroup;
using dist::ReduceOp;
using dist::Splits;

constexpr int64_t kCols = 3;
constexpr double kSentinel = 253;  // > every mval (< 251) and every reduction here

// ---------------------------------------------------------------- values
inline int gid(const ProcessGroup& g, int r) { return g.global_rank(r); }

inline double mval(int global, int64_t block, int64_t i) {
  return static_cast<double>((16 * static_cast<int64_t>(global) + 7 * block + i) % 251);
}

inline std::vector<ReduceOp> reduce_ops(DType dt) {
  std::vector<ReduceOp> ops = {ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max};
  if (is_floating(dt)) {  // Avg and PremulSum on integers are refused
    ops.push_back(ReduceOp::Avg);
    ops.push_back(ReduceOp::premul_sum(0.25));  // factor x sum, exact in every float dtype
  }
  return ops;
}

/// What member s contributes at element i.
inline double rval(ReduceOp op, const ProcessGroup& g, int s, int64_t i) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::PremulSum: return gid(g, s) + static_cast<double>(i % 3);
    case ReduceOp::Avg: return 2.0 * s + static_cast<double>(i % 3) + gid(g, 0);
    case ReduceOp::Product: return (gid(g, s) + i) % 4 == 1 ? 2.0 : 1.0;
    case ReduceOp::Min:
    case ReduceOp::Max: return static_cast<double>((5 * gid(g, s) + 3 * i) % 11);
  }
  return 0;
}

/// The reduction over all members of rval(op, s, i).
inline double rexpect(ReduceOp op, const ProcessGroup& g, int64_t i) {
  const int n = g.size();
  switch (op) {
    case ReduceOp::Sum: {
      const std::vector<int> m = g.members();
      double sum_globals = 0;
      for (int x : m) sum_globals += x;
      return sum_globals + n * static_cast<double>(i % 3);
    }
    case ReduceOp::PremulSum: return op.factor() * rexpect(ReduceOp::Sum, g, i);
    case ReduceOp::Avg:  // (sum_s 2s)/n = n-1
      return (n - 1) + static_cast<double>(i % 3) + gid(g, 0);
    case ReduceOp::Product: {
      double p = 1;
      for (int s = 0; s < n; ++s)
        if ((gid(g, s) + i) % 4 == 1) p *= 2;
      return p;
    }
    case ReduceOp::Min:
    case ReduceOp::Max: {
      double best = rval(op, g, 0, i);
      for (int s = 1; s < n; ++s)
        best = op == ReduceOp::Min ? std::min(best, rval(op, g, s, i))
                                   : std::max(best, rval(op, g, s, i));
      return best;
    }
  }
  return 0;
}

// ---------------------------------------------------------------- helpers
template <class F>
Tensor make_tensor(const Shape& shape, DType dt, F&& value) {
  std::vector<double> v(static_cast<std::size_t>(shape_numel(shape)));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = value(static_cast<int64_t>(i));
  return from_vector(v, shape, dt);
}
inline Tensor sentinel(const Shape& shape, DType dt) { return full(shape, kSentinel, dt); }

/// Message prefix: the group, this rank and what was called.
inline std::string ctx(const ProcessGroup& g, const std::string& call) {
  return where(g) + ": " + call;
}
inline std::string splits_str(const Splits& s) {
  std::ostringstream os;
  os << "[";
  for (std::size_t i = 0; i < s.size(); ++i) os << (i ? "," : "") << s[i];
  return os.str() + "]";
}

/// Expects t to have dtype dt, the given shape, and element i == expected(i).
/// Reports the first differing element only.
template <class F>
void expect_tensor(const Tensor& t, const Shape& shape, DType dt, F&& expected,
                   const std::string& what) {
  EXPECT_EQ(t.dtype(), dt) << what;
  EXPECT_EQ(shape_str(t.shape()), shape_str(shape)) << what;
  if (t.shape() != shape || t.dtype() != dt) return;
  const std::vector<double> got = t.to_vector();
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double e = expected(static_cast<int64_t>(i));
    if (got[i] != e) {
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", expected " << e;
      return;
    }
  }
}

inline int64_t sum_of(const Splits& s) {
  int64_t t = 0;
  for (int64_t x : s) t += x;
  return t;
}
/// Rows before block b.
inline int64_t offset_of(const Splits& s, int b) {
  int64_t t = 0;
  for (int i = 0; i < b; ++i) t += s[static_cast<std::size_t>(i)];
  return t;
}
/// The block holding `row` and the row's index within it.
inline std::pair<int, int64_t> block_of_row(const Splits& s, int64_t row) {
  for (std::size_t b = 0; b < s.size(); ++b) {
    if (row < s[b]) return {static_cast<int>(b), row};
    row -= s[b];
  }
  return {-1, -1};
}

/// Split patterns over n members (rows per member), zeros included.
inline std::vector<Splits> split_patterns(int n) {
  std::vector<Splits> out;
  Splits uneven, zeros, last_only, by_rank;
  for (int s = 0; s < n; ++s) {
    uneven.push_back((s + 1) % 3);  // 1, 2, 0, 1, 2, 0, ...
    zeros.push_back(0);
    last_only.push_back(s == n - 1 ? 2 : 0);
    by_rank.push_back(s);  // member 0 contributes nothing
  }
  return {uneven, zeros, last_only, by_rank};
}

// ---------------------------------------------------------------- cases

/// rank(), size(), members() and global_rank() agree with each other and
/// with what every member reports about itself.
inline void case_group_basics(const ProcessGroup& g, DType dt) {
  const int n = g.size();
  const int me = g.rank();
  EXPECT_GE(me, 0) << where(g);
  EXPECT_LT(me, n) << where(g);
  const std::vector<int> m = g.members();
  EXPECT_EQ(static_cast<int>(m.size()), n) << where(g);
  std::vector<int> sorted = m;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_TRUE(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end())
      << where(g) << ": members repeat";
  EXPECT_THROW(g.global_rank(-1), InvalidArgument) << where(g);
  EXPECT_THROW(g.global_rank(n), InvalidArgument) << where(g);
  // Every member reports its own global rank; all must agree with members().
  std::vector<Tensor> outs;
  for (int s = 0; s < n; ++s) outs.push_back(sentinel({1}, dt));
  dist::all_gather(g, outs, full({1}, gid(g, me), dt));
  for (int s = 0; s < n; ++s)
    expect_tensor(
        outs[static_cast<std::size_t>(s)], {1}, dt,
        [&](int64_t) { return static_cast<double>(m[static_cast<std::size_t>(s)]); },
        ctx(g, "all_gather of global ranks, slot " + std::to_string(s)));
}

inline void case_barrier(const ProcessGroup& g, DType dt) {
  for (int k = 0; k < 3; ++k) dist::barrier(g);
  // The barriers consumed the same call numbers on every member: the next
  // collective still matches.
  Tensor t = ones({1}, dt);
  dist::all_reduce(g, t);
  expect_tensor(
      t, {1}, dt, [&](int64_t) { return static_cast<double>(g.size()); },
      ctx(g, "all_reduce after barriers"));
}

// Out of place (dist::all_reduce_into): the output gets the reduction, the
// input keeps its values; an output overlapping the input (rows 1..2 of a
// buffer whose rows 0..1 are the input) reduces the input as it was.
inline void case_all_reduce_into(const ProcessGroup& g, DType dt, ReduceOp op,
                                 const std::vector<Shape>& shapes) {
  const int me = g.rank();
  const std::string name = "all_reduce_into(" + dist::reduce_op_name(op);
  for (const Shape& shape : shapes) {
    const Tensor in = make_tensor(shape, dt, [&](int64_t i) { return rval(op, g, me, i); });
    Tensor out = make_tensor(shape, dt, [](int64_t) { return kSentinel; });
    dist::all_reduce_into(g, out, in, op);
    expect_tensor(
        out, shape, dt, [&](int64_t i) { return rexpect(op, g, i); },
        ctx(g, name + ", " + shape_str(shape) + ") output"));
    expect_tensor(
        in, shape, dt, [&](int64_t i) { return rval(op, g, me, i); },
        ctx(g, name + ", " + shape_str(shape) + ") input unchanged"));
  }
  Tensor buf = make_tensor(
      {4, kCols}, dt, [&](int64_t i) { return i < 2 * kCols ? rval(op, g, me, i) : kSentinel; });
  dist::all_reduce_into(g, buf.row_view(1, 2), buf.row_view(0, 2), op);
  expect_tensor(
      buf, {4, kCols}, dt,
      [&](int64_t i) {
        const int64_t row = i / kCols;
        return row == 0 ? rval(op, g, me, i) : row == 3 ? kSentinel : rexpect(op, g, i - kCols);
      },
      ctx(g, name + ") into rows 1..2 from rows 0..1 of a [4, 3] buffer"));
}

inline void case_all_reduce(const ProcessGroup& g, DType dt) {
  const int me = g.rank();
  const std::vector<Shape> shapes = {{2, kCols}, {}, {5}, {0, kCols}, {1, 0, 2}};
  for (ReduceOp op : reduce_ops(dt)) {
    for (const Shape& shape : shapes) {
      Tensor t = make_tensor(shape, dt, [&](int64_t i) { return rval(op, g, me, i); });
      dist::all_reduce(g, t, op);
      expect_tensor(
          t, shape, dt, [&](int64_t i) { return rexpect(op, g, i); },
          ctx(g, "all_reduce(" + dist::reduce_op_name(op) + ", " + shape_str(shape) + ")"));
    }
    // In place on a zero-copy row view: rows 1..2 of a 4-row buffer; rows 0
    // and 3 are not touched.
    Tensor buf = make_tensor({4, kCols}, dt, [&](int64_t i) {
      const int64_t row = i / kCols;
      return row == 1 || row == 2 ? rval(op, g, me, i - kCols) : kSentinel;
    });
    dist::all_reduce(g, buf.row_view(1, 2), op);
    expect_tensor(
        buf, {4, kCols}, dt,
        [&](int64_t i) {
          const int64_t row = i / kCols;
          return row == 1 || row == 2 ? rexpect(op, g, i - kCols) : kSentinel;
        },
        ctx(g, "all_reduce(" + dist::reduce_op_name(op) + ") on rows 1..2 of a [4, 3] buffer"));
    case_all_reduce_into(g, dt, op, shapes);
  }
}

inline void case_broadcast(const ProcessGroup& g, DType dt) {
  const int me = g.rank();
  for (int src = 0; src < g.size(); ++src) {
    Tensor t = make_tensor({2, kCols}, dt, [&](int64_t i) { return mval(gid(g, me), src, i); });
    dist::broadcast(g, t, src);
    expect_tensor(
        t, {2, kCols}, dt, [&](int64_t i) { return mval(gid(g, src), src, i); },
        ctx(g, "broadcast(src=" + std::to_string(src) + ")"));
  }
  const int last = g.size() - 1;
  for (const Shape& shape : std::vector<Shape>{{}, {0, kCols}}) {
    Tensor t = make_tensor(shape, dt, [&](int64_t i) { return mval(gid(g, me), 1, i); });
    dist::broadcast(g, t, last);
    expect_tensor(
        t, shape, dt, [&](int64_t i) { return mval(gid(g, last), 1, i); },
        ctx(g, "broadcast(" + shape_str(shape) + ", src=last)"));
  }
}

inline void case_reduce(const ProcessGroup& g, DType dt) {
  const int me = g.rank();
  for (int dst = 0; dst < g.size(); ++dst)
    for (ReduceOp op : reduce_ops(dt)) {
      Tensor t = make_tensor({2, kCols}, dt, [&](int64_t i) { return rval(op, g, me, i); });
      dist::reduce(g, t, dst, op);
      const std::string what =
          ctx(g, "reduce(dst=" + std::to_string(dst) + ", " + dist::reduce_op_name(op) + ")");
      if (me == dst)
        expect_tensor(
            t, {2, kCols}, dt, [&](int64_t i) { return rexpect(op, g, i); }, what);
      else  // documented: left unchanged on the other ranks
        expect_tensor(
            t, {2, kCols}, dt, [&](int64_t i) { return rval(op, g, me, i); },
            what + " (non-dst keeps its input)");
    }
  Tensor empty_rows = zeros({0, kCols}, dt);
  dist::reduce(g, empty_rows, 0);
  EXPECT_EQ(shape_str(empty_rows.shape()), shape_str({0, kCols})) << where(g);
}

inline void case_all_gather(const ProcessGroup& g, DType dt) {
  const int me = g.rank();
  const int n = g.size();
  // [2, 3]; CASES.md 4: zero elements (1, 0, 2); a 0-d tensor.
  for (const Shape& shape : std::vector<Shape>{{2, kCols}, {1, 0, 2}, {}}) {
    std::vector<Tensor> outs;
    for (int s = 0; s < n; ++s) outs.push_back(sentinel(shape, dt));
    Tensor in = make_tensor(shape, dt, [&](int64_t i) { return mval(gid(g, me), 0, i); });
    dist::all_gather(g, outs, in);
    for (int s = 0; s < n; ++s)
      expect_tensor(
          outs[static_cast<std::size_t>(s)], shape, dt,
          [&](int64_t i) { return mval(gid(g, s), 0, i); },
          ctx(g, "all_gather(" + shape_str(shape) + "), outputs[" + std::to_string(s) + "]"));
  }
}

inline void case_all_gather_single(const ProcessGroup& g, DType dt) {
  const int me = g.rank();
  const int64_t n = g.size();
  for (int64_t rows : {2, 0, 1}) {
    Tensor in = make_tensor({rows, kCols}, dt, [&](int64_t i) { return mval(gid(g, me), 0, i); });
    Tensor out = sentinel({n * rows, kCols}, dt);
    dist::all_gather_single(g, out, in);
    const int64_t per = rows * kCols;
    expect_tensor(
        out, {n * rows, kCols}, dt,
        [&](int64_t q) { return mval(gid(g, static_cast<int>(q / per)), 0, q % per); },
        ctx(g, "all_gather_single(rows=" + std::to_string(rows) + ")"));
  }
}

inline void case_all_gather_v(const ProcessGroup& g, DType dt) {
  const int me = g.rank();
  for (const Splits& splits : split_patterns(g.size())) {
    const int64_t mine = splits[static_cast<std::size_t>(me)];
    Tensor in = make_tensor({mine, kCols}, dt, [&](int64_t i) { return mval(gid(g, me), 0, i); });
    Tensor out = sentinel({sum_of(splits), kCols}, dt);
    dist::all_gather_v(g, out, in, splits);
    expect_tensor(
        out, {sum_of(splits), kCols}, dt,
        [&](int64_t q) {
          const auto [s, k] = block_of_row(splits, q / kCols);
          return mval(gid(g, s), 0, k * kCols + q % kCols);
        },
        ctx(g, "all_gather_v(output_splits=" + splits_str(splits) + ")"));
  }
}

inline void case_gather(const ProcessGroup& g, DType dt) {
  const int me = g.rank();
  const int n = g.size();
  for (int dst = 0; dst < n; ++dst) {
    const Shape shape = dst == n - 1 ? Shape{0, kCols} : Shape{2, kCols};
    std::vector<Tensor> outs;
    if (me == dst)
      for (int s = 0; s < n; ++s) outs.push_back(sentinel(shape, dt));
    Tensor in = make_tensor(shape, dt, [&](int64_t i) { return mval(gid(g, me), dst, i); });
    dist::gather(g, outs, in, dst);
    if (me == dst)
      for (int s = 0; s < n; ++s)
        expect_tensor(
            outs[static_cast<std::size_t>(s)], shape, dt,
            [&](int64_t i) { return mval(gid(g, s), dst, i); },
            ctx(g, "gather(dst=" + std::to_string(dst) + "), outputs[" + std::to_string(s) + "]"));
    // The input is read-only.
    expect_tensor(
        in, shape, dt, [&](int64_t i) { return mval(gid(g, me), dst, i); },
        ctx(g, "gather input after the call"));
  }
}

inline void case_scatter(const ProcessGroup& g, DType dt) {
  const int me = g.rank();
  const int n = g.size();
  for (int src = 0; src < n; ++src) {
    const Shape shape = src == n - 1 ? Shape{0, kCols} : Shape{2, kCols};
    std::vector<Tensor> ins;
    if (me == src)
      for (int r = 0; r < n; ++r)
        ins.push_back(make_tensor(shape, dt, [&](int64_t i) { return mval(gid(g, src), r, i); }));
    Tensor out = sentinel(shape, dt);
    dist::scatter(g, out, ins, src);
    expect_tensor(
        out, shape, dt, [&](int64_t i) { return mval(gid(g, src), me, i); },
        ctx(g, "scatter(src=" + std::to_string(src) + ")"));
  }
}

inline void case_reduce_scatter(const ProcessGroup& g, DType dt) {
  const int me = g.rank();
  const int n = g.size();
  for (ReduceOp op : reduce_ops(dt))
    for (int64_t rows : {2, 0}) {
      const int64_t per = rows * kCols;  // elements per block
      std::vector<Tensor> ins;
      for (int j = 0; j < n; ++j)
        ins.push_back(make_tensor({rows, kCols}, dt,
                                  [&](int64_t i) { return rval(op, g, me, j * per + i); }));
      Tensor out = sentinel({rows, kCols}, dt);
      dist::reduce_scatter(g, out, ins, op);
      expect_tensor(
          out, {rows, kCols}, dt, [&](int64_t i) { return rexpect(op, g, me * per + i); },
          ctx(g, "reduce_scatter(" + dist::reduce_op_name(op) + ", rows " + std::to_string(rows) +
                     ")"));
    }
}

inline void case_reduce_scatter_single(const ProcessGroup& g, DType dt) {
  const int me = g.rank();
  const int64_t n = g.size();
  for (ReduceOp op : reduce_ops(dt))
    for (int64_t rows : {2, 0}) {
      Tensor in = make_tensor({n * rows, kCols}, dt, [&](int64_t i) { return rval(op, g, me, i); });
      Tensor out = sentinel({rows, kCols}, dt);
      dist::reduce_scatter_single(g, out, in, op);
      expect_tensor(
          out, {rows, kCols}, dt, [&](int64_t i) { return rexpect(op, g, me * rows * kCols + i); },
          ctx(g, "reduce_scatter_single(" + dist::reduce_op_name(op) + ", rows " +
                     std::to_string(rows) + ")"));
    }
}

inline void case_reduce_scatter_v(const ProcessGroup& g, DType dt) {
  const int me = g.rank();
  for (const Splits& splits : split_patterns(g.size()))
    for (ReduceOp op : reduce_ops(dt)) {
      const int64_t mine = splits[static_cast<std::size_t>(me)];
      const int64_t base = offset_of(splits, me) * kCols;
      Tensor in =
          make_tensor({sum_of(splits), kCols}, dt, [&](int64_t i) { return rval(op, g, me, i); });
      Tensor out = sentinel({mine, kCols}, dt);
      dist::reduce_scatter_v(g, out, in, splits, op);
      expect_tensor(
          out, {mine, kCols}, dt, [&](int64_t i) { return rexpect(op, g, base + i); },
          ctx(g, "reduce_scatter_v(" + dist::reduce_op_name(op) +
                     ", input_splits=" + splits_str(splits) + ")"));
    }
}

inline void case_all_to_all(const ProcessGroup& g, DType dt) {
  const int me = g.rank();
  const int n = g.size();
  // inputs[j] on member i has rows(i, j) rows; outputs[s] on r gets rows(s, r).
  auto rows = [](int i, int j) { return static_cast<int64_t>((i + 2 * j + 1) % 3); };
  {
    std::vector<Tensor> ins, outs;
    for (int j = 0; j < n; ++j)
      ins.push_back(
          make_tensor({rows(me, j), kCols}, dt, [&](int64_t i) { return mval(gid(g, me), j, i); }));
    for (int s = 0; s < n; ++s) outs.push_back(sentinel({rows(s, me), kCols}, dt));
    dist::all_to_all(g, outs, ins);
    for (int s = 0; s < n; ++s)
      expect_tensor(
          outs[static_cast<std::size_t>(s)], {rows(s, me), kCols}, dt,
          [&](int64_t i) { return mval(gid(g, s), me, i); },
          ctx(g, "all_to_all, outputs[" + std::to_string(s) + "]"));
  }
  {  // 0-d tensors
    std::vector<Tensor> ins, outs;
    for (int j = 0; j < n; ++j)
      ins.push_back(make_tensor({}, dt, [&](int64_t) { return mval(gid(g, me), j, 0); }));
    for (int s = 0; s < n; ++s) outs.push_back(sentinel({}, dt));
    dist::all_to_all(g, outs, ins);
    for (int s = 0; s < n; ++s)
      expect_tensor(
          outs[static_cast<std::size_t>(s)], {}, dt,
          [&](int64_t) { return mval(gid(g, s), me, 0); },
          ctx(g, "all_to_all of 0-d tensors, outputs[" + std::to_string(s) + "]"));
  }
}

/// all_to_all_single where member i sends c(i, j) rows to member j.
inline void check_all_to_all_single(const ProcessGroup& g, DType dt,
                                    const std::function<int64_t(int, int)>& c, bool pass_splits,
                                    const std::string& label) {
  const int me = g.rank();
  const int n = g.size();
  Splits in_splits, out_splits;
  for (int j = 0; j < n; ++j) in_splits.push_back(c(me, j));
  for (int s = 0; s < n; ++s) out_splits.push_back(c(s, me));
  Tensor in = make_tensor({sum_of(in_splits), kCols}, dt,
                          [&](int64_t i) { return mval(gid(g, me), 0, i); });
  Tensor out = sentinel({sum_of(out_splits), kCols}, dt);
  if (pass_splits)
    dist::all_to_all_single(g, out, in, out_splits, in_splits);
  else
    dist::all_to_all_single(g, out, in);
  expect_tensor(
      out, {sum_of(out_splits), kCols}, dt,
      [&](int64_t q) {
        const auto [s, k] = block_of_row(out_splits, q / kCols);
        // Row k of the block from s is row (rows s sent to members < me) + k of s's input.
        int64_t src_row = k;
        for (int j = 0; j < me; ++j) src_row += c(s, j);
        return mval(gid(g, s), 0, src_row * kCols + q % kCols);
      },
      ctx(g, "all_to_all_single(" + label + ", input_splits=" + splits_str(in_splits) +
                 ", output_splits=" + splits_str(out_splits) + ")"));
}

inline void case_all_to_all_single(const ProcessGroup& g, DType dt) {
  check_all_to_all_single(
      g, dt, [](int, int) { return int64_t{2}; }, false, "even, no splits");
  check_all_to_all_single(
      g, dt, [](int, int) { return int64_t{2}; }, true, "even, explicit");
  check_all_to_all_single(
      g, dt, [](int i, int j) { return static_cast<int64_t>((i + 2 * j + 1) % 3); }, true,
      "uneven");
  // CASES.md 5, generalised: everybody sends only to member 0; the others
  // receive nothing (0-row outputs) and must still take part.
  check_all_to_all_single(
      g, dt, [](int i, int j) { return j == 0 ? static_cast<int64_t>(i % 2 + 1) : int64_t{0}; },
      true, "all to member 0");
  check_all_to_all_single(
      g, dt, [](int, int) { return int64_t{0}; }, true, "all zero");
  check_all_to_all_single(
      g, dt, [](int, int) { return int64_t{0}; }, false, "0 rows, no splits");
}

inline void case_send_recv(const ProcessGroup& g, DType dt) {
  const int me = g.rank();
  const int n = g.size();
  const Shape shape{2, kCols};
  // Every ordered pair, pairs taken in one global order (deadlock-free with
  // blocking send/recv): a -> b, then b -> a.
  for (int a = 0; a < n; ++a)
    for (int b = a + 1; b < n; ++b) {
      if (me != a && me != b) continue;
      const int peer = me == a ? b : a;
      Tensor mine = make_tensor(shape, dt, [&](int64_t i) { return mval(gid(g, me), peer, i); });
      Tensor got = sentinel(shape, dt);
      if (me == a) {
        dist::send(g, mine, b, 5);
        dist::recv(g, got, b, 6);
      } else {
        dist::recv(g, got, a, 5);
        dist::send(g, mine, a, 6);
      }
      expect_tensor(
          got, shape, dt, [&](int64_t i) { return mval(gid(g, peer), me, i); },
          ctx(g, "recv from member " + std::to_string(peer)));
    }
  if (n < 2) return;
  // Several messages with one tag arrive in order; 0-d and zero-element
  // messages; first and last member.
  const int a = 0, b = n - 1;
  if (me == a) {
    for (int k = 0; k < 3; ++k)
      dist::send(g, make_tensor(shape, dt, [&](int64_t i) { return mval(gid(g, a), 10 + k, i); }),
                 b, 9);
    dist::send(g, make_tensor({}, dt, [&](int64_t) { return mval(gid(g, a), 20, 0); }), b, 9);
    dist::send(g, zeros({0, kCols}, dt), b, 9);
  } else if (me == b) {
    for (int k = 0; k < 3; ++k) {
      Tensor got = sentinel(shape, dt);
      dist::recv(g, got, a, 9);
      expect_tensor(
          got, shape, dt, [&](int64_t i) { return mval(gid(g, a), 10 + k, i); },
          ctx(g, "message " + std::to_string(k) + " with tag 9"));
    }
    Tensor scalar = sentinel({}, dt);
    dist::recv(g, scalar, a, 9);
    expect_tensor(
        scalar, {}, dt, [&](int64_t) { return mval(gid(g, a), 20, 0); }, ctx(g, "0-d message"));
    Tensor none = sentinel({0, kCols}, dt);
    dist::recv(g, none, a, 9);
    EXPECT_EQ(shape_str(none.shape()), shape_str({0, kCols})) << where(g);
  }
}

}  // namespace diffcomm::conformance
