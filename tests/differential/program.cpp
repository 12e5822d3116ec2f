#include "program.hpp"

#include <fmt/format.h>
#include <rapidcheck.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <optional>

#include "diffcomm/distributed/collectives.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::differential {
namespace {

using dist::OpType;
using dist::ProcessGroup;
using dist::ReduceOp;
using dist::Splits;

const std::vector<OpType> kOps = {OpType::Barrier,
                                  OpType::AllReduce,
                                  OpType::Broadcast,
                                  OpType::Reduce,
                                  OpType::AllGather,
                                  OpType::AllGatherSingle,
                                  OpType::AllGatherV,
                                  OpType::Gather,
                                  OpType::Scatter,
                                  OpType::ReduceScatter,
                                  OpType::ReduceScatterSingle,
                                  OpType::ReduceScatterV,
                                  OpType::AllToAll,
                                  OpType::AllToAllSingle,
                                  OpType::Send};

bool has_reduce(OpType op) {
  return op == OpType::AllReduce || op == OpType::Reduce || op == OpType::ReduceScatter ||
         op == OpType::ReduceScatterSingle || op == OpType::ReduceScatterV;
}

Step gen_step(int world) {
  Step s;
  s.op = *rc::gen::elementOf(kOps);
  s.group = *rc::gen::element(GroupKind::World, GroupKind::Subset, GroupKind::Halves);
  s.dtype = *rc::gen::element(DType::Float64, DType::Float32, DType::BFloat16, DType::Float16,
                              DType::Int32);
  std::vector<ReduceOp> ops = {ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max};
  if (is_floating(s.dtype)) ops.push_back(ReduceOp::Avg);
  s.reduce_op = *rc::gen::elementOf(ops);
  s.root = *rc::gen::inRange(0, world);
  s.rows = *rc::gen::inRange<int64_t>(0, 6);
  s.cols = *rc::gen::inRange<int64_t>(1, 7);
  const bool uniform = *rc::gen::inRange(0, 3) == 0;  // in-place all_to_all needs it
  const int64_t u = *rc::gen::inRange<int64_t>(0, 3);
  s.splits.assign(static_cast<std::size_t>(world), std::vector<int64_t>(world, 0));
  for (auto& row : s.splits)
    for (auto& v : row) v = uniform ? u : *rc::gen::inRange<int64_t>(0, 4);
  s.in_place = *rc::gen::inRange(0, 2) == 0;
  if (s.in_place && (s.op == OpType::AllToAll || s.op == OpType::AllToAllSingle) && !uniform)
    s.in_place = false;
  return s;
}

// A deterministic value for (seed, step, global rank, tensor, element):
// integers in [-100, 100] for integer dtypes; otherwise a float with a full
// random mantissa in [-8, 8) (in [0.5, 2) for products), so that sums round
// and any other order or rounding of the reduction shows in the bits.
double value(uint64_t seed, std::size_t step, int rank, int tensor, int64_t i, bool product,
             bool integer) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + step * 0xBF58476D1CE4E5B9ull +
               static_cast<uint64_t>(rank) * 0x94D049BB133111EBull +
               static_cast<uint64_t>(tensor) * 0x2545F4914F6CDD1Dull + static_cast<uint64_t>(i);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  if (integer) return static_cast<double>(static_cast<int64_t>(z % 201) - 100);
  const double u = static_cast<double>(z >> 11) * 0x1.0p-53;  // [0, 1)
  return product ? 0.5 + 1.5 * u : 16.0 * u - 8.0;
}

class Runner {
 public:
  Runner(uint64_t seed, std::size_t step, int global, Outcome& out)
      : seed_(seed), step_(step), global_(global), out_(out) {}

  Tensor input(const Shape& shape, DType dt, bool product = false) {
    const int64_t n = shape_numel(shape);
    std::vector<double> v(static_cast<std::size_t>(n));
    const int t = tensors_++;
    for (int64_t i = 0; i < n; ++i)
      v[static_cast<std::size_t>(i)] =
          value(seed_, step_, global_, t, i, product, !is_floating(dt));
    return from_vector(v, shape, dt);
  }
  Tensor output(const Shape& shape, DType dt) { return full(shape, -99.0, dt); }
  void record(const Tensor& t) {
    const auto* p = static_cast<const uint8_t*>(t.data_ptr());
    out_.bytes.insert(out_.bytes.end(), p, p + t.nbytes());
  }
  void record(const std::vector<Tensor>& ts) {
    for (const auto& t : ts) record(t);
  }

 private:
  uint64_t seed_;
  std::size_t step_;
  int global_;
  Outcome& out_;
  int tensors_ = 0;
};

// The deliberate mismatch, on one rank only.
void apply_mismatch(Step& s, int n, int r) {
  if (s.mismatch == 0 || r != s.mismatch_rank) return;
  const auto nu = static_cast<std::size_t>(n), ru = static_cast<std::size_t>(r);
  switch (s.mismatch) {
    case 1: s.root = (s.root + 1) % n; break;
    case 2: s.reduce_op = s.reduce_op == ReduceOp::Max ? ReduceOp::Min : ReduceOp::Max; break;
    case 3: s.dtype = s.dtype == DType::Float64 ? DType::Float32 : DType::Float64; break;
    case 4: s.cols += 1; break;
    case 5: s.splits[ru][(ru + 1) % nu] += 1; break;
    case 6: s.op = OpType::Barrier; break;
    default: break;
  }
}

// One step on one rank: its arguments resolved for this rank.
struct RankStep {
  const Step& s;
  const ProcessGroup& g;
  Runner& rt;
  int n, r;
  std::size_t nu, ru;
  DType dt;
  int root;
  bool product;  // a Product reduction: inputs drawn near 1
  Shape shape;
  Shape rows_block(int64_t rows) const { return Shape{rows, s.cols}; }
};

// barrier, all_reduce, broadcast, reduce, send/recv
void run_whole_tensor_op(const RankStep& x) {
  const Step& s = x.s;
  const ProcessGroup& g = x.g;
  Runner& rt = x.rt;
  const int n = x.n, r = x.r, root = x.root;
  const DType dt = x.dt;
  const bool product = x.product;
  const Shape& shape = x.shape;
  switch (s.op) {
    case OpType::Barrier: dist::barrier(g); break;
    case OpType::AllReduce: {
      Tensor t = rt.input(shape, dt, product);
      dist::all_reduce(g, t, s.reduce_op);
      rt.record(t);
      break;
    }
    case OpType::Broadcast: {
      Tensor t = rt.input(shape, dt);
      dist::broadcast(g, t, root);
      rt.record(t);
      break;
    }
    case OpType::Reduce: {
      Tensor t = rt.input(shape, dt, product);
      dist::reduce(g, t, root, s.reduce_op);
      rt.record(t);  // left unchanged off the root
      break;
    }
    case OpType::Send: {
      // Group rank 0 sends to group rank 1; the others take no part.
      if (n < 2) break;
      if (r == 0) dist::send(g, rt.input(shape, dt), 1, 3);
      if (r == 1) {
        Tensor t = rt.output(shape, dt);
        dist::recv(g, t, 0, 3);
        rt.record(t);
      }
      break;
    }
    default: break;
  }
}

// all_gather, all_gather_single, all_gather_v, gather, scatter
void run_gather_op(const RankStep& x) {
  const Step& s = x.s;
  const ProcessGroup& g = x.g;
  Runner& rt = x.rt;
  const int n = x.n, r = x.r, root = x.root;
  const std::size_t ru = x.ru;
  const DType dt = x.dt;
  const Shape& shape = x.shape;
  auto rows_block = [&](int64_t rows) { return x.rows_block(rows); };
  switch (s.op) {
    case OpType::AllGather: {
      std::vector<Tensor> outs;
      for (int k = 0; k < n; ++k) outs.push_back(rt.output(shape, dt));
      Tensor in = rt.input(shape, dt);
      if (s.in_place) {
        outs[ru].copy_(in);
        in = outs[ru];
      }
      dist::all_gather(g, outs, in);
      rt.record(outs);
      break;
    }
    case OpType::AllGatherSingle: {
      Tensor out = rt.output(rows_block(n * s.rows), dt);
      Tensor in = rt.input(shape, dt);
      if (s.in_place) {
        out.row_view(r * s.rows, s.rows).copy_(in);
        in = out.row_view(r * s.rows, s.rows);
      }
      dist::all_gather_single(g, out, in);
      rt.record(out);
      break;
    }
    case OpType::AllGatherV: {
      Splits splits(s.splits[0].begin(), s.splits[0].begin() + n);
      const int64_t total = std::accumulate(splits.begin(), splits.end(), int64_t{0});
      Tensor out = rt.output(rows_block(total), dt);
      Tensor in = rt.input(rows_block(splits[ru]), dt);
      dist::all_gather_v(g, out, in, splits);
      rt.record(out);
      break;
    }
    case OpType::Gather: {
      std::vector<Tensor> outs;
      if (r == root)
        for (int k = 0; k < n; ++k) outs.push_back(rt.output(shape, dt));
      dist::gather(g, outs, rt.input(shape, dt), root);
      rt.record(outs);
      break;
    }
    case OpType::Scatter: {
      std::vector<Tensor> ins;
      if (r == root)
        for (int k = 0; k < n; ++k) ins.push_back(rt.input(shape, dt));
      Tensor out = rt.output(shape, dt);
      if (s.in_place && r == root) out = ins[ru];
      dist::scatter(g, out, ins, root);
      rt.record(out);
      break;
    }
    default: break;
  }
}

// reduce_scatter, reduce_scatter_single, reduce_scatter_v, all_to_all, all_to_all_single
void run_scatter_op(const RankStep& x) {
  const Step& s = x.s;
  const ProcessGroup& g = x.g;
  Runner& rt = x.rt;
  const int n = x.n, r = x.r;
  const std::size_t ru = x.ru;
  const DType dt = x.dt;
  const bool product = x.product;
  const Shape& shape = x.shape;
  auto rows_block = [&](int64_t rows) { return x.rows_block(rows); };
  switch (s.op) {
    case OpType::ReduceScatter: {
      std::vector<Tensor> ins;
      for (int k = 0; k < n; ++k) ins.push_back(rt.input(shape, dt, product));
      Tensor out = s.in_place ? ins[ru] : rt.output(shape, dt);
      dist::reduce_scatter(g, out, ins, s.reduce_op);
      rt.record(out);
      break;
    }
    case OpType::ReduceScatterSingle: {
      Tensor in = rt.input(rows_block(n * s.rows), dt, product);
      Tensor out = s.in_place ? in.row_view(r * s.rows, s.rows) : rt.output(shape, dt);
      dist::reduce_scatter_single(g, out, in, s.reduce_op);
      rt.record(out);
      break;
    }
    case OpType::ReduceScatterV: {
      Splits splits(s.splits[0].begin(), s.splits[0].begin() + n);
      const int64_t total = std::accumulate(splits.begin(), splits.end(), int64_t{0});
      Tensor in = rt.input(rows_block(total), dt, product);
      Tensor out = rt.output(rows_block(splits[ru]), dt);
      dist::reduce_scatter_v(g, out, in, splits, s.reduce_op);
      rt.record(out);
      break;
    }
    case OpType::AllToAll: {
      std::vector<Tensor> ins, outs;
      for (int j = 0; j < n; ++j) ins.push_back(rt.input(rows_block(s.splits[ru][j]), dt));
      for (int k = 0; k < n; ++k) outs.push_back(rt.output(rows_block(s.splits[k][ru]), dt));
      if (s.in_place) outs = ins;
      dist::all_to_all(g, outs, ins);
      rt.record(outs);
      break;
    }
    case OpType::AllToAllSingle: {
      Splits in_splits, out_splits;
      for (int j = 0; j < n; ++j) in_splits.push_back(s.splits[ru][static_cast<std::size_t>(j)]);
      for (int k = 0; k < n; ++k) out_splits.push_back(s.splits[static_cast<std::size_t>(k)][ru]);
      const int64_t in_rows = std::accumulate(in_splits.begin(), in_splits.end(), int64_t{0});
      const int64_t out_rows = std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0});
      Tensor in = rt.input(rows_block(in_rows), dt);
      Tensor out = s.in_place && in_rows == out_rows ? in : rt.output(rows_block(out_rows), dt);
      dist::all_to_all_single(g, out, in, out_splits, in_splits);
      rt.record(out);
      break;
    }
    default: break;
  }
}

void run_step(Step s, const ProcessGroup& g, Runner& rt) {
  const int n = g.size(), r = g.rank();
  apply_mismatch(s, n, r);
  const RankStep x{s,
                   g,
                   rt,
                   n,
                   r,
                   static_cast<std::size_t>(n),
                   static_cast<std::size_t>(r),
                   s.dtype,
                   s.root % n,
                   has_reduce(s.op) && s.reduce_op == ReduceOp::Product,
                   {s.rows, s.cols}};
  switch (s.op) {
    case OpType::AllGather:
    case OpType::AllGatherSingle:
    case OpType::AllGatherV:
    case OpType::Gather:
    case OpType::Scatter: run_gather_op(x); break;
    case OpType::ReduceScatter:
    case OpType::ReduceScatterSingle:
    case OpType::ReduceScatterV:
    case OpType::AllToAll:
    case OpType::AllToAllSingle: run_scatter_op(x); break;
    default: run_whole_tensor_op(x); break;
  }
}

}  // namespace

Program make_program(int world, uint64_t seed) {
  const auto gen = rc::gen::exec([world] {
    Program p;
    p.world = world;
    std::vector<int> all(static_cast<std::size_t>(world));
    std::iota(all.begin(), all.end(), 0);
    const int k = *rc::gen::inRange(1, world + 1);
    std::vector<int> order = all;
    // A seeded shuffle (Fisher-Yates over generated indices).
    for (int i = world - 1; i > 0; --i)
      std::swap(order[static_cast<std::size_t>(i)],
                order[static_cast<std::size_t>(*rc::gen::inRange(0, i + 1))]);
    p.subset.assign(order.begin(), order.begin() + k);
    const int steps = *rc::gen::inRange(1, 9);
    for (int i = 0; i < steps; ++i) p.steps.push_back(gen_step(world));
    if (world >= 2 && *rc::gen::inRange(0, 4) == 0) {
      Step m = gen_step(world);
      m.group = GroupKind::World;
      m.in_place = false;
      m.mismatch = *rc::gen::inRange(1, 7);
      m.mismatch_rank = *rc::gen::inRange(0, world);
      switch (m.mismatch) {
        case 1: m.op = *rc::gen::element(OpType::Broadcast, OpType::Reduce); break;
        case 2:
        case 3:
        case 6:
          m.op = OpType::AllReduce;
          m.dtype = DType::Float32;
          m.reduce_op = ReduceOp::Sum;
          break;
        case 4: m.op = OpType::AllGatherSingle; break;
        case 5: m.op = OpType::AllToAllSingle; break;
        default: break;
      }
      p.steps.push_back(m);
    }
    return p;
  });
  return gen(rc::Random(seed), 50).value();
}

std::string describe(const Program& p) {
  std::string s = fmt::format("world {}, subset {{{}}}\n", p.world, fmt::join(p.subset, ","));
  const char* groups[] = {"world", "subset", "halves"};
  for (std::size_t i = 0; i < p.steps.size(); ++i) {
    const Step& st = p.steps[i];
    s += fmt::format("  {}: {} on {} {} {} rows={} cols={} root={}{}", i, dist::op_cstr(st.op),
                     groups[static_cast<int>(st.group)], dtype_name(st.dtype),
                     dist::reduce_op_name(st.reduce_op), st.rows, st.cols, st.root,
                     st.in_place ? " in-place" : "");
    if (st.mismatch)
      s += fmt::format(" MISMATCH kind {} on rank {}", st.mismatch, st.mismatch_rank);
    s += "\n";
  }
  return s;
}

Outcome run_program(const Program& p, uint64_t seed, const ProcessGroup& world) {
  Outcome out;
  std::size_t at = 0;
  try {
    const std::optional<ProcessGroup> subset = world.new_group(p.subset);
    const int me = world.rank();
    const std::optional<ProcessGroup> half =
        world.split(me % 2, -me, {2}, me % 2 == 0 ? "even" : "odd");
    for (at = 0; at < p.steps.size(); ++at) {
      const Step& s = p.steps[at];
      const ProcessGroup* g = s.group == GroupKind::World    ? &world
                              : s.group == GroupKind::Subset ? (subset ? &*subset : nullptr)
                                                             : (half ? &*half : nullptr);
      if (g == nullptr) continue;  // not a member
      Runner rt(seed, at, me, out);
      run_step(s, *g, rt);
    }
    return out;
  } catch (const CollectiveMismatch& e) {
    out.error_kind = "CollectiveMismatch";
    out.error = e.what();
  } catch (const Timeout& e) {
    out.error_kind = "Timeout";
    out.error = e.what();
  } catch (const Deadlock& e) {
    out.error_kind = "Deadlock";
    out.error = e.what();
  } catch (const InvalidArgument& e) {
    out.error_kind = "InvalidArgument";
    out.error = e.what();
  } catch (const Error& e) {
    out.error_kind = "Error";
    out.error = e.what();
  }
  out.failed_step = static_cast<int>(at);
  return out;
}

std::string compare(const Outcome& a, const Outcome& b) {
  if (a.error_kind != b.error_kind || a.failed_step != b.failed_step)
    return fmt::format("errors differ: '{}' at step {} ({}) vs '{}' at step {} ({})", a.error_kind,
                       a.failed_step, a.error, b.error_kind, b.failed_step, b.error);
  if (a.error != b.error) return fmt::format("messages differ:\n  {}\n  {}", a.error, b.error);
  if (a.bytes.size() != b.bytes.size())
    return fmt::format("output sizes differ: {} vs {} bytes", a.bytes.size(), b.bytes.size());
  for (std::size_t i = 0; i < a.bytes.size(); ++i)
    if (a.bytes[i] != b.bytes[i])
      return fmt::format("outputs differ at byte {} of {}: {:#04x} vs {:#04x}", i, a.bytes.size(),
                         a.bytes[i], b.bytes[i]);
  return "";
}

}  // namespace diffcomm::differential
